"""The pieces of a decoder layer, each a set of prepared operators bound once at load.

Projection weights are stored transposed and contiguous (``Wt [in, out]``), with q/k/v fused into
one ``[hidden, (H + 2 Hkv) D]`` matrix and gate/up into one ``[hidden, 2 I]``: a decode row then
streams each weight once, front to back, which is the layout CPU BLAS reads fastest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtorch.core.errors import ModelError
from dtorch.core.memory import MemoryKind, adopt
from dtorch.ops import (
    AddRMSNorm,
    Embedding,
    MatMul,
    OperatorInitContext,
    RMSNorm,
    RoPE,
    SiluAndMul,
    add_out as _add_out,
)


def persistent(t: torch.Tensor) -> torch.Tensor:
    """Count a weight this module made (a transposed or fused copy) as PERSISTENT memory."""
    return adopt(t, MemoryKind.PERSISTENT)


class Projection:
    """``out = x @ Wt (+ bias)``. x: [T, in] -> out: [T, out]; Wt: [in, out] contiguous."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None,
                 init: OperatorInitContext) -> None:
        # weights: HF layout [out_i, in]; fused along out, stored transposed
        w = weights[0] if len(weights) == 1 else torch.cat(weights, dim=0)
        self.wt = persistent(w.t().contiguous())
        self.bias = None if biases is None else persistent(torch.cat(biases).contiguous())
        self.in_features, self.out_features = self.wt.shape
        self.mm = MatMul().prepare(init)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self.mm.forward_out(x, self.wt, out=out)
        if self.bias is not None:
            _add_out(out, self.bias, out=out)
        return out


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer's tensors in HF layout ([out, in] projections)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


class DecoderLayer:
    """Weights and prepared projections of one layer; the model drives the shared norm/rope/attention ops."""

    def __init__(self, w: LayerWeights, init: OperatorInitContext) -> None:
        self.input_norm = w.input_norm
        self.post_norm = w.post_norm
        biases = None if w.q_bias is None else [w.q_bias, w.k_bias, w.v_bias]
        self.qkv = Projection([w.q, w.k, w.v], biases, init)
        self.o = Projection([w.o], None, init)
        self.gate_up = Projection([w.gate, w.up], None, init)
        self.down = Projection([w.down], None, init)
        self.q_norm = w.q_norm
        self.k_norm = w.k_norm


class SharedOps:
    """The prepared operators every layer runs with its own weights: bound once for the whole model."""

    def __init__(self, eps: float, head_dim: int, max_positions: int, inv_freq: torch.Tensor,
                 init: OperatorInitContext) -> None:
        self.embed = Embedding().prepare(init)
        self.norm = RMSNorm(eps).prepare(init)
        self.add_norm = AddRMSNorm(eps).prepare(init)
        self.rope = RoPE(head_dim, max_positions=max_positions, inv_freq=inv_freq).prepare(init)
        self.silu_mul = SiluAndMul().prepare(init)


def check_shape(name: str, t: torch.Tensor | None, shape: tuple[int, ...], source: str) -> torch.Tensor:
    """The checkpoint tensor ``name`` exists and has ``shape``; returns it."""
    if t is None:
        raise ModelError(f"{source}: tensor {name!r} is missing (expected shape {shape})")
    if tuple(t.shape) != shape:
        raise ModelError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
    return t
