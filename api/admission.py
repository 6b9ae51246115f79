"""Admission: at most `MAX_REQUESTS_IN_APP` requests inside the app at once; the rest wait on the event loop.

Why: a request's database session holds its pooled connection from its first query until the
commit, and FastAPI runs the query (in the endpoint) and the commit (in the dependency's exit) in
two separate hops through the thread pool (40 threads). With more requests in flight than pooled
connections, every thread can end up waiting for a connection held by a request that is itself
waiting for a thread: nothing moves until the pool's 30 s timeout (seen with 100 concurrent status
pollers). Admitting fewer requests than the pool has connections (`jobs.db.MAX_CONNECTIONS`, less
room for background validation) makes that cycle impossible; waiting requests hold neither a thread
nor a connection. A request leaves the count when its response starts: by then its session has
ended (``SessionDep`` commits, ``ReadSessionDep`` rolls back, before the response), and a streamed
body reads storage in short sessions of its own. A request body is received before the request is
admitted (`api.limits`), so a slow upload holds no slot.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jobs.db import MAX_CONNECTIONS

MAX_REQUESTS_IN_APP = MAX_CONNECTIONS - 4
"""Requests admitted at once: the pool's connections less 4 for background validation and start-up work."""


def admission_slots() -> asyncio.Semaphore:
    """The slots `Admission` hands out: `MAX_REQUESTS_IN_APP` of them."""
    return asyncio.Semaphore(MAX_REQUESTS_IN_APP)


class Admission:
    """ASGI middleware admitting an HTTP request once it holds one of ``slots``, until its response starts."""

    def __init__(self, app: ASGIApp, *, slots: asyncio.Semaphore) -> None:
        self.app = app
        self.slots = slots

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.slots.acquire()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.slots.release()

        async def releasing_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                release()
            await send(message)

        try:
            await self.app(scope, receive, releasing_send)
        finally:
            release()
