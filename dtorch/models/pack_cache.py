"""A GGUF file's weights as the kernels read them (packed, ``dtorch.kernels.layouts``), cached on disk so that a
later load of the same file is one read instead of a read, a repack and a check.

One entry per (file, dtype, this process's devices of the mesh) in ``DTORCH_PACK_CACHE_DIR`` (default
``~/.cache/dtorch/packed``), named by a hash of those; ``DTORCH_PACK_CACHE=0`` turns the cache off. An entry is

    b"DTORCHPK" | header bytes: uint64 LE | header: JSON | padding to 4 KiB | each tensor's bytes, 4 KiB aligned

and its header holds the identity it was made for: the file's path, size, mtime, inode and a hash of its first MiB
(its header and metadata), the hash of the code that packs (``CODE``'s sources: a new layout is a new version),
``FORMAT``, the dtype, the mesh, ``check_finite``, the checksum's kind and whether the projections are packed with 16
rows interleaved (``repack.x16_wanted``: an entry made on the other choice is stale); then per weight its parts, each
tensor's dtype, shape, offset and the checksum of each 16 MiB of it: XXH3-64 where the ``xxhash`` package is installed
(25 GB/s on one core here: a cached load of a 0.5B model checks its 375 MiB in 0.02 s), else zlib's CRC-32 (4 GB/s:
0.09 s), an entry made with the other one being stale. Nothing is trusted: an entry whose identity differs (the file
changed: stale) is rebuilt, and a weight with a checksum that differs (corrupt) is read again from the model file, after
which the whole entry is written again.

Writers are safe beside each other and beside readers: an entry is written to a temporary file in the same folder and
renamed over the old one (a reader sees the old entry or the new one, whole), under an exclusive ``flock`` of the
entry's ``.lock`` file (a second writer of the same entry skips its write: the first one's will do). The write runs on
a thread of its own after the load (the weights are never changed), so ``LLM(path)`` does not wait for it; the process
waits for it before it exits. That thread runs at idle priority (``SCHED_IDLE``, Linux): it takes a CPU only when
nothing else of the machine wants one, so the decode that starts as soon as ``LLM(path)`` returns keeps its CPUs;
``wait()``, and the process's exit, give it the normal priority back. Where the system would not allow that back
(no CAP_SYS_NICE, RLIMIT_NICE too low: ``priority_restorable``) the write keeps the normal priority throughout.
A write also deletes the entries of model files that no longer exist. The cache holds about one model's packed bytes
per (file, dtype, mesh) loaded; delete the folder to reclaim it.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import tempfile
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dtorch.core import env
from dtorch.core.memory import empty_weight

FORMAT = 3
MAGIC = b"DTORCHPK"
ALIGN = 4096
CHUNK = 16 << 20  # bytes per checksum: a large tensor is read and checked in chunks, several threads at once
READERS = 4  # threads reading an entry (each preadv, and a CRC-32, releases the GIL)
HEAD_BYTES = 1 << 20  # the first MiB of the model file is hashed into the identity (GGUF header and metadata)
# the modules whose code decides the packed bytes: any change to them makes every entry stale
CODE = ("kernels/layouts.py", "kernels/x16.py", "kernels/group_formats.py", "kernels/half.py",
        "kernels/native/csrc/repack.h", "models/weights.py", "models/loaders/gguf.py", "models/loaders/checkpoint.py",
        "models/families")
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.uint8, torch.float32, torch.float16, torch.bfloat16)}
log = logging.getLogger("dtorch.models")


@functools.cache
def checksum_kind() -> str:
    """The checksum new entries get and this process reads: "xxh3_64" where the ``xxhash`` package is installed (the
    ``fast`` extra), else "crc32" (zlib's, 5x slower)."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "crc32"
    return "xxh3_64"


def _checksum(view: memoryview, kind: str) -> int:
    """The checksum of ``kind`` ("xxh3_64" or "crc32") of bytes ``view``."""
    if kind == "xxh3_64":
        import xxhash

        return xxhash.xxh3_64_intdigest(view)
    return zlib.crc32(view)


def _code_hash() -> str:
    root, h = Path(__file__).resolve().parent.parent, hashlib.sha256()
    for rel in CODE:
        p = root / rel
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _file_identity(path: Path) -> dict[str, Any]:
    st = path.stat()
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()[:16]
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino,
            "head": head}


