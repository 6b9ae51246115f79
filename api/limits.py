"""Request-size limit: refuse a body that cannot hold an acceptable upload, before reading it.

A request whose ``Content-Length`` is over ``max_file_bytes`` plus `FORM_SLACK_BYTES` (room for the
multipart boundaries, part headers and small fields) gets a 413 without its body being parsed or
stored; a body without ``Content-Length`` (chunked) is counted as it arrives and refused as soon as
it goes over. Either way the server holds at most one received chunk: the rest of the body is read
and dropped (up to `DRAIN_LIMIT_BYTES`) before the 413 goes out, because a client such as httpx
sends the whole body before it reads a response, and would otherwise see the connection reset
instead of the 413. The exact limits on the file itself (bytes
and lines) are enforced while it is copied into storage (`api.routes.files.store_upload`).
Design: docs/api.md, "Limits".

(Starlette's own body limit answers a plain-text 413; this one answers OpenAI's error envelope.)
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_response, too_large_message

FORM_SLACK_BYTES = 64 * 1024
"""Request bytes allowed beyond ``max_file_bytes``: multipart boundaries, part headers and the small fields."""
DRAIN_LIMIT_BYTES = 1 << 30
"""Most bytes of a refused body read and dropped before answering; past it the connection is closed."""


async def _drain(receive: Receive, budget: int) -> None:
    """Read and drop request body messages until the body ends, the client leaves, or ``budget`` bytes."""
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        budget -= len(message.get("body", b""))


class BodySizeLimit:
    """ASGI middleware: a 413 ``file_too_large`` for request bodies over ``max_file_bytes + FORM_SLACK_BYTES``."""

    def __init__(self, app: ASGIApp, *, max_file_bytes: int) -> None:
        self.app = app
        self.max_file_bytes = max_file_bytes
        self.max_body_bytes = max_file_bytes + FORM_SLACK_BYTES

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await _drain(receive, DRAIN_LIMIT_BYTES)
            response = error_response(413, too_large_message(self.max_file_bytes), param="file", code="file_too_large")
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    if message.get("more_body", False):
                        await _drain(receive, DRAIN_LIMIT_BYTES)
                    # NOTE: an HTTPException passes through FastAPI's body parsing unchanged (any other
                    # exception becomes a 400) to the app's handler, which answers the 413 envelope.
                    raise HTTPException(413)
            return message

        await self.app(scope, counting_receive, send)
