"""Memory kinds and accounting.

Every tensor dtorch allocates on purpose is tagged with a ``MemoryKind``: PERSISTENT (weights),
WORKSPACE (scratch reused across steps) or KV_CACHE. ``memory_stats()`` reports live and peak
bytes per (kind, device). Accounting follows the tensor's life: bytes are returned when the
tensor's storage is freed.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import ctypes.util
import enum
import functools
import mmap
import sys
import threading
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from dtorch.core import env
from dtorch.core.device import Device, as_device
from dtorch.core.errors import ArgumentError


class MemoryKind(enum.Enum):
    PERSISTENT = "persistent"
    WORKSPACE = "workspace"
    KV_CACHE = "kv_cache"
    ACTIVATION = "activation"


@dataclass(frozen=True, slots=True)
class MemoryStat:
    kind: MemoryKind
    device: Device
    live_bytes: int
    peak_bytes: int
    tensors: int


class MemoryTracker:
    """Live and peak bytes per (kind, device); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[tuple[MemoryKind, Device], int] = defaultdict(int)
        self._peak: dict[tuple[MemoryKind, Device], int] = defaultdict(int)
        self._count: dict[tuple[MemoryKind, Device], int] = defaultdict(int)
        self._kinds: dict[int, MemoryKind] = {}  # id(tensor) -> kind, while the tensor lives

    def track(self, t: torch.Tensor, kind: MemoryKind, device: Device) -> torch.Tensor:
        """Count ``t``'s bytes under (kind, device) until it is freed; returns ``t``."""
        nbytes = t.untyped_storage().nbytes()
        key = (kind, device)
        with self._lock:
            self._live[key] += nbytes
            self._count[key] += 1
            self._peak[key] = max(self._peak[key], self._live[key])
            self._kinds[id(t)] = kind
        weakref.finalize(t, self._release, key, nbytes, id(t))
        return t

    def _release(self, key: tuple[MemoryKind, Device], nbytes: int, ident: int) -> None:
        with self._lock:
            self._kinds.pop(ident, None)
            self._live[key] -= nbytes
            self._count[key] -= 1

    def kind_of(self, t: torch.Tensor) -> MemoryKind | None:
        """The kind ``t`` was allocated as, or None if dtorch did not allocate it."""
        with self._lock:
            return self._kinds.get(id(t))

    def stats(self) -> list[MemoryStat]:
        with self._lock:
            keys = sorted(set(self._live) | set(self._peak), key=lambda k: (k[0].value, str(k[1])))
            return [MemoryStat(k[0], k[1], self._live[k], self._peak[k], self._count[k]) for k in keys]

    def live_bytes(self, kind: MemoryKind | None = None, device: Device | str | None = None) -> int:
        dev = as_device(device) if device is not None else None
        with self._lock:
            return sum(v for (k, d), v in self._live.items()
                       if (kind is None or k is kind) and (dev is None or d == dev))

    def peak_bytes(self, kind: MemoryKind, device: Device | str) -> int:
        with self._lock:
            return self._peak[(kind, as_device(device))]

    def reset_peak(self) -> None:
        with self._lock:
            for k in self._peak:
                self._peak[k] = self._live[k]


memory = MemoryTracker()


def allocate(shape: Sequence[int], dtype: torch.dtype, device: Device | str = "cpu",
             kind: MemoryKind = MemoryKind.WORKSPACE, *, zero: bool = False) -> torch.Tensor:
    """A new tensor of ``shape`` and ``dtype`` on ``device``, counted under ``kind``."""
    dev = as_device(device)
    if any((not isinstance(s, int)) or s < 0 for s in shape):
        raise ArgumentError(f"allocate: shape must be non-negative ints, got {tuple(shape)}")
    make = torch.zeros if zero else torch.empty
    return memory.track(make(tuple(shape), dtype=dtype, device=dev.torch), kind, dev)


def adopt(t: torch.Tensor, kind: MemoryKind, device: Device | str | None = None) -> torch.Tensor:
    """Count an existing tensor (e.g. a loaded weight) under ``kind``; returns it."""
    return memory.track(t, kind, as_device(device) if device is not None else as_device(t.device))


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 128 << 10  # glibc's own initial value


def map_large_allocations() -> None:
    """Pin glibc's mmap threshold at its initial 128 KiB, so every large buffer is its own mapping, unmapped when
    freed. Left alone, glibc raises the threshold to the size of each mapped buffer freed (up to 32 MiB): after a
    model load has freed its file reads and packing buffers, later buffers of that size come from the heap, whose
    freed pages stay in the process's RSS. Pinned, the peak RSS of loading the default model is about 20 MiB lower.
    Where the C library is not glibc, nothing happens."""
    mallopt = libc_function("mallopt")  # glibc's
    if mallopt is not None:
        mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(MMAP_THRESHOLD))


