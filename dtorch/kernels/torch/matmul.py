"""Matrix products ``matmul.mm``, ``matmul.bmm`` and ``matmul.linear``.

Reference kernels are a broadcast-multiply-sum (no BLAS), accumulated in float32 for half types and
in float64 for float64, computed in row blocks so the [rows, K, N] product stays small. BLAS kernels
(torch.mm / bmm / linear with ``out=``; mm and bmm also with their allocating forms for the functional
wrappers) are registered over them as provider "blas". On CPUs without native bf16 matrix units, bf16
``matmul.mm`` with many rows is registered as provider "upcast" above blas (see ``mm_upcast``).

inputs: mm (a [M, K], b [K, N]); bmm (a [B, M, K], b [B, K, N]); linear (x [..., K], w [N, K], bias [N] or None).
outputs: mm [M, N]; bmm [B, M, N]; linear [..., N].
"""

from __future__ import annotations

import functools
import math

import torch

from dtorch.core import cpu
from dtorch.dispatch.meta import Call
from dtorch.kernels.torch.registry import FLOATS, INTS, KERNELS

# Capture-safe (the default meta): no kernel here reads a value on the host; temporaries come from torch's
# caching allocator, which capture allows.
# torch has integer matmul on CPU only (CUDA's addmm/bmm have no int kernels), so ints are registered for cpu.
CPU_ONLY = ("cpu",)
_BLOCK_ELEMENTS = 1 << 22  # elements of one [rows, K, N] product block in the reference kernels


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def _reference_bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    # a: [B, M, K], b: [B, K, N], out: [B, M, N]; out[:, i, j] = sum_k a[:, i, k] * b[:, k, j]
    acc = _acc_dtype(a.dtype)
    a, b = a.to(acc), b.to(acc)
    m, k, n = a.shape[1], a.shape[2], b.shape[2]
    rows = max(1, _BLOCK_ELEMENTS // max(1, a.shape[0] * k * n))
    for i in range(0, m, rows):
        block = a[:, i:i + rows, :, None] * b[:, None, :, :]  # [B, rows, K, N]
        out[:, i:i + rows].copy_(block.sum(dim=2))


def _mm_functional(ctx, inputs):
    return (torch.mm(inputs[0], inputs[1]),)


def _bmm_functional(ctx, inputs):
    return (torch.bmm(inputs[0], inputs[1]),)


@KERNELS.kernel("matmul.mm", INTS, devices=CPU_ONLY)
@KERNELS.kernel("matmul.mm", FLOATS)
def mm_reference(ctx, inputs, outputs):
    a, b = inputs
    _reference_bmm(a[None], b[None], outputs[0][None])


@KERNELS.kernel("matmul.mm", INTS, devices=CPU_ONLY, provider="blas", functional=_mm_functional)
@KERNELS.kernel("matmul.mm", FLOATS, provider="blas", functional=_mm_functional)
def mm_blas(ctx, inputs, outputs):
    torch.mm(inputs[0], inputs[1], out=outputs[0])


# -- bf16 upcast ----------------------------------------------------------------------------------
# Without AVX512-BF16 or AMX, torch's bf16 mm on CPU runs ~4x slower per output element than float32 once
# a has more than a few rows, while a single row (decode) streams the half-size weight faster than float32
# does. Upcasting costs one pass over b (~1 ns per element with its allocation, measured on an AVX512
# CPU without bf16 units: [576, 1536] at 16 rows 540 -> 300 us, at 512 rows 14.5 -> 3.1 ms; a [576, 49152]
# head loses until ~64 rows). So: upcast from 16 rows, and only when the rows are at least b's
# elements / 2**19 (the weight pass must stay small beside the product).
UPCAST_MIN_ROWS = 16
UPCAST_ELEMENTS_PER_ROW = 1 << 19


def native_bf16_matmul() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX), which torch's bf16 mm uses.

    Forceable either way: ``DTORCH_CPU_FEATURES=-avx512_bf16,-amx_bf16`` or ``dtorch.core.cpu.forced(...)``.
    """
    return cpu.has("avx512_bf16") or cpu.has("amx_bf16")


def upcast_pays(rows: int, k: int, n: int) -> bool:
    """Whether a [rows, k] @ [k, n] bf16 product runs faster upcast to float32 (see the rule above)."""
    return rows >= UPCAST_MIN_ROWS and rows * UPCAST_ELEMENTS_PER_ROW >= k * n


def _upcast_check(call: Call) -> str | None:
    if native_bf16_matmul():
        return "this CPU has native bf16 matmul (AVX512-BF16 or AMX)"
    if call.inputs is not None:
        (m, k), n = call.inputs[0].shape, call.inputs[1].shape[-1]
        if not upcast_pays(m, k, n):
            return f"[{m}, {k}] @ [{k}, {n}]: too few rows for the upcast to pay (bf16 mm is faster)"
    return None


@KERNELS.kernel("matmul.mm", (torch.bfloat16,), devices=("cpu",), provider="upcast", priority=25,
                check=_upcast_check,
                varies=f"torch's bf16 mm below {UPCAST_MIN_ROWS} rows or when the weight pass would not pay")
def mm_upcast(ctx, inputs, outputs):
    # a [M, K] bf16, b [K, N] bf16 -> out [M, N] bf16: a product in float32, rounded once. A prepared
    # MatMul binds this kernel for every row count, so few rows take torch's bf16 mm here.
    a, b = inputs
    out = outputs[0]
    if b.dtype != a.dtype or out.dtype != a.dtype:  # the upcast would accept them silently; bf16 mm raises
        raise TypeError(f"mm_upcast: dtypes disagree: a {a.dtype}, b {b.dtype}, out {out.dtype}")
    if upcast_pays(a.shape[0], b.shape[0], b.shape[1]):
        out.copy_(torch.mm(a.float(), b.float()))
    else:
        torch.mm(a, b, out=out)


@KERNELS.kernel("matmul.bmm", INTS, devices=CPU_ONLY)
@KERNELS.kernel("matmul.bmm", FLOATS)
def bmm_reference(ctx, inputs, outputs):
    _reference_bmm(inputs[0], inputs[1], outputs[0])


@KERNELS.kernel("matmul.bmm", INTS, devices=CPU_ONLY, provider="blas", functional=_bmm_functional)
@KERNELS.kernel("matmul.bmm", FLOATS, provider="blas", functional=_bmm_functional)
def bmm_blas(ctx, inputs, outputs):
    torch.bmm(inputs[0], inputs[1], out=outputs[0])


@KERNELS.kernel("matmul.linear", INTS, devices=CPU_ONLY)
@KERNELS.kernel("matmul.linear", FLOATS)
def linear_reference(ctx, inputs, outputs):
    x, w, bias = inputs
    out = outputs[0]
    rows, k, n = math.prod(x.shape[:-1]), w.shape[1], w.shape[0]
    y = torch.empty((1, rows, n), dtype=_acc_dtype(x.dtype), device=x.device)
    _reference_bmm(x.reshape(1, rows, k), w.t()[None], y)  # y: [1, rows, N]
    if bias is not None:
        y += bias.to(y.dtype)
    out.copy_(y.reshape(out.shape))


def _linear_functional(ctx, inputs):
    # Prepared Linear.forward_out must give exactly the functional wrapper's results. For a 2-D x torch's
    # allocating linear and linear.out run the same kernel (addmm with a bias, mm without); other ranks may
    # round differently (bf16 [..., K] with a bias: one fused addmm against mm then add), so they allocate
    # and run the out= form.
    x, w, bias = inputs
    if x.dim() == 2:
        return (torch._C._nn.linear(x, w, bias),)
    out = x.new_empty((*x.shape[:-1], w.shape[0]))
    linear_blas(ctx, inputs, (out,))
    return (out,)


@KERNELS.kernel("matmul.linear", INTS, devices=CPU_ONLY, provider="blas", functional=_linear_functional)
@KERNELS.kernel("matmul.linear", FLOATS, provider="blas", functional=_linear_functional)
def linear_blas(ctx, inputs, outputs):
    x, out = inputs[0], outputs[0]
    if x.dim() == 1:  # torch's linear.out would resize a [N] out to [1, N]
        x, out = x[None], out[None]
    torch._C._nn.linear(x, inputs[1], inputs[2], out=out)


# -- oneDNN's float32 linear ------------------------------------------------------------------------------------
# torch's float32 linear runs MKL's GEMM, which on AMD CPUs takes a generic path: ~47 GMAC/s on one AVX-512 core
# (Zen 4) where oneDNN's own (torch's mkldnn::_linear_pointwise, the op inductor's CPU fusions call) runs ~101-110,
# and 1.4-1.8x faster for 1 to 16 rows too (a cold [3072, 1024] weight: 0.62 -> 0.44 ms for one row); two threads
# alike (97 -> 214 GMAC/s at 512 rows). Registered over blas as provider "onednn" where torch has the op.


@functools.cache
def onednn_linear_op():
    """torch's oneDNN linear (``torch.ops.mkldnn._linear_pointwise``), or None where torch is built without it."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


