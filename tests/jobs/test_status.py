"""The batch lifecycle: every allowed move stamps its ``*_at``; every other move raises."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jobs.status import ALLOWED_TRANSITIONS, BatchStatus, IllegalTransition, transition

_CONTRACT_MOVES = {
    ("validating", "failed"),
    ("validating", "in_progress"),
    ("validating", "cancelling"),
    ("in_progress", "finalizing"),
    ("in_progress", "expired"),
    ("in_progress", "cancelling"),
    ("finalizing", "completed"),
    ("cancelling", "cancelled"),
}


def _batch(status: str) -> SimpleNamespace:
    return SimpleNamespace(status=status, **{f"{s.value}_at": None for s in BatchStatus})


def test_allowed_transitions_are_exactly_the_contract_lifecycle() -> None:
    allowed = {(old.value, new.value) for old, news in ALLOWED_TRANSITIONS.items() for new in news}
    assert allowed == _CONTRACT_MOVES
    assert {s for s in BatchStatus if s.is_terminal} == {
        BatchStatus.FAILED,
        BatchStatus.COMPLETED,
        BatchStatus.EXPIRED,
        BatchStatus.CANCELLED,
    }


@pytest.mark.parametrize(("old", "new"), sorted(_CONTRACT_MOVES))
def test_allowed_transition_sets_status_and_stamps_time(old: str, new: str) -> None:
    batch = _batch(old)
    transition(batch, new, now=1_700_000_123)
    assert batch.status == new
    assert getattr(batch, f"{new}_at") == 1_700_000_123


@pytest.mark.parametrize(
    ("old", "new"),
    sorted(
        (old.value, new.value)
        for old in BatchStatus
        for new in BatchStatus
        if (old.value, new.value) not in _CONTRACT_MOVES
    ),
)
def test_illegal_transition_raises_and_changes_nothing(old: str, new: str) -> None:
    batch = _batch(old)
    with pytest.raises(IllegalTransition, match=f"from '{old}' to '{new}'"):
        transition(batch, new, now=5)
    assert batch.status == old
    assert all(getattr(batch, f"{s.value}_at") is None for s in BatchStatus)


def test_transition_defaults_now_to_current_unix_seconds() -> None:
    import time

    batch = _batch("validating")
    before = int(time.time())
    transition(batch, BatchStatus.IN_PROGRESS)
    assert before <= batch.in_progress_at <= int(time.time())
