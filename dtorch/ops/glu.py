"""Gated activations of an MLP: ``silu_and_mul`` (SwiGLU) and ``gelu_tanh_and_mul`` (GeGLU), their ``*_out`` forms
and prepared operators, and how they run in a graph.

x [..., 2I] = [gate | up] -> act(gate) * up [..., I]; or two inputs, gate and up [..., I] each.
"""

from __future__ import annotations

import torch

from dtorch.core.device import Device
from dtorch.core.errors import ShapeError
from dtorch.core.placement import Shard
from dtorch.dispatch.context import NO_PARAMS, KernelParams
from dtorch.ops import _checks
from dtorch.ops._checks import STRIDED
from dtorch.ops._invoke import run
from dtorch.ops.context import RuntimeContext
from dtorch.ops.graph_op import R, Shapes, Strategy, declare, elementwise
from dtorch.ops.llm import _alike, _check_float, _device, _PreparedLLM, _run


def _split_gate_up(x: torch.Tensor, up: torch.Tensor | None, ctx: RuntimeContext | None,
                   op: str = "llm.silu_and_mul") -> tuple[Device, torch.Tensor, torch.Tensor]:
    device = _check_float(op, x, ctx)
    if up is None:
        if x.shape[-1] % 2:
            raise ShapeError(f"{op}: 'x' [..., 2I] must have an even last dim, got shape {tuple(x.shape)}")
        half = x.shape[-1] // 2
        return device, x[..., :half], x[..., half:]
    _device(op, {"x": x, "up": up}, ctx)
    _checks.same_dtype(op, {"x": x, "up": up})
    if up.shape != x.shape:
        raise ShapeError(f"{op}: 'up' must have the shape of 'x' (the gate) {tuple(x.shape)}, got {tuple(up.shape)}")
    return device, x, up


def silu_and_mul(x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU activation: x [..., 2I] -> silu(x[..., :I]) * x[..., I:] [..., I].

    Two-input form: ``silu_and_mul(gate, up)`` with gate and up both [..., I] -> silu(gate) * up.
    """
    device, gate, up = _split_gate_up(x, up, None)
    out = torch.empty(gate.shape, dtype=x.dtype, device=x.device)
    run("llm.silu_and_mul", device, x.dtype, (gate, up), (out,))
    return out


def silu_and_mul_out(x: torch.Tensor, up: torch.Tensor | None = None, *, out: torch.Tensor,
                     ctx: RuntimeContext | None = None) -> torch.Tensor:
    """``silu_and_mul`` into ``out`` [..., I]."""
    device, gate, up = _split_gate_up(x, up, ctx)
    _checks.out("llm.silu_and_mul", out, gate.shape, x.dtype, x.device)
    _run("llm.silu_and_mul", device, x.dtype, (gate, up), (out,), NO_PARAMS, ctx)
    return out


GELU_TANH = "llm.gelu_tanh_and_mul"


def gelu_tanh_and_mul(x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """GeGLU activation (Gemma's MLP): x [..., 2I] -> gelu_tanh(x[..., :I]) * x[..., I:] [..., I], where gelu_tanh is
    GELU with the tanh approximation (``F.gelu(approximate="tanh")``), rounded to x's dtype before the product.

    Two-input form: ``gelu_tanh_and_mul(gate, up)`` with gate and up both [..., I].
    """
    device, gate, up = _split_gate_up(x, up, None, GELU_TANH)
    out = torch.empty(gate.shape, dtype=x.dtype, device=x.device)
    run(GELU_TANH, device, x.dtype, (gate, up), (out,))
    return out


def gelu_tanh_and_mul_out(x: torch.Tensor, up: torch.Tensor | None = None, *, out: torch.Tensor,
                          ctx: RuntimeContext | None = None) -> torch.Tensor:
    """``gelu_tanh_and_mul`` into ``out`` [..., I]."""
    device, gate, up = _split_gate_up(x, up, ctx, GELU_TANH)
    _checks.out(GELU_TANH, out, gate.shape, x.dtype, x.device)
    _run(GELU_TANH, device, x.dtype, (gate, up), (out,), NO_PARAMS, ctx)
    return out


class SiluAndMul(_PreparedLLM):
    """Prepared ``llm.silu_and_mul``: ``forward(x)`` with x [..., 2I], or ``forward(gate, up)``."""

    op = "llm.silu_and_mul"

    def _validate(self, x: torch.Tensor, up: torch.Tensor | None, out: torch.Tensor,
                  ctx: RuntimeContext | None) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_like("x", x)
        _, gate, up = _split_gate_up(x, up, ctx, self.op)
        _checks.out(self.op, out, gate.shape, x.dtype, x.device)
        return gate, up

    def forward_out(self, x: torch.Tensor, up: torch.Tensor | None = None, *, out: torch.Tensor,
                    ctx: RuntimeContext | None = None) -> torch.Tensor:
        """x [..., 2I] (or gate and up [..., I]) -> out [..., I]."""
        dt, dev = self._dtype, self._device
        if (up is None and type(x) is torch.Tensor and x.dim() and x.dtype is dt and x.layout is STRIDED
                and x.device == dev and not x.shape[-1] % 2
                and _alike(dt, dev, (*x.shape[:-1], x.shape[-1] // 2), (out,))):
            half = out.shape[-1]
            pair = x[..., :half], x[..., half:]
        else:
            pair = self._validate(x, up, out, ctx)
        self._kernel(pair, (out,), ctx, lambda: self._validate(x, up, out, ctx))
        return out

    def forward(self, x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        self._check_like("x", x)
        _, gate, _ = _split_gate_up(x, up, None, self.op)
        return self.forward_out(x, up, out=torch.empty(gate.shape, dtype=x.dtype, device=x.device))


class GeluTanhAndMul(SiluAndMul):
    """Prepared ``llm.gelu_tanh_and_mul`` (GeGLU): ``forward(x)`` with x [..., 2I], or ``forward(gate, up)``."""

    op = GELU_TANH


# -- in a graph: silu_and_mul(x) with the fused x, or silu_and_mul(gate, up); the kernel splits the fused x itself --

def _rule(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    x, up = shapes
    nd = len(x)
    if up is not None:  # gate [..., I], up [..., I]: elementwise, the feature dim included
        return elementwise(nd, partial_ok=False, k=2)
    # fused x [..., 2I] = [gate | up]: a plain split of the last dim would pair gate with gate; the blocked
    # split S(last)[I, I] gives each device [gate_r | up_r], its own features of both halves
    half = x[-1] // 2
    out = [Strategy((Shard(d), None), Shard(d)) for d in range(nd - 1)]
    return [Strategy((R, None), R)] + out + [Strategy((Shard(nd - 1, (half, half)), None), Shard(nd - 1))]


declare("llm.silu_and_mul", silu_and_mul, ("x", "up"), rule=_rule)
declare(GELU_TANH, gelu_tanh_and_mul, ("x", "up"), rule=_rule)

__all__ = ["GeluTanhAndMul", "SiluAndMul", "gelu_tanh_and_mul", "gelu_tanh_and_mul_out", "silu_and_mul",
           "silu_and_mul_out"]