def trim_heap() -> None:
    """Give the heap memory freed so far back to the system, where the C library can (glibc's ``malloc_trim``): a
    model load frees many buffers whose pages malloc would otherwise keep in the process's RSS."""
    malloc_trim = libc_function("malloc_trim")  # glibc's (musl has none)
    if malloc_trim is not None:
        malloc_trim(ctypes.c_size_t(0))


HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KiB base pages) transparent huge page
MADV_COLLAPSE = 25  # Linux 6.1: make the range's pages huge now, in place


def huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Move the 2 MiB pages that hold each CPU tensor's storage into transparent huge pages (madvise MADV_COLLAPSE,
    one 2 MiB page at a time, in place: the bytes are the same), and return how many bytes of the storages lie in
    2 MiB pages afterwards (each storage counted once): a weight read end to end each step misses the TLB 512 times
    less there (decode of a 1.7B-parameter Q4_K_M file ~10% faster on one core here).

    The pages asked for are the whole ones inside a storage, and every one of a ``HugePageArena`` slab a storage
    touches (a slab holds weights alone, so its pages that hold small weights are asked for too); a storage's end
    pages that it shares with other memory (the heap) are left alone, and its bytes there count as 4 KiB pages.
    A page the kernel refuses (busy, or the last page of a closed arena, marked MADV_NOHUGEPAGE) counts as 4 KiB
    pages; an arena's page faulted in as a huge page already is one answer of the kernel, at no cost. It costs no
    memory (weights are written whole); nothing is done, and 0 returned, where the C library has no madvise
    (not Linux, not glibc); a kernel before 6.1, or THP "never", refuses every page."""
    madvise = libc_function("madvise")
    if madvise is None:
        return 0
    huge: dict[int, bool] = {}  # 2 MiB page address -> whether it is in a huge page now (each asked once)
    done, seen = 0, set()
    for t in tensors:
        if t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        base, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or (base, size) in seen:
            continue
        seen.add((base, size))
        for page in range(base // HUGE_PAGE * HUGE_PAGE, base + size, HUGE_PAGE):
            if not (base <= page and page + HUGE_PAGE <= base + size) and not _in_arena(page):
                continue  # shared with memory that is not the weights'
            if page not in huge:
                huge[page] = madvise(ctypes.c_void_p(page), ctypes.c_size_t(HUGE_PAGE), MADV_COLLAPSE) == 0
            if huge[page]:
                done += min(base + size, page + HUGE_PAGE) - max(base, page)
    return done


MADV_HUGEPAGE = 14


def empty_in_huge_pages(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype)`` on the cpu whose whole 2 MiB pages are marked MADV_HUGEPAGE before anything is
    written: the first write then faults them in as transparent huge pages directly (THP "madvise" or "always"), where
    ``huge_pages`` would copy 4 KiB pages into huge ones after the fact (1.3 s for a 400 MB model on a busy core).
    Where the C library or the kernel says no, or ``DTORCH_NO_HUGE_PAGES`` is set, a plain ``torch.empty``."""
    t = torch.empty(tuple(shape), dtype=dtype)
    madvise = None if env.no_huge_pages() else libc_function("madvise")
    size = t.untyped_storage().nbytes()
    if madvise is not None and size >= 2 * HUGE_PAGE:
        base = t.untyped_storage().data_ptr()
        lo, hi = -(-base // HUGE_PAGE) * HUGE_PAGE, (base + size) // HUGE_PAGE * HUGE_PAGE
        if hi > lo:
            madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_HUGEPAGE)
    return t


MAP_NORESERVE = 0x4000  # Linux's (Python's mmap module names it from 3.12): no swap reserved for untouched pages
# bytes a new slab of a HugePageArena maps at least: virtual (untouched pages cost nothing), and large, as each slab
# may hold one 2 MiB page it fills only in part
ARENA_SLAB = 256 << 20
ARENA_ALIGN = 64  # where each tensor of an arena starts (a cache line, as torch.empty's)
MADV_DONTNEED = 4
MADV_NOHUGEPAGE = 15


def thp_mode() -> str:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"); "never" where it cannot be read (not
    Linux, a kernel without them)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "never"
    return text[text.index("[") + 1:text.index("]")] if "[" in text and "]" in text else "never"


