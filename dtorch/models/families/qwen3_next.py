"""Qwen3-Next: gated delta net layers among gated attention layers (``families.delta_net``), sparse MoE MLPs with a
shared expert (``families.moe``), and its input projections fused per key head in the checkpoint (``in_proj_qkvz``,
``in_proj_ba``), which llama.cpp's converter splits into ``attn_qkv`` [all q | all k | all v] and ``attn_gate``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dtorch.models.families import delta_net, moe
from dtorch.models.families.base import (
    TINY_EXPERTS,
    TINY_HYBRID,
    Family,
    GgufMeta,
    View,
    Weight,
    decoder,
    layer_source,
    transposed_rows,
)

if TYPE_CHECKING:
    from dtorch.models.config import ModelConfig
    from dtorch.models.layout import Layout

# transformers' Qwen3NextConfig defaults
_DEFAULTS = {"num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512, "norm_topk_prob": True}


def _hf_config(c: dict[str, Any], source: str) -> dict[str, Any]:
    return dict(**delta_net.hf_fields(c), **moe.hf_fields(c, _DEFAULTS),
                shared_expert_intermediate_size=c.get("shared_expert_intermediate_size", 512))


def _gguf_config(m: GgufMeta, common: dict[str, Any]) -> dict[str, Any]:
    return dict(**delta_net.gguf_fields(m, common), **moe.gguf_fields(m, common["num_layers"]),
                shared_expert_intermediate_size=m.need("expert_shared_feed_forward_length"))


def _lin_in(c: ModelConfig, layout: Layout, i: int) -> Weight:
    """in_proj_qkvz (per key head h: [q_h | k_h | v_h | z_h]) and in_proj_ba ([b_h | a_h]): each device whole key heads
    of both, reordered to [q | k | v | z] and [b | a] before the join."""
    dk, dv, gl, E = c.linear_key_head_dim, c.linear_value_head_dim, layout.linear_group, c.hidden_size
    a = "linear_attn."
    return Weight(f"layers.{i}.lin_in", (
        layer_source(i, a + "in_proj_qkvz.weight", ("attn_qkv.weight", "attn_gate.weight"),
                     (2 * c.linear_key_dim + 2 * c.linear_value_dim, E), 0, 2 * dk + 2 * gl * dv),
        layer_source(i, a + "in_proj_ba.weight", "ssm_ba.weight", (2 * c.linear_num_value_heads, E), 0, 2 * gl)),
        transposed_rows(*_qkvz_ba_rows(dk, dv, gl)), delta_net.lin_in_shape(c))


def _qkvz_ba_rows(dk: int, dv: int, group: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
    """in_proj_qkvz rows [q_h | k_h | v_h | z_h] and in_proj_ba rows [b_h | a_h] per key head h (its ``group`` value
    heads each) -> [q | k | v | z] and [b | a], each part in head order (two row functions)."""
    def qkvz_rows(qkvz: torch.Tensor) -> torch.Tensor:
        parts = qkvz.reshape(-1, 2 * dk + 2 * group * dv, qkvz.shape[-1]).split((dk, dk, group * dv, group * dv), 1)
        return torch.cat([x.flatten(0, 1) for x in parts], 0)

    def ba_rows(ba: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.flatten(0, 1) for x in ba.reshape(-1, 2 * group, ba.shape[-1]).split((group, group), 1)])

    return qkvz_rows, ba_rows


def _gguf_views(views: dict[str, View], c: ModelConfig, path: Path) -> None:
    """Besides what every hybrid undoes: in_proj_qkvz is stored as attn_qkv [all q | all k | all v] then attn_gate
    [all z] (the view's parts): interleave their rows back per key head."""
    delta_net.gguf_views(views, c, path)
    nk, dk, kd, vd = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_key_dim, c.linear_value_dim
    r = c.linear_num_value_heads // nk
    dv = r * c.linear_value_head_dim  # one key head's value rows
    rows = torch.cat([torch.cat([g * dk + torch.arange(dk), kd + g * dk + torch.arange(dk),
                                 2 * kd + g * dv + torch.arange(dv), 2 * kd + vd + g * dv + torch.arange(dv)])
                      for g in range(nk)])
    for i in c.linear_layers:
        delta_net.change(views, f"model.layers.{i}.linear_attn.in_proj_qkvz.weight", rows=rows)


FAMILY = Family(
    name="qwen3_next", hf_types=("qwen3_next",), gguf_arch="qwen3next", fields=delta_net.FIELDS, moe=True,
    layer_types=delta_net.LAYER_TYPES, unused=delta_net.UNUSED, hf_inert=delta_net.HF_INERT,
    hf_keys=delta_net.HF_KEYS | moe.HF_KEYS | {"shared_expert_intermediate_size": "shared_expert_intermediate_size"},
    gguf_keys=delta_net.GGUF_KEYS | moe.GGUF_KEYS
    | {"shared_expert_intermediate_size": "expert_shared_feed_forward_length"},
    hf_config=_hf_config, gguf_config=_gguf_config,
    tensors=decoder(delta_net.hybrid_layer(_lin_in, moe.sparse_mlp)), gguf_views=_gguf_views,
    tiny={"qwen3_next": ("Qwen3NextConfig", dict(TINY_HYBRID, **TINY_EXPERTS, shared_expert_intermediate_size=48,
                                                 norm_topk_prob=True))},
)
