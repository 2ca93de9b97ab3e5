"""A test helper: run a function on one thread per device, as a Runner's streams would."""

from __future__ import annotations

import threading
from collections.abc import Callable


def on_devices(n: int, fn: Callable[[int], object], timeout: float = 10.0) -> list:
    """fn(i) on thread "dev{i}" for each of n devices; the results (or the exception each raised)."""
    out: list = [None] * n

    def body(i: int) -> None:
        try:
            out[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out[i] = exc

    threads = [threading.Thread(target=body, args=(i,), name=f"dev{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a device thread hung"
    return out
