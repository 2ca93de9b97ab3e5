"""Phi-3 (and Phi-4-mini): Llama with q/k/v fused in one ``qkv_proj`` and gate/up in one ``gate_up_proj`` in its
checkpoints (each device reads its heads' rows of each part), part of each head rotated, and, where its config says
so, a sliding window on every layer. The 128k models' LongRoPE is a rope scaling (``models.rope_scaling``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dtorch.core.placement import Shard
from dtorch.models.families import base

if TYPE_CHECKING:
    from dtorch.models.config import ModelConfig
    from dtorch.models.layout import Layout


def _hf_config(c: dict[str, Any], source: str) -> dict[str, Any]:
    """A window on every layer where the config has one; "su", the first name of LongRoPE in Phi-3's configs, read as
    "longrope" (as transformers' Phi3Config does)."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = c.get(key)
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "su":
            c[key] = {k: v for k, v in rope.items() if k != "type"} | {"rope_type": "longrope"}
    return base.every_layer_slides(c.get("sliding_window"), c.get("num_hidden_layers"))


def _gguf_config(m: base.GgufMeta, common: dict[str, Any]) -> dict[str, Any]:
    """``attention.sliding_window`` (every layer), ``rope.dimension_count`` rotated dims of each head."""
    return dict(partial_rotary_factor=m.rotary_fraction(common["head_dim"], default=common["head_dim"]),
                **base.every_layer_slides(base.gguf_window(m), common["num_layers"]))


def _layer(c: ModelConfig, layout: Layout, i: int) -> Iterator[base.Weight]:
    """Llama's, its q/k/v and gate/up fused: [q | k | v] rows, each device its heads' rows of each part; [gate | up]
    rows, each device its rows of each half (llama.cpp keeps them fused too, as attn_qkv and ffn_up)."""
    H, Hkv, D, E, inter = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size
    G = H // Hkv
    qkv = base.layer_source(i, "self_attn.qkv_proj.weight", "attn_qkv.weight", (c.q_size + 2 * c.kv_size, E), 0,
                            Shard(0, (H * D, Hkv * D, Hkv * D), (G * D, D, D)))
    gate_up = base.layer_source(i, "mlp.gate_up_proj.weight", "ffn_up.weight", (2 * inter, E), 0,
                                Shard(0, (inter, inter), 1))
    yield from base.dense_layer(c, layout, i, (qkv,), (gate_up,))


FAMILY = base.Family(
    name="phi3", hf_types=("phi3",), gguf_arch="phi3", hf_keys={"sliding_window": "sliding_window"},
    gguf_keys={"sliding_window": "attention.sliding_window"},
    hf_config=_hf_config, gguf_config=_gguf_config, tensors=base.decoder(_layer),
    # 3/4 of each head rotated, every layer sliding over 12 keys
    tiny={"phi3": ("Phi3Config", dict(base.TINY_DENSE, sliding_window=12, pad_token_id=0,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                       "partial_rotary_factor": 0.75}))},
)