def onednn_linear(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 [M, K] @ w [N, K].T (+ bias) in oneDNN's GEMM: float32 CPU tensors, x2 contiguous, w contiguous or the
    transpose of a contiguous [K, N]; a new [M, N]."""
    return onednn_linear_op()(x2, w, bias, "none", [], "")


def _onednn_check(call: Call) -> str | None:
    if onednn_linear_op() is None:
        return "torch is built without oneDNN (torch.backends.mkldnn)"
    return None


# oneDNN reads mm's b [K, N] as the weight b.T [N, K] through its strides: from 2 rows that is as fast as torch's mm
# or up to ~4x faster, but for one row torch's BLAS gemv streams b [K, N] 1.4-2.3x faster (one thread, an AVX-512
# AMD core, alternating medians: [576, 49152] 18 against 39 ms cold, [896, 4864] 0.93 against 1.41 ms, [640, 2048]
# 0.09 against 0.20 ms; at 2 rows 0.6-1.2x). matmul.linear's [N, K] weights are oneDNN's own layout: level or faster
# at one row too. So mm goes to oneDNN from this many rows.
ONEDNN_MM_MIN_ROWS = 2


def onednn_mm_pays(rows: int) -> bool:
    """Whether oneDNN's GEMM beats torch's mm for ``rows`` rows against a [K, N] weight (``ONEDNN_MM_MIN_ROWS``)."""
    return rows >= ONEDNN_MM_MIN_ROWS


def _onednn_mm_check(call: Call) -> str | None:
    reason = _onednn_check(call)
    if reason is None and call.inputs is not None and call.inputs[0].dim() == 2 \
            and not onednn_mm_pays(call.inputs[0].shape[0]):
        return (f"{call.inputs[0].shape[0]} row(s): torch's BLAS gemv reads b [K, N] faster than oneDNN through b.T "
                f"(oneDNN from {ONEDNN_MM_MIN_ROWS} rows)")
    return reason


@KERNELS.kernel("matmul.mm", (torch.float32,), devices=CPU_ONLY, provider="onednn", check=_onednn_mm_check,
                varies=f"oneDNN's GEMM on contiguous float32 operands (b read as the weight b.T) from "
                       f"{ONEDNN_MM_MIN_ROWS} rows; else torch's mm")
def mm_onednn(ctx, inputs, outputs):
    # a [M, K] @ b [K, N]: oneDNN reads b.T [N, K] through its strides (a model's [K, N] weights); a prepared MatMul
    # that knew no shapes when it bound this kernel sends one row to torch's mm here (``onednn_mm_pays``)
    a, b = inputs
    out = outputs[0]
    if (a.dim() != 2 or b.dim() != 2 or a.dtype != b.dtype or not a.is_contiguous() or not b.is_contiguous()
            or a.numel() == 0 or b.numel() == 0 or not onednn_mm_pays(a.shape[0])):
        return mm_blas(ctx, inputs, outputs)
    out.copy_(onednn_linear(a, b.t(), None))


@KERNELS.kernel("matmul.linear", (torch.float32,), devices=CPU_ONLY, provider="onednn", check=_onednn_check,
                varies="oneDNN's GEMM on a contiguous float32 weight; other weights or x: torch's linear (blas)")
def linear_onednn(ctx, inputs, outputs):
    x, w, bias = inputs
    out = outputs[0]
    k = w.shape[-1]
    if (w.dim() != 2 or not w.is_contiguous() or w.dtype != x.dtype or not x.is_contiguous() or x.numel() == 0
            or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()))):
        return linear_blas(ctx, inputs, outputs)
    out.copy_(onednn_linear(x.reshape(-1, k), w, bias).view(out.shape))


def _linear_upcast_check(call: Call) -> str | None:
    if native_bf16_matmul():
        return "this CPU has native bf16 matmul (AVX512-BF16 or AMX)"
    if call.inputs is not None:
        x, w = call.inputs[0].shape, call.inputs[1].shape
        rows = math.prod(x[:-1])
        if not upcast_pays(rows, w[1], w[0]):
            return f"[{rows}, {w[1]}] @ [{w[0]}, {w[1]}].T: too few rows for the upcast to pay (bf16 linear is faster)"
    return None


@KERNELS.kernel("matmul.linear", (torch.bfloat16,), devices=("cpu",), provider="upcast", priority=25,
                check=_linear_upcast_check,
                varies=f"torch's bf16 linear below {UPCAST_MIN_ROWS} rows or when the weight pass would not pay")
def linear_upcast(ctx, inputs, outputs):
    # x [..., K] bf16, w [N, K] bf16, bias [N] or None -> out [..., N] bf16: ``mm_upcast`` for a weight stored as
    # the checkpoint has it (the same rule; a prepared Linear binds this kernel for every row count)
    x, w, bias = inputs
    out = outputs[0]
    if w.dtype != x.dtype or out.dtype != x.dtype:
        raise TypeError(f"linear_upcast: dtypes disagree: x {x.dtype}, w {w.dtype}, out {out.dtype}")
    if upcast_pays(math.prod(x.shape[:-1]), w.shape[1], w.shape[0]):
        out.copy_(torch._C._nn.linear(x.float(), w.float(), None if bias is None else bias.float()))
    else:
        linear_blas(ctx, inputs, outputs)