# the 2 MiB aligned span [lo, hi) of every arena slab still mapped, by id (a slab leaves when its mapping is freed)
_slab_spans: dict[int, tuple[int, int]] = {}


def _in_arena(page: int) -> bool:
    """Whether the 2 MiB page at ``page`` lies in a ``HugePageArena`` slab still mapped (weights alone)."""
    return any(lo <= page and page + HUGE_PAGE <= hi for lo, hi in list(_slab_spans.values()))


class HugePageArena:
    """Memory for the tensors of one model's weights in 2 MiB pages, small ones included: each tensor a piece of a
    slab (a private anonymous mapping, 2 MiB aligned, marked MADV_HUGEPAGE before anything is written), so its first
    write faults it in as transparent huge pages. A weight under 4 MiB given memory of its own (``torch.empty``: a
    mapping that starts at a 4 KiB boundary) sits in 4 KiB pages, where its one-row product reads it ~1.4x slower at
    one thread (``bench/weight_pages.py``); a larger one only at its ends.

    ``empty(shape, dtype)`` gives a tensor with a storage of its own (exactly its bytes, so memory accounting and
    ``huge_pages`` see it alone) that keeps its slab mapped; a slab is unmapped when its last tensor is freed, so
    the arena itself may go once the model is loaded. Tensors are laid out first fit, each at a 64-byte boundary; a
    slab's untouched pages hold no memory, and ``close`` gives back the rest of the 2 MiB page each slab's tensors
    end in, so the arena costs its tensors' bytes.

    ``HugePageArena.usable()``: whether one helps here (Linux with a C library, transparent huge pages "always" or
    "madvise", not ``DTORCH_NO_HUGE_PAGES``); where not, or where the kernel refuses a slab's madvise, ``empty``
    is ``torch.empty``."""

    def __init__(self) -> None:
        self._slabs: list[list] = []  # [mapping, offset of its first 2 MiB boundary, bytes, bytes used]
        self._lock = threading.Lock()
        self.refused = False  # a slab's madvise failed: plain torch.empty from then on
        self.bytes = 0  # of the tensors given out

    @staticmethod
    def usable() -> bool:
        return not env.no_huge_pages() and libc_function("madvise") is not None and \
            thp_mode() in ("always", "madvise")

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized cpu tensor of ``shape`` and ``dtype`` in the arena's 2 MiB pages (``torch.empty``
        where the kernel refused them)."""
        shape = tuple(int(s) for s in shape)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0 or self.refused:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            slab = next((s for s in self._slabs if s[2] - s[3] >= nbytes), None) or self._new_slab(nbytes)
            if slab is None:
                return torch.empty(shape, dtype=dtype)
            offset = slab[1] + slab[3]
            slab[3] += -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN
            self.bytes += nbytes
        return torch.frombuffer(slab[0], dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)

    def close(self) -> None:
        """No more tensors come from the arena (``empty`` is ``torch.empty`` from now on); each slab's last 2 MiB page,
        where its tensors end inside it, gives back the 4 KiB pages after their end (MADV_DONTNEED: it is then held
        in 4 KiB pages, and the arena costs no more than its tensors, up to 4 KiB a slab). That page and the slab's
        untouched rest are marked MADV_NOHUGEPAGE first, so that khugepaged does not make it whole again."""
        madvise = libc_function("madvise")
        with self._lock:
            self.refused = True
            for mapping, start, size, used in self._slabs:
                base = ctypes.addressof(ctypes.c_char.from_buffer(mapping)) + start
                end = base + used
                last, page_end = end // HUGE_PAGE * HUGE_PAGE, -(-end // mmap.PAGESIZE) * mmap.PAGESIZE
                if madvise is None or last == end:
                    continue
                madvise(ctypes.c_void_p(last), ctypes.c_size_t(base + size - last), MADV_NOHUGEPAGE)
                madvise(ctypes.c_void_p(page_end), ctypes.c_size_t(last + HUGE_PAGE - page_end), MADV_DONTNEED)
            self._slabs = []

    def _new_slab(self, nbytes: int) -> list | None:
        """A new slab of at least ``nbytes`` (None, and ``refused`` set, where the mapping or madvise fails)."""
        size = max(ARENA_SLAB, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
        try:  # (strict overcommit, vm.overcommit_memory 2, may refuse the reservation)
            mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        except OSError:
            self.refused = True
            return None
        base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        skip = -base % HUGE_PAGE  # the slab starts at the first 2 MiB boundary of the mapping
        madvise = libc_function("madvise")
        if madvise is None or madvise(ctypes.c_void_p(base + skip), ctypes.c_size_t(size), MADV_HUGEPAGE) != 0:
            self.refused = True
            mapping.close()
            return None
        self._slabs.append([mapping, skip, size, 0])
        _slab_spans[id(mapping)] = (base + skip, base + skip + size)
        weakref.finalize(mapping, _slab_spans.pop, id(mapping), None)
        return self._slabs[-1]


_weight_arena: contextvars.ContextVar[HugePageArena | None] = contextvars.ContextVar("dtorch_weight_arena",
                                                                                     default=None)


@contextlib.contextmanager
def weight_arena() -> Iterator[HugePageArena | None]:
    """While inside, ``empty_weight`` takes a model's weights from one ``HugePageArena`` (where it helps: see
    ``HugePageArena.usable``; else nothing changes). Yields the arena, or None."""
    arena = HugePageArena() if HugePageArena.usable() else None
    token = _weight_arena.set(arena)
    try:
        yield arena
    finally:
        _weight_arena.reset(token)
        if arena is not None:
            arena.close()


def current_weight_arena() -> HugePageArena | None:
    """The arena of the innermost open ``weight_arena`` (None: none open, or arenas do not help here)."""
    return _weight_arena.get()


def empty_weight(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The memory of a weight as the loader makes it (uninitialized, cpu): from the arena of ``weight_arena`` when
    one is open, else marked for 2 MiB pages (``empty_in_huge_pages``, unless ``DTORCH_NO_HUGE_PAGES``)."""
    arena = _weight_arena.get()
    return arena.empty(shape, dtype) if arena is not None else empty_in_huge_pages(shape, dtype)


