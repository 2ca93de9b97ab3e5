"""Every environment setting dtorch reads, in one place, each checked when it is read.

| setting | meaning | allowed | default |
|---|---|---|---|
| DTORCH_VERIFY | run the reference kernel beside the active one and compare | a flag | off |
| DTORCH_DISABLE_PROVIDERS | providers never chosen, comma-separated ("blas,sdpa") | provider names | none |
| DTORCH_SYNC_TIMEOUT | seconds a stream synchronization waits before raising | a number > 0 | 300 |
| DTORCH_THREADS | intra-op CPU threads of LLM(threads=None) and the CLI's --threads | an int >= 0 (0: torch's) | 0 |
| DTORCH_DEBUG | show the Python traceback of a CLI error instead of its one-line message | a flag | off |
| DTORCH_TRACE | record every kernel's start and end on its stream | a flag | off |
| DTORCH_FORBID_SYNC | a kernel reading tensor values on the host raises SyncError (core/hostsync.py) | a flag | off |
| DTORCH_CPU_FEATURES | force CPU probe answers: "+avx512_bf16,-avx512_vnni" | +/- feature names | none |
| DTORCH_NATIVE_ISA | instruction set of the native CPU kernels | auto, avx512, avx2, portable | auto |
| DTORCH_NATIVE_CACHE | folder where the native CPU kernels are compiled and cached | a path | ~/.cache/dtorch/native |
| DTORCH_API_KEY | the key ``dtorch serve`` asks clients for when ``--api-key`` is not given | any text | none |
| DTORCH_BATCH_INVARIANT | LLM(batch_invariant=None): a sequence's tokens never depend on its batch | a flag | off |
| DTORCH_NO_HUGE_PAGES | a CPU model's weights in 4 KiB pages (no 2 MiB page arena, no MADV_COLLAPSE) | a flag | off |
| DTORCH_PACK_CACHE | cache a GGUF file's packed weights, so a later load is one read | a flag | on |
| DTORCH_PACK_CACHE_DIR | folder of that cache (``dtorch.models.pack_cache``) | a path | ~/.cache/dtorch/packed |
| DTORCH_SHM_COMM | gloo ranks of one host talk through shared memory (``distributed/shm.py``) | a flag | on |
| DTORCH_ONE_LEVEL | quantized CPU products: one int8 level of x per 32 values, every row (ops.qlinear) | a flag | off |

A flag is one of 1/true/yes/on or 0/false/no/off (or empty). A malformed value, or a ``DTORCH_*`` name
not in this table, raises ``ConfigError`` listing what is allowed: a typo is never ignored silently.
"""

from __future__ import annotations

import math
import os
import sys

from dtorch.core.errors import ConfigError

SETTINGS = ("DTORCH_VERIFY", "DTORCH_DISABLE_PROVIDERS", "DTORCH_SYNC_TIMEOUT", "DTORCH_THREADS", "DTORCH_TRACE",
            "DTORCH_FORBID_SYNC", "DTORCH_CPU_FEATURES", "DTORCH_NATIVE_ISA", "DTORCH_NATIVE_CACHE", "DTORCH_DEBUG",
            "DTORCH_API_KEY", "DTORCH_BATCH_INVARIANT", "DTORCH_NO_HUGE_PAGES", "DTORCH_PACK_CACHE",
            "DTORCH_PACK_CACHE_DIR", "DTORCH_SHM_COMM", "DTORCH_ONE_LEVEL")
NATIVE_ISAS = ("auto", "avx512", "avx2", "portable")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def check() -> None:
    """Raise ``ConfigError`` for a ``DTORCH_*`` variable that is not a known setting (a typo) or has a
    malformed value; run once at import, so a bad setting fails first thing rather than mid-run."""
    unknown = sorted(n for n in os.environ if n.startswith("DTORCH_") and n not in SETTINGS)
    if unknown:
        raise ConfigError(f"unknown environment setting(s) {', '.join(unknown)}; dtorch reads "
                          f"{', '.join(SETTINGS)} (see dtorch/core/env.py)")
    for read in (verify, disabled_providers, sync_timeout, threads, trace, forbid_sync, cpu_features, native_isa,
                 debug, batch_invariant, pack_cache, shm_comm, one_level):
        read()


