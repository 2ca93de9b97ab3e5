"""Loading the native kernels once per process, the reason when they cannot load, and the ISA choice.

The ISA is chosen at load from ``isa_setting()`` ("auto" picks the best the CPU runs, avx512 > avx2 > portable,
of those DTORCH_CPU_FEATURES does not force off) and can be forced later with ``set_isa`` / ``use_isa`` (tests run
every path on one machine).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from dtorch.core import cpu, env
from dtorch.core.errors import ArgumentError, DtorchError, DTypeError, LayoutError, ShapeError

ISAS = ("avx512", "avx2", "portable")  # best first


class NativeUnavailable(DtorchError, RuntimeError):
    """The native kernels cannot be built or loaded here; the message says why and what to do."""

_mod: ModuleType | None = None
_reason: str | None = None


def isa_setting() -> str:
    """"auto" | "avx512" | "avx2" | "portable", from DTORCH_NATIVE_ISA."""
    return env.native_isa()


def load() -> ModuleType:
    """The compiled module (built on first use if the cache lacks it); raises NativeUnavailable with the reason.

    A failure is remembered: later calls raise the same reason without trying again.
    """
    global _mod, _reason
    if _mod is not None:
        return _mod
    if _reason is not None:
        raise NativeUnavailable(_reason)
    from dtorch.kernels.native import oplist
    from dtorch.kernels.native.build import build, import_library  # not at import: `-m ...build` runs it as main

    try:
        mod = import_library(build())
        try:
            oplist.check_module(mod)
        except DtorchError as e:
            raise NativeUnavailable(str(e)) from None
        mod.set_errors(ShapeError, DTypeError, LayoutError, ArgumentError)
        want = isa_setting()
        try:
            _set(mod, want)
        except ArgumentError as e:
            raise NativeUnavailable(f"DTORCH_NATIVE_ISA={want}: {e}") from None
    except NativeUnavailable as e:
        _reason = str(e)
        raise
    _mod = mod
    _bf16_panels()
    cpu.add_listener(_bf16_panels)
    cpu.add_listener(_repick)
    return mod


def _bf16_panels() -> None:
    """Coarse prompt rows through bfloat16 panels (oneDNN's AMX GEMM) where AMX works (``cpu.use_amx``; forced with
    DTORCH_CPU_FEATURES=-amx_bf16 or -amx_int8, +amx_bf16), else on the integer tiles or float32 panels."""
    if _mod is not None:
        _mod.set_bf16_panels(cpu.use_amx())


def bf16_panels() -> bool:
    """Whether coarse prompt rows go through bfloat16 panels (AMX) now."""
    return load().set_bf16_panels(None)


def unavailable_reason() -> str | None:
    """None when the native kernels load, else why not (no compiler, a compile error, an unusable ISA setting)."""
    try:
        load()
    except NativeUnavailable as e:
        return str(e)
    return None


def available_isas() -> list[str]:
    """The ISAs this CPU runs, best first."""
    mod = load()
    return [i for i in ISAS if mod.cpu_supports(i)]


# the CPU features each ISA's kernels execute (binding.cpp's cpu_supports checks them by CPUID; the AVX-512 units also
# run AVX2 code)
ISA_FEATURES = {"avx512": ("avx512", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"),
                "avx2": ("avx2", "fma", "f16c"), "portable": ()}
_auto = False  # whether the ISA now set came from "auto" (re-picked when a forced CPU answer changes)


def _best(mod: ModuleType) -> str:
    """The best ISA this CPU runs that no forced answer rules out: ``DTORCH_CPU_FEATURES=-avx512`` (or
    ``cpu.forced(avx512=False)``) picks the AVX2 kernels, ``-avx2`` the portable ones; forcing a feature on never
    picks kernels the CPU cannot run."""
    return next(i for i in ISAS if mod.cpu_supports(i) and not any(cpu.ruled_out(f) for f in ISA_FEATURES[i]))


def _set(mod: ModuleType, name: str) -> None:
    global _auto
    _auto = name == "auto"
    mod.set_isa(_best(mod) if _auto else name)


def _repick() -> None:
    """A forced CPU answer changed: an "auto" choice follows it."""
    if _mod is not None and _auto:
        _mod.set_isa(_best(_mod))


def isa() -> str:
    """The ISA whose kernels run now."""
    return load().isa()


def set_isa(name: str) -> None:
    """Force "avx512", "avx2" or "portable" (or "auto") for every later call in this process."""
    if name not in (*ISAS, "auto"):
        raise ArgumentError(f"set_isa: name must be one of auto, {', '.join(ISAS)}; got {name!r}")
    _set(load(), name)


@contextmanager
def use_isa(name: str) -> Iterator[None]:
    """Run the block with the ``name`` kernels, then restore the previous choice."""
    before = "auto" if _auto else isa()
    set_isa(name)
    try:
        yield
    finally:
        set_isa(before)


def float_gemm() -> str:
    """The float GEMM that ``qlinear``'s dequantized panels (prefill) go through: "onednn" (torch's oneDNN linear,
    where torch has it) or "torch" (``torch.mm``)."""
    return load().set_float_gemm(None)


@contextmanager
def use_float_gemm(name: str) -> Iterator[None]:
    """Run the block with the panels in ``name``'s GEMM ("onednn" or "torch"), then restore the previous choice."""
    before = load().set_float_gemm(name)
    try:
        yield
    finally:
        load().set_float_gemm(before)


def row_split() -> str:
    """How the products share their output rows among the intra-op threads: "static" (the default: an even split,
    at::parallel_for's) or "claimed" (each thread claims chunks from a shared counter, largest first, so a slower
    thread takes fewer rows)."""
    return load().set_row_split(None)


@contextmanager
def use_row_split(name: str) -> Iterator[None]:
    """Run the block with the products' rows split ``name``'s way ("claimed" or "static"), then restore."""
    before = load().set_row_split(name)
    try:
        yield
    finally:
        load().set_row_split(before)


def row_counts(reset: bool = False) -> list[int]:
    """Rows each OpenMP thread (0: the caller) has computed in claimed splits since the last reset, the first 8
    threads: equal speeds claim equal rows, so the shares say how fast each thread really ran. ``reset`` zeroes
    them after reading."""
    return load().row_counts(reset)
