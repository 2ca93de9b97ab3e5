"""What stands between the network and the app: the API key, the request body's size, the header's size, the time a
request may take to arrive, the number of open connections.

``ApiKey`` answers 401 with OpenAI's error JSON to a request without ``Authorization: Bearer <key>``, except on
``/health`` and ``/metrics`` (probes and scrapers carry no key, as with vLLM) and CORS preflights. ``BodyLimit``
answers 413 to a body past its limit: a declared ``Content-Length`` is refused before the body is read, a chunked one
once it passes the limit; either way the rest is read and dropped (for a few seconds at most) before the answer, so
that the client, still sending, sees the 413 instead of a reset connection. ``H11Protocol`` is uvicorn's with the
limits at the connection: a head past ``h11_max_incomplete_event_size`` is a 431 (the connection lingers the same
way before it closes), a request that does not arrive whole in time a 408, a connection past the cap a 503.
"""

from __future__ import annotations

import asyncio
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
PAUSE_S = 0.5  # ... unless the client pauses this long: it is not sending


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
        while more and time.monotonic() < end:  # drop what the client still sends, until it pauses
            try:
                message = await asyncio.wait_for(receive(), min(PAUSE_S, end - time.monotonic()))
            except TimeoutError:
                break
            more = message["type"] == "http.request" and message.get("more_body", False)
        await send_error(send, 413, f"the request body is {size} bytes; this server takes at most {self.max_bytes} "
                                    "(dtorch serve --max-body-bytes)", "request_too_large")


class H11Protocol(_UvicornH11):
    """uvicorn's h11 protocol with the limits a server facing a network needs (``http_protocol`` sets them):

    - a request whose head passes ``h11_max_incomplete_event_size`` is answered 431, as h11 advises, instead of 400;
    - a request must arrive whole (head and body) within ``request_timeout`` seconds of its first byte (or of the
      connection, for its first request); one that does not is answered 408 and closed, so half-sent requests cannot
      hold the server's open files (uvicorn's ``timeout_keep_alive`` closes idle connections between requests);
    - past ``max_connections`` open connections a new one is answered 503 and closed at once, while those already
      open are served as before.
    """

    max_connections: int | None = None
    request_timeout: float | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refused = 400  # the status h11 advises for the protocol error being answered
        self._dropping = False
        self._deadline: Any = None  # the timer of the request being received (asyncio.TimerHandle)
        next_event = self.conn.next_event

        def checked() -> Any:
            try:
                return next_event()
            except h11.RemoteProtocolError as exc:
                self._refused = exc.error_status_hint
                raise

        self.conn.next_event = checked

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            self._answer_and_close(503, "Service Unavailable", f"the server has {self.max_connections} connections "
                                   "open, its most (dtorch serve --max-connections); try again later",
                                   "too_many_connections")
            return
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._unwatch()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._dropping:
            super().data_received(data)
            self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def _watch(self) -> None:
        """Arm the request timer while a request is being received (not yet whole); disarm it once it is."""
        receiving = self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing()
        idle_between = self.conn.their_state is h11.IDLE and self.timeout_keep_alive_task is not None
        if receiving and not idle_between and self.request_timeout is not None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(self.request_timeout, self._timed_out)
        else:
            self._unwatch()

    def _unwatch(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and self.conn.their_state is h11.SEND_BODY and not self.cycle.response_started:
            # the app may be waiting for the body: it sees the client gone, and the client a 408 before the close
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        if self.cycle is None or not self.cycle.response_started:
            self._answer_and_close(408, "Request Timeout", f"the request did not arrive whole within "
                                   f"{self.request_timeout:g} s (dtorch serve --request-timeout)", "request_timeout")
        else:
            self.transport.close()

    def _answer_and_close(self, status: int, reason: str, message: str, code: str) -> None:
        """Write an error response straight to the socket (whatever h11's state) and close the connection."""
        body = _error_json(message, code)
        head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                "connection: close\r\n\r\n").encode()
        self.transport.write(head + body)
        self.transport.close()

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
        self._unwatch()
        self.loop.call_later(LINGER_S, self.transport.close)


def http_protocol(max_connections: int | None, request_timeout: float | None) -> type[H11Protocol]:
    """``H11Protocol`` with these limits, for ``uvicorn.Config(http=...)`` (None: no such limit)."""
    return type("H11Protocol", (H11Protocol,), {"max_connections": max_connections,
                                                "request_timeout": request_timeout})


def default_max_connections(reserve: int = 64) -> int:
    """Open connections at most by default: the process's open-file limit (its soft limit, first raised to the hard
    one) less ``reserve`` files for the model, the logs and the workers, at least 16."""
    try:
        import resource
    except ImportError:  # not on a POSIX system
        return 1000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    soft = 1 << 20 if soft == resource.RLIM_INFINITY else soft
    return max(16, min(soft - reserve, 65536))
