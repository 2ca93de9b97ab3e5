"""Incremental compilation: one object per translation unit, cached under a key of its own inputs, built only when
they change.

An object's key hashes the unit's identity (its source's name, its flags, the compiler and its version) and the
contents of every file of the source tree it read, as the compiler listed them (``-MMD``) when it compiled it. The
unit's manifest keeps the lists of files of its last few compiles (several trees share one cache: main and each
worktree), and an object is found when one of those lists, hashed with this tree's contents, names an object that
exists. That is sound: the set of files a unit reads is a function of the contents of those files, so an object whose
listed files all have this tree's contents is the object this tree would compile. Files outside the tree (the
system's and torch's headers) are covered by the compiler's version and by the caller's ``salt`` (the torch version,
for the units that include torch).

Safe when several processes build at once: objects and manifests are written under a temporary name and renamed
into place (a reader sees a whole file or none); two processes compiling one unit write equal objects.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# objects kept per unit identity beyond the newest, and the age under which none is removed (a build of another tree
# may be about to link it); lists of files kept per unit's manifest
KEEP_PER_UNIT = 6
KEEP_MANIFESTS = 8
KEEP_YOUNGER_S = 3600.0


@dataclass(frozen=True)
class Unit:
    """One object: ``source`` (a path relative to the tree) compiled with ``flags``; ``name`` names the object."""

    name: str
    source: str
    flags: tuple[str, ...]
    salt: str = ""  # what else the object depends on (e.g. the torch version of the headers it includes)


@dataclass
class Result:
    """Objects in unit order, and which units were compiled (the others came from the cache)."""

    objects: list[Path]
    compiled: list[str]
    log: list[str]


class CompileError(Exception):
    def __init__(self, unit: str, output: str) -> None:
        super().__init__(f"{unit}: {output}")
        self.unit, self.output = unit, output


def compiler_version(cxx: str) -> str:
    """The compiler's full version ("12.2.0"), or "" when it does not say."""
    try:
        out = subprocess.run([cxx, "-dumpfullversion", "-dumpversion"], capture_output=True, text=True, timeout=30)
    except OSError:
        return ""
    return out.stdout.strip()


