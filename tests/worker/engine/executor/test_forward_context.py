"""The step-wide batch-invariance flag the model runner sets around a forward (worker/engine/executor/forward_context)."""

import pytest

from worker.engine.executor.forward_context import batch_invariant_step, step_is_batch_invariant


def test_false_outside_a_step_and_restored_after_nested_steps_and_errors():
    assert not step_is_batch_invariant()
    with batch_invariant_step(True):
        assert step_is_batch_invariant()
        with batch_invariant_step(False):
            assert not step_is_batch_invariant()
        assert step_is_batch_invariant()
        with pytest.raises(RuntimeError), batch_invariant_step(False):
            raise RuntimeError("a failing forward")
        assert step_is_batch_invariant()
    assert not step_is_batch_invariant()
