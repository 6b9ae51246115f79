"""The batch lifecycle (OpenAI Batch API statuses) and its allowed transitions.

```
validating -> failed                                  (bad input file)
validating -> in_progress -> finalizing -> completed
in_progress -> expired                                (24 h window passed)
validating | in_progress -> cancelling -> cancelled
```
"""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Any


class BatchStatus(StrEnum):
    """A batch's status, spelled as the API returns it."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        """True for statuses a batch never leaves (failed, completed, expired, cancelled)."""
        return not ALLOWED_TRANSITIONS[self]


ALLOWED_TRANSITIONS: dict[BatchStatus, frozenset[BatchStatus]] = {
    BatchStatus.VALIDATING: frozenset({BatchStatus.FAILED, BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING}),
    BatchStatus.IN_PROGRESS: frozenset({BatchStatus.FINALIZING, BatchStatus.EXPIRED, BatchStatus.CANCELLING}),
    BatchStatus.FINALIZING: frozenset({BatchStatus.COMPLETED}),
    BatchStatus.CANCELLING: frozenset({BatchStatus.CANCELLED}),
    BatchStatus.FAILED: frozenset(),
    BatchStatus.COMPLETED: frozenset(),
    BatchStatus.EXPIRED: frozenset(),
    BatchStatus.CANCELLED: frozenset(),
}


class IllegalTransition(ValueError):
    """A status change the lifecycle does not allow (e.g. completed -> cancelling)."""

    def __init__(self, current: BatchStatus, new: BatchStatus) -> None:
        super().__init__(f"cannot move a batch from {current.value!r} to {new.value!r}")
        self.current = current
        self.new = new


def now_s() -> int:
    """The current Unix time in whole seconds (the unit of every ``*_at`` field)."""
    return int(time.time())


def transition(batch: Any, new_status: BatchStatus | str, now: int | None = None) -> None:
    """Move ``batch`` to ``new_status`` and stamp ``batch.<new_status>_at = now``.

    Args:
        batch: any object with ``status`` and the ``*_at`` attributes (the ORM `Batch`); mutated.
        new_status: the target status.
        now: Unix seconds; default the current time.

    Raises:
        IllegalTransition: the lifecycle does not allow the move.
    """
    current = BatchStatus(batch.status)
    new = BatchStatus(new_status)
    if new not in ALLOWED_TRANSITIONS[current]:
        raise IllegalTransition(current, new)
    batch.status = new.value
    setattr(batch, f"{new.value}_at", now_s() if now is None else now)
