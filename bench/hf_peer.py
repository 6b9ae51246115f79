"""Run a saved workload on Hugging Face ``generate`` in this process; prints one JSON object.

Usage: python bench/hf_peer.py WORKLOAD_JSON MODEL_DIR [--threads 2] [--batch-size 16] [--reference]
       [--device cpu] [--dtype float32]

Default (a timed round): static batches of ``--batch-size`` prompts, left padded, each batch run to its
largest ``max_tokens``, credited only with useful tokens (each request's own ``max_tokens``); one short
warm-up first. ``tok_per_s`` is useful tokens over the wall time. ``--device``/``--dtype`` place the timed
model (the peer of batchinfer on the same device and dtype; on CUDA the clock stops after a synchronize).

``--reference`` (the fidelity reference, not timed): each prompt alone (batch of one, no padding), greedy,
float32, with its per-position top two logprobs (``top2``: ``[logprob_1, logprob_2, id_1, id_2]``), as
the parity tests' ``hf_greedy_reference`` (tests/helpers/parity.py).
``ignore_eos`` throughout: EOS may be generated and generation goes on (docs/benchmarks.md, "HF generate
as a reference").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers.parity import hf_greedy_reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload")
    parser.add_argument("model_dir")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--device", default="cpu", help="the timed model's device (not --reference's)")
    parser.add_argument("--dtype", default="float32", help="the timed model's dtype (not --reference's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    workload = json.loads(Path(args.workload).read_text())
    prompts, max_tokens = workload["prompt_token_ids"], workload["max_tokens"]
    if args.reference:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
        references = [hf_greedy_reference(model, ids, m) for ids, m in zip(prompts, max_tokens)]
        print(
            json.dumps(
                {
                    "token_ids": [r.token_ids for r in references],
                    "top2": [[list(t) for t in r.top2] for r in references],
                }
            )
        )
        return

    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype)).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    # ignore_eos as the engine does it: EOS may be sampled and generation goes on (not min_new_tokens,
    # which masks EOS and so changes the greedy path).
    model.generation_config.eos_token_id = None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def generate(batch_ids: list[list[int]], max_new_tokens: int) -> None:
        width = max(len(ids) for ids in batch_ids)
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in batch_ids], device=device)
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch_ids], device=device)
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )

    generate(prompts[:2], 4)
    start = time.perf_counter()
    for first in range(0, len(prompts), args.batch_size):
        generate(prompts[first : first + args.batch_size], max(max_tokens[first : first + args.batch_size]))
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed_s = time.perf_counter() - start
    print(json.dumps({"tok_per_s": sum(max_tokens) / elapsed_s, "elapsed_s": elapsed_s}))


if __name__ == "__main__":
    main()
