"""Qwen3-MoE: Qwen3 whose MLPs are sparse mixtures of experts on the layers ``ModelConfig.is_sparse`` names."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dtorch.core.errors import ModelError
from dtorch.models.families import moe
from dtorch.models.families.base import (
    TINY_DENSE,
    TINY_EXPERTS,
    Family,
    GgufMeta,
    Weight,
    all_full_attention,
    attention,
    decoder,
    is_false,
    layer_norm,
)

if TYPE_CHECKING:
    from dtorch.models.config import ModelConfig
    from dtorch.models.layout import Layout

# transformers' Qwen3MoeConfig defaults
_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False}


def _hf_config(c: dict[str, Any], source: str) -> dict[str, Any]:
    if c.get("use_sliding_window"):
        raise ModelError(f"{source}: use_sliding_window=true is not supported for qwen3_moe models; expected false "
                         "(full attention on every layer)")
    return moe.hf_fields(c, _DEFAULTS)


def _gguf_config(m: GgufMeta, common: dict[str, Any]) -> dict[str, Any]:
    return moe.gguf_fields(m, common["num_layers"])


def _layer(c: ModelConfig, layout: Layout, i: int) -> Iterator[Weight]:
    yield layer_norm(c, i, "input_norm", "input_layernorm", "attn_norm")
    yield layer_norm(c, i, "post_norm", "post_attention_layernorm", "ffn_norm")
    yield from attention(c, i)
    yield from moe.sparse_mlp(c, layout, i)


FAMILY = Family(
    name="qwen3_moe", hf_types=("qwen3_moe",), gguf_arch="qwen3moe", fields={"qk_norm": True}, moe=True,
    hf_keys=moe.HF_KEYS, gguf_keys=moe.GGUF_KEYS, hf_config=_hf_config, gguf_config=_gguf_config,
    tensors=decoder(_layer),
    hf_inert={"use_sliding_window": is_false, "sliding_window": None, "max_window_layers": None,
              "layer_types": all_full_attention},
    tiny={"qwen3_moe": ("Qwen3MoeConfig", dict(TINY_DENSE, **TINY_EXPERTS, head_dim=16, tie_word_embeddings=False))},
)
