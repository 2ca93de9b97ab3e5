"""``HostShm``: collectives and sends between the gloo ranks of one host through a shared-memory segment.

gloo on loopback costs ~0.5 ms per all-reduce (a TCP round trip through its pairs), and a tensor-parallel step of a
small model makes ~60 of them per token; vLLM's and SGLang's CPU backends keep such ranks in shared memory. Here:

- Set-up (``HostShm.join``, collective over a gloo group): every rank tells its host; the lowest rank of each host
  makes a segment in /dev/shm (filled with ``posix_fallocate``, so a full /dev/shm is an error now, never a SIGBUS
  later) holding a random token; the others on that host open it and check the token, so a segment is used only by
  ranks that really share it. Then each rank takes a lock on its byte of the file (``fcntl.lockf``), and every rank
  unlinks the name: the memory lives while a rank maps it and goes with the last one, also when ranks are killed.
- A collective is a *round*: each rank copies its piece into its buffer of the round's parity, bumps its own 32-bit
  counter (a futex word) to the round's number and wakes its waiters, then waits until every other rank's counter has
  reached that number and reads what it needs of their buffers. A rank writes its buffer for round s only after it
  has seen every rank reach round s - 1, which each did after reading round s - 2: two buffers a rank suffice. A sum
  is taken in rank order (((x0 + x1) + x2) + ...), the same on every rank and as ``InProcessCommunicator``'s, so
  every rank holds the same bits. Tensors larger than a buffer go in several rounds.
- A send goes through a ring of ``RING_SLOTS`` slots per ordered pair of ranks: the sender waits for a free slot, the
  receiver for a filled one (each side one counter), the first slot of a message carrying its length.
- A wait spins ``SPIN_S`` seconds (yielding the interpreter lock), then sleeps on the futex in slices of ``SLICE_S``;
  between slices it checks ``abort()``, the timeout, and whether the peer's lock is still held: a killed rank's lock
  goes with its process, so a lost peer is a ``CommunicationError`` within a slice ("rank r was lost: its process
  exited"), as gloo's closed connection is.

Linux on x86-64 only (futex numbers; x86 keeps stores in order, so a counter is seen only after the data written
before it; a lock operation between the two also orders non-temporal stores). Elsewhere, with ``DTORCH_SHM_COMM=0``,
or when the ranks of a group are not all on one host, ``join`` returns None and gloo carries everything.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import mmap
import os
import platform
import secrets
import socket
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from dtorch.core import env
from dtorch.core.errors import CommunicationError
from dtorch.core.placement import Shard, shard_sizes
from dtorch.runtime.blob import local_piece

log = logging.getLogger("dtorch.distributed")

BUFFER_BYTES = 1 << 20  # each rank's buffer for one round of a collective (two per rank: the rounds' parities)
RING_SLOTS, SLOT_BYTES = 4, 1 << 17  # a send's ring per ordered pair of ranks
SPIN_S = 5e-5  # seconds a wait polls (yielding) before it sleeps
SLICE_S = 0.02  # seconds of one futex sleep; a lost peer or an abort is seen within one
LINE = 64  # bytes: each counter on a cache line of its own
# syscall(2)'s arguments as full registers; x86-64's numbers; not FUTEX_PRIVATE: the words are shared between processes
_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = ctypes.c_long(202), ctypes.c_long(0), ctypes.c_long(1)
_MANY, _ZERO = ctypes.c_long(0x7FFFFFFF), ctypes.c_long(0)
_fence_lock = threading.Lock()


class ShmError(CommunicationError):
    """A wait in shared memory failed: aborted, a peer lost, or its timeout (the message says which and who);
    ``lost``: the global rank whose process is gone (its lock went with it), else None."""

    def __init__(self, message: str, lost: int | None = None) -> None:
        super().__init__(message)
        self.lost = lost


def lost_rank(exc: BaseException | None) -> int | None:
    """The rank a failure was caused by the loss of, when a wait in shared memory saw its process gone."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, ShmError) and exc.lost is not None:
            return exc.lost
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def unsupported() -> str | None:
    """Why shared-memory collectives cannot run in this process (None: they can)."""
    if not env.shm_comm():
        return "DTORCH_SHM_COMM is off"
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"shared-memory collectives need Linux on x86-64, not {sys.platform} on {platform.machine()}"
    if not os.path.isdir("/dev/shm"):
        return "there is no /dev/shm"
    return None


