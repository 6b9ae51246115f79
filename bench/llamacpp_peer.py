"""One llama.cpp batch-1 run (llama-cpp-python's high-level API) for bench/quant.py; prints one JSON object.

Runs in bench/.llamacpp-venv (bench/setup_llamacpp.sh), which has neither torch nor batchinfer: the prompt comes
as token ids (the same ids our engine gets; SmolLM2's GGUF carries the same vocabulary). One warm-up completion
of 4 tokens, then ``--max-tokens`` greedy tokens with end-of-sequence masked (as ``ignore_eos``); ``tok_per_s`` is
completion tokens over the call's wall time (the prompt's prefill included, as in ours).

Usage: python bench/llamacpp_peer.py GGUF PROMPT_IDS_JSON [--threads 2] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    from llama_cpp import Llama

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("prompt_ids_json")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    prompt = json.loads(args.prompt_ids_json)
    llm = Llama(model_path=args.gguf, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=2048, verbose=False)
    no_eos = {llm.token_eos(): float("-inf")}
    llm.create_completion(prompt, max_tokens=4, temperature=0.0, logit_bias=no_eos)
    llm.reset()
    start = time.perf_counter()
    out = llm.create_completion(prompt, max_tokens=args.max_tokens, temperature=0.0, logit_bias=no_eos)
    elapsed_s = time.perf_counter() - start
    print(json.dumps({"tok_per_s": out["usage"]["completion_tokens"] / elapsed_s}))


if __name__ == "__main__":
    main()
