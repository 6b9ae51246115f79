"""Keep a shard's lease alive from a background thread while the runner works on it (docs/operations.md).

`LeaseKeeper` renews the lease every ``renew_s`` seconds (`jobs.shards.renew_lease`). When a renewal
finds the lease gone (it lapsed and the reaper gave the shard to another worker, or the batch was
finalized) or the database has been unreachable past the lease's expiry, it sets ``lost``; the runner
looks at ``lost`` after every engine step and stops working on the shard.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from sqlalchemy.exc import SQLAlchemyError

from jobs.db import session_scope
from jobs.shards import Lease, renew_lease

logger = logging.getLogger(__name__)


def this_worker_id() -> str:
    """This process's id as leases and heartbeats name it: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


class LeaseKeeper:
    """Renews ``lease`` every ``renew_s`` seconds until `stop`; ``lost`` is set when it no longer holds.

    Args:
        lease: the lease the runner claimed (it lapses ``expiry_s`` seconds after each renewal).
        database_url: the database holding the lease (None: the settings' database).
        clock: Unix seconds.
    """

    def __init__(
        self,
        lease: Lease,
        *,
        database_url: str | None,
        renew_s: float,
        expiry_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.lease = lease
        self.lost = threading.Event()
        self._database_url = database_url
        self._renew_s, self._expiry_s, self._clock = renew_s, expiry_s, clock
        self._held_until = clock() + expiry_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{lease.shard_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the renewals (the lease is left as it is: finished, handed back, or to lapse)."""
        self._stop.set()
        self._thread.join(timeout=self._renew_s + 30)

    def _run(self) -> None:
        while not self._stop.wait(self._renew_s):
            now = self._clock()
            try:
                with session_scope(self._database_url) as session:
                    held = renew_lease(session, lease=self.lease, now=now, lease_s=self._expiry_s)
            except SQLAlchemyError as exc:
                logger.warning("lease of shard %s: renewal failed (%s)", self.lease.shard_id, exc)
                if self._clock() < self._held_until:
                    continue
                held = False
            if not held:
                logger.warning("lease of shard %s lost; stopping work on it", self.lease.shard_id)
                self.lost.set()
                return
            self._held_until = now + self._expiry_s
