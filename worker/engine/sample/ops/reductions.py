"""Row reductions whose result for a row does not depend on the other rows (docs/engine.md, "Batch-invariant
numerics").

``torch.logsumexp`` over the last dimension splits a lone row's sum across threads, but gives each thread whole rows
when there are several, so a row's bits can change with the number of rows beside it (measured: 12 of 300 single
rows of 49,152 float32 logits at 2 threads). ``torch.log_softmax`` and ``torch.softmax`` over the last dimension
reduce every row on one thread in a fixed order whatever the number of rows, so the normaliser is taken from them.
"""

from __future__ import annotations

import torch


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """``log(sum(exp(x), dim=-1))`` of a float ``[rows, n]`` tensor, batch invariant: read off ``log_softmax`` at
    each row's maximum ``m`` (there it is ``-log(sum(exp(x - m)))``, so ``m`` minus it is the normaliser, as
    ``torch.logsumexp`` computes it up to rounding).

    Args:
        x: float ``[rows, n]``, ``n >= 1``, each row with a finite maximum.

    Returns:
        ``[rows]`` in ``x.dtype``.
    """
    at_max = x.argmax(dim=-1, keepdim=True)
    return (x.gather(-1, at_max) - torch.log_softmax(x, dim=-1).gather(-1, at_max)).squeeze(-1)
