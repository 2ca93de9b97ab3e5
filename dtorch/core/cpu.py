"""What this CPU can do, probed once, and forceable either way for tests.

Kernel choices that depend on the machine (bf16 matrix units, the native kernels' instruction set) ask
``has(feature)``. ``DTORCH_CPU_FEATURES="-avx512_bf16"`` (or ``forced(avx512_bf16=False)`` in a test)
overrides the probe, so every answer can be exercised on any machine. Forcing a feature on that the CPU
lacks changes choices only: code that executes the instructions checks ``really_has`` first.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from functools import cache

import torch

from dtorch.core import env
from dtorch.core.errors import ConfigError

# feature -> (torch.cpu probe, /proc/cpuinfo flags that imply it)
FEATURES: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "avx2": ("_is_avx2_supported", ("avx2",)),
    "fma": (None, ("fma",)),
    "f16c": (None, ("f16c",)),
    "avx512": ("_is_avx512_supported", ("avx512f",)),
    "avx512bw": (None, ("avx512bw",)),
    "avx512vl": (None, ("avx512vl",)),
    "avx512_vnni": ("_is_vnni_supported", ("avx512_vnni",)),
    "avx512_bf16": ("_is_avx512_bf16_supported", ("avx512_bf16",)),
    "amx_bf16": ("_is_amx_tile_supported", ("amx_bf16",)),
    "amx_int8": ("_is_amx_tile_supported", ("amx_int8",)),
    "avx512_fp16": (None, ("avx512_fp16",)),
    "amx_fp16": ("_is_amx_fp16_supported", ("amx_fp16",)),
}

_lock = threading.Lock()
_overrides: dict[str, bool] = {}
_listeners: list[weakref.WeakMethod | Callable[[], None]] = []


@cache
def _cpuinfo_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@cache
def really_has(feature: str) -> bool:
    """The probe's answer, never overridden: whether executing ``feature``'s instructions is safe."""
    probe, flags = _known(feature)
    fn = getattr(torch.cpu, probe, None) if probe else None
    if fn is not None:
        return bool(fn())
    return bool(flags) and all(f in _cpuinfo_flags() for f in flags)


def _known(feature: str) -> tuple[str | None, tuple[str, ...]]:
    try:
        return FEATURES[feature]
    except KeyError:
        raise ConfigError(f"unknown CPU feature {feature!r}; known: {', '.join(FEATURES)}") from None


def check_env() -> None:
    """Raise ``ConfigError`` when DTORCH_CPU_FEATURES names a feature this module does not know."""
    _env_overrides()


@cache
def _env_overrides() -> dict[str, bool]:
    forced = env.cpu_features()
    for name in forced:
        _known(name)
    return forced


def _forced(feature: str) -> bool | None:
    """The forced answer for ``feature`` (``forced`` first, then DTORCH_CPU_FEATURES), or None."""
    forced = _overrides.get(feature)
    return _env_overrides().get(feature) if forced is None else forced


def ruled_out(feature: str) -> bool:
    """Whether ``feature`` is forced off (``DTORCH_CPU_FEATURES=-name`` or ``forced(name=False)``): code that could
    run on it acts as if the CPU lacked it."""
    return _forced(feature) is False


def has(feature: str) -> bool:
    """Whether to act as if the CPU has ``feature``: a forced answer if any, else the probe's."""
    forced = _forced(feature)
    return really_has(feature) if forced is None else forced


def fast_float16() -> bool:
    """Whether float16 arithmetic has instructions of its own here (AVX512-FP16 or AMX-FP16); without them torch's
    float16 CPU paths convert every value, and a model runs many times slower than in bfloat16."""
    return has("avx512_fp16") or has("amx_fp16")


# a bf16 product big enough for oneDNN's AMX kernels, checked against float32, in a child process: a CPU whose CPUID
# reports AMX may still fault on it (llama.cpp's AMX path crashes on such VMs), and a crash must not take this process
_AMX_CHECK = """
import torch
a, b = torch.randn(64, 256), torch.randn(256, 64)
got = torch.mm(a.bfloat16(), b.bfloat16()).float()
assert ((got - a @ b).norm() / (a @ b).norm()).item() < 1e-2
"""


@cache
def amx_works() -> bool:
    """Whether AMX really runs here: torch's probe says so (it also asks the kernel for the tile state) and a bf16
    product through oneDNN, which takes its AMX kernels where it can, returns the right numbers in a child process."""
    if not really_has("amx_bf16"):
        return False
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-c", _AMX_CHECK], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


AMX = ("amx_bf16", "amx_int8")


def use_amx() -> bool:
    """Whether to take the AMX paths: no where ``amx_bf16`` or ``amx_int8`` is forced off
    (``DTORCH_CPU_FEATURES=-amx_int8`` and ``-amx_bf16`` each force the paths without AMX), yes where either is forced
    on and oneDNN has bfloat16 kernels here (their products run wherever it does: AMX tiles or not, only the speed
    differs), else ``amx_works()``."""
    answers = {_forced(f) for f in AMX} - {None}
    if answers:
        return all(answers) and onednn_bf16()
    return amx_works()


@cache
def onednn_bf16() -> bool:
    """Whether torch's oneDNN has bfloat16 kernels on this CPU (it needs AVX-512; without it a bf16 oneDNN product
    fails to build): a forced AMX path runs only where this holds."""
    import torch

    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe is not None and probe())


def add_listener(method: Callable[[], None]) -> None:
    """Call ``method`` (held weakly when it is a bound method) whenever a forced answer changes."""
    _listeners.append(weakref.WeakMethod(method) if hasattr(method, "__self__") else method)


def _notify() -> None:
    for ref in list(_listeners):
        fn = ref() if isinstance(ref, weakref.WeakMethod) else ref
        if fn is None:
            _listeners.remove(ref)
        else:
            fn()


@contextlib.contextmanager
def forced(**features: bool) -> Iterator[None]:
    """Within the block, ``has(name)`` answers as given (``forced(avx512_bf16=False)``); choices re-bind."""
    for name in features:
        _known(name)
    with _lock:
        saved = dict(_overrides)
        _overrides.update({k: bool(v) for k, v in features.items()})
    _notify()
    try:
        yield
    finally:
        with _lock:
            _overrides.clear()
            _overrides.update(saved)
        _notify()
