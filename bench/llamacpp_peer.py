"""llama.cpp runs for bench/quant.py (llama-cpp-python, same GGUF, same threads); each prints one JSON object.

Runs in bench/.llamacpp-venv (bench/setup_llamacpp.sh), which has neither torch nor batchinfer: prompts come as
token ids (the same ids our engine gets; SmolLM2's GGUF carries the same vocabulary). Two modes:

- batch 1 (``GGUF PROMPT_IDS_JSON``): the high-level API. One warm-up completion of 4 tokens, then
  ``--max-tokens`` greedy tokens with end-of-sequence masked (as ``ignore_eos``); ``tok_per_s`` is completion
  tokens over the call's wall time (the prompt's prefill included, as in ours).
- many sequences (``GGUF --workload WORKLOAD_JSON``, bench/workload.py's file): the low-level batch API, as
  llama.cpp's own server and ``batched`` example drive it. One context with ``n_seq_max`` = the number of
  prompts and room for each sequence's prompt and tokens; every prompt enters at once, its tokens chunked
  into ``llama_batch`` calls of at most ``n_batch`` tokens (one sequence id each, logits at a prompt's last
  token only); then each step decodes one token of every running sequence in one batch, each picking its
  greedy token with end-of-sequence masked, until it has its ``max_tokens``. ``tok_per_s``: generated tokens
  over the wall time from the first prompt token to the last token (prefill included, as in ours).

``--no-extra-bufts`` loads the weights without llama.cpp's extra CPU buffer types (its repacked and AMX
layouts): on the project's AMX Xeon VM, llama-cpp-python 0.3.36 crashes in ``ggml_backend_amx_mul_mat`` at the
first decode with them (bench/quant.py passes the flag where the CPU reports AMX).

Usage: python bench/llamacpp_peer.py GGUF [PROMPT_IDS_JSON | --workload WORKLOAD_JSON] [--threads 2]
       [--max-tokens 64] [--no-extra-bufts]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def batch1(gguf: str, prompt: list[int], threads: int, max_tokens: int, use_extra_bufts: bool = True) -> dict[str, Any]:
    """Batch-1 greedy decode through ``llama_cpp.Llama``."""
    import llama_cpp.llama_cpp as low
    from llama_cpp import Llama

    # NOTE: Llama takes no use_extra_bufts argument; it builds its model params with llama_cpp.llama_cpp's function.
    if not use_extra_bufts:
        defaults = low.llama_model_default_params

        def model_params() -> Any:
            params = defaults()
            params.use_extra_bufts = False
            return params

        low.llama_model_default_params = model_params
    llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)
    no_eos = {llm.token_eos(): float("-inf")}
    llm.create_completion(prompt, max_tokens=4, temperature=0.0, logit_bias=no_eos)
    llm.reset()
    start = time.perf_counter()
    out = llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, logit_bias=no_eos)
    elapsed_s = time.perf_counter() - start
    return {"tok_per_s": out["usage"]["completion_tokens"] / elapsed_s}


def many(
    gguf: str, prompts: list[list[int]], max_tokens: list[int], threads: int, use_extra_bufts: bool = True
) -> dict[str, Any]:
    """All ``prompts`` at once through ``llama_batch`` / ``llama_decode`` (see the module docstring).

    Raises:
        RuntimeError: when the model or context cannot be made, or ``llama_decode`` fails (its code named).
    """
    import llama_cpp as lc
    import numpy as np

    lc.llama_backend_init()
    model_params = lc.llama_model_default_params()
    model_params.use_extra_bufts = use_extra_bufts
    model = lc.llama_model_load_from_file(gguf.encode(), model_params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    vocab = lc.llama_model_get_vocab(model)
    n_vocab, eos = lc.llama_vocab_n_tokens(vocab), lc.llama_vocab_eos(vocab)
    per_seq = max(len(p) + n for p, n in zip(prompts, max_tokens, strict=True)) + 8
    params = lc.llama_context_default_params()
    params.n_seq_max = len(prompts)
    params.n_ctx = per_seq * len(prompts)
    params.n_batch = params.n_ubatch = 512
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not make the context")
    batch = lc.llama_batch_init(params.n_batch, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens = len(entries)
        code = lc.llama_decode(ctx, batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")

    def greedy(index: int) -> int:
        """The greedy token of the batch's ``index``-th entry, end-of-sequence masked."""
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, index), shape=(n_vocab,)).copy()
        logits[eos] = -np.inf
        return int(logits.argmax())

    def run(prompts: list[list[int]], max_tokens: list[int]) -> int:
        """Generate for every prompt; the number of tokens generated."""
        generated: list[list[int]] = [[] for _ in prompts]
        entries: list[tuple[int, int, int, bool]] = []
        owners: list[int] = []  # sequence of each entry that wants logits
        for seq, prompt in enumerate(prompts):
            for pos, token in enumerate(prompt):
                entries.append((token, pos, seq, pos == len(prompt) - 1))
                if pos == len(prompt) - 1:
                    owners.append(seq)
                if len(entries) == params.n_batch:
                    decode(entries)
                    wanted = [i for i, entry in enumerate(entries) if entry[3]]
                    for i, owner in zip(wanted, owners, strict=True):
                        generated[owner].append(greedy(i))
                    entries, owners = [], []
        if entries:
            decode(entries)
            wanted = [i for i, entry in enumerate(entries) if entry[3]]
            for i, owner in zip(wanted, owners, strict=True):
                generated[owner].append(greedy(i))
        while True:
            running = [s for s in range(len(prompts)) if len(generated[s]) < max_tokens[s]]
            if not running:
                return sum(len(g) for g in generated)
            decode([(generated[s][-1], len(prompts[s]) + len(generated[s]) - 1, s, True) for s in running])
            for i, s in enumerate(running):
                generated[s].append(greedy(i))

    run(prompts[:1], [4])  # warm-up
    lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
    start = time.perf_counter()
    tokens = run(prompts, max_tokens)
    elapsed_s = time.perf_counter() - start
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return {"tok_per_s": tokens / elapsed_s, "tokens": tokens, "sequences": len(prompts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("prompt_ids_json", nargs="?", help="batch 1: the prompt's token ids as JSON")
    parser.add_argument("--workload", type=Path, help="many sequences: a bench/workload.py JSON file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-extra-bufts", action="store_true", help="no repacked/AMX weight buffers")
    args = parser.parse_args()
    extra = not args.no_extra_bufts
    if args.workload is not None:
        workload = json.loads(args.workload.read_text())
        result = many(args.gguf, workload["prompt_token_ids"], workload["max_tokens"], args.threads, extra)
    else:
        result = batch1(args.gguf, json.loads(args.prompt_ids_json), args.threads, args.max_tokens, extra)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