def check_or_exit() -> None:
    """``check()``; when the command line is starting (``python -m dtorch`` or the ``dtorch`` script), a bad setting
    is printed as one line and the process exits 2 instead of showing a traceback (``DTORCH_DEBUG=1``: the
    traceback)."""
    try:
        check()
    except ConfigError as exc:
        starting_cli = sys.argv[:1] == ["-m"] or os.path.basename(sys.argv[0] if sys.argv else "") == "dtorch"
        if not starting_cli or _raw("DTORCH_DEBUG").lower() in _TRUE:
            raise
        print(f"dtorch: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def _flag(name: str) -> bool:
    value = _raw(name).lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={os.environ[name]!r} is not a flag; use one of {', '.join(_TRUE + _FALSE[1:])}")


def _number(name: str, default: str, kind: type, minimum: float, what: str) -> int | float:
    raw = _raw(name) or default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or value < minimum or (minimum == 0 and kind is float and value == 0):
        raise ConfigError(f"{name}={raw!r} is not valid; expected {what}")
    return value


def verify() -> bool:
    return _flag("DTORCH_VERIFY")


def disabled_providers() -> frozenset[str]:
    """The providers named in DTORCH_DISABLE_PROVIDERS (the dispatcher checks that each exists)."""
    return frozenset(p.strip() for p in _raw("DTORCH_DISABLE_PROVIDERS").split(",") if p.strip())


def sync_timeout() -> float:
    seconds = float(_number("DTORCH_SYNC_TIMEOUT", "300", float, 0, "a finite number of seconds > 0"))
    if not math.isfinite(seconds):
        raise ConfigError(f"DTORCH_SYNC_TIMEOUT={_raw('DTORCH_SYNC_TIMEOUT')!r} is not valid; expected a finite "
                          f"number of seconds > 0")
    return seconds


def threads() -> int:
    """Intra-op CPU threads that ``LLM`` gives torch when its ``threads`` is None (0: leave torch's default)."""
    return int(_number("DTORCH_THREADS", "0", int, 0, "an int >= 0 (0: torch's default, one per physical core)"))


def trace() -> bool:
    return _flag("DTORCH_TRACE")


def batch_invariant() -> bool:
    return _flag("DTORCH_BATCH_INVARIANT")


def one_level() -> bool:
    return _flag("DTORCH_ONE_LEVEL")


def no_huge_pages() -> bool:
    return _flag("DTORCH_NO_HUGE_PAGES")


def pack_cache() -> bool:
    """Whether GGUF loads read and write the packed-weight cache (on unless DTORCH_PACK_CACHE is a false flag)."""
    return _raw("DTORCH_PACK_CACHE") == "" or _flag("DTORCH_PACK_CACHE")


def shm_comm() -> bool:
    """Whether gloo ranks on one host talk through shared memory (on unless DTORCH_SHM_COMM is a false flag)."""
    return _raw("DTORCH_SHM_COMM") == "" or _flag("DTORCH_SHM_COMM")


def pack_cache_dir() -> str:
    return _raw("DTORCH_PACK_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "dtorch", "packed")


def forbid_sync() -> bool:
    return _flag("DTORCH_FORBID_SYNC")


def debug() -> bool:
    return _flag("DTORCH_DEBUG")


def cpu_features() -> dict[str, bool]:
    """Forced CPU probe answers from DTORCH_CPU_FEATURES: {"avx512_bf16": False, ...} ("+name" / "-name")."""
    forced = {}
    for item in _raw("DTORCH_CPU_FEATURES").split(","):
        item = item.strip()
        if not item:
            continue
        if item[0] not in "+-" or len(item) < 2:
            raise ConfigError(f"DTORCH_CPU_FEATURES item {item!r} must be +name or -name, e.g. "
                              "'-avx512_bf16,+avx2'")
        forced[item[1:].lower()] = item[0] == "+"
    return forced


def native_isa() -> str:
    value = _raw("DTORCH_NATIVE_ISA").lower() or "auto"
    if value not in NATIVE_ISAS:
        raise ConfigError(f"DTORCH_NATIVE_ISA={value!r} is not valid; expected one of {', '.join(NATIVE_ISAS)}")
    return value


def native_cache() -> str:
    return _raw("DTORCH_NATIVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dtorch", "native")


def api_key() -> str | None:
    """The API key of ``dtorch serve`` from DTORCH_API_KEY (None: unset or empty)."""
    return _raw("DTORCH_API_KEY") or None
