"""What stands between the network and the app: the API key, the request body's size, the header's size.

``ApiKey`` answers 401 with OpenAI's error JSON to a request without ``Authorization: Bearer <key>``, except on
``/health`` and ``/metrics`` (probes and scrapers carry no key, as with vLLM) and CORS preflights. ``BodyLimit``
answers 413 to a body past its limit: a declared ``Content-Length`` is refused before the body is read, a chunked one
once it passes the limit; either way the rest is read and dropped (for a few seconds at most) before the answer, so
that the client, still sending, sees the 413 instead of a reset connection. ``H11Protocol`` is uvicorn's with one
change: a request whose head passes ``h11_max_incomplete_event_size`` is answered 431, as h11 advises, instead of
400, and the connection lingers the same way before it closes.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol as _UvicornH11

from dtorch.serve.protocol import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = ("/health", "/metrics")  # answered without the API key
LINGER_S = 3.0  # how long a refused request's remaining bytes are read and dropped before the answer or the close


def _error_json(message: str, code: str) -> bytes:
    return json.dumps(error_body(message, "invalid_request_error", None, code), separators=(",", ":")).encode()


async def send_error(send: Send, status: int, message: str, code: str,
                     headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """An OpenAI error JSON response, sent straight to the ASGI ``send``."""
    body = _error_json(message, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope["headers"] if k == name), None)


class ApiKey:
    """ASGI middleware: every request but ``OPEN_PATHS`` and OPTIONS preflights needs ``Authorization: Bearer key``."""

    def __init__(self, app: App, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = _header(scope, b"authorization") or b""
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        message = "Incorrect API key provided." if given else \
            "You didn't provide an API key: send it in an Authorization header (Authorization: Bearer YOUR_KEY)."
        await send_error(send, 401, message, "invalid_api_key", ((b"www-authenticate", b"Bearer"),))


class BodyLimit:
    """ASGI middleware: a request body of more than ``max_bytes`` is answered 413."""

    def __init__(self, app: App, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None:  # h11 holds the body to this length
            if declared.isdigit() and int(declared) <= self.max_bytes:
                return await self.app(scope, receive, send)
            return await self._refuse(receive, send, declared.decode("latin-1"), more=True)
        chunks, size, more = [], 0, True  # chunked: read it here, up to the limit, and hand it on whole
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self._refuse(receive, send, f"more than {self.max_bytes}", more)
        body, given = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal given
            if given:
                return await receive()  # http.disconnect, when it comes
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, receive: Receive, send: Send, size: str, more: bool) -> None:
        end = time.monotonic() + LINGER_S
        while more and time.monotonic() < end:
            message = await receive()
            more = message["type"] == "http.request" and message.get("more_body", False)
        await send_error(send, 413, f"the request body is {size} bytes; this server takes at most {self.max_bytes} "
                                    "(dtorch serve --max-body-bytes)", "request_too_large")


class H11Protocol(_UvicornH11):
    """uvicorn's h11 protocol, answering 431 to a request head past ``h11_max_incomplete_event_size``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refused = 400  # the status h11 advises for the protocol error being answered
        self._dropping = False
        next_event = self.conn.next_event

        def checked() -> Any:
            try:
                return next_event()
            except h11.RemoteProtocolError as exc:
                self._refused = exc.error_status_hint
                raise

        self.conn.next_event = checked

    def send_400_response(self, msg: str) -> None:
        if self._refused != 431:
            return super().send_400_response(msg)
        limit = self.config.h11_max_incomplete_event_size
        body = _error_json(f"the request's header is more than {limit} bytes (dtorch serve --max-header-bytes)",
                           "request_header_too_large")
        for event in (h11.Response(status_code=431, reason=b"Request Header Fields Too Large",
                                   headers=[(b"content-type", b"application/json"), (b"connection", b"close"),
                                            (b"content-length", str(len(body)).encode())]),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        # the client may still be sending its header: read and drop it a while, so the answer is not lost to a reset
        self._dropping = True
        self.loop.call_later(LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if not self._dropping:
            super().data_received(data)
