"""Compile the native kernels once, into a cache directory keyed by what the binary depends on, and load them.

``python -m dtorch.kernels.native.build`` builds ahead of time (the README's set-up step), so the first
``generate`` never waits on a compiler. The key is the torch version, the Python version, the compiler name and
a hash of the sources and flags: another torch gets its own build instead of a crash. Units are compiled in
parallel with plain compiler calls (no ninja): the three ISA units see no torch header; only ``binding.cpp``
includes ATen (that is most of the build time).

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
from dtorch.kernels.native.loader import NativeUnavailable

CSRC = Path(__file__).parent / "csrc"
MODULE = "_dtorch_native"
_COMMON = ["-O3", "-std=c++20", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off", "-fopenmp-simd",
           "-Wall", "-Wno-unused-function"]
# unit -> its own flags; the ISA units are x86-only
_UNITS = {
    "binding.cpp": ["-fopenmp"],  # at::parallel_for is OpenMP pragmas in ATen's headers
    "isa_portable.cpp": [],
    "isa_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
    # GCC 12's own AVX-512 headers trip -Wuninitialized on _mm512_undefined_*; nothing of ours
    "isa_avx512.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c",
                       "-Wno-uninitialized", "-Wno-maybe-uninitialized"],
}
_X86_ONLY = ("isa_avx2.cpp", "isa_avx512.cpp")


def compiler() -> str:
    return os.environ.get("CXX", "").strip() or "c++"


def cache_root() -> Path:
    return Path(env.native_cache()).expanduser()


def _units() -> dict[str, list[str]]:
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return {u: f for u, f in _UNITS.items() if x86 or u not in _X86_ONLY}


def cache_key(torch_version: str | None = None, python_version: str | None = None, cxx: str | None = None) -> str:
    """The build's directory name: torch and Python versions, then a hash of sources, flags and compiler name."""
    tv = torch_version or torch.__version__
    pv = python_version or f"{sys.version_info.major}{sys.version_info.minor}"
    h = hashlib.sha256()
    for f in sorted(CSRC.iterdir()):
        if f.suffix in (".cpp", ".h"):
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(repr((_COMMON, _units(), Path(cxx or compiler()).name, tv, pv)).encode())
    safe_tv = "".join(c if c.isalnum() or c in ".-" else "_" for c in tv)
    return f"torch{safe_tv}-py{pv}-{h.hexdigest()[:16]}"


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
        _compile(cxx, lib, verbose)
    return lib


def _compile(cxx: str, lib: Path, verbose: bool) -> None:
    tmp = lib.parent / f"build-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    cflags, ldflags = _torch_flags()
    log_path = lib.parent / "build.log"
    start = time.perf_counter()
    procs = {}
    for unit, flags in _units().items():
        extra = cflags if unit == "binding.cpp" else []
        cmd = [cxx, *_COMMON, *flags, *extra, "-c", str(CSRC / unit), "-o", str(tmp / (unit + ".o"))]
        procs[unit] = (cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    log = []
    failed = None
    for unit, (cmd, p) in procs.items():
        out = p.communicate()[0]
        log.append(f"$ {' '.join(cmd)}\n{out}")
        if p.returncode and failed is None:
            failed = (unit, out)
    if failed is None:
        cmd = [cxx, "-shared", "-fopenmp", *(str(tmp / (u + ".o")) for u in procs), *ldflags, "-o",
               str(tmp / lib.name)]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log.append(f"$ {' '.join(cmd)}\n{p.stdout}")
        if p.returncode:
            failed = ("link", p.stdout)
    log.append(f"# {time.perf_counter() - start:.1f} s")
    log_path.write_text("\n".join(log))
    if failed is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        raise NativeUnavailable(f"compiling the native kernels failed at {failed[0]} with {cxx}:\n"
                                f"{_first_lines(failed[1])}\n(full log: {log_path})")
    os.replace(tmp / lib.name, lib)  # atomic: a reader sees no library or a whole one
    shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        print(f"built {lib} in {time.perf_counter() - start:.1f} s")


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
    ap.add_argument("--force", action="store_true", help="rebuild even when the cache has this build")
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
