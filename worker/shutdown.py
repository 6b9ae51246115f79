"""Stopping a worker never fails a line: a stop signal hands the running shard back (docs/operations.md).

Celery's own handlers stop a solo worker only after its task returns (SIGTERM, first Ctrl-C), or
cancel the task from inside the signal handler (SIGQUIT, second Ctrl-C), which on the solo pool
raises out of whatever the engine was doing. Instead, `install` (called once the worker is ready,
after Celery set its handlers) puts a wrapper in front of them for SIGTERM, SIGINT and SIGQUIT:

- while no shard runs, the signal goes straight to Celery's handler, as before;
- while a shard runs (`running_shard`), the wrapper only sets ``requested``: the runner sees it
  after the current engine step, records the lines already finished, hands the shard back
  (`jobs.shards.hand_back_shard`, the attempt not counted) and queues a message for it; then,
  as the task returns, Celery is told to stop: warm (exit 0) for SIGTERM or a first Ctrl-C, cold
  (exit 1) for SIGQUIT or a second Ctrl-C. Either way the lines not finished go back to the queue.

SIGKILL cannot be caught: then the lease lapses and the reaper re-queues the shard.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
EX_OK, EX_FAILURE = 0, 1

requested = threading.Event()
"""Set by the first stop signal; the runner stops its shard when it sees it."""

_previous: dict[int, Any] = {}
_state = {"busy": False, "cold": False, "interrupts": 0}


def install() -> None:
    """Wrap the current SIGTERM, SIGINT and SIGQUIT handlers (Celery's); call from the main thread."""
    for signum in _SIGNALS:
        _previous[signum] = signal.getsignal(signum)
        signal.signal(signum, _handle)


def _handle(signum: int, frame: FrameType | None) -> None:
    requested.set()
    if signum == signal.SIGINT:
        _state["interrupts"] += 1
    if signum == signal.SIGQUIT or _state["interrupts"] >= 2:
        _state["cold"] = True
    if _state["busy"]:
        logger.warning("worker: %s; handing the running shard back", signal.Signals(signum).name)
        return
    previous = _previous.get(signum)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


@contextmanager
def running_shard() -> Iterator[threading.Event]:
    """The block runs a shard: stop signals only set the yielded event; on exit, a stop asked for
    meanwhile is passed on to Celery (warm or cold, as the signals asked)."""
    _state["busy"] = True
    try:
        yield requested
    finally:
        _state["busy"] = False
        if requested.is_set():
            _stop_celery(cold=bool(_state["cold"]))


def _stop_celery(*, cold: bool) -> None:
    from celery.worker import state

    if cold:
        state.should_terminate = EX_FAILURE
    else:
        state.should_stop = EX_OK
