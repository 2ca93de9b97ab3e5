"""Triton row kernels: ``llm.rms_norm``, ``llm.add_rms_norm``, ``llm.rope`` (the table form ``rope_cached``
runs), ``llm.silu_and_mul`` and ``llm.gelu_tanh_and_mul``, with the semantics and rounding of the torch backend's
reference kernels.

Each program handles one row of the last dim and computes in float32 (rounding where the reference rounds), so
an output may alias its input. Tensors are seen as rows ``[M, D]`` or ``[M, H, D]`` with any row strides (q/k
heads and gate/up halves of fused projections are strided views) and a unit stride on the last dim; a layout
that cannot be viewed so, or the positions form of rope, goes to the torch kernel. Launches read no device
value and allocate nothing, so every kernel here is capture-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dtorch.kernels.torch import llm as torch_llm
from dtorch.kernels.triton.registry import FLOATS, KERNELS, TRITON

_SILU_BLOCK = 1024  # columns per program of silu_and_mul (the intermediate size can be 10^4+)


def _rows3(t: torch.Tensor) -> torch.Tensor | None:
    """t [..., H, D] as a view [M, H, D] with a unit last stride (t [D] is [1, 1, D]), or None."""
    if t.dim() < 2:
        t = t.view(1, 1, -1)
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        return None
    try:
        return t.view(-1, t.shape[-2], t.shape[-1])
    except RuntimeError:  # leading dims that no single stride spans
        return None


def _rows2(t: torch.Tensor) -> torch.Tensor | None:
    """t [..., D] as a view [M, D] with a unit last stride, or None."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


# -- rms_norm / add_rms_norm ---------------------------------------------------------------------
# inputs: x [..., D], (residual [..., D],) weight [D]; outputs: out [..., D] (may alias x), (residual_out
# [..., D], may alias residual); params: eps. residual_out = residual + x rounded to x's dtype; out = weight *
# (r * rsqrt(mean(r^2) + eps)) with the normalized row rounded to x's dtype before the weight, as LlamaRMSNorm.

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, res_out_ptr, w_ptr, out_ptr, H, D, eps,
                     sx_m, sx_h, sr_m, sr_h, sro_m, sro_h, so_m, so_h,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    m, h = row // H, row % H
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + m * sx_m + h * sx_h + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + m * sr_m + h * sr_h + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + m * sro_m + h * sro_h + cols, x, mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + m * so_m + h * so_h + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm_launch(x, residual, residual_out, weight, out, eps: float) -> bool:
    """Launch the row kernel; False when a layout does not fit it (the caller then runs the torch kernel)."""
    views = [_rows3(t) for t in (x, out, *((residual, residual_out) if residual is not None else ()))]
    if any(v is None for v in views) or weight.dim() != 1 or weight.stride(0) != 1:
        return False
    xv, ov = views[0], views[1]
    rv, rov = (views[2], views[3]) if residual is not None else (xv, xv)  # unused without a residual
    if ov.shape != xv.shape or rov.shape != xv.shape or rv.shape != xv.shape:
        return False
    M, H, D = xv.shape
    if M * H and D:
        _rms_norm_kernel[(M * H,)](xv, rv, rov, weight, ov, H, D, eps,
                                   xv.stride(0), xv.stride(1), rv.stride(0), rv.stride(1),
                                   rov.stride(0), rov.stride(1), ov.stride(0), ov.stride(1),
                                   HAS_RESIDUAL=residual is not None, BLOCK_D=triton.next_power_of_2(D))
    return True


@KERNELS.kernel("llm.rms_norm", FLOATS, meta=torch_llm.INPLACE, **TRITON)
def rms_norm(ctx, inputs, outputs):
    x, weight = inputs
    if not _rms_norm_launch(x, None, None, weight, outputs[0], ctx.params.eps):
        torch_llm.rms_norm_reference(ctx, inputs, outputs)


@KERNELS.kernel("llm.add_rms_norm", FLOATS, meta=torch_llm.INPLACE, **TRITON)
def add_rms_norm(ctx, inputs, outputs):
    x, residual, weight = inputs
    if not _rms_norm_launch(x, residual, outputs[1], weight, outputs[0], ctx.params.eps):
        torch_llm.add_rms_norm_reference(ctx, inputs, outputs)


# -- rope (table form) ---------------------------------------------------------------------------
# inputs: x [..., T, H, D], cos, sin float32 [..., T, R/2]; outputs: out like x (may alias x); params:
# rotary_dim R, interleaved. Half rotation pairs dim i with i + R/2, interleaved pairs 2i with 2i+1; dims R..
# pass through (copied when out is not x). The positions form (x, positions) goes to the torch kernel.

