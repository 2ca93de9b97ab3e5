"""A test helper: run a function on one thread per device, as a Runner's streams would."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


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


def every_collective(comm, i: int, x: torch.Tensor, gathered_rows: int, scattered_rows: int, src: int) -> dict:
    """Device i's results of all_reduce (sum, max), all_gather and reduce_scatter on dim 0, and broadcast from src."""
    rest = x.shape[1:]
    out = {"sum": torch.empty_like(x), "max": torch.empty_like(x), "gather": torch.empty(gathered_rows, *rest),
           "rs": torch.empty(scattered_rows, *rest), "bc": torch.empty_like(x)}
    comm.all_reduce(i, x, out["sum"], "sum")
    comm.all_reduce(i, x, out["max"], "max")
    comm.all_gather(i, x, out["gather"], dim=0)
    comm.reduce_scatter(i, x, out["rs"], dim=0)
    comm.broadcast(i, x, out["bc"], src=src)
    return out
