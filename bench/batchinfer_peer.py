"""Run a saved workload on batchinfer in this process; prints one JSON object (one round of a benchmark).

Usage: python bench/batchinfer_peer.py WORKLOAD_JSON MODEL_DIR [--threads 2] [--device cpu] [--dtype float32]
       [--prefix-caching] [--order-by-shared-prefix] [--kv-cache-bytes N] [--warmup-prompt-json IDS]
One engine; one short warm-up (4 tokens of ``--warmup-prompt-json``, default the workload's first prompt);
then the whole workload, added in input order (or in ``order_by_shared_prefix`` order, as the worker adds
a job's lines) and stepped to completion. Reports ``tok_per_s`` (output tokens over the measured wall
time), the engine's counters for that run, and the generated ids in input order (``token_ids``).
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

from worker.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from worker.prefix_grouping import order_by_shared_prefix  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload")
    parser.add_argument("model_dir")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--order-by-shared-prefix", action="store_true")
    parser.add_argument("--kv-cache-bytes", type=int, default=None)
    parser.add_argument("--warmup-prompt-json", default=None, help="token ids of the warm-up prompt, as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    workload = json.loads(Path(args.workload).read_text())
    prompts, max_tokens = workload["prompt_token_ids"], workload["max_tokens"]
    extra = {} if args.kv_cache_bytes is None else {"kv_cache_memory_bytes": args.kv_cache_bytes}
    engine = LLMEngine(
        EngineConfig(
            model=args.model_dir,
            device=args.device,
            dtype=args.dtype,
            enable_prefix_caching=args.prefix_caching,
            **extra,
        )
    )
    engine.populate_kv_cache()  # as the worker does at start (worker/bootstrap.py, warm_up_engine)
    warmup_ids = json.loads(args.warmup_prompt_json) if args.warmup_prompt_json else prompts[0]
    engine.generate([warmup_ids], SamplingParams(max_tokens=4, temperature=0.0))
    engine.make_stats()  # start a fresh window
    order = order_by_shared_prefix(prompts) if args.order_by_shared_prefix else range(len(prompts))
    for i in order:
        params = SamplingParams(max_tokens=max_tokens[i], temperature=0.0, ignore_eos=True)
        engine.add_request(str(i), prompts[i], params)
    outputs = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out) for out in engine.step())
    elapsed_s = time.perf_counter() - start
    token_ids = [outputs[str(i)].outputs[0].token_ids for i in range(len(prompts))]
    stats = engine.make_stats()
    num_output_tokens = sum(map(len, token_ids))
    print(
        json.dumps(
            {
                "tok_per_s": num_output_tokens / elapsed_s,
                "elapsed_s": elapsed_s,
                "output_tokens": num_output_tokens,
                "kv_utilization": stats.kv_slot_utilization,
                "overhead_fraction": 1.0 - (stats.forward_s + stats.sampling_s) / stats.step_s
                if stats.step_s
                else None,
                "steps": stats.num_steps,
                "prefill_tokens": stats.num_prompt_tokens_computed,
                "prefix_cache_queries": stats.prefix_cache_queries,
                "prefix_cache_hits": stats.prefix_cache_hits,
                "prefix_holds": stats.num_prefix_holds,
                "preemptions": stats.num_preemptions,
                "token_ids": token_ids,
            }
        )
    )


if __name__ == "__main__":
    main()
