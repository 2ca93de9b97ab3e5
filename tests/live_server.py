"""A dtorch server over an ``LLM``, on a free loopback port, in a thread for the length of a test."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

Post = Callable[[str, dict], "tuple[int, dict]"]


@contextlib.contextmanager
def live_server(llm, name: str = "m") -> Iterator[Post]:
    """Serve ``llm`` as model ``name`` on 127.0.0.1; yields ``post(path, body) -> (status, JSON body)``. The server
    (and with it its engine loop) stops on the way out."""
    import uvicorn

    from dtorch.engine.loop import EngineLoop
    from dtorch.serve import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop = EngineLoop(llm.engine).start()
    server = uvicorn.Server(uvicorn.Config(build_app(llm, name, engine_loop=loop), host="127.0.0.1", port=port,
                                          log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < end, "the server did not start"
        time.sleep(0.05)

    def post(path: str, body: dict) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()

    try:
        yield post
    finally:
        server.should_exit = True
        thread.join(10)