@dataclass
class Part:
    """One part of a weight kept as stored: its layout (None: float rows beside packed parts), its rows, and this
    process's tensor of it per device id (on the cpu, as packed)."""

    layout: str | None
    rows: int
    tensors: dict[int, torch.Tensor]


@dataclass
class PackCache:
    """The cache entry of one model file for one load: ``get(name)`` gives a weight's parts from the entry (or None:
    not there, or corrupt), ``put(name, parts)`` records what the load made, ``commit()`` writes the entry when
    anything was missing (on a thread; ``wait()`` joins it)."""

    path: Path  # the entry
    identity: dict[str, Any]
    found: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # name -> its parts' records in the entry
    made: dict[str, list[Part]] = field(default_factory=dict)
    dirty: bool = False
    status: str = "miss"  # "hit", "miss", "stale" or "corrupt"
    start: int = 0  # where the entry's tensor bytes start
    _fd: int | None = None  # the entry, open while the load reads it
    _pool: ThreadPoolExecutor | None = None
    writer: threading.Thread | None = None
    waited: bool = False  # someone waits for the write: it runs at the normal priority (under ``_priority``)
    _priority: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(cls, model: str | Path, dtype: torch.dtype, mesh: str, check_finite: bool) -> PackCache | None:
        """The entry for GGUF file ``model`` loaded in ``dtype`` on ``mesh`` (a text naming the mesh and this
        process's devices), read when it is there and its identity matches; None when the cache is off
        (``DTORCH_PACK_CACHE=0``) or ``model`` is not a ``.gguf`` file."""
        model = Path(model)
        if not env.pack_cache() or model.suffix != ".gguf" or not model.is_file():
            return None
        from dtorch.kernels.native.repack import x16_wanted

        identity = {"format": FORMAT, "code": _code_hash(), "file": _file_identity(model),
                    "dtype": str(dtype).removeprefix("torch."), "mesh": mesh, "check_finite": check_finite,
                    "checksum": checksum_kind(), "x16": x16_wanted(dtype)}
        key = json.dumps([identity["file"]["path"], identity["dtype"], mesh, check_finite]).encode()
        folder = Path(env.pack_cache_dir()).expanduser()
        cache = cls(folder / f"{model.stem[:64]}-{hashlib.sha256(key).hexdigest()[:16]}.dtpk", identity)
        cache._read_header()
        return cache

    # -- reading ---------------------------------------------------------------------------------------------------

    def _read_header(self) -> None:
        try:
            header, self.start = _header(self.path)
        except FileNotFoundError:
            self.status, self.dirty = "miss", True
            return
        except (OSError, ValueError, UnicodeDecodeError) as e:
            log.info("%s: unreadable pack cache entry (%s); it is made again", self.path, e)
            self.status, self.dirty = "corrupt", True
            return
        if not isinstance(header, dict) or header.get("identity") != self.identity:
            self.status, self.dirty = "stale", True
            return
        self.found, self.status = header.get("weights", {}), "hit"

    def get(self, name: str) -> list[Part] | None:
        """Weight ``name``'s parts read from the entry, each tensor's checksums checked; None when the entry lacks it
        or a checksum differs (then the load makes it again and the entry is rewritten)."""
        records = self.found.get(name)
        if records is None:
            self.dirty = True
            return None
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
                self._pool = ThreadPoolExecutor(READERS, thread_name_prefix="dtorch-pack-read")
            read = [_empty(t) for r in records for t in r["tensors"].values()]
            recs = [t for r in records for t in r["tensors"].values()]
            jobs = [(self._fd, self.start, rec, out, c, self.identity["checksum"])
                    for rec, out in zip(recs, read, strict=True) for c in range(len(rec["sums"]))]
            list(self._pool.map(lambda job: _read_chunk(*job), jobs))  # the reads release the GIL
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("%s: weight %r in the pack cache is corrupt (%s); it is read from the model file again and "
                        "the entry rewritten", self.path, name, e)
            self.status, self.dirty = "corrupt", True
            return None
        parts, it = [], iter(read)
        for r in records:
            parts.append(Part(r["layout"], int(r["rows"]), {int(i): next(it) for i in r["tensors"]}))
        self.made[name] = parts
        return parts

    # -- writing ---------------------------------------------------------------------------------------------------

    def put(self, name: str, parts: list[Part]) -> None:
        """Record weight ``name``'s parts as the load made them (written by ``commit``)."""
        self.made[name] = parts

    def close(self) -> None:
        """Stop reading the entry (its file and reader threads); a load that fails ends here."""
        if self._fd is not None:
            self._pool.shutdown()
            os.close(self._fd)
            self._fd = self._pool = None

    def commit(self) -> None:
        """The load is over: close the entry, and write it, on a thread of its own, when the load made anything the
        entry lacked (a miss, a stale or corrupt entry); the weights recorded must not change afterwards."""
        self.close()
        if not self.dirty or not self.made:
            self.made = {}  # (on a GPU, the cpu copies of its weights)
            return
        self.writer = threading.Thread(target=self._write, name="dtorch-pack-cache", daemon=False)
        self.writer.start()
        at_exit = getattr(threading, "_register_atexit", None)  # runs before the interpreter joins the thread
        if at_exit is not None:
            at_exit(self.wait)

    def wait(self) -> None:
        """Until the entry's write (if any) is done; the write is given the caller's priority back first (someone
        waits for it now: at idle priority on a busy machine it could take minutes), where the system allows."""
        if self.writer is not None:
            with self._priority:  # the writer lowers itself under it, or sees ``waited`` and does not
                self.waited = True
                if self.writer.is_alive() and hasattr(os, "SCHED_OTHER"):
                    try:
                        os.sched_setscheduler(self.writer.native_id, os.SCHED_OTHER, os.sched_param(0))
                    except OSError:  # gone meanwhile, or not permitted (RLIMIT_NICE): it stays idle
                        pass
            self.writer.join()

    def _write(self) -> None:
        with self._priority:
            if not self.waited and priority_restorable():
                idle_priority()
        folder = self.path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_suffix(".lock"), "a+b") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return  # another process writes this entry now
                self._write_locked(folder)
        except OSError as e:  # a full disk, a read-only folder: the next load packs again
            log.warning("%s: could not write the pack cache entry (%s); set DTORCH_PACK_CACHE=0 to stop trying",
                        self.path, e)
        finally:
            self.made = {}  # written: the weights are the model's alone again (on a GPU, their cpu copies go)

    def _write_locked(self, folder: Path) -> None:
        weights: dict[str, list[dict[str, Any]]] = {}
        order: list[tuple[int, torch.Tensor]] = []
        offset = 0
        for name, parts in self.made.items():
            records = []
            for p in parts:
                tensors = {}
                for i, t in p.tensors.items():
                    data = _bytes(t)
                    view = memoryview(data.numpy())
                    sums = [_checksum(view[c:c + CHUNK], self.identity["checksum"])
                            for c in range(0, len(view), CHUNK)]
                    tensors[str(i)] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                                       "offset": offset, "nbytes": data.numel(), "sums": sums}
                    order.append((offset, data))
                    offset += -(-data.numel() // ALIGN) * ALIGN
                records.append({"layout": p.layout, "rows": p.rows, "tensors": tensors})
            weights[name] = records
        header = json.dumps({"identity": self.identity, "weights": weights}).encode()
        start = _data_start(len(header))
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + len(header).to_bytes(8, "little") + header)
                for at, data in order:
                    f.seek(start + at)
                    f.write(memoryview(data.numpy()))
                f.truncate(start + offset)
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise
        _prune(folder, self.path)


