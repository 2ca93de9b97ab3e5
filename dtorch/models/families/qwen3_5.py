"""Qwen3.5's text model: gated delta net layers among gated attention layers (``families.delta_net``), dense MLPs, its
input projections kept apart in the checkpoint (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dtorch.models.families import delta_net
from dtorch.models.families.base import TINY_HYBRID, Family, GgufMeta, View, Weight, cat_t, decoder, layer_source, mlp

if TYPE_CHECKING:
    from dtorch.models.config import ModelConfig
    from dtorch.models.layout import Layout


def _lin_in(c: ModelConfig, layout: Layout, i: int) -> Weight:
    """[q | k | v] from in_proj_qkv (split by whole key heads), z, b and a: each device its key heads' share."""
    E, kd, vd, hv, gl = c.hidden_size, c.linear_key_dim, c.linear_value_dim, c.linear_num_value_heads, \
        layout.linear_group
    a = "linear_attn."
    return Weight(f"layers.{i}.lin_in", (
        layer_source(i, a + "in_proj_qkv.weight", "attn_qkv.weight", (2 * kd + vd, E), 0,
                     delta_net.conv_blocks(c, layout)),
        layer_source(i, a + "in_proj_z.weight", "attn_gate.weight", (vd, E), 0, gl * c.linear_value_head_dim),
        layer_source(i, a + "in_proj_b.weight", "ssm_beta.weight", (hv, E), 0, gl),
        layer_source(i, a + "in_proj_a.weight", "ssm_alpha.weight", (hv, E), 0, gl)), cat_t, delta_net.lin_in_shape(c))


def _dense(c: ModelConfig, layout: Layout, i: int) -> Iterator[Weight]:
    yield from mlp(c, i)


def _v_head_rows(k_heads: int, v_heads: int, dim: int) -> torch.Tensor:
    """Where the converter put each row of ``v_heads`` value heads of ``dim`` rows: transformers groups them by key
    head (head g * r + j, r = v_heads / k_heads), the GGUF tiles them (at j * k_heads + g) so that llama.cpp can
    broadcast the key heads; [v_heads * dim] stored row of each transformers row."""
    r = v_heads // k_heads
    h = torch.arange(v_heads)
    return ((h % r * k_heads + h // r)[:, None] * dim + torch.arange(dim)).reshape(-1)


def _gguf_views(views: dict[str, View], c: ModelConfig, path: Path) -> None:
    """Besides what every hybrid undoes: the value heads of in_proj_qkv's v rows, in_proj_z, in_proj_b / a, A_log,
    dt_bias, conv1d's v channels and out_proj's columns are tiled (``_v_head_rows``): put them back in grouped order."""
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    v_rows, h_rows = _v_head_rows(nk, nv, c.linear_value_head_dim), _v_head_rows(nk, nv, 1)
    qkv_rows = torch.cat([torch.arange(2 * c.linear_key_dim), 2 * c.linear_key_dim + v_rows])
    delta_net.gguf_views(views, c, path, h_rows, qkv_rows)
    for i in c.linear_layers:
        p = f"model.layers.{i}.linear_attn."
        delta_net.change(views, p + "in_proj_qkv.weight", rows=qkv_rows)
        delta_net.change(views, p + "in_proj_z.weight", rows=v_rows)
        for n in ("in_proj_b.weight", "in_proj_a.weight", "dt_bias"):
            delta_net.change(views, p + n, rows=h_rows)
        delta_net.change(views, p + "out_proj.weight", cols=v_rows)


def _gguf_config(m: GgufMeta, common: dict[str, Any]) -> dict[str, Any]:
    return delta_net.gguf_fields(m, common)


def _hf_config(c: dict[str, Any], source: str) -> dict[str, Any]:
    return delta_net.hf_fields(c)


FAMILY = Family(
    name="qwen3_5_text", hf_types=("qwen3_5_text",), gguf_arch="qwen35", fields=delta_net.FIELDS,
    layer_types=delta_net.LAYER_TYPES, unused=delta_net.UNUSED, hf_inert=delta_net.HF_INERT, hf_keys=delta_net.HF_KEYS,
    gguf_keys=delta_net.GGUF_KEYS, hf_config=_hf_config, gguf_config=_gguf_config,
    tensors=decoder(delta_net.hybrid_layer(_lin_in, _dense)), gguf_views=_gguf_views,
    # linear and full attention layers alternating; 2 key and 4 value heads of 16 in the linear ones
    tiny={"qwen3_5_text": ("Qwen3_5TextConfig", dict(TINY_HYBRID))},
)
