"""Per-key rate limits of one API process: request rate and concurrent uploads (docs/api.md, "Limits").

Both are counted in this process's memory, so each API process behind a load balancer allows its own
share (run N processes, and a key gets up to N times each limit). Requests are counted per API key;
in a deployment without keys, per client address (`limit_key`), since there is no key to tell
clients apart.

- Request rate (``max_requests_per_minute``): a token bucket per key holding up to a minute's worth
  of requests and refilled continuously, so a key may burst up to the limit and then goes on at the
  limit's pace. The 429's ``Retry-After`` is when the next request fits.
- Concurrent uploads (``max_concurrent_uploads`` in all, ``max_concurrent_uploads_per_key``): request
  bodies being received at once (`api.limits.RequestBodies` takes a slot before it reads a body and
  gives it back once the body is in).

Refusals raise `RateLimited`, answered 429 with OpenAI's envelope (``code`` ``rate_limit_exceeded``,
``type`` ``requests``, as OpenAI's own rate-limit errors) and ``Retry-After`` in whole seconds.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from fastapi import Request

from api.auth import OwnerDep

UPLOAD_RETRY_AFTER_S = 5
"""``Retry-After`` of a 429 for too many concurrent uploads: how long an upload slot is waited for."""
_MAX_IDLE_BUCKETS = 10_000
"""Buckets kept before full ones (keys idle for a minute) are forgotten: anonymous clients are many."""


class RateLimited(Exception):
    """A request over a rate limit (a 429): ``message`` names the limit and its setting, ``retry_after_s``
    (whole seconds, at least 1) goes out as ``Retry-After``; ``code`` / ``error_type`` are OpenAI's."""

    def __init__(
        self, message: str, *, retry_after_s: float, code: str = "rate_limit_exceeded", error_type: str = "requests"
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = max(1, math.ceil(retry_after_s))
        self.code = code
        self.error_type = error_type


def limit_key(owner: str | None, client_host: str | None) -> str:
    """What the per-key limits count by: the API key's id, or ``client <address>`` without a key."""
    if owner is not None:
        return owner
    return f"client {client_host or 'unknown'}"


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated_s: float


class RequestRate:
    """Token buckets of ``max_per_minute`` requests per key (thread-safe: sync dependencies run in threads)."""

    def __init__(self, max_per_minute: int) -> None:
        self.max_per_minute = max_per_minute
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    def take(self, key: str, *, now_s: float | None = None) -> None:
        """Count one request of ``key`` (``now_s``: a monotonic time, for tests).

        Raises:
            RateLimited: ``key`` made ``max_per_minute`` requests in the last minute (at the refill pace).
        """
        if self.max_per_minute <= 0:
            return
        now = time.monotonic() if now_s is None else now_s
        rate_per_s = self.max_per_minute / 60
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                if len(self._buckets) >= _MAX_IDLE_BUCKETS:
                    self._forget_full(now, rate_per_s)
                bucket = self._buckets[key] = _Bucket(float(self.max_per_minute), now)
            bucket.tokens = min(float(self.max_per_minute), bucket.tokens + (now - bucket.updated_s) * rate_per_s)
            bucket.updated_s = now
            if bucket.tokens < 1:
                raise RateLimited(
                    f"Rate limit reached for {key} on requests per minute: limit {self.max_per_minute} "
                    "(BATCHINFER_MAX_REQUESTS_PER_MINUTE, counted per API process); try again later.",
                    retry_after_s=(1 - bucket.tokens) / rate_per_s,
                )
            bucket.tokens -= 1

    def _forget_full(self, now: float, rate_per_s: float) -> None:
        full = [
            key
            for key, bucket in self._buckets.items()
            if bucket.tokens + (now - bucket.updated_s) * rate_per_s >= self.max_per_minute
        ]
        for key in full:
            del self._buckets[key]


class UploadSlots:
    """Request bodies being received: at most ``max_total`` at once, ``max_per_key`` per key (0: no cap).

    Used on the event loop only (`api.limits.RequestBodies`), so it needs no lock.
    """

    def __init__(self, *, max_total: int, max_per_key: int) -> None:
        self.max_total = max_total
        self.max_per_key = max_per_key
        self.num_total = 0
        self._per_key: dict[str, int] = {}

    def acquire(self, key: str) -> None:
        """Take an upload slot of ``key`` (give it back with `release`).

        Raises:
            RateLimited: ``max_total`` bodies, or ``max_per_key`` of ``key``'s, are being received.
        """
        if 0 < self.max_total <= self.num_total:
            raise RateLimited(
                f"Too many uploads in progress: limit {self.max_total} at once "
                "(BATCHINFER_MAX_CONCURRENT_UPLOADS, per API process); try again shortly.",
                retry_after_s=UPLOAD_RETRY_AFTER_S,
            )
        held = self._per_key.get(key, 0)
        if 0 < self.max_per_key <= held:
            raise RateLimited(
                f"Too many uploads in progress for {key}: limit {self.max_per_key} at once "
                "(BATCHINFER_MAX_CONCURRENT_UPLOADS_PER_KEY, per API process); try again shortly.",
                retry_after_s=UPLOAD_RETRY_AFTER_S,
            )
        self.num_total += 1
        self._per_key[key] = held + 1

    def release(self, key: str) -> None:
        """Give back a slot `acquire` took for ``key``."""
        self.num_total -= 1
        if self._per_key[key] == 1:
            del self._per_key[key]
        else:
            self._per_key[key] -= 1


def check_request_rate(request: Request, owner: OwnerDep) -> str | None:
    """Dependency of every keyed route: count the request against its key's rate (`RequestRate` on
    ``app.state.request_rate``); returns the owner.

    Raises:
        RateLimited: over ``max_requests_per_minute``.
    """
    rate: RequestRate = request.app.state.request_rate
    rate.take(limit_key(owner, request.client.host if request.client else None))
    return owner
