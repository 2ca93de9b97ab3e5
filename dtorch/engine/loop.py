"""``EngineLoop``: the driver that steps an ``Engine`` whenever it has work, on its own thread or the caller's, and
stops it gracefully (the server's shutdown: no new requests, a grace period for those in flight, then abort)."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

from dtorch.core.sync import leave_signals_to_main
from dtorch.engine.engine import Engine


class EngineLoop:
    """Steps ``engine`` whenever it has work, on a thread of its own (``start``) or on the caller's (``run``).

    On a CPU, prefer ``run`` on the thread that loaded the model: each thread that runs torch kernels keeps its own
    OpenMP team, and once two teams hold more threads than there are cores libgomp stops its workers from spinning
    between kernels, which halved decode speed on 2 cores (64 against 134 tok/s for the default model).
    """

    def __init__(self, engine: Engine, on_error: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.on_error = on_error
        self._stop = threading.Event()
        self._stopping = threading.Lock()
        self._thread: threading.Thread | None = None
        # called (on the stopping thread) when the grace is over, before what is left is aborted: the aborts wait for
        # the step in flight, which may be long (a prompt's chunk on a busy CPU), so the server need not
        self.at_grace_end: list[Callable[[], None]] = []
        self._finalizer = weakref.finalize(self, self._stop.set)

    def start(self) -> EngineLoop:
        """Step on a new thread."""
        self._thread = threading.Thread(target=self.run, name="dtorch-engine", daemon=True)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return not self._stop.is_set()

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Step on this thread until ``stop`` (or until ``until()`` turns true, checked at least every 0.1 s); while
        there is no work, build the step shapes ``Engine.start_warmup`` queued, one between two looks for work."""
        leave_signals_to_main()  # on a thread of its own: Ctrl-C and SIGTERM stay the main thread's
        e = self.engine
        while not self._stop.is_set() and not (until is not None and until()):
            try:
                worked = e.step()
            except Exception as exc:  # the failed step's requests were aborted; the engine goes on
                worked = True
                if self.on_error is not None:
                    self.on_error(exc)
            # idle: build a queued step shape, if any (not once shutting down), else wait for work
            if not worked and not (e.accepting and e.warm_next()):
                with e.stepped:
                    if not e.has_unfinished() and not self._stop.is_set():
                        e.stepped.wait(0.1)

    def stop(self, grace: float = 0.0) -> None:
        """Stop taking requests, let unfinished ones run for up to ``grace`` seconds, abort the rest and end the loop
        (joining its thread). Call it from another thread than the one in ``run``; a second call returns at once."""
        e = self.engine
        e.accepting = False
        if not self._stopping.acquire(blocking=False):
            return
        end = time.monotonic() + grace
        while e.has_unfinished() and time.monotonic() < end and not self._stop.is_set():
            time.sleep(0.02)
        self._stop.set()
        for fn in self.at_grace_end:
            fn()
        with e.stepped:
            e.stepped.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        e.abort_all()