def priority_restorable() -> bool:
    """Whether a thread of this process lowered to ``SCHED_IDLE`` can be given the normal policy back: Linux allows
    it with CAP_SYS_NICE, or where RLIMIT_NICE lets the thread's nice value stand (20 - nice <= the limit). Where it
    cannot (an ordinary user's default limit is 0), the write keeps the normal priority: an idle write that nobody
    can raise would make the process's exit wait for idle CPUs, minutes on a busy machine."""
    try:
        with open("/proc/self/status") as f:
            caps = next((line.split()[1] for line in f if line.startswith("CapEff:")), "0")
        if int(caps, 16) >> 23 & 1:  # CAP_SYS_NICE
            return True
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
        return soft == resource.RLIM_INFINITY or 20 - os.getpriority(os.PRIO_PROCESS, 0) <= soft
    except (OSError, ValueError, ImportError, AttributeError):
        return False


def idle_priority() -> bool:
    """Run the calling thread (alone: Linux schedules threads) only on a CPU that has nothing else to run
    (``SCHED_IDLE``); False where the system has no such policy or refuses it (the thread keeps its priority).

    The entry's write (a 1.5B Q4_K_M model's: ~1 GB checksummed and copied into the page cache, ~1.5 s of a CPU)
    would otherwise take a CPU from the decode that starts when the load returns: at 2 threads on 2 CPUs, a decode
    thread parked for a slice holds its partner at every product's end. An idle thread still runs whenever a CPU
    idles (between steps, at a barrier's sleep, when the process waits for it at exit), so it always ends."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        return False
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError:
        return False
    return True


def _header(path: Path) -> tuple[Any, int]:
    """(an entry's header, where its tensor bytes start); ValueError when it is no entry."""
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a dtorch pack cache entry")
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size < 1 << 30:
            raise ValueError(f"header of {size} bytes")
        return json.loads(f.read(size)), _data_start(size)


def _prune(folder: Path, keep: Path) -> None:
    """Delete the entries (and their locks) of model files that no longer exist: a file deleted or moved leaves its
    entry behind, which no load can ever read again. Entries of files that exist are kept (another dtype, mesh, or a
    copy of the file elsewhere)."""
    for entry in folder.glob("*.dtpk"):
        if entry == keep:
            continue
        try:
            source = _header(entry)[0]["identity"]["file"]["path"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable: its own next load rewrites it
        if isinstance(source, str) and not os.path.exists(source):
            entry.unlink(missing_ok=True)
            entry.with_suffix(".lock").unlink(missing_ok=True)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous cpu tensor's bytes, uint8 [nbytes] (the same memory)."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _empty(rec: dict[str, Any]) -> torch.Tensor:
    """The memory a recorded tensor is read into: in 2 MiB pages from its first write (the load's weight arena;
    unless ``DTORCH_NO_HUGE_PAGES``), as the load's own packing would give it."""
    dtype, shape = _DTYPES[rec["dtype"]], [int(n) for n in rec["shape"]]
    t = empty_weight(shape, dtype)
    if t.numel() * t.element_size() != int(rec["nbytes"]):
        raise ValueError(f"{rec['nbytes']} bytes recorded for a {shape} {rec['dtype']} tensor")
    return t


def _read_chunk(fd: int, start: int, rec: dict[str, Any], out: torch.Tensor, chunk: int, kind: str) -> None:
    """Chunk ``chunk`` (``CHUNK`` bytes) of a recorded tensor, read from file ``fd`` (its bytes at ``start`` + its
    offset) into ``out``; ValueError when it is short or its checksum (of ``kind``) differs."""
    view = memoryview(_bytes(out).numpy())[chunk * CHUNK:(chunk + 1) * CHUNK]
    got = os.preadv(fd, [view], start + int(rec["offset"]) + chunk * CHUNK)
    if got != len(view) or _checksum(view, kind) != int(rec["sums"][chunk]):
        raise ValueError(f"chunk {chunk} of a tensor at byte {rec['offset']} is truncated or its checksum differs")


def _data_start(header_bytes: int) -> int:
    """Where an entry's tensor bytes start (their offsets count from there): the first 4 KiB boundary after the
    magic, the header's length and the header."""
    return -(-(len(MAGIC) + 8 + header_bytes) // ALIGN) * ALIGN
