"""``StageWorkers``: a pipeline's stages of this process, each driven by a host thread of its own, so that several
steps (micro-batches) are in flight at once.

A step goes in at the first local stage (``submit``) and comes out of the last (``Flight.wait``): stage s runs step m
while stage s + 1 runs step m - 1. Each stage's Runner waits only for its own devices' streams, so on
``DeviceMesh.cpu(P)`` the stages' compute streams run at the same time, and across ranks a stage computes its next
step while its send of the last one is still on the communicate stream. Steps leave each stage in the order they
came, so a stage's recv always takes the activations of the step it runs.

A step that fails fails every step then in flight after it (their activations may be in the mailboxes, or missing);
before the next step goes in, what their stages sent is dropped, so no recv reads another step's activations.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from dtorch.core.errors import DtorchError, SyncTimeout
from dtorch.core.sync import leave_signals_to_main


class Flight:
    """One step in flight through the stages (``runners``: one Runner per local stage, in stage order)."""

    __slots__ = ("runners", "feeds", "index", "out", "error", "_done")

    def __init__(self, runners: Sequence[Any], feeds: dict[str, torch.Tensor], index: int) -> None:
        self.runners, self.feeds, self.index = runners, feeds, index
        self.out: dict[str, Any] = {}
        self.error: BaseException | None = None
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def finish(self, out: dict[str, Any] | None = None, error: BaseException | None = None) -> None:
        self.out, self.error = out or {}, error
        self.feeds = None  # the host tensors go as soon as the last stage has copied them
        self._done.set()

    def wait(self, timeout: float) -> dict[str, Any]:
        """The last local stage's outputs ({} on a rank whose stages do not end the pipeline); raises the step's
        failure, or ``SyncTimeout`` after ``timeout`` seconds."""
        if not self._done.wait(timeout):
            raise SyncTimeout(f"a pipelined step did not leave its stages within {timeout:g}s")
        if self.error is not None:
            raise self.error
        return self.out


class StageWorkers:
    """``count`` stage threads, for the pipeline's stages ``first``.. (the local ones); ``timeout``: how long
    ``Flight.wait`` waits for a step at most."""

    def __init__(self, count: int, timeout: float, first: int = 0) -> None:
        self.timeout, self.first = timeout, first
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(count)]
        self._lock = threading.Lock()
        self._submitted = -1
        self._failed_through = -1  # steps up to this index fail (an earlier one failed while they were in flight)
        self._dirty = False  # a step failed: drop what its stages sent before the next one goes in
        self._live: list[Flight] = []
        self._threads = [threading.Thread(target=self._loop, args=(k,), name=f"dtorch-stage-{k}", daemon=True)
                         for k in range(count)]
        for t in self._threads:
            t.start()

    @property
    def in_flight(self) -> int:
        return sum(not f.done for f in self._live)

    def submit(self, runners: Sequence[Any], feeds: dict[str, torch.Tensor]) -> Flight:
        """Start a step: ``runners[k]`` runs it on local stage k (each takes the feeds its graph has)."""
        with self._lock:
            self._live = [f for f in self._live if not f.done]
            dirty = self._dirty
        if dirty:  # every step in flight fails now; once they are out, nothing they sent may stay
            end = time.monotonic() + self.timeout
            for f in list(self._live):
                f._done.wait(max(0.0, end - time.monotonic()))
            for r in runners:
                r.comm.drop_messages()
            self._dirty = False
        with self._lock:
            self._submitted += 1
            f = Flight(runners, feeds, self._submitted)
            self._live.append(f)
        self._queues[0].put(f)
        return f

    def _loop(self, k: int) -> None:
        leave_signals_to_main()
        torch.set_num_threads(1)  # this thread only hands work to the stream threads: no OpenMP team of its own
        last = k == len(self._queues) - 1
        while True:
            f = self._queues[k].get()
            if f is None:
                return
            if f.index <= self._failed_through:
                f.finish(error=DtorchError("a pipelined step was dropped: a step before it failed while it was in "
                                           "flight (see that step's error)"))
                continue
            r = f.runners[k]
            t0 = time.perf_counter_ns()
            try:
                out = r.run({n: v for n, v in f.feeds.items() if n in r.graph.inputs})
            except BaseException as exc:  # noqa: BLE001 - the step's caller gets it from Flight.wait
                with self._lock:
                    self._failed_through, self._dirty = self._submitted, True
                f.finish(error=exc)
                continue
            tracer = r.manager.tracer
            if tracer is not None:
                tracer.add_stage(r.mesh.device(r.local_ids[0]), f"stage {self.first + k} step {f.index}", t0,
                                 time.perf_counter_ns())
            if last:
                f.finish(out)
            else:
                self._queues[k + 1].put(f)

    def close(self, timeout: float = 5.0) -> None:
        """End the stage threads once the steps queued before have run."""
        for q in self._queues:
            q.put(None)
        end = time.monotonic() + timeout
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, end - time.monotonic()))
