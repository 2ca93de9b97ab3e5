"""A model served across ranks (``torchrun ... -m dtorch serve -tp N``): rank 0 runs the HTTP server and the engine,
every other rank follows it.

Rank 0's executor (and its draft model's) and its KV cache each get a ``Teller`` as their ``mirror``: each call that
runs collectives, builds a graph or changes the cache from the host (``Executor.submit`` / ``runner`` /
``capture_now``, a pipeline's ``Pending.result``, ``KVCache.reset_state`` / ``release``) is first broadcast to every
rank (``PlanChannel``: the call pickled, one gloo broadcast of ``CHUNK`` bytes, two when it is longer; a decode step's
plan is a few hundred bytes) and each other rank (``follow``) makes the same call on its own executor or cache, in the
same order: every rank runs the same step graph. A submitted step runs on the stages' threads while the follower takes
the next message, so a pipeline keeps its micro-batches in flight across ranks as in one process; a told ``result``
takes the oldest step's (the logits' broadcast from the last stage).
The scheduler, sampling, grammars, tools and the tokenizer run on rank 0 only; followers never sample.

Liveness (``Watchdog``): every ``BEAT_S`` seconds rank 0 sends a beat to each other rank on a gloo group of the two;
a rank that does not take it within ``rank_timeout`` seconds (its process died, or it hangs) is lost, and the next
beats tell the others which; a follower whose beat does not come has lost rank 0. A step whose collective fails (a
closed connection), or any failure of a step the other ranks were told of, is a lost rank too (named by the watchdog
when it does so within ``NAMING_S`` seconds, as it does for a closed connection). Either way ``Ranks.lose`` runs
once: the ``on_lost`` callback (the server answers 503 and ends the requests in flight), then the process exits with
status 2 after ``LINGER_S`` seconds (rank 0; the others at once), the message naming the lost rank on stderr.
``Leader.stop`` (SIGTERM on rank 0, after the drain) tells every rank to stop and waits for each one's
acknowledgement, so every rank exits 0 together.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dtorch.core.errors import ArgumentError, CommunicationError

log = logging.getLogger("dtorch.engine")
CHUNK = 4096  # bytes of the first broadcast of a message (its length, then its start): one broadcast for most plans
BEAT_S = 1.0  # seconds between two liveness beats
LINGER_S = 3.0  # seconds rank 0 keeps answering (503) after a lost rank before it exits
STOP = -1  # a beat's news: the watchdog ends (the ranks stop)
NAMING_S = 2.5  # seconds a failed collective waits for the watchdog to name the lost rank (a closed connection: ~1 s)
IDLE = datetime.timedelta(days=30)  # the plan group's timeout: a follower waits for work as long as rank 0 lives
_STEPS = ("submit", "result", "runner", "capture_now")
CALLS = {"target": _STEPS, "draft": _STEPS, "cache": ("reset_state", "release")}  # what a follower may be told to call


class PlanChannel:
    """Rank 0 -> every rank: pickled messages, broadcast on the gloo group ``group`` in order (through shared memory
    when every rank is on one host: ~10 us a plan instead of gloo's ~200)."""

    def __init__(self, group: Any) -> None:
        from dtorch.distributed.shm import HostShm

        self.group = group
        self.head = torch.zeros(CHUNK, dtype=torch.uint8)  # [4-byte length, the message's first bytes]
        shm = HostShm.join(group, IDLE.total_seconds())  # a follower waits for work as long as rank 0 lives
        self.shm = shm if shm is not None and shm.whole else None

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        first = len(data).to_bytes(4, "little") + data[:CHUNK - 4]
        self.head[:len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        self._broadcast(self.head)
        if len(data) > CHUNK - 4:
            self._broadcast(torch.frombuffer(bytearray(data[CHUNK - 4:]), dtype=torch.uint8))

    def recv(self) -> Any:
        self._broadcast(self.head)
        size = int.from_bytes(self.head[:4].numpy().tobytes(), "little")
        data = self.head[4:4 + min(size, CHUNK - 4)].numpy().tobytes()
        if size > CHUNK - 4:
            rest = torch.empty(size - (CHUNK - 4), dtype=torch.uint8)
            self._broadcast(rest)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def barrier(self, timeout: float) -> None:
        """Every rank reached this point within ``timeout`` seconds (the acknowledgement of a stop; rank 0's error
        names a rank that did not)."""
        self._do("the stop's acknowledgement", lambda: dist.monitored_barrier(
            group=self.group, timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True))

    def _broadcast(self, t: torch.Tensor) -> None:
        if self.shm is not None:
            self._do("the plan broadcast", lambda: self.shm.broadcast(t, t, 0))
            return
        self._do("the plan broadcast", lambda: dist.broadcast(t, src=0, group=self.group))

    def _do(self, what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except (RuntimeError, ValueError) as exc:
            raise CommunicationError(f"{what} failed on rank {dist.get_rank()}: a rank was lost (its connection "
                                     f"closed or it stopped answering). {type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class RankInfo:
    """What one rank is and holds, for the banner and for naming a lost rank."""

    rank: int
    host: str
    pid: int
    device: str
    holds: str  # "layers 0-11 of 24 (stage 0), tp shard 1 of 2"
    weight_bytes: int
    kv_bytes: int

    @classmethod
    def of(cls, llm: Any) -> RankInfo:
        model, mesh, rank = llm.model, llm.mesh, llm.rank
        n = model.config.num_layers
        stage = model.stages[mesh.stage_of(rank)]
        layers = f"layers {stage.layers.start}-{stage.layers.stop - 1} of {n}"
        if mesh.pp_size > 1:
            layers += f" (stage {stage.index} of {mesh.pp_size})"
        tp = stage.mesh.size
        shard = f", tp shard {stage.mesh.rank(rank) + 1} of {tp}" if tp > 1 else ""
        return cls(rank, socket.gethostname(), os.getpid(), str(llm.device), layers + shard,
                   model.weight_bytes(), llm.cache.nbytes)

    def line(self) -> str:
        from dtorch.engine.info import mib

        return (f"rank {self.rank} on {self.host} (pid {self.pid}, {self.device}): {self.holds}; weights "
                f"{mib(self.weight_bytes)}, KV cache {mib(self.kv_bytes)}")


class Watchdog:
    """A thread that checks every ``BEAT_S`` seconds that the other side of each pair group (rank 0 and one other
    rank; ``pairs[r]`` is rank r's) still answers, and calls ``on_lost(why)`` once when one does not (unless stopped).

    Rank 0 broadcasts a beat on each pair in turn and waits ``timeout`` seconds at most for each: the pair that fails
    names the lost rank, and the beats rank 0 then sends to the others carry its number, so that every rank exits
    naming it. A follower waits for its beat for longer (rank 0 may first wait out another rank).
    """

    def __init__(self, pairs: dict[int, Any], timeout: float, world: int, describe: Callable[[int], str],
                 on_lost: Callable[[str], None]) -> None:
        self.pairs, self.timeout, self.world = pairs, timeout, world
        self.describe, self.on_lost = describe, on_lost
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dtorch-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self.thread.start()
        return self

    def _run(self) -> None:
        """Beat until stopped; a beat returns None (go on), "" (stopped) or why a rank was lost."""
        from dtorch.core.sync import leave_signals_to_main

        leave_signals_to_main()
        lead = dist.get_rank() == 0
        beat = self._lead if lead else self._follow
        while not (lead and self.stopped.wait(BEAT_S)):  # rank 0 keeps the pace; the others wait for its beats
            why = beat()
            if why is not None:
                if why and not self.stopped.is_set():
                    self.on_lost(why)
                return

    def finish(self) -> None:
        """Stop: rank 0's thread ends after its round, then a last beat tells each other rank's thread to end; a
        follower's thread ends on that beat. No collective of the watchdog is left pending at the exit."""
        self.stopped.set()
        if dist.get_rank() == 0:
            self.thread.join(self.timeout * self.world + 2 * BEAT_S)
            for r in self.pairs:
                self._beat(r, STOP, self.timeout)
        else:
            self.thread.join(self.timeout * self.world + 2 * BEAT_S)

    def _beat(self, rank: int, news: int, wait: float) -> tuple[int, float | None]:
        """One beat on ``rank``'s pair: rank 0 sends ``news`` (0, or 1 + a lost rank), the other receives it; returns
        what came and, when the beat failed, after how many seconds (None: it came)."""
        t = torch.tensor([news], dtype=torch.int64)
        t0 = time.monotonic()
        try:
            dist.broadcast(t, src=0, group=self.pairs[rank], async_op=True).wait(
                timeout=datetime.timedelta(seconds=wait))
        except RuntimeError:
            return 0, time.monotonic() - t0
        return int(t.item()), None

    def _lead(self) -> str | None:
        for r in self.pairs:
            _, failed = self._beat(r, 0, self.timeout)
            if failed is not None:
                for other in self.pairs:  # the survivors learn whom they lost
                    if other != r:
                        self._beat(other, 1 + r, BEAT_S)
                return self._lost(r, failed)
        return None

    def _follow(self) -> str | None:
        (me,) = self.pairs
        # rank 0 may first wait out every other rank, then beat this one
        news, failed = self._beat(me, 0, self.timeout * self.world + 2 * BEAT_S)
        if failed is not None:
            return self._lost(0, failed) if not self.stopped.is_set() else ""
        if news == STOP:
            return ""
        return self._lost(news - 1, None, told=True) if news else None

    def _lost(self, rank: int, waited: float | None, told: bool = False) -> str:
        who = self.describe(rank)
        if told:
            return f"lost {who}, as rank 0 found (see rank 0's log)"
        if waited < 0.9 * self.timeout:  # refused at once: the connection closed
            return f"lost {who}: its connection closed (the process exited or was killed; see its log)"
        return (f"lost {who}: it did not answer the liveness check within {self.timeout:g} s (it hangs or its host "
                f"is unreachable; see its log; --rank-timeout sets the wait)")


class Ranks:
    """This rank's part of a model served across ranks: the plan channel, the watchdog, every rank's ``RankInfo``,
    and what happens when a rank is lost (``lose``)."""

    def __init__(self, llm: Any, rank_timeout: float, on_lost: Callable[[str], None] | None = None) -> None:
        if not 0 < rank_timeout < float("inf"):
            raise ArgumentError(f"Ranks: rank_timeout must be a number of seconds > 0, got {rank_timeout}")
        self.llm, self.rank, self.world = llm, dist.get_rank(), dist.get_world_size()
        self.on_lost = on_lost
        self.leader: Leader | None = None  # rank 0's (``Leader``)
        self.lost: str | None = None
        self._lost_lock = threading.Lock()
        self._named = threading.Event()  # set with ``lost``
        self._exiting = threading.Thread(target=self._exit, args=(LINGER_S if self.rank == 0 else 0.0,),
                                         name="dtorch-lost", daemon=True)
        # new_group is collective: every rank makes both, in this order
        self.channel = PlanChannel(dist.new_group(backend="gloo", timeout=IDLE))
        pairs = {r: dist.new_group([0, r], backend="gloo", timeout=IDLE) for r in range(1, self.world)}
        infos: list[Any] = [None] * self.world
        dist.all_gather_object(infos, RankInfo.of(llm), group=self.channel.group)
        self.infos: list[RankInfo] = infos
        mine = pairs if self.rank == 0 else {self.rank: pairs[self.rank]}
        self.watchdog = Watchdog(mine, rank_timeout, self.world, self.describe, self.lose).start()

    def describe(self, rank: int) -> str:
        i = self.infos[rank]
        return f"rank {rank} ({i.host}, pid {i.pid})"

    def lose(self, why: str) -> None:
        """A rank is lost (``why`` names it): once, tell ``on_lost``, then exit with status 2 after ``LINGER_S`` seconds
        (rank 0: while the server answers 503; the other ranks at once), the message on stderr."""
        with self._lost_lock:
            if self.lost is not None:
                return
            self.lost = why
        self.watchdog.stopped.set()
        log.error("%s", why)
        if self.on_lost is not None:
            try:
                self.on_lost(why)
            except Exception:
                log.exception("telling the server of the lost rank failed")
        self._named.set()  # only now: what the engine does after (its "abort" deltas) comes after the server's errors
        self._exiting.start()

    def settled(self) -> None:
        """Wait until ``lose`` has told ``on_lost`` (``lost`` is set a moment before)."""
        self._named.wait()

    def lost_within(self, seconds: float) -> bool:
        """Whether a rank is lost, or found lost within ``seconds`` (a closed connection is found in about one)."""
        return self._named.wait(seconds)

    def lose_after(self, exc: BaseException) -> None:
        """A collective failed here (``exc``): when a wait in shared memory found a rank's process gone, that rank is
        lost now; else the watchdog's barrier, which names the lost rank, decides within ``NAMING_S`` seconds, or
        ``exc`` itself is the reason. Returns once the server was told."""
        from dtorch.distributed.shm import lost_rank

        gone = lost_rank(exc)  # a wait in shared memory saw that rank's process gone: no need to wait for the watchdog
        if gone is not None:
            self.lose(f"lost {self.describe(gone)}: its process exited or was killed (its lock on the shared memory "
                      "went with it; see its log)")
            self.settled()
            return
        if not self._named.wait(NAMING_S):
            self.lose(str(exc) if isinstance(exc, CommunicationError) else
                      f"rank {self.rank}'s step failed after the other ranks were told of it ({type(exc).__name__}: "
                      f"{exc}); the ranks are out of step")
            self.settled()

    def wait_exit(self) -> None:
        """After ``lose``: wait for the exit (never returns)."""
        self._exiting.join()

    def _exit(self, after: float) -> None:
        time.sleep(after)
        print(f"dtorch: error: rank {self.rank} of {self.world}: {self.lost}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)  # another thread may be blocked in a collective of the lost rank: nothing can join it


class Teller:
    """A ``mirror`` of rank 0's executor or cache (``target``): tells the other ranks each call before it runs."""

    def __init__(self, leader: Leader, target: str) -> None:
        self.leader, self.target = leader, target

    def tell(self, name: str, *args: Any) -> None:
        self.leader.tell(self.target, name, args)

    def failed(self, exc: BaseException) -> None:
        """A step the others were told of failed here: whatever the cause, the ranks are no longer in step."""
        self.leader.ranks.lose_after(exc)


class Leader:
    """Rank 0: makes its executors and cache tell every rank their calls (``Teller``); ``stop`` ends the followers."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self._lock = threading.Lock()  # one message at a time, whichever thread drives the engine
        llm = ranks.llm
        llm.executor.mirror = Teller(self, "target")
        llm.cache.mirror = Teller(self, "cache")
        drafter = getattr(llm.engine.speculator, "drafter", None)
        if drafter is not None:
            drafter.executor.mirror = Teller(self, "draft")
        llm.engine.agree = None  # only rank 0 samples, and the followers never step an engine

    def tell(self, target: str, name: str, args: tuple) -> None:
        if self.ranks.lost is not None:
            self.ranks.settled()
            raise CommunicationError(self.ranks.lost)
        try:
            with self._lock:
                self.ranks.channel.send((target, name, args))
        except CommunicationError as exc:
            self.ranks.lose_after(exc)
            raise

    def stop(self) -> None:
        """Tell every rank to stop and wait for each one's acknowledgement (a ``CommunicationError`` when one is
        lost); the watchdog stops with it."""
        with self._lock:
            self.ranks.channel.send(("stop", "", ()))
            self.ranks.watchdog.finish()
            self.ranks.channel.barrier(self.ranks.watchdog.timeout)


def follow(ranks: Ranks) -> int:
    """A follower's loop: make each call rank 0 tells, on this rank's executor, draft executor or cache, until rank 0
    says stop (then 0). A failed call raises (a ``CommunicationError`` when a peer was lost)."""
    llm = ranks.llm
    drafter = getattr(llm.engine.speculator, "drafter", None)
    targets = {"target": llm.executor, "cache": llm.cache, "draft": drafter.executor if drafter is not None else None}
    channel = ranks.channel
    told: dict[str, deque] = {t: deque() for t in targets}  # each executor's submitted steps whose result comes later
    with torch.no_grad():
        while True:
            target, name, args = channel.recv()
            if target == "stop":
                ranks.watchdog.finish()
                channel.barrier(ranks.watchdog.timeout * 2)
                return 0
            if name not in CALLS.get(target, ()) or targets[target] is None:
                raise CommunicationError(f"rank {ranks.rank}: rank 0 told a call this rank cannot make: "
                                         f"{target}.{name}; are both running the same dtorch?")
            try:
                _make(targets[target], name, args, told[target])
            except CommunicationError as exc:  # a lost peer: exit naming it (also when the watchdog saw it first)
                ranks.lose_after(exc)
                ranks.wait_exit()


def _make(obj: Any, name: str, args: tuple, told: deque) -> None:
    """Make one told call on a follower's ``obj``. An executor's submitted steps wait in ``told`` (oldest first) for
    their ``result``, where rank 0 tells it (a pipeline across processes: ``Executor.logits_from``); a step whose
    result takes no collective ends here at once."""
    if name == "result":
        told.popleft().result()
        return
    out = getattr(obj, name)(*args)
    if name == "submit":
        if obj.logits_from is None:
            out.result()
        else:
            told.append(out)