@functools.cache
def libc_function(name: str):
    """The C library's function ``name`` (errno kept), or None: not Linux, no C library ctypes finds, or not there."""
    if sys.platform != "linux":
        return None
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):
        return None


def memory_stats() -> list[MemoryStat]:
    """Live and peak bytes for every (kind, device) seen so far."""
    return memory.stats()


class WorkspaceArena:
    """Scratch memory reused across steps.

    ``get(nbytes)`` returns a uint8 view of at least ``nbytes`` from one buffer that grows when
    a step needs more; ``view(shape, dtype)`` a typed tensor over it. A step's scratch is valid
    until the next ``get``/``view`` call on the same arena. The buffer is WORKSPACE memory.
    """

    def __init__(self, device: Device | str = "cpu", alignment: int = 64) -> None:
        self.device = as_device(device)
        self.alignment = alignment
        self._buffer: torch.Tensor | None = None
        self.grows = 0

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def get(self, nbytes: int) -> torch.Tensor:
        if nbytes < 0:
            raise ArgumentError(f"WorkspaceArena.get: nbytes must be >= 0, got {nbytes}")
        if nbytes > self.capacity:
            size = -(-max(nbytes, 2 * self.capacity) // self.alignment) * self.alignment
            self._buffer = allocate((size,), torch.uint8, self.device, MemoryKind.WORKSPACE)
            self.grows += 1
        assert self._buffer is not None or nbytes == 0
        return self._buffer[:nbytes] if self._buffer is not None else torch.empty(0, dtype=torch.uint8)

    def view(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self.get(nbytes).view(dtype).view(tuple(shape))

    def __repr__(self) -> str:
        return f"WorkspaceArena({self.device}, {self.capacity} bytes, grew {self.grows} times)"


class ThreadWorkspace:
    """The workspace a kernel gets when its caller passes none: one ``WorkspaceArena`` per thread.

    Kernels on different threads (streams, user threads) never share scratch; kernels on one thread
    run one at a time, so they can share that thread's arena across steps.
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self._local = threading.local()

    def arena(self) -> WorkspaceArena:
        arena = getattr(self._local, "arena", None)
        if arena is None:
            arena = self._local.arena = WorkspaceArena(self.device)
        return arena

    def get(self, nbytes: int) -> torch.Tensor:
        return self.arena().get(nbytes)

    def view(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return self.arena().view(shape, dtype)


_default_workspaces: dict[Device, ThreadWorkspace] = {}
_default_lock = threading.Lock()


def default_workspace(device: Device | str) -> ThreadWorkspace:
    """The per-thread default workspace of ``device``."""
    dev = as_device(device)
    ws = _default_workspaces.get(dev)
    if ws is None:
        with _default_lock:
            ws = _default_workspaces.setdefault(dev, ThreadWorkspace(dev))
    return ws
