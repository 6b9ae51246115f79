"""Request bodies are received in full, within size, time and concurrency limits, before the request
enters the app (docs/api.md, "Limits").

Why: a request holds one of the few admission slots (`api.admission`) from the moment it enters the
app until its response starts, and the app (FastAPI) reads the body first; so 16 uploads that declared
a body and then stalled held every slot, and every route, ``/health`` included, waited behind them.
Here a body is read before the request is admitted and before anything opens a database session, so
a slow or stalled sender holds only its own connection and one upload slot.

For an HTTP request that carries a body (``Content-Length`` above 0, or chunked), in this order:

1. a ``Content-Length`` over the route's limit: a 413 at once, nothing read. An upload route
   (`UPLOAD_ROUTES`: ``POST /v1/files``, ``POST /v1/jobs``) takes ``max_file_bytes`` +
   `FORM_SLACK_BYTES` (room for the multipart boundaries, part headers and small fields), else a 413
   ``file_too_large``; any other request (a JSON body, parsed in memory) takes
   ``max_request_body_bytes``, else a 413 ``request_too_large``;
2. its API key (`api.auth.owner_of`, one short query in a worker thread under an admission slot): a
   401 at once when the deployment has keys and the request has no live one;
3. an upload slot (`api.rate_limits.UploadSlots`, per key and in all): a 429 at once when none is free;
4. the body, received into a spool (in memory up to `SPOOL_MEMORY_BYTES`, then in a temporary file):
   each wait for more bytes lasts at most ``upload_read_timeout_s`` and the whole body at most
   ``upload_timeout_s`` (0: no bound), else a 408 ``request_timeout``; a chunked body is counted as
   it arrives and refused with the 413 as soon as it goes over;
5. the upload slot is given back and the request goes on into the app, which reads the spooled body.

Every refusal carries ``Connection: close``. The answers given before the body is in (413, 401, 429,
and 503 when the database does not answer the key lookup) are sent at once, and then what the
client goes on sending is read and dropped for a while (`DRAIN_IDLE_S`, `DRAIN_MAX_S`,
`DRAIN_LIMIT_BYTES`) before the connection closes, because a client such as httpx sends the whole
body before it reads a response and would otherwise see the connection reset instead of the answer.
A 408 closes at once: that client is not sending. The exact limits on an uploaded file (bytes and
lines) are enforced while it is copied into storage (`api.routes.files.store_upload`).
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from typing import IO

import anyio
import anyio.to_thread
from fastapi.responses import JSONResponse
from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.auth import Unauthorized, is_browser_path, owner_of
from api.errors import (
    database_unavailable_response,
    error_response,
    rate_limited_response,
    too_large_message,
    unauthorized_response,
)
from api.rate_limits import RateLimited, UploadSlots, limit_key
from jobs.config import Settings
from jobs.db import session_scope

UPLOAD_ROUTES = frozenset({("POST", "/v1/files"), ("POST", "/v1/jobs")})
"""(method, path) of the multipart upload routes, whose bodies may be up to ``max_file_bytes``."""
FORM_SLACK_BYTES = 64 * 1024
"""Request bytes allowed beyond ``max_file_bytes``: multipart boundaries, part headers and the small fields."""
SPOOL_MEMORY_BYTES = 1 << 20
"""Body bytes a spool holds in memory; beyond, they go to a temporary file 1 MiB at a time."""
DRAIN_LIMIT_BYTES = 1 << 30
"""Most bytes of a refused body read and dropped after the answer; past it the connection is closed."""
DRAIN_IDLE_S = 2.0
"""A refused body's drain ends once the client has sent nothing for this long."""
DRAIN_MAX_S = 60.0
"""A refused body's drain ends after this long, whatever the client still sends."""


