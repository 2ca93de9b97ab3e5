"""GGUF files of the hybrid Qwen architectures (``qwen3next``, ``qwen35``): their config fields from the metadata, and
how each Hugging Face tensor is rebuilt from the tensors llama.cpp's converter wrote (``View``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dtorch.core.errors import ModelError
from dtorch.models.config import ModelConfig


def hybrid_fields(need: Callable[[str], Any], layers: int, head_dim: int, arch: str, path: Path) -> dict[str, Any]:
    """The hybrid fields of a qwen3next / qwen35 file. The converter writes the gated delta net's shapes as SSM keys:
    ``ssm.conv_kernel`` (conv taps), ``ssm.state_size`` (key head dim), ``ssm.group_count`` (key heads),
    ``ssm.time_step_rank`` (value heads), ``ssm.inner_size`` (value heads * value head dim); the layer schedule as
    ``full_attention_interval`` (layer i is full attention when (i + 1) % interval == 0, as llama.cpp reads it);
    the partial rotary as ``rope.dimension_count`` (rotated dims of each head)."""
    def positive(key: str) -> int:
        v = need(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ModelError(f"{path}: metadata key {arch}.{key} is {v!r}; expected a positive integer")
        return v

    interval, v_heads, inner = positive("full_attention_interval"), positive("ssm.time_step_rank"), \
        positive("ssm.inner_size")
    if inner % v_heads:
        raise ModelError(f"{path}: metadata key {arch}.ssm.inner_size ({inner}) is not a multiple of "
                         f"{arch}.ssm.time_step_rank ({v_heads}, the value heads); expected heads * head dim")
    rope_dim = positive("rope.dimension_count")
    if rope_dim > head_dim or rope_dim % 2:
        raise ModelError(f"{path}: metadata key {arch}.rope.dimension_count is {rope_dim}; expected an even number "
                         f"of rotated dims <= the head dim {head_dim}")
    return dict(layer_types=tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                  for i in range(layers)),
                linear_conv_kernel_dim=positive("ssm.conv_kernel"), linear_num_key_heads=positive("ssm.group_count"),
                linear_num_value_heads=v_heads, linear_key_head_dim=positive("ssm.state_size"),
                linear_value_head_dim=inner // v_heads, partial_rotary_factor=rope_dim / head_dim,
                attn_output_gate=True, norm_plus_one=True)


@dataclass(frozen=True, slots=True)
class View:
    """A Hugging Face tensor made of GGUF tensors: the rows of ``parts`` concatenated (a 1-D tensor's rows are its
    items), row i of the result taken from row ``rows[i]`` (None: in order), column j of a 2-D one from column
    ``cols[j]``, then ``value`` applied (undoing an elementwise change) and reshaped to ``shape``."""

    parts: tuple[Any, ...]
    shape: tuple[int, ...]
    rows: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    value: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def plain(self) -> bool:
        """Whether the tensor is one GGUF tensor as stored."""
        return len(self.parts) == 1 and self.rows is None and self.cols is None and self.value is None and \
            self.shape == gguf_shape(self.parts[0])


def gguf_shape(t: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in reversed(t.shape))  # GGUF lists dims fastest first


def _v_head_rows(k_heads: int, v_heads: int, dim: int) -> torch.Tensor:
    """Where Qwen3.5's converter put each row of ``v_heads`` value heads of ``dim`` rows: transformers groups them by
    key head (head g * r + j, r = v_heads / k_heads), the GGUF tiles them (at j * k_heads + g) so that llama.cpp can
    broadcast the key heads; [v_heads * dim] stored row of each transformers row."""
    r = v_heads // k_heads
    h = torch.arange(v_heads)
    return ((h % r * k_heads + h // r)[:, None] * dim + torch.arange(dim)).reshape(-1)


def hybrid_views(views: dict[str, View], config: ModelConfig, path: Path) -> None:
    """Undo what ``convert_hf_to_gguf.py`` changes in the hybrids' tensors (in place on ``views``):

    - the (1 + weight) RMS norms (all but the gated ``linear_attn.norm``) are stored with 1 added: subtract it;
    - ``A_log`` is stored as A = -exp(A_log) (``ssm_a``): take log(-A); ``conv1d`` [C, 1, W] is stored squeezed;
    - qwen3next: ``in_proj_qkvz`` (per key head g: q_g, k_g, v_g, z_g) is stored as ``attn_qkv`` [all q | all k |
      all v] and ``attn_gate`` [all z]: interleave them back; ``in_proj_ba`` is stored as it is (``ssm_ba``);
    - qwen35: the value heads of in_proj_qkv's v rows, in_proj_z, in_proj_b / a, A_log, dt_bias, conv1d's v
      channels and out_proj's columns are tiled (``_v_head_rows``): put them back in grouped order.
    """
    c = config
    nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    kd, vd = c.linear_key_dim, c.linear_value_dim
    qwen35 = c.family == "qwen3_5_text"
    v_rows = _v_head_rows(nk, nv, dv) if qwen35 else torch.arange(vd)
    h_rows = _v_head_rows(nk, nv, 1) if qwen35 else None  # one row per value head
    qkv_rows = torch.cat([torch.arange(2 * kd), 2 * kd + v_rows])  # in_proj_qkv and the conv channels

    def change(name: str, **kw: Any) -> None:
        if name in views:
            old = views[name]
            views[name] = View(old.parts, kw.pop("shape", old.shape), **kw)

    for name in [n for n in views if n.endswith("norm.weight") and ".linear_attn." not in n]:
        change(name, value=lambda w: w - 1)
    for i in c.linear_layers:
        p = f"model.layers.{i}.linear_attn."
        change(p + "A_log", rows=h_rows, value=lambda a: torch.log(-a))
        conv = views.get(p + "conv1d.weight")
        if conv is not None:
            change(p + "conv1d.weight", shape=(conv.shape[0], 1, conv.shape[-1]), rows=qkv_rows if qwen35 else None)
        if qwen35:
            change(p + "in_proj_qkv.weight", rows=qkv_rows)
            change(p + "in_proj_z.weight", rows=v_rows)
            for n in ("in_proj_b.weight", "in_proj_a.weight", "dt_bias"):
                change(p + n, rows=h_rows)
            change(p + "out_proj.weight", cols=v_rows)
        elif p + "in_proj_qkv.weight" in views or p + "in_proj_z.weight" in views:
            if p + "in_proj_qkv.weight" not in views or p + "in_proj_z.weight" not in views:
                raise ModelError(f"{path}: layer {i} has only one of blk.{i}.attn_qkv.weight and "
                                 f"blk.{i}.attn_gate.weight; a qwen3next file needs both (they make in_proj_qkvz)")
            qkv, z = views.pop(p + "in_proj_qkv.weight"), views.pop(p + "in_proj_z.weight")
            r = nv // nk
            rows = torch.cat([torch.cat([g * dk + torch.arange(dk), kd + g * dk + torch.arange(dk),
                                         2 * kd + g * r * dv + torch.arange(r * dv),
                                         2 * kd + vd + g * r * dv + torch.arange(r * dv)]) for g in range(nk)])
            views[p + "in_proj_qkvz.weight"] = View(qkv.parts + z.parts, (2 * kd + 2 * vd, qkv.shape[1]), rows=rows)
