"""The native kernels' Python API: thin calls into the compiled module, writing into ``out``.

Every tensor must be contiguous and on the CPU; activations float32 or bfloat16 (outputs take their dtype).
Shapes and dtypes are checked in C++ (cheaply) and raise dtorch's ShapeError, DTypeError, LayoutError or
ArgumentError. Work is split over output rows on torch's intra-op threads (``torch.set_num_threads``).
"""

from __future__ import annotations

import torch

from dtorch.kernels import layouts
from dtorch.kernels.native import loader


def _lib():
    mod = loader._mod
    return mod if mod is not None else loader.load()


def qlinear(x: torch.Tensor, packed: torch.Tensor, layout: str, bias: torch.Tensor | None = None,
            out: torch.Tensor | None = None, one_level: bool = False) -> torch.Tensor:
    """out [..., N] = x [..., K] @ dequantize(packed).T (+ bias [N]) for a weight packed uint8 [N, row_bytes]
    in ``layout`` (see dtorch/kernels/layouts.py); K comes from x. x float32 or bfloat16, out and bias alike.

    Under 32 rows of x (decode): x is quantized once per call to two int8 levels per 32 values, x = d (hi +
    lo / 254) with d = amax / 127 (about 16 bits), and the products are integer dot products scaled in float32.
    ``one_level`` (coarse rows: a prompt's, a batch of decodes) from 4 rows: the formats of super-groups (all
    but Q2_K and Q3_K) use the hi level alone (8 bits per block of 32, as llama.cpp's Q8_0 activations: half
    the integer work); with DTORCH_DECODE_ONE_LEVEL (``dtorch.core.env.decode_one_level``) every row does,
    a lone decode's too (1.2-1.35x faster one-row products on one thread). 32 rows and more (prefill): the weight
    is dequantized to float32 in panels and multiplied in a float GEMM (``float_gemm()``: oneDNN's where torch
    has it, else torch's mm; the products are exact), except
    on AVX-512 VNNI (``isa() == "avx512"``), where the super-grouped formats stay on the integer levels: one level
    (coarse rows) at every row count, two below 128 rows per thread, and for Q4_K, Q5_K, IQ4_XS and Q8_0 (whose tiles
    run at about oneDNN's speed) at every row count. Where AMX works (``bf16_panels()``, ``dtorch.core.cpu.use_amx``),
    coarse rows of 32 and more go through bfloat16 panels in oneDNN's GEMM (its AMX tiles) instead.
    The bias is added before the one rounding to out's dtype.
    """
    if out is None:
        out = x.new_empty(*x.shape[:-1], packed.shape[0])
    _lib().qlinear(x, packed, layouts.format_code(layout), bias, out, one_level)
    return out


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out [..., N] = x [..., K] @ w.T for a float32, bfloat16 or float16 weight w [N, K] (made for a few rows of x;
    x float32 or bfloat16)."""
    if out is None:
        out = x.new_empty(*x.shape[:-1], w.shape[0])
    _lib().gemv(x, w, out)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """out [..., D] = weight [D] * rms_norm(x [..., D]) rounded as LlamaRMSNorm; out may be x."""
    if out is None:
        out = torch.empty_like(x)
    _lib().rms_norm(x, None, None, weight, out, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None,
                 residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """h = residual + x (stored to residual_out, which may be residual); out = weight * rms_norm(h).

    Returns (out, residual_out); all [..., D] of one dtype, weight [D].
    """
    if out is None:
        out = torch.empty_like(x)
    if residual_out is None:
        residual_out = torch.empty_like(x)
    _lib().rms_norm(x, residual, residual_out, weight, out, eps)
    return out, residual_out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None,
         interleaved: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary embedding of x [..., T, H, D] with cos, sin float32 [T, R/2] or [B, T, R/2] (the call's positions).

    Half split (NeoX / Llama) pairs dim i with i + R/2, interleaved pairs 2i with 2i + 1; dims R.. pass
    through. Computed in float32 and rounded once; out may be x (in place).
    """
    if out is None:
        out = torch.empty_like(x)
    _lib().rope(x, cos, sin, out, rotary_dim or 2 * cos.shape[-1], interleaved)
    return out


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """out [..., I] = gelu_tanh(gate) * up; with up None, gate is the fused [..., 2I] (gate first, then up)."""
    if out is None:
        shape = gate.shape if up is not None else (*gate.shape[:-1], gate.shape[-1] // 2)
        out = gate.new_empty(shape)
    _lib().gelu_tanh_and_mul(gate, up, out)
    return out


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """out [..., I] = silu(gate) * up; with up None, gate is the fused [..., 2I] (gate first, then up)."""
    if out is None:
        shape = gate.shape if up is not None else (*gate.shape[:-1], gate.shape[-1] // 2)
        out = gate.new_empty(shape)
    _lib().silu_and_mul(gate, up, out)
    return out
