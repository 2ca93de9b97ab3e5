"""Gemma 3 (text): sliding and full attention layers (``layer_types``, or five sliding to one full), each kind with
its own RoPE base, q/k norms, ``(1 + w)`` RMS norms before and after attention and the MLP, a GeGLU MLP, the embedding
scaled by sqrt(hidden), queries scaled by ``query_pre_attn_scalar ** -0.5``, tied embeddings. From ``gemma3_text``
config.json files, the language model of multimodal ``gemma3`` ones, and ``gemma3`` GGUF files."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from dtorch.core.errors import ModelError
from dtorch.models.config_fields import check_field
from dtorch.models.families.base import (
    TINY_DENSE,
    Family,
    GgufMeta,
    Weight,
    attention,
    decoder,
    gguf_window,
    layer_norm,
    mlp,
    shifted_norms,
)
from dtorch.models.rope_scaling import rope_from_hf

if TYPE_CHECKING:
    from dtorch.models.config import ModelConfig
    from dtorch.models.layout import Layout


def _hf_config(c: dict[str, Any], source: str) -> dict[str, Any]:
    """``layer_types`` (or every ``sliding_window_pattern``-th layer full attention, transformers' default), the local
    RoPE base (``rope_parameters["sliding_attention"]``, or ``rope_local_base_freq``; the global set is the common
    parse's, ``rope_parameters["full_attention"]``), ``query_pre_attn_scalar``; logit soft-capping (Gemma 2) is
    refused."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if c.get(key) is not None:
            raise ModelError(f"{source}: {key}={c[key]!r} is not supported; expected null (Gemma 3 has none)")
    if c.get("use_bidirectional_attention"):
        raise ModelError(f"{source}: use_bidirectional_attention=true is not supported; expected false")
    layers = c.get("num_hidden_layers")
    types = c.get("layer_types")
    if types is None and isinstance(layers, int):
        pattern = c.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ModelError(f"{source}: sliding_window_pattern must be an int >= 1, got {pattern!r}")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if isinstance(c.get("rope_parameters"), Mapping) and "sliding_attention" in c["rope_parameters"]:
        local = rope_from_hf(c, 10000.0, source, "sliding_attention", "rope_local_base_freq")  # transformers 5
        if local["rope_type"] != "default":
            raise ModelError(f"{source}: rope_parameters.sliding_attention of type {local['rope_type']!r} is not "
                             "supported; expected the default rope")
        local_theta = local["rope_theta"]
    else:  # the sliding layers unscaled, on their own base
        local_theta = c.get("rope_local_base_freq", 10000.0)
    check_field("rope_theta", local_theta, f"{source}: the sliding layers' rope_theta")
    c.setdefault("tie_word_embeddings", True)
    window = c.get("sliding_window", 4096)  # transformers' Gemma3TextConfig default
    scalar = c.get("query_pre_attn_scalar", 256)
    return dict(layer_types=tuple(types or ()), sliding_window=window if types and "sliding_attention" in types
                else None, rope_local_theta=local_theta, attention_multiplier=scalar ** -0.5,
                embedding_multiplier=c["hidden_size"] ** 0.5)


def _gguf_config(m: GgufMeta, common: dict[str, Any]) -> dict[str, Any]:
    """As llama.cpp reads a gemma3 file: every sixth layer full attention, the others sliding over
    ``attention.sliding_window``; the sliding layers' RoPE base ``rope.freq_base_swa`` (10000 when absent); linear
    RoPE scaling of the global layers from ``rope.scaling.type`` / ``rope.scaling.factor``; queries scaled by
    ``attention.scale`` when given, else by head_dim ** -0.5 (hidden / heads for the 62-layer 27B, llama.cpp's rule)."""
    window, layers = gguf_window(m), common["num_layers"]
    local = m.get("rope.freq_base_swa", 10000.0)
    check_field("rope_local_theta", local, f"{m.path}: {m.key('rope.freq_base_swa')}")
    scale = m.get("attention.scale")
    if scale is not None:
        check_field("attention_multiplier", scale, f"{m.path}: {m.key('attention.scale')}")
    else:
        scale = (common["hidden_size"] / common["num_heads"] if layers == 62 else common["head_dim"]) ** -0.5
    types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers))
    out = dict(layer_types=types if window is not None else (), sliding_window=window, rope_local_theta=local,
               attention_multiplier=scale, embedding_multiplier=common["hidden_size"] ** 0.5)
    kind = m.get("rope.scaling.type")
    if kind not in (None, "none"):
        factor = m.get("rope.scaling.factor")
        if kind != "linear" or isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0:
            raise ModelError(f"{m.path}: rope scaling {kind!r} with factor {factor!r} is not supported; expected "
                             "linear scaling with a positive factor")
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    return out


def sandwich_layer(c: ModelConfig, layout: Layout, i: int) -> Iterator[Weight]:
    """Gemma's layer (Gemma 2's too): norms before and after attention and the MLP: transformers'
    post_attention_layernorm is the attention output's (llama.cpp's post_attention_norm), pre_feedforward_layernorm the
    MLP input's (ffn_norm)."""
    yield layer_norm(c, i, "input_norm", "input_layernorm", "attn_norm")
    yield layer_norm(c, i, "attn_out_norm", "post_attention_layernorm", "post_attention_norm")
    yield layer_norm(c, i, "post_norm", "pre_feedforward_layernorm", "ffn_norm")
    yield layer_norm(c, i, "mlp_out_norm", "post_feedforward_layernorm", "post_ffw_norm")
    yield from attention(c, i)
    yield from mlp(c, i)


FAMILY = Family(
    name="gemma3", hf_types=("gemma3_text",), hf_multimodal=("gemma3",), gguf_arch="gemma3",
    fields={"qk_norm": True, "norm_placement": "sandwich", "norm_plus_one": True, "hidden_act": "gelu_tanh"},
    hf_keys={"sliding_window": "sliding_window", "layer_types": "layer_types",
             "rope_local_theta": "rope_local_base_freq", "query_pre_attn_scalar": "query_pre_attn_scalar"},
    gguf_keys={"sliding_window": "attention.sliding_window", "rope_local_theta": "rope.freq_base_swa",
               "attention_multiplier": "attention.scale"},
    hf_config=_hf_config, gguf_config=_gguf_config, tensors=decoder(sandwich_layer), gguf_views=shifted_norms,
    hf_rope_theta=1_000_000.0,
    hf_read=("sliding_window_pattern", "attn_logit_softcapping", "final_logit_softcapping",
             "use_bidirectional_attention"),
    hf_inert={"_sliding_window_pattern": None},  # transformers' own copy of the pattern it wrote into layer_types
    # transformers' default 5:1 schedule (layers 0-4 slide over 8 keys, 5 is global), the global layers' RoPE scaled
    # linearly, the local ones on their own base; query_pre_attn_scalar not head_dim
    tiny={"gemma3": ("Gemma3TextConfig", dict(
        TINY_DENSE, num_hidden_layers=6, head_dim=16, sliding_window=8, query_pre_attn_scalar=24, pad_token_id=0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))},
)
