"""Request-size limit: refuse a body that cannot hold an acceptable upload, before reading it.

A request whose ``Content-Length`` is over ``max_file_bytes`` plus `FORM_SLACK_BYTES` (room for the
multipart boundaries, part headers and small fields) gets a 413 at once, its body unread; a body
without ``Content-Length`` (chunked) is counted as it arrives and refused as soon as it goes over.
Either way the server holds at most one received chunk. The exact limits on the file itself (bytes
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
            response = error_response(
                413, too_large_message(self.max_file_bytes), param="file", code="file_too_large"
            )
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
                    # NOTE: an HTTPException passes through FastAPI's body parsing unchanged (any other
                    # exception becomes a 400) to the app's handler, which answers the 413 envelope.
                    raise HTTPException(413)
            return message

        await self.app(scope, counting_receive, send)
