"""C++ exponential-race sampling for CPUs: one token per row from counter-based random numbers; and greedy
sampling's argmax of each row (:func:`argmax_rows_cpu`).

The source is ``cpu_sampling.cpp`` next to this file, built with the other CPU kernels by
:mod:`kernels.cpu_extension` (check :func:`kernels.cpu_extension.cpu_kernels_available` first). Its
PyTorch twin, which runs on any device, is :func:`kernels.reference.exponential_race_reference`.

This module imports nothing of batchinfer's outside ``kernels``.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import require_cpu_kernels


def exponential_race_cpu(logits: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of ``softmax(logits)`` by the Gumbel-max trick (an exponential race).

    Row ``r`` returns ``argmax_t logits[r, t] + g(keys[r], counters[r], t)`` (lowest ``t`` on a tie), where
    ``g`` is Gumbel noise from two levels of SplitMix64 (see the source's header): the same key, counter and
    logits always give the same token, whatever the other rows. Tokens more than 20 below the row's largest
    logit cannot win and get no noise.

    Args:
        logits: float32 contiguous CPU ``[num_rows, vocab_size]`` (temperature-scaled; ``-inf`` excludes a
            token); every row needs a finite entry.
        keys: int64 ``[num_rows]``: each row's stream key (a request's seed, prompt and sample index).
        counters: int64 ``[num_rows]``: index of the token being sampled in its sequence's output.

    Returns:
        int64 ``[num_rows]`` token ids.

    Raises:
        RuntimeError: when the kernels are unavailable, on bad shapes or dtypes, or a row without a finite
            logit.
    """
    require_cpu_kernels()
    out = torch.empty(logits.shape[0], dtype=torch.long)
    torch.ops.batchinfer_cpu.exponential_race_(out, logits, keys, counters)
    return out


def argmax_rows_cpu(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of a 2-D float32 CPU tensor, the same indices: each row's lowest index of its
    maximum, or its first NaN where it has one; vectorised (two passes over a row) and split over rows across
    ``torch.get_num_threads()`` threads, where torch's CPU argmax compares element by element.

    Args:
        logits: float32 CPU ``[num_rows, n]``, ``n >= 1``, unit stride in the last dimension.

    Returns:
        int64 ``[num_rows]``.

    Raises:
        RuntimeError: when the kernels are unavailable, or on other shapes, dtypes or devices.
    """
    require_cpu_kernels()
    out = torch.empty(logits.shape[0], dtype=torch.long)
    torch.ops.batchinfer_cpu.argmax_rows_(out, logits)
    return out
