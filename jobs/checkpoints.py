"""Line checkpoints: the output token ids a running line generated so far, saved under its shard's lease.

A worker saves the generated token ids of the lines it is running every ``Settings.checkpoint_interval_s``
seconds and when it hands its shard back (`worker.checkpointer`); whoever claims the shard next
resumes each such line from them instead of from zero (docs/operations.md, "Checkpoints"). Token ids,
never text: the engine rebuilds the rest (``LLMEngine.add_request``'s ``resumed_token_ids``).

Only the holder of the shard's lease may write: a worker whose lease lapsed and went to another must
not overwrite the newer owner's checkpoints. The batch row is locked first, as by every function that
claims or ends a shard (`jobs.shards`), so a claim either happened before (nothing is written) or waits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlalchemy import update
from sqlalchemy.orm import Session

from jobs.models import BatchRequest, RequestState
from jobs.repository import get_batch
from jobs.shards import Lease, holds_lease


def save_checkpoints(
    session: Session,
    *,
    lease: Lease,
    token_ids: Mapping[str, Sequence[int]],
    recomputed_tokens: Mapping[str, int] | None = None,
) -> bool:
    """Store each pending line's generated token ids, and add to its ``recomputed_tokens``, while ``lease`` is held.

    Args:
        lease: the shard's lease; lines of other shards, and lines already recorded, are left alone.
        token_ids: request id -> the line's output token ids so far (replaces its checkpoint).
        recomputed_tokens: request id -> generated tokens this run throws away (not in any checkpoint).

    Returns:
        False, with nothing written, when the lease is no longer held.

    Raises:
        jobs.repository.NotFound: the batch is gone.
    """
    recomputed_tokens = recomputed_tokens or {}
    get_batch(session, batch_id=lease.batch_id, for_update=True)
    if not holds_lease(session, lease=lease):
        return False
    for request_id in sorted(set(token_ids) | set(recomputed_tokens)):
        values: dict[str, object] = {}
        if request_id in token_ids:
            values["checkpoint_token_ids"] = list(token_ids[request_id])
        if recomputed_tokens.get(request_id):
            values["recomputed_tokens"] = BatchRequest.recomputed_tokens + recomputed_tokens[request_id]
        session.execute(
            update(BatchRequest)
            .where(
                BatchRequest.id == request_id,
                BatchRequest.shard_id == lease.shard_id,
                BatchRequest.state == RequestState.PENDING.value,
            )
            .values(**values)
            .execution_options(synchronize_session=False)
        )
    return True
