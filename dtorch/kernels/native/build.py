"""Compile the native kernels into a cache directory keyed by what the binary depends on, and load them.

``python -m dtorch.kernels.native.build`` builds ahead of time (the README's set-up step), so the first
``generate`` never waits on a compiler. The library's directory is keyed by the torch version, the Python version,
the compiler name and a hash of the sources and flags: another torch gets its own build instead of a crash.

The library links one object per translation unit: ``binding.cpp`` (the only one that includes ATen), ``table.cpp``,
and each ISA unit once per group of the op list (``csrc/ops.def``, read by ``oplist.py``), reading that group's rows
and headers only. Objects are cached apart (``objcache.py``, in ``<cache>/objects``) under a key of their own inputs
(source, the headers it includes, flags, compiler), so a change to one kernel's header recompiles the objects that
include it and relinks, and a new declared op (a DTN_OP row) recompiles its group's objects and ``table``, never
``binding`` (which reads no row: it makes the rows' functions at import from table.cpp's descriptions); the others
come from the cache. Units are compiled in parallel with plain compiler calls (no ninja).

Settings (environment, read by the small functions below): ``CXX`` the compiler (default ``c++``),
``DTORCH_NATIVE_CACHE`` the cache root (``dtorch.core.env.native_cache``, default ``~/.cache/dtorch/native``).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType

import torch

from dtorch.core import env
from dtorch.kernels.native import oplist
from dtorch.kernels.native.loader import NativeUnavailable
from dtorch.kernels.native.objcache import CompileError, ObjectCache, Result, Tree, Unit

CSRC = Path(__file__).parent / "csrc"
MODULE = "_dtorch_native"
_COMMON = ["-O3", "-std=c++20", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off", "-fopenmp-simd",
           "-Wall", "-Wno-unused-function"]
# unit -> its own flags; the ISA units (isa_*.cpp, compiled once per group of ops.def) are x86-only but the portable
_UNITS = {
    "binding.cpp": ["-fopenmp"],  # at::parallel_for is OpenMP pragmas in ATen's headers
    "table.cpp": [],
    "isa_portable.cpp": [],
    "isa_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
    # GCC 12's own AVX-512 headers trip -Wuninitialized on _mm512_undefined_*; nothing of ours
    "isa_avx512.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c",
                       "-Wno-uninitialized", "-Wno-maybe-uninitialized"],
}
_X86_ONLY = ("isa_avx2.cpp", "isa_avx512.cpp")
_SOURCES = (".cpp", ".h", ".def")  # what the library's key hashes

def compiler() -> str:
    return os.environ.get("CXX", "").strip() or "c++"


def cache_root() -> Path:
    return Path(env.native_cache()).expanduser()


def _units() -> dict[str, list[str]]:
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return {u: f for u, f in _UNITS.items() if x86 or u not in _X86_ONLY}


def units(csrc: Path = CSRC) -> list[Unit]:
    """The library's objects: binding.cpp (with torch's headers), table.cpp, and each ISA unit once per group of
    the op list (``csrc/entries.def``'s slot files, then ``csrc/ops.def``'s). A group's object gets only its own
    group's flags (-DDTN_GROUP=<group>, -DDTN_GROUP_<group>=1 and, where the group has them, the file of its declared
    rows -DDTN_GROUP_DEF, of its slots -DDTN_GROUP_SLOTS and its kernels' header -DDTN_GROUP_H), so a new group
    leaves every other object's flags, and so its cached object, as they were."""
    groups = oplist.parse(csrc / "ops.def").groups
    out = []
    for source, flags in _units().items():
        if source == "binding.cpp":
            cflags, _ = _torch_flags()
            salt = f"torch {torch.__version__} py{sys.version_info.major}{sys.version_info.minor}"
            out.append(Unit("binding", source, (*_COMMON, *flags, *cflags), salt))
        elif not source.startswith("isa_"):
            out.append(Unit(Path(source).stem, source, (*_COMMON, *flags)))
        else:
            for g in groups:
                defs = [f"-DDTN_GROUP={g}", f"-DDTN_GROUP_{g}=1"]
                for flag, rel in (("DEF", f"ops/{g}.def"), ("SLOTS", f"slots/{g}.def"), ("H", f"ops/{g}.h")):
                    if (csrc / rel).is_file():
                        defs.append(f'-DDTN_GROUP_{flag}="{rel}"')
                out.append(Unit(f"{Path(source).stem}.{g}", source, (*_COMMON, *flags, *defs)))
    return out


