"""What keeps one request from stalling the others at the HTTP layer: a body-size limit enforced before the
body is read (:class:`BodyLimit`, 413 at once), and the detection of a client that went away while its
non-streamed answer is generated (:func:`client_gone`).

Example:
    >>> from fastapi import FastAPI
    >>> from fastapi.testclient import TestClient
    >>> app = FastAPI()
    >>> app.add_middleware(BodyLimit, max_bytes=10)
    >>> TestClient(app).post("/anything", content=b"x" * 11).status_code
    413
"""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from .schema import error_body

__all__ = ["BodyLimit", "client_gone"]


class BodyLimit:
    """ASGI middleware: an HTTP request whose body exceeds ``max_bytes`` gets 413 in OpenAI's error shape,
    refused from its ``Content-Length`` before any of it is read, or as soon as a chunked body passes the
    limit, so a huge body costs neither memory nor time on the event loop."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, int(declared))
            return
        received = 0
        refused = False

        async def counted_receive() -> dict:
            # Past the limit the 413 is sent from here and the app is told the client left: whatever it
            # answers then (FastAPI turns a read failure into a 400) is dropped.
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request" and not refused:
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    await self._refuse(send, None)
                    return {"type": "http.disconnect"}
            return message

        async def watched_send(message: dict) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counted_receive, watched_send)

    async def _refuse(self, send: Callable, size: int | None) -> None:
        told = f"{size:,} bytes" if size is not None else "more bytes"
        payload = json.dumps(error_body(f"the request body has {told}, more than the limit of {self.max_bytes:,} "
                                        f"bytes (the server's --max-body-bytes)",
                                        code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


async def client_gone(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns once the client of a request whose body was read has disconnected (ASGI's
    ``http.disconnect``); meant to be raced against the response and cancelled when that is ready."""
    while (await receive())["type"] != "http.disconnect":
        pass
