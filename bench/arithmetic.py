"""What a workload's arithmetic allows: its FLOPs, this machine's peak, and the resulting tokens/s limit.

The ruler of ``bench/profile_workload.py`` (the throughput workload) and ``bench/prefix.py`` (the few-shot
job, where a perfect prefix cache computes each distinct prompt prefix once). See docs/benchmarks.md.

**FLOPs** (multiply-adds count 2): a projection of ``M`` rows, ``K`` inputs and ``N`` outputs does ``2*M*K*N``.
Per layer, per token: qkv ``2*h*(H+2*Hkv)*D``, o ``2*H*D*h``, gate_up ``2*h*2*I``, down ``2*I*h``; the LM head
``2*h*V`` per sampled row (``h`` hidden size, ``H``/``Hkv`` query/KV heads, ``D`` head size, ``I``
intermediate size, ``V`` vocabulary). Causal attention, per layer: a query at position ``p`` reads ``p + 1``
keys, ``4*H*D*(p+1)`` (``q.k`` and the weighted sum of ``v``); a sequence adding ``q`` tokens to a context of
``L`` (new ones included) does ``4*H*D*(q*(L-q) + q*(q+1)/2)``. Elementwise work, softmax and sampling are
not counted.

Each request feeds ``P + T - 1`` tokens through the decoder (``P`` prompt tokens, ``T`` = ``max_tokens``; the
last sampled token is never fed back) and samples ``T`` rows through the LM head. With ``shared_prefixes``,
a request's prompt tokens that an earlier request (in sorted order) already holds are not fed again: the
prompts form a trie and each of its nodes is computed once, the least any prefix cache can compute.

**Peak**: a square float32 product through our packed kernel (``kernels/cpu_gemm.py``), through
``torch.matmul`` (MKL) and through oneDNN with a prepacked weight (the ops torch's inductor emits for a frozen CPU
graph; on AMD Zen 4 MKL does not reach oneDNN's AVX-512 rate), best of ``reps`` each, the largest of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import torch
from workload import Workload

from kernels.cpu_extension import cpu_kernels_available
from kernels.cpu_gemm import linear_packed, pack_linear_weight
from worker.engine.executor.layers.onednn_linear import onednn_linear_available, packed_linear
from worker.engine.executor.layers.onednn_linear import pack_linear_weight as pack_onednn_weight
from worker.engine.executor.models.llama import head_size_of, num_kv_heads_of


def model_dims(config: Any) -> dict[str, int]:
    """The sizes the FLOP formulas use: h, H, Hkv, D, I, V and the number of layers (from a HF config)."""
    return {
        "h": int(config.hidden_size),
        "H": int(config.num_attention_heads),
        "Hkv": num_kv_heads_of(config),
        "D": head_size_of(config),
        "I": int(config.intermediate_size),
        "V": int(config.vocab_size),
        "layers": int(config.num_hidden_layers),
    }


def attention_flops(dims: dict[str, int], query_lens: list[int], seq_lens: list[int]) -> float:
    """Causal attention FLOPs of one layer for sequences adding ``query_lens`` tokens to contexts of ``seq_lens``."""
    keys = sum(q * (n - q) + q * (q + 1) // 2 for q, n in zip(query_lens, seq_lens))
    return 4.0 * dims["H"] * dims["D"] * keys


def _shared_prefix_lens(prompts: list[list[int]]) -> list[int]:
    """Per prompt, its tokens held by an earlier prompt in sorted order (the longest common prefix with its
    sorted predecessor: summed, the prompt tokens minus the trie's nodes)."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    shared = [0] * len(prompts)
    for before, i in pairwise(order):
        a, b = prompts[before], prompts[i]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        shared[i] = n
    return shared


def workload_flops(dims: dict[str, int], workload: Workload, *, shared_prefixes: bool = False) -> dict[str, float]:
    """FLOPs of the workload's forward passes by GEMM class and attention (module docstring)."""
    h, heads, kv_heads, d, inter, layers = dims["h"], dims["H"], dims["Hkv"], dims["D"], dims["I"], dims["layers"]
    prompts = workload.prompt_token_ids
    shared = _shared_prefix_lens(prompts) if shared_prefixes else [0] * len(prompts)
    contexts = [len(p) + t - 1 for p, t in zip(prompts, workload.max_tokens)]
    fed = [n - s for n, s in zip(contexts, shared)]
    tokens = sum(fed)
    return {
        "qkv": 2.0 * tokens * layers * h * (heads + 2 * kv_heads) * d,
        "o": 2.0 * tokens * layers * heads * d * h,
        "gate_up": 2.0 * tokens * layers * h * 2 * inter,
        "down": 2.0 * tokens * layers * inter * h,
        "lm_head": 2.0 * workload.num_output_tokens * h * dims["V"],
        "attention": layers * attention_flops(dims, fed, contexts),
    }


def calibrate_peak(size: int, reps: int) -> dict[str, float]:
    """Best GFLOP/s of a ``size`` x ``size`` x ``size`` float32 product: our packed kernel, ``torch.matmul`` and
    oneDNN (keys ``torch_matmul_gflops``, ``packed_gemm_gflops`` where the kernels are built,
    ``onednn_gflops`` where torch has oneDNN, ``peak_gflops``)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator)
    w = torch.randn(size, size, generator=generator)
    candidates: dict[str, Callable[[], torch.Tensor]] = {"torch_matmul": lambda: torch.matmul(a, w.T)}
    if cpu_kernels_available():
        packed = pack_linear_weight(w)
        candidates["packed_gemm"] = lambda: linear_packed(a, packed, size)
    if onednn_linear_available():
        onednn_weight = pack_onednn_weight(w, size)
        candidates["onednn"] = lambda: packed_linear(a, onednn_weight, None)
    result = {}
    for name, run in candidates.items():
        run()
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        result[f"{name}_gflops"] = 2.0 * size**3 / best / 1e9
    result["peak_gflops"] = max(result.values())
    return result