class _Spool:
    """A request body: in memory up to `SPOOL_MEMORY_BYTES`, then in a temporary file (written and read
    in worker threads, 1 MiB at a time, so the event loop never waits on the disk)."""

    def __init__(self) -> None:
        self.num_bytes = 0
        self._memory = bytearray()
        self._file: IO[bytes] | None = None
        self._num_read = 0

    async def write(self, data: bytes) -> None:
        self._memory += data
        self.num_bytes += len(data)
        if len(self._memory) >= SPOOL_MEMORY_BYTES:
            await self._flush()

    async def _flush(self) -> None:
        if self._file is None:
            self._file = await anyio.to_thread.run_sync(tempfile.TemporaryFile)
        data = bytes(self._memory)
        self._memory.clear()
        await anyio.to_thread.run_sync(self._file.write, data)

    async def finish(self) -> None:
        """Call once the body is complete, before `read`."""
        if self._file is not None:
            if self._memory:
                await self._flush()
            await anyio.to_thread.run_sync(self._file.seek, 0)

    async def read(self) -> bytes:
        """The next piece of the body (at most `SPOOL_MEMORY_BYTES` from a file); b"" once all was read."""
        if self._file is None:
            data = bytes(self._memory)
            self._memory.clear()
        else:
            data = await anyio.to_thread.run_sync(self._file.read, SPOOL_MEMORY_BYTES)
        self._num_read += len(data)
        return data

    @property
    def at_end(self) -> bool:
        return self._num_read >= self.num_bytes

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


@dataclass(frozen=True, slots=True)
class _Refusal:
    """An answer instead of the app's; ``drain``: the client may still be sending the body."""

    response: JSONResponse
    drain: bool


class _ClientGone(Exception):
    pass


def _has_body(headers: Headers) -> bool:
    declared = headers.get("content-length", "")
    return (declared.isdigit() and int(declared) > 0) or "transfer-encoding" in headers


async def _drain(receive: Receive) -> None:
    """Read and drop request body messages until the body ends, the client leaves, goes quiet for
    `DRAIN_IDLE_S`, `DRAIN_MAX_S` pass, or `DRAIN_LIMIT_BYTES` were read."""
    budget = DRAIN_LIMIT_BYTES
    with anyio.move_on_after(DRAIN_MAX_S):
        while budget > 0:
            with anyio.move_on_after(DRAIN_IDLE_S) as idle:
                message = await receive()
            if idle.cancelled_caught:
                return
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            budget -= len(message.get("body", b""))


async def _refuse(response: JSONResponse, receive: Receive, send: Send, *, drain: bool) -> None:
    """Send ``response`` and close the connection; with ``drain``, read and drop the rest of the body
    between sending the answer and ending it (see the module docstring)."""
    response.headers["Connection"] = "close"
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    if drain:
        await send({"type": "http.response.body", "body": response.body, "more_body": True})
        await _drain(receive)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    else:
        await send({"type": "http.response.body", "body": response.body, "more_body": False})


class _Replay:
    """The ``receive`` the app gets: the spooled body, then the connection's own messages (a disconnect)."""

    def __init__(self, spool: _Spool, receive: Receive) -> None:
        self._spool = spool
        self._receive = receive
        self._replayed = False

    async def __call__(self) -> Message:
        if self._replayed:
            return await self._receive()
        body = await self._spool.read()
        self._replayed = self._spool.at_end
        return {"type": "http.request", "body": body, "more_body": not self._replayed}