def cache_key(torch_version: str | None = None, python_version: str | None = None, cxx: str | None = None) -> str:
    """The build's directory name: torch and Python versions, then a hash of sources, flags and compiler name."""
    tv = torch_version or torch.__version__
    pv = python_version or f"{sys.version_info.major}{sys.version_info.minor}"
    h = hashlib.sha256()
    for f in sorted(CSRC.rglob("*")):
        if f.suffix in _SOURCES:
            h.update(f.relative_to(CSRC).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(repr((_COMMON, _units(), Path(cxx or compiler()).name, tv, pv)).encode())
    safe_tv = "".join(c if c.isalnum() or c in ".-" else "_" for c in tv)
    return f"torch{safe_tv}-py{pv}-{h.hexdigest()[:16]}"


def objects_dir() -> Path:
    """The object cache shared by every build under the cache root (objcache.py)."""
    return cache_root() / "objects"


def library_path() -> Path:
    return cache_root() / cache_key() / (MODULE + sysconfig.get_config_var("EXT_SUFFIX"))


def _first_lines(text: str, n: int = 12) -> str:
    errors = [ln for ln in text.splitlines() if "error" in ln.lower()]
    return "\n".join((errors or text.splitlines())[:n])


def _torch_flags() -> tuple[list[str], list[str]]:
    from torch.utils.cpp_extension import include_paths, library_paths

    inc = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    lib = library_paths()[0]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [*inc, abi], [f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu", "-ltorch_python"]


def build(force: bool = False, verbose: bool = False) -> Path:
    """Compile (unless cached) and return the path of the extension module; raises NativeUnavailable."""
    lib = library_path()
    if lib.exists() and not force:
        return lib
    cxx = compiler()
    if shutil.which(cxx) is None:
        raise NativeUnavailable(f"no C++ compiler: CXX={cxx!r} is not an executable on PATH; install g++ "
                                "(e.g. apt-get install g++) or set CXX to a C++20 compiler")
    lib.parent.mkdir(parents=True, exist_ok=True)
    with open(lib.parent / ".lock", "w") as lock:  # one builder per key; the others wait, then load its result
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists() and not force:
            return lib
        _compile(cxx, lib, verbose, fresh=force)
    return lib


def _compile(cxx: str, lib: Path, verbose: bool, fresh: bool = False) -> None:
    log_path = lib.parent / "build.log"
    start = time.perf_counter()
    tree = Tree(CSRC)
    try:
        res = compile_objects(cxx, tree, fresh=fresh)
        if tree.changed_since():
            raise NativeUnavailable(f"{', '.join(tree.changed_since())} changed during the build; build again")
        link(cxx, res.objects, lib)
    except CompileError as e:
        log_path.write_text(f"{e.output}\n# failed at {e.unit} after {time.perf_counter() - start:.1f} s")
        raise NativeUnavailable(f"compiling the native kernels failed at {e.unit} with {cxx}:\n"
                                f"{_first_lines(e.output)}\n(full log: {log_path})") from None
    log_path.write_text("\n".join([*res.log, f"# compiled {', '.join(res.compiled) or 'nothing'}; "
                                             f"{time.perf_counter() - start:.1f} s"]))
    if verbose:
        print(f"built {lib} in {time.perf_counter() - start:.1f} s "
              f"({len(res.compiled)} of {len(res.objects)} objects compiled, the others cached)")


def compile_objects(cxx: str, tree: Tree, jobs: int | None = None, fresh: bool = False) -> Result:
    """Every object of the library for the sources in ``tree``: cached ones reused (unless ``fresh``), the others
    compiled, ``jobs`` at a time (default: one per CPU)."""
    return ObjectCache(objects_dir(), cxx).build(units(tree.root), tree, jobs or os.cpu_count() or 1, fresh=fresh)


def link(cxx: str, objects: list[Path], lib: Path) -> None:
    """Link ``objects`` into ``lib``, replaced atomically: a reader sees no library or a whole one."""
    _, ldflags = _torch_flags()
    tmp = lib.parent / f".{lib.name}.{os.getpid()}.tmp"
    cmd = [cxx, "-shared", "-fopenmp", *map(str, objects), *ldflags, "-o", str(tmp)]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode:
        tmp.unlink(missing_ok=True)
        raise CompileError("link", f"$ {' '.join(cmd)}\n{p.stdout}")
    os.replace(tmp, lib)


def import_library(path: Path) -> ModuleType:
    """Import the extension at ``path`` (torch must be imported first: the module links its libraries)."""
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(mod)
    except ImportError as e:
        raise NativeUnavailable(f"the native kernels at {path} do not load ({e}); delete that directory to "
                                "rebuild") from None
    return mod


def main(argv: list[str] | None = None) -> int:
    """Build into the cache and print the library's path. Without the kernels (no compiler, a compile error, whose
    message names the full log) print why and return 0, as dtorch still runs on its torch kernels: the README's
    set-up command chains this step; ``--strict`` returns 1 instead."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m dtorch.kernels.native.build",
                                 description="Compile dtorch's native CPU kernels into the cache.")
    ap.add_argument("--force", action="store_true", help="recompile every object and relink, cached or not")
    ap.add_argument("--strict", action="store_true", help="exit with 1 when the kernels cannot be built")
    args = ap.parse_args(argv)
    try:
        path = build(force=args.force, verbose=True)
    except NativeUnavailable as e:
        print(f"native kernels unavailable: {e}; dtorch will run on its torch kernels", file=sys.stderr)
        return 1 if args.strict else 0
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
