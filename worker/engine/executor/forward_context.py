"""What a model forward's layers read about the step they run in, without threading it through every signature
(as vLLM's ``forward_context``).

One fact today: whether the step must be batch invariant, i.e. holds a sequence whose numbers must not depend on
its batch (``SamplingParams.batch_invariant``, docs/engine.md "Batch-invariant numerics"). The model runner wraps
the forward and the logits of each step in :func:`batch_invariant_step`; linear layers whose fastest numerics for
tall calls depend on the call's height (bfloat16 Q4 panels, oneDNN's bfloat16 GEMM) read
:func:`step_is_batch_invariant` on every call and keep their height-independent kernel when it is true. Outside any
step (tests, benchmarks calling a layer directly) it is false.

The flag lives in a :class:`contextvars.ContextVar`, so a read costs one ``ContextVar.get`` and nested or
concurrent forwards (threads, tasks) each see their own step's value.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_batch_invariant: ContextVar[bool] = ContextVar("batch_invariant_step", default=False)


def step_is_batch_invariant() -> bool:
    """Whether the forward running now belongs to a step that must be batch invariant (False outside a step)."""
    return _batch_invariant.get()


@contextmanager
def batch_invariant_step(batch_invariant: bool) -> Iterator[None]:
    """Run the block as a step that must (``True``) or need not (``False``) be batch invariant; the previous value
    is restored on exit, exceptions included."""
    token = _batch_invariant.set(batch_invariant)
    try:
        yield
    finally:
        _batch_invariant.reset(token)
