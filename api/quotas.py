"""The per-key enqueued-token limit (``max_enqueued_tokens``), checked when a batch is created
(``POST /v1/batches`` and ``POST /v1/jobs``; docs/api.md, "Limits").

OpenAI's Batch API bounds each organization's queue the same way, in enqueued tokens, and names the
refusal ``token_limit_exceeded``. A key's enqueued tokens are estimates (the API loads no tokenizer):

- its ``in_progress`` batches: the estimated tokens of their shards not yet finished
  (`jobs.sharding.estimate_tokens`: prompt characters / 4 + completion budget, per line);
- its batches still ``validating`` (not cut into shards yet), and the new batch: their input
  files' bytes / `jobs.sharding.CHARS_PER_TOKEN`, a lower bound of the same estimate.

A new batch whose own estimate is over the limit can never fit: a 400. One that does not fit beside
the key's enqueued batches: a 429 with ``Retry-After``. Requests without an API key (an open
deployment) share one queue. Batches that schedules create are not checked (the scheduler has no
one to answer), but count once they are queued; two batches created at the same instant may both fit.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.rate_limits import RateLimited
from jobs.errors import InvalidRequest
from jobs.models import Batch, BatchShard, File, ShardState
from jobs.sharding import CHARS_PER_TOKEN
from jobs.status import BatchStatus

TOKEN_LIMIT_RETRY_AFTER_S = 60
"""``Retry-After`` of a 429 ``token_limit_exceeded``: batches take minutes, so ask again in a minute."""


def enqueued_tokens(session: Session, *, owner: str | None) -> int:
    """The estimated tokens of ``owner``'s unfinished batches (see the module docstring); owner None:
    the batches created without an API key."""
    owned = Batch.owner_key_id == owner if owner is not None else Batch.owner_key_id.is_(None)
    in_shards = session.scalar(
        select(func.coalesce(func.sum(BatchShard.num_tokens), 0))
        .join(Batch, Batch.id == BatchShard.batch_id)
        .where(
            owned,
            Batch.status == BatchStatus.IN_PROGRESS.value,
            BatchShard.state.in_([ShardState.QUEUED.value, ShardState.RUNNING.value]),
        )
    )
    validating_bytes = session.scalar(
        select(func.coalesce(func.sum(File.num_bytes), 0))
        .select_from(Batch)
        .join(File, File.id == Batch.input_file_id)
        .where(owned, Batch.status == BatchStatus.VALIDATING.value)
    )
    return int(in_shards or 0) + int(validating_bytes or 0) // CHARS_PER_TOKEN


def check_enqueued_tokens(
    session: Session, *, owner: str | None, input_file_bytes: int, max_enqueued_tokens: int
) -> None:
    """Refuse a new batch of an ``input_file_bytes`` input file that would take ``owner`` over
    ``max_enqueued_tokens`` (0: no limit).

    Raises:
        InvalidRequest: the batch alone is over the limit (``code="token_limit_exceeded"``, ``param="input_file_id"``).
        RateLimited: the batch does not fit beside the key's enqueued batches (``code="token_limit_exceeded"``).
    """
    if max_enqueued_tokens <= 0:
        return
    new_tokens = input_file_bytes // CHARS_PER_TOKEN
    setting = "BATCHINFER_MAX_ENQUEUED_TOKENS"
    if new_tokens > max_enqueued_tokens:
        raise InvalidRequest(
            f"this batch alone is estimated at {new_tokens} tokens or more (input file bytes / {CHARS_PER_TOKEN}), "
            f"over the limit of {max_enqueued_tokens} enqueued tokens per key ({setting}); split the file",
            param="input_file_id",
            code="token_limit_exceeded",
        )
    enqueued = enqueued_tokens(session, owner=owner)
    if enqueued + new_tokens > max_enqueued_tokens:
        who = f"key {owner}" if owner is not None else "requests without an API key"
        raise RateLimited(
            f"Enqueued token limit reached for {who}: limit {max_enqueued_tokens} enqueued tokens ({setting}); "
            f"about {enqueued} are enqueued and this batch adds about {new_tokens}. "
            "Try again once some in_progress batches have been completed.",
            retry_after_s=TOKEN_LIMIT_RETRY_AFTER_S,
            code="token_limit_exceeded",
            error_type="tokens",
        )
