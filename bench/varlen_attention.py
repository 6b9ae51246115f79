"""The encoder's varlen attention kernel alone, on BERT's shapes: GFLOP per CPU second, one thread.

q/k/v are strided views of one fused ``[num_tokens, 3 * heads * head_size]`` projection (as in
worker/engine/executor/models/bert.py), sequence lengths uniform in 5..256 (bench/embed.py's workload) adding
up to about ``--tokens``. FLOPs per (sequence of length ``L``, head): ``4 * head_size * L**2`` (``Q K^T`` and
``P V``; the softmax is not counted). Times are the best of ``--reps`` by process CPU time
(``time.process_time``), which a machine shared with other work distorts less than wall time. The reference
point is torch's ``scaled_dot_product_attention`` called once per sequence (no mask, no padding).

Usage: python bench/varlen_attention.py [--tokens 4096] [--heads 12] [--head-size 32] [--reps 7]
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.nn import functional as F

from kernels.cpu_attention import varlen_attention_cpu


def _best_cpu_seconds(fn: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-size", type=int, default=32)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    rng = random.Random(args.seed)
    lengths: list[int] = []
    while sum(lengths) < args.tokens:
        lengths.append(rng.randint(5, 256))
    num_tokens, width = sum(lengths), args.heads * args.head_size
    qkv = torch.randn(num_tokens, 3 * width, generator=torch.Generator().manual_seed(args.seed))
    query, key, value = (qkv[:, i * width : (i + 1) * width].view(num_tokens, args.heads, -1) for i in range(3))
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    scale = args.head_size**-0.5
    flops = sum(4 * args.head_size * length**2 * args.heads for length in lengths)

    def ours() -> torch.Tensor:
        return varlen_attention_cpu(query, key, value, cu_seqlens, scale)

    def sdpa() -> torch.Tensor:
        outs, start = [], 0
        for length in lengths:
            q, k, v = (x[start : start + length].transpose(0, 1) for x in (query, key, value))
            outs.append(F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1))
            start += length
        return torch.cat(outs)

    max_abs_diff = (ours() - sdpa()).abs().max().item()
    ours_s, sdpa_s = _best_cpu_seconds(ours, args.reps), _best_cpu_seconds(sdpa, args.reps)
    print(
        json.dumps(
            {
                "num_seqs": len(lengths),
                "num_tokens": num_tokens,
                "gflop": round(flops / 1e9, 4),
                "ours_cpu_ms": round(ours_s * 1e3, 2),
                "ours_gflop_per_cpu_s": round(flops / ours_s / 1e9, 1),
                "sdpa_cpu_ms": round(sdpa_s * 1e3, 2),
                "sdpa_gflop_per_cpu_s": round(flops / sdpa_s / 1e9, 1),
                "max_abs_diff_vs_sdpa": max_abs_diff,
            }
        )
    )


if __name__ == "__main__":
    main()
