"""Admission: at most `MAX_REQUESTS_IN_APP` requests inside the app at once; the rest wait on the event loop.

Why: a request's database session holds its pooled connection from its first query until the
commit, and FastAPI runs the query (in the endpoint) and the commit (in the dependency's exit) in
two separate hops through the thread pool (40 threads). With more requests in flight than pooled
connections, every thread can end up waiting for a connection held by a request that is itself
waiting for a thread: nothing moves until the pool's 30 s timeout (seen with 100 concurrent status
pollers). Admitting fewer requests than the pool has connections (`jobs.db.MAX_CONNECTIONS`, less
room for background validation) makes that cycle impossible; waiting requests hold neither a thread
nor a connection. A request leaves the count when its response starts: by then its session has
committed (``SessionDep`` commits before the response), and a streamed body reads storage in short
sessions of its own.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jobs.db import MAX_CONNECTIONS

MAX_REQUESTS_IN_APP = MAX_CONNECTIONS - 4
"""Requests admitted at once: the pool's connections less 4 for background validation and start-up work."""


class Admission:
    """ASGI middleware admitting at most ``limit`` HTTP requests until their response starts."""

    def __init__(self, app: ASGIApp, *, limit: int = MAX_REQUESTS_IN_APP) -> None:
        self.app = app
        self.slots = asyncio.Semaphore(limit)

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