def _fence() -> None:
    """A locked instruction: the data written before it is visible before the counter written after it."""
    _fence_lock.acquire()
    _fence_lock.release()


def _past(value: int, target: int) -> bool:
    """Whether a 32-bit counter ``value`` has reached ``target`` (both mod 2**32; they never drift 2**31 apart)."""
    return (value - target) & 0xFFFFFFFF < 0x80000000


class _Layout:
    """Byte offsets in a segment of ``n`` ranks: a header page (token, each rank's lock byte), the counters, the
    collective buffers [parity][rank], then the send rings [src][dst][slot] with their lengths."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.arrive = 4096  # rank r's round counter at arrive + r * LINE
        self.sent = self.arrive + n * LINE  # pair (a, b)'s sent counter at sent + (a * n + b) * 2 * LINE
        self.taken = self.sent + LINE  # and its taken counter one line further
        self.lengths = self.sent + n * n * 2 * LINE  # int64 per (pair, slot): bytes of the message a slot starts
        self.buffers = _align(self.lengths + n * n * RING_SLOTS * 8)
        self.rings = self.buffers + 2 * n * BUFFER_BYTES
        self.size = self.rings + n * n * RING_SLOTS * SLOT_BYTES

    def buffer(self, parity: int, rank: int) -> int:
        return self.buffers + (parity * self.n + rank) * BUFFER_BYTES

    def pair(self, a: int, b: int) -> int:
        return a * self.n + b

    def slot(self, pair: int, k: int) -> int:
        return self.rings + (pair * RING_SLOTS + k) * SLOT_BYTES


def _align(n: int, to: int = 4096) -> int:
    return (n + to - 1) // to * to


class HostShm:
    """One segment shared by the ranks ``ranks`` (global ids, in group order) of one host; ``me`` is this rank's
    position among them. Collectives span all of them; ``send``/``recv`` name a peer's position."""

    def __init__(self, path: str, ranks: tuple[int, ...], me: int, token: bytes, timeout: float) -> None:
        self.ranks, self.me, self.n, self.timeout = ranks, me, len(ranks), timeout
        self.layout = lay = _Layout(self.n)
        self.fd = os.open(path, os.O_RDWR)
        self.mm = mmap.mmap(self.fd, lay.size)
        if self.mm[:len(token)] != token:
            raise CommunicationError(f"shared-memory segment {path}: not the one rank {ranks[0]} made")
        self.words = memoryview(self.mm).cast("I")  # every 32-bit word of the segment
        self.lengths = memoryview(self.mm)[lay.lengths:lay.buffers].cast("q")
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)  # the whole segment; views carve it
        fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, me)  # held while this process lives
        self.round = self.words[lay.arrive // 4 + me * LINE // 4]
        self.sent = [0] * self.n  # messages (slots) this rank sent to each peer / took from each peer
        self.taken = [0] * self.n
        self.aborted = False
        self._views: dict[tuple[int, torch.dtype, int], list[torch.Tensor]] = {}
        self.whole = False  # every rank of the group is here: collectives may use the segment (``join`` sets it)
        self._p2p_locks = [threading.Lock() for _ in range(self.n)]

    # -- set-up ----------------------------------------------------------------------------------

    @classmethod
    def join(cls, group: Any, timeout: float) -> HostShm | None:
        """Collective over the gloo ``group`` (every rank of it calls): a segment of this host's ranks of the group,
        or None where it cannot be used (``unsupported``, another backend, a group of one, a failed set-up: logged).
        The segment serves collectives only when every rank of the group is on this host (``whole``)."""
        why = unsupported()
        if dist.get_backend(group) != "gloo":
            why = why or f"the process group's backend is {dist.get_backend(group)}, not gloo"
        world = dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        if world < 2:
            return None
        try:
            return cls._join(group, ranks, world, why, timeout)
        except (RuntimeError, ValueError) as exc:  # a peer lost during the set-up: the group's first collective says so
            log.warning("shared-memory set-up of ranks %s failed (%s); they use gloo", ranks, exc)
            return None

    @classmethod
    def _join(cls, group: Any, ranks: list[int], world: int, why: str | None, timeout: float) -> HostShm | None:
        host = socket.gethostname()
        hosts: list[Any] = [None] * world
        dist.all_gather_object(hosts, (host, why), group=group)
        if any(w for _, w in hosts):  # every rank decides alike: one rank's reason is everyone's
            log.info("collectives of ranks %s go through gloo: %s", ranks, next(w for _, w in hosts if w))
            return None
        mine = tuple(r for r, (h, _) in zip(ranks, hosts, strict=True) if h == host)
        me = mine.index(dist.get_rank())
        alone = len(mine) < 2  # nothing to share on this host (the others' set-up goes on: the gathers are collective)
        made = cls._make(mine) if me == 0 and not alone else None
        names: list[Any] = [None] * world
        dist.all_gather_object(names, made, group=group)
        path, token = names[ranks.index(mine[0])] or ("", b"")
        shm, error = None, None
        try:
            if path:
                shm = cls(path, mine, me, token, timeout)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
        except CommunicationError as exc:
            error = str(exc)
        oks: list[Any] = [None] * world
        dist.all_gather_object(oks, (host, error if path or alone else "its host's segment could not be made"),
                               group=group)
        if path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # every rank of this host has it mapped (or failed): the name is no longer needed
        failed = [(r, e) for r, (h, e) in zip(ranks, oks, strict=True) if h == host and e]
        if alone:
            return None
        if failed:
            log.warning("shared-memory collectives are off for ranks %s: %s", list(mine), failed)
            return None
        shm.whole = len(mine) == world
        return shm

    @staticmethod
    def _make(ranks: tuple[int, ...]) -> tuple[str, bytes] | None:
        """A new segment for ``ranks`` (its path and token), or None (logged) when /dev/shm cannot hold it."""
        token = secrets.token_bytes(16)
        path = f"/dev/shm/dtorch-comm-{os.getpid()}-{secrets.token_hex(6)}"
        size = _Layout(len(ranks)).size
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)  # the pages now, or ENOSPC now (a later write past it: SIGBUS)
                os.pwrite(fd, token, 0)
            finally:
                os.close(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(path)
            log.warning("no shared-memory segment of %d MiB for ranks %s (%s); they use gloo", size >> 20,
                        list(ranks), exc)
            return None
        return path, token

    # -- waiting ---------------------------------------------------------------------------------

    def _signal(self, word: int, value: int) -> None:
        _fence()
        self.words[word] = value & 0xFFFFFFFF
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self.base + 4 * word), _FUTEX_WAKE, _MANY, None, None, _ZERO)

    def _wait(self, word: int, target: int, peer: int) -> None:
        """Until the counter at ``word`` (written by the rank at position ``peer``) reaches ``target``."""
        words, target = self.words, target & 0xFFFFFFFF
        if _past(words[word], target):
            return
        end = time.perf_counter() + SPIN_S
        while time.perf_counter() < end:
            os.sched_yield()  # lets this process's other threads have the interpreter lock meanwhile
            if _past(words[word], target):
                return
        deadline = time.monotonic() + self.timeout
        ts = _Timespec(0, int(SLICE_S * 1e9))
        addr = ctypes.c_void_p(self.base + 4 * word)
        while True:
            value = words[word]
            if _past(value, target):
                return
            if self.aborted:
                raise ShmError("aborted (a kernel of this run failed or the run timed out)")
            if not self._alive(peer):
                raise ShmError(f"rank {self.ranks[peer]} was lost: its connection closed (its lock on the shared "
                               "memory went with its process: it exited or was killed; see its log)",
                               lost=self.ranks[peer])
            if time.monotonic() > deadline:
                raise ShmError(f"rank {self.ranks[peer]} did not answer within {self.timeout:g}s, the process group's "
                               "timeout (a stuck or slow peer; a longer wait is init_process_group(timeout=...))")
            _libc.syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, ctypes.c_long(value), ctypes.byref(ts), None, _ZERO)

    def _alive(self, peer: int) -> bool:
        """Whether the rank at ``peer`` still holds its lock (a process's locks go with it)."""
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, peer)
        except OSError:
            return True
        fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, peer)
        return False

    def abort(self) -> None:
        self.aborted = True

    def reset(self) -> None:
        self.aborted = False

    # -- collectives -----------------------------------------------------------------------------

    def _rounds(self, flat: torch.Tensor | None, numel: int, dtype: torch.dtype):
        """Run one round per buffer-sized chunk of ``numel`` elements; yields (start, stop, the ranks' buffers as
        ``dtype`` [stop - start]) once every rank wrote its chunk of ``flat`` (None: this rank sends nothing)."""
        per = BUFFER_BYTES // dtype.itemsize
        for start in range(0, max(numel, 1), per):
            stop = min(numel, start + per)
            yield start, stop, self._round(flat[start:stop] if flat is not None else None, stop - start, dtype)

    def _round(self, mine: torch.Tensor | None, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """One round: ``mine`` (at most ``numel`` elements: an all-gather's shorter piece fills only the start) into
        this rank's buffer, then every rank's buffer as ``dtype`` [numel] once all have written theirs."""
        self.round = rnd = (self.round + 1) & 0xFFFFFFFF
        bufs = self._buffers(rnd & 1, dtype, numel)
        if mine is not None:
            (bufs[self.me] if mine.numel() == numel else bufs[self.me][:mine.numel()]).copy_(mine)
        arrive, step = self.layout.arrive // 4, LINE // 4
        self._signal(arrive + self.me * step, rnd)
        for r in range(self.n):
            if r != self.me:
                self._wait(arrive + r * step, rnd, r)
        return bufs

    def _buffers(self, parity: int, dtype: torch.dtype, numel: int) -> list[torch.Tensor]:
        """Every rank's buffer of ``parity`` as ``dtype`` [numel] (views made once per shape: a step repeats them)."""
        key = (parity, dtype, numel)
        views = self._views.get(key)
        if views is None:
            lay = self.layout
            views = [self.bytes[lay.buffer(parity, r):lay.buffer(parity, r) + BUFFER_BYTES].view(dtype)[:numel]
                     for r in range(self.n)]
            if len(self._views) < 1024:
                self._views[key] = views
        return views

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor, op: str) -> None:
        fn = torch.add if op == "sum" else torch.maximum
        if x.numel() * x.element_size() <= BUFFER_BYTES and out.is_contiguous():  # one round (a decode step's)
            bufs = self._round(x.reshape(-1), x.numel(), x.dtype)
            acc = out.view(-1)
            fn(bufs[0], bufs[1], out=acc)
            for b in bufs[2:]:
                fn(acc, b, out=acc)
            return
        flat_x, flat_out = x.reshape(-1), _flat_out(out)
        for start, stop, bufs in self._rounds(flat_x, flat_x.numel(), x.dtype):
            acc = flat_out[start:stop]
            fn(bufs[0], bufs[1], out=acc)
            for b in bufs[2:]:
                fn(acc, b, out=acc)
        _write_back(out, flat_out)

    def all_gather(self, x: torch.Tensor, out: torch.Tensor, dim: int) -> None:
        sizes = shard_sizes(out.shape[dim], self.n)
        shapes = [out.shape[:dim] + (s,) + out.shape[dim + 1:] for s in sizes]
        numels = [int(torch.Size(s).numel()) for s in shapes]
        if max(numels) * out.element_size() <= BUFFER_BYTES:  # one round: straight from the buffers
            for _, _, bufs in self._rounds(x.reshape(-1), max(numels), out.dtype):
                torch.cat([b[:m].view(s) for b, m, s in zip(bufs, numels, shapes, strict=True)], dim=dim, out=out)
            return
        pieces = [torch.empty(m, dtype=out.dtype) for m in numels]  # every rank's piece, flat, gathered in chunks
        for start, stop, bufs in self._rounds(x.reshape(-1), max(numels), out.dtype):
            for piece, b, m in zip(pieces, bufs, numels, strict=True):
                if start < m:
                    piece[start:min(stop, m)].copy_(b[:min(stop, m) - start])
        torch.cat([p.view(s) for p, s in zip(pieces, shapes, strict=True)], dim=dim, out=out)

    def broadcast(self, x: torch.Tensor, out: torch.Tensor, src: int) -> None:
        """``src``: the source's position among the ranks."""
        mine = src == self.me
        flat_out = _flat_out(out)
        flat_x = x.reshape(-1) if mine else None
        for start, stop, bufs in self._rounds(flat_x, flat_out.numel(), out.dtype):
            flat_out[start:stop].copy_(flat_x[start:stop] if mine else bufs[src])
        _write_back(out, flat_out)

    def reduce_scatter(self, x: torch.Tensor, out: torch.Tensor, dim: int, op: str) -> None:
        full = torch.empty_like(x)
        self.all_reduce(x, full, op)
        out.copy_(local_piece(full, Shard(dim), self.me, self.n))

    # -- point to point --------------------------------------------------------------------------

    def send(self, x: torch.Tensor, dst: int) -> None:
        """To the rank at position ``dst``; returns once the last slot is written (the ring holds it)."""
        data = x.contiguous().reshape(-1).view(torch.uint8)
        pair, lay = self.layout.pair(self.me, dst), self.layout
        sent, taken = (lay.sent + pair * 2 * LINE) // 4, (lay.taken + pair * 2 * LINE) // 4
        with self._p2p_locks[dst]:
            for start in range(0, max(data.numel(), 1), SLOT_BYTES):
                seq = self.sent[dst]
                self._wait(taken, seq + 1 - RING_SLOTS, dst)  # a free slot: taken > seq - RING_SLOTS
                k = seq % RING_SLOTS
                chunk = data[start:start + SLOT_BYTES]
                self.bytes[lay.slot(pair, k):lay.slot(pair, k) + chunk.numel()].copy_(chunk)
                self.lengths[pair * RING_SLOTS + k] = data.numel() if start == 0 else -1
                self.sent[dst] = seq + 1
                self._signal(sent, seq + 1)

    def recv(self, out: torch.Tensor, src: int) -> None:
        """From the rank at position ``src``, into ``out`` (the sent tensor's bytes must fill it exactly)."""
        flat = _flat_out(out)
        data = flat.view(torch.uint8)
        pair, lay = self.layout.pair(src, self.me), self.layout
        sent, taken = (lay.sent + pair * 2 * LINE) // 4, (lay.taken + pair * 2 * LINE) // 4
        with self._p2p_locks[src]:
            for start in range(0, max(data.numel(), 1), SLOT_BYTES):
                seq = self.taken[src]
                self._wait(sent, seq + 1, src)
                k = seq % RING_SLOTS
                if start == 0 and self.lengths[pair * RING_SLOTS + k] != data.numel():
                    raise CommunicationError(
                        f"recv on rank {self.ranks[self.me]}: rank {self.ranks[src]} sent "
                        f"{self.lengths[pair * RING_SLOTS + k]} bytes, expected {data.numel()} (shape "
                        f"{list(out.shape)}, {out.dtype}); the ranks' graphs disagree")
                n = min(SLOT_BYTES, data.numel() - start)
                data[start:start + n].copy_(self.bytes[lay.slot(pair, k):lay.slot(pair, k) + n])
                self.taken[src] = seq + 1
                self._signal(taken, seq + 1)
        _write_back(out, flat)

    def __repr__(self) -> str:
        return f"HostShm(ranks {list(self.ranks)}, {self.layout.size >> 20} MiB)"


def _flat_out(out: torch.Tensor) -> torch.Tensor:
    """``out`` as a flat tensor to write: itself when dense, else a scratch one (``_write_back`` copies it in)."""
    return out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype)


def _write_back(out: torch.Tensor, flat: torch.Tensor) -> None:
    if not out.is_contiguous():
        out.copy_(flat.view(out.shape))