@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, D, HALF,
                 sx_m, sx_h, sc_m, ss_m, so_m, so_h,
                 INTERLEAVED: tl.constexpr, COPY_REST: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    m, h = row // H, row % H
    x_row = x_ptr + m * sx_m + h * sx_h
    o_row = out_ptr + m * so_m + h * so_h
    i = tl.arange(0, BLOCK_HALF)
    mask = i < HALF
    if INTERLEAVED:
        first, second = 2 * i, 2 * i + 1
    else:
        first, second = i, i + HALF
    c = tl.load(cos_ptr + m * sc_m + i, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + m * ss_m + i, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(x_row + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + second, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_row + first, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + second, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)
    if COPY_REST:
        cols = 2 * HALF + tl.arange(0, BLOCK_D)
        rest = cols < D
        tl.store(o_row + cols, tl.load(x_row + cols, mask=rest), mask=rest)


def _rope_launch(x, cos, sin, out, rotary_dim: int, interleaved: bool) -> bool:
    """Launch the rope kernel; False when a layout does not fit it (the caller then runs the torch kernel)."""
    half = rotary_dim // 2
    if x.dim() < 3 or tuple(cos.shape) != (*x.shape[:-2], half) or cos.shape != sin.shape:
        return False
    xv, ov = _rows3(x), _rows3(out)
    cv, sv = _rows2(cos), _rows2(sin)
    if xv is None or ov is None or cv is None or sv is None or ov.shape != xv.shape:
        return False
    M, H, D = xv.shape
    if M * H and D:
        copy_rest = rotary_dim < D and out.data_ptr() != x.data_ptr()
        _rope_kernel[(M * H,)](xv, cv, sv, ov, H, D, half,
                               xv.stride(0), xv.stride(1), cv.stride(0), sv.stride(0), ov.stride(0), ov.stride(1),
                               INTERLEAVED=bool(interleaved), COPY_REST=copy_rest,
                               BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
                               BLOCK_D=triton.next_power_of_2(max(D - rotary_dim, 1)))
    return True


@KERNELS.kernel("llm.rope", FLOATS, meta=torch_llm.INPLACE, **TRITON)
def rope(ctx, inputs, outputs):
    p = ctx.params
    if len(inputs) != 3 or not _rope_launch(*inputs, outputs[0], p.rotary_dim, p.interleaved):
        torch_llm.rope_reference(ctx, inputs, outputs)


# -- silu_and_mul, gelu_tanh_and_mul ---------------------------------------------------------------
# inputs: gate [..., I], up [..., I] (row-strided views allowed), or x [..., 2I], None (the fused form);
# outputs: out [..., I] = act(gate) * up; act rounded to the input dtype before the product, as F.silu / F.gelu.

@triton.jit
def _glu_kernel(gate_ptr, up_ptr, out_ptr, N, sg_m, su_m, so_m, GELU: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(gate_ptr + m * sg_m + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + m * su_m + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # 0.5 x (1 + tanh(t / 2)) = x / (1 + exp(-t)), t = 2 sqrt(2/pi) (x + 0.044715 x^3)
        t = 1.5957691216057308 * (g + 0.044715 * g * g * g)
    else:  # silu: x / (1 + exp(-x))
        t = g
    act = (g / (1.0 + tl.exp(-t))).to(gate_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + m * so_m + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def _glu(gelu: bool, reference, ctx, inputs, outputs) -> None:
    """A gated activation's launch (``gelu``: GeGLU, else SiLU): one program per row and block of columns; layouts it
    cannot view as rows go to the torch ``reference``."""
    gate, up = inputs
    if up is None:  # the fused x [..., 2I]: its two halves
        gate, up = gate.chunk(2, dim=-1)
    gv, uv, ov = _rows2(gate), _rows2(up), _rows2(outputs[0])
    if gv is None or uv is None or ov is None or not gv.shape == uv.shape == ov.shape:
        reference(ctx, inputs, outputs)
        return
    M, N = gv.shape
    if M and N:
        grid = (M, triton.cdiv(N, _SILU_BLOCK))
        _glu_kernel[grid](gv, uv, ov, N, gv.stride(0), uv.stride(0), ov.stride(0), GELU=gelu,
                          BLOCK=min(_SILU_BLOCK, triton.next_power_of_2(N)))


@KERNELS.kernel("llm.silu_and_mul", FLOATS, **TRITON)
def silu_and_mul(ctx, inputs, outputs):
    _glu(False, torch_llm.silu_and_mul_reference, ctx, inputs, outputs)


@KERNELS.kernel("llm.gelu_tanh_and_mul", FLOATS, **TRITON)
def gelu_tanh_and_mul(ctx, inputs, outputs):
    _glu(True, torch_llm.gelu_tanh_and_mul_reference, ctx, inputs, outputs)
