"""Native CPU kernels (C++ with SIMD intrinsics, one build holding AVX-512 VNNI, AVX2 and portable paths,
chosen per CPU at load): GGUF quantized products on weights kept packed (``dtorch.kernels.layouts``),
float32/bf16 GEMV and the fused decode ops. Importing this package compiles nothing; ``unavailable`` (the
dispatcher's first look at the cpu), ``load()`` or the first kernel call builds or loads the library.

As a dispatcher backend: ``unavailable("cpu")`` is None when the library loads (else why not: no compiler, a
compile error, an ISA the CPU lacks), and ``install(dispatcher, "cpu")`` registers the kernels of
``kernels.py`` as provider "native".
"""

from dtorch.dispatch.registry import Dispatcher
from dtorch.kernels.native.loader import (
    ISA_FEATURES as ISA_FEATURES,
    ISAS as ISAS,
    NativeUnavailable as NativeUnavailable,
    available_isas as available_isas,
    bf16_panels as bf16_panels,
    float_gemm as float_gemm,
    isa as isa,
    load as load,
    row_counts as row_counts,
    row_split as row_split,
    set_isa as set_isa,
    unavailable_reason as unavailable_reason,
    use_float_gemm as use_float_gemm,
    use_isa as use_isa,
    use_row_split as use_row_split,
)
from dtorch.kernels.native.ops import (
    add_rms_norm as add_rms_norm,
    gelu_tanh_and_mul as gelu_tanh_and_mul,
    gemv as gemv,
    qlinear as qlinear,
    rms_norm as rms_norm,
    rope as rope,
    silu_and_mul as silu_and_mul,
)


def unavailable(device_type: str) -> str | None:
    """None when the native kernels serve ``device_type`` here, else the reason."""
    if device_type != "cpu":
        return f"the native kernels run on the cpu only, not {device_type}"
    return unavailable_reason()


def install(dispatcher: Dispatcher, device_type: str) -> None:
    """Register the kernels of ``kernels.py`` and ``products.py``, first checked against the ops that the op list
    (csrc/ops.def, entries.def) names: an op declared there without a native kernel, or a kernel no row declares, is a
    RegistrationError naming it."""
    from dtorch.kernels.native import oplist
    from dtorch.kernels.native.kernels import KERNELS

    oplist.check_registrations(KERNELS)
    KERNELS.install(dispatcher, device_type)
