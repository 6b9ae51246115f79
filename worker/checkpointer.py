"""Checkpoints of the lines a shard run has in flight (docs/operations.md, "Checkpoints").

The runner (`worker.runner`) gives a `Checkpointer` the engine and its lines in flight: `maybe_save` after
engine steps (it writes once ``interval_s`` passed since the last write), `save_final` when the shard is
handed back (every line's tokens so far), `discard` when the lease was lost. Each writes, in one short
transaction under the shard's lease (`jobs.checkpoints.save_checkpoints`), the output token ids of every
line that grew since its last checkpoint (`LLMEngine.progress`).

*Recomputed tokens* are generated tokens an interrupted run throws away because no checkpoint holds them
(the line generates them again when it resumes): those after a line's last checkpoint, and all of a
line that cannot resume (`worker.engine.core.request.can_resume`). They are added to each line's
``recomputed_tokens`` where the lease still allows, and reported to the observer
(``batchinfer:recomputed_tokens_total``). A worker killed outright (SIGKILL) loses what it generated
since its last checkpoint without counting it. An engine preemption is no interruption: the preempted line keeps
its generated tokens (only their KV is computed again), so it adds nothing here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

from jobs.checkpoints import save_checkpoints
from jobs.db import session_scope
from jobs.shards import Lease
from worker.engine.outputs import RequestProgress

logger = logging.getLogger(__name__)


class ProgressSource(Protocol):
    """The slice of the engine a checkpointer reads (`LLMEngine.progress`)."""

    def progress(self) -> dict[str, RequestProgress]: ...


@dataclass(slots=True)
class Checkpointer:
    """Saves the generated token ids of one shard run's lines in flight; ``interval_s`` 0 saves only at the end."""

    lease: Lease
    database_url: str | None
    interval_s: float
    clock: Callable[[], float] = time.monotonic
    _num_saved: dict[str, int] = field(default_factory=dict)
    _last_save_s: float = field(init=False)

    def __post_init__(self) -> None:
        self._last_save_s = self.clock()

    def resumed(self, request_id: str, num_tokens: int) -> None:
        """``request_id`` joined the engine resuming from a checkpoint of ``num_tokens`` tokens."""
        self._num_saved[request_id] = num_tokens

    def maybe_save(self, engine: ProgressSource, in_flight: Collection[str]) -> None:
        """Save the lines in flight that grew, when ``interval_s`` passed since the last save (best effort)."""
        if self.interval_s <= 0 or self.clock() - self._last_save_s < self.interval_s:
            return
        self._last_save_s = self.clock()
        token_ids, _ = self._split(engine, in_flight)
        self._write(self._grown(token_ids), {})

    def save_final(self, engine: ProgressSource, in_flight: Collection[str]) -> int:
        """Save every line in flight as it stands (the shard is handed back); returns the recomputed tokens:
        those of lines that cannot resume, plus every unsaved one when the write failed."""
        token_ids, lost = self._split(engine, in_flight)
        if self._write(self._grown(token_ids), lost):
            return sum(lost.values())
        return self._num_unsaved(token_ids) + sum(lost.values())

    def discard(self, engine: ProgressSource, in_flight: Collection[str]) -> int:
        """The recomputed tokens of the lines in flight when nothing more can be saved (the lease was lost)."""
        token_ids, lost = self._split(engine, in_flight)
        return self._num_unsaved(token_ids) + sum(lost.values())

    @staticmethod
    def _split(engine: ProgressSource, in_flight: Collection[str]) -> tuple[dict[str, list[int]], dict[str, int]]:
        """The lines in flight: the resumable ones' output token ids, the others' generated token counts."""
        progress = engine.progress()
        token_ids: dict[str, list[int]] = {}
        num_generated: dict[str, int] = {}
        for request_id in in_flight:
            entry = progress.get(request_id)
            if entry is None:
                continue
            if entry.resumable_token_ids is not None:
                token_ids[request_id] = entry.resumable_token_ids
            elif entry.num_generated_tokens:
                num_generated[request_id] = entry.num_generated_tokens
        return token_ids, num_generated

    def _grown(self, token_ids: dict[str, list[int]]) -> dict[str, list[int]]:
        return {rid: ids for rid, ids in token_ids.items() if len(ids) > self._num_saved.get(rid, 0)}

    def _num_unsaved(self, token_ids: dict[str, list[int]]) -> int:
        return sum(max(len(ids) - self._num_saved.get(rid, 0), 0) for rid, ids in token_ids.items())

    def _write(self, token_ids: dict[str, list[int]], recomputed_tokens: dict[str, int]) -> bool:
        if not token_ids and not recomputed_tokens:
            return True
        try:
            with session_scope(self.database_url) as session:
                held = save_checkpoints(
                    session, lease=self.lease, token_ids=token_ids, recomputed_tokens=recomputed_tokens
                )
        except Exception:
            logger.exception("shard %s: could not save checkpoints", self.lease.shard_id)
            return False
        if not held:
            return False
        for request_id, ids in token_ids.items():
            self._num_saved[request_id] = len(ids)
        logger.debug("shard %s: checkpointed %d lines", self.lease.shard_id, len(token_ids))
        return True
