"""C++ exponential-race sampling for CPUs: one token per row from counter-based random numbers.

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