class RequestBodies:
    """ASGI middleware receiving each request body before the app sees the request (see the module docstring).

    ``admission_slots`` is the semaphore of `api.admission.Admission`: the key lookup takes one of its
    slots while it holds a database connection, as any request in the app does.
    """

    def __init__(self, app: ASGIApp, *, settings: Settings, admission_slots: asyncio.Semaphore) -> None:
        self.app = app
        self.settings = settings
        self.max_upload_bytes = settings.max_file_bytes + FORM_SLACK_BYTES
        self.admission_slots = admission_slots
        self.uploads = UploadSlots(
            max_total=settings.max_concurrent_uploads, max_per_key=settings.max_concurrent_uploads_per_key
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if not _has_body(headers):
            await self.app(scope, receive, send)
            return
        upload = (scope["method"], scope["path"].rstrip("/")) in UPLOAD_ROUTES
        max_bytes = self.max_upload_bytes if upload else self.settings.max_request_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            await _refuse(self._too_large(upload=upload), receive, send, drain=True)
            return
        try:
            owner = await self._owner(headers.get("authorization", ""), browser=is_browser_path(scope["path"]))
        except Unauthorized as exc:
            await _refuse(unauthorized_response(exc), receive, send, drain=True)
            return
        except (OperationalError, InterfaceError) as exc:
            await _refuse(database_unavailable_response(exc), receive, send, drain=True)
            return
        client = scope.get("client")
        key = limit_key(owner, client[0] if client else None)
        try:
            self.uploads.acquire(key)
        except RateLimited as exc:
            await _refuse(rate_limited_response(exc), receive, send, drain=True)
            return
        try:
            spool = await self._receive_body(receive, max_bytes=max_bytes, upload=upload)
        except _ClientGone:
            return
        finally:
            # NOTE: given back before any refusal's drain: a refused sender holds no upload slot.
            self.uploads.release(key)
        if isinstance(spool, _Refusal):
            await _refuse(spool.response, receive, send, drain=spool.drain)
            return
        try:
            await self.app(scope, _Replay(spool, receive), send)
        finally:
            spool.close()

    def _too_large(self, *, upload: bool) -> JSONResponse:
        if upload:
            message = too_large_message(self.settings.max_file_bytes)
            return error_response(413, message, param="file", code="file_too_large")
        message = (
            f"the request body is larger than the limit of {self.settings.max_request_body_bytes} bytes "
            "(BATCHINFER_MAX_REQUEST_BODY_BYTES); only uploads (POST /v1/files, POST /v1/jobs) may be larger"
        )
        return error_response(413, message, code="request_too_large")

    async def _owner(self, authorization: str, *, browser: bool) -> str | None:
        def lookup() -> str | None:
            with session_scope(self.settings.database_url, read_only=True) as session:
                return owner_of(session, authorization=authorization, browser=browser)

        async with self.admission_slots:
            return await anyio.to_thread.run_sync(lookup)

    async def _receive_body(self, receive: Receive, *, max_bytes: int, upload: bool) -> _Spool | _Refusal:
        """The whole body, spooled; or the 408 of a body that stalled for ``upload_read_timeout_s`` or
        took over ``upload_timeout_s``, or the 413 of a (chunked) body over ``max_bytes``.

        Raises:
            _ClientGone: the client disconnected.
        """
        read_timeout_s, total_timeout_s = self.settings.upload_read_timeout_s, self.settings.upload_timeout_s
        deadline = anyio.current_time() + total_timeout_s if total_timeout_s > 0 else None
        spool = _Spool()
        try:
            while True:
                wait_s = read_timeout_s
                if deadline is not None:
                    wait_s = min(wait_s, deadline - anyio.current_time())
                with anyio.move_on_after(wait_s) as waited:
                    message = await receive()
                if waited.cancelled_caught:
                    spool.close()
                    message_408 = self._timeout_message(whole=wait_s < read_timeout_s)
                    return _Refusal(error_response(408, message_408, code="request_timeout"), drain=False)
                if message["type"] == "http.disconnect":
                    raise _ClientGone
                await spool.write(message.get("body", b""))
                if spool.num_bytes > max_bytes:
                    spool.close()
                    return _Refusal(self._too_large(upload=upload), drain=True)
                if not message.get("more_body", False):
                    await spool.finish()
                    return spool
        except BaseException:
            spool.close()
            raise

    def _timeout_message(self, *, whole: bool) -> str:
        if whole:
            return (
                f"the request body took longer than {self.settings.upload_timeout_s:g} s to arrive "
                "(BATCHINFER_UPLOAD_TIMEOUT_S); the connection is closed"
            )
        return (
            f"the request body stalled: nothing arrived for {self.settings.upload_read_timeout_s:g} s "
            "(BATCHINFER_UPLOAD_READ_TIMEOUT_S); the connection is closed"
        )