class Tree:
    """The source tree's file contents, hashed once per build (a snapshot, so every key of one build sees the same
    files)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._hash: dict[str, str] = {}

    def digest(self, rel: str) -> str:
        if rel not in self._hash:
            p = self.root / rel
            self._hash[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "missing"
        return self._hash[rel]

    def changed_since(self) -> list[str]:
        """The files hashed so far whose contents differ now (edited during the build)."""
        return [rel for rel, h in self._hash.items() if Tree(self.root).digest(rel) != h]


def _identity(unit: Unit, cxx: str, version: str) -> str:
    h = hashlib.sha256(repr((unit.source, unit.flags, Path(cxx).name, version, unit.salt)).encode())
    return f"{unit.name}-{h.hexdigest()[:16]}"


def _object_key(identity: str, deps: Sequence[str], tree: Tree) -> str:
    h = hashlib.sha256(identity.encode())
    for rel in deps:
        h.update(b"\0" + rel.encode() + b"\0" + tree.digest(rel).encode())
    return h.hexdigest()[:20]


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _deps(depfile: Path, root: Path) -> list[str]:
    """The files under ``root`` that a make-style depfile lists, relative to root, sorted."""
    text = depfile.read_text().replace("\\\n", " ")
    files = text.split(":", 1)[1].split() if ":" in text else []
    root = root.resolve()
    out = set()
    for f in files:
        p = Path(f).resolve()
        if p.is_relative_to(root):
            out.add(p.relative_to(root).as_posix())
    return sorted(out)


class ObjectCache:
    """Objects under ``directory``: ``<identity>-<key>.o`` and the unit's manifest ``<identity>.manifests`` (and
    ``<identity>.deps``, its newest list)."""

    def __init__(self, directory: Path, cxx: str, version: str | None = None) -> None:
        self.dir = directory
        self.cxx = cxx
        self.version = compiler_version(cxx) if version is None else version

    def cached(self, unit: Unit, tree: Tree) -> Path | None:
        """The unit's object for the tree as it is, or None when it must be compiled."""
        ident = _identity(unit, self.cxx, self.version)
        for deps in self._manifests(ident):
            obj = self.dir / f"{ident}-{_object_key(ident, deps, tree)}.o"
            if obj.is_file():
                return obj
        return None

    def _manifests(self, ident: str) -> list[list[str]]:
        """The unit's lists of files read, newest first: ``<ident>.manifests``, else the one list of ``<ident>.deps``
        (which this module still writes, newest list only, for trees whose objcache.py reads that file alone)."""
        for name in (f"{ident}.manifests", f"{ident}.deps"):
            try:
                lists = json.loads((self.dir / name).read_text())
            except (OSError, ValueError):
                continue
            return lists if name.endswith(".manifests") else [lists]
        return []

    def build(self, units: Sequence[Unit], tree: Tree, jobs: int, fresh: bool = False) -> Result:
        """Compile the units whose object is not cached (every unit when ``fresh``), ``jobs`` at a time; raises
        CompileError for the first unit that fails (after the running ones finish)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temporaries()
        objects: dict[str, Path] = {}
        todo = []
        for u in units:
            obj = None if fresh else self.cached(u, tree)
            if obj is None:
                todo.append(u)
            else:
                os.utime(obj)  # in use: pruning keeps the recently used
                objects[u.name] = obj
        log: list[str] = []
        failed: CompileError | None = None
        running: list[tuple[Unit, list[str], subprocess.Popen, Path, Path]] = []
        pending = list(todo)
        while pending or running:
            while pending and len(running) < max(1, jobs):
                u = pending.pop(0)
                tmp = self.dir / f".{u.name}.{os.getpid()}.o"
                dep = tmp.with_suffix(".d")
                cmd = [self.cxx, *u.flags, "-MMD", "-MF", str(dep), "-c", str(tree.root / u.source), "-o", str(tmp)]
                p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                running.append((u, cmd, p, tmp, dep))
            u, cmd, p, tmp, dep = running.pop(0)
            out = p.communicate()[0]
            log.append(f"$ {' '.join(cmd)}\n{out}")
            if p.returncode:
                failed = failed or CompileError(u.name, out)
                pending.clear()  # start nothing more; the running ones finish (their objects are still good)
                tmp.unlink(missing_ok=True)
                dep.unlink(missing_ok=True)
                continue
            objects[u.name] = self._store(u, tree, tmp, dep)
        if failed is not None:
            raise failed
        return Result([objects[u.name] for u in units], [u.name for u in todo], log)

    def _store(self, unit: Unit, tree: Tree, tmp: Path, dep: Path) -> Path:
        ident = _identity(unit, self.cxx, self.version)
        deps = _deps(dep, tree.root)
        dep.unlink(missing_ok=True)
        obj = self.dir / f"{ident}-{_object_key(ident, deps, tree)}.o"
        os.replace(tmp, obj)
        lists = [deps, *(d for d in self._manifests(ident) if d != deps)][:KEEP_MANIFESTS]
        _write_atomic(self.dir / f"{ident}.manifests", json.dumps(lists).encode())  # two writers: a list may be lost
        _write_atomic(self.dir / f"{ident}.deps", json.dumps(deps).encode())
        self._prune(ident)
        return obj

    def _remove_stale_temporaries(self) -> None:
        """Temporaries (dot files) older than an hour: left by a build that was killed."""
        now = time.time()
        for p in self.dir.glob(".*"):
            try:
                if now - p.stat().st_mtime > KEEP_YOUNGER_S:
                    p.unlink()
            except OSError:
                pass  # another process removed it first

    def _prune(self, ident: str) -> None:
        """Remove this unit's objects past the newest KEEP_PER_UNIT that no one used in the last hour."""
        objs = sorted(self.dir.glob(f"{ident}-*.o"), key=lambda p: p.stat().st_mtime, reverse=True)
        now = time.time()
        for p in objs[KEEP_PER_UNIT:]:
            try:
                if now - p.stat().st_mtime > KEEP_YOUNGER_S:
                    p.unlink()
            except OSError:
                pass  # another process pruned it first
