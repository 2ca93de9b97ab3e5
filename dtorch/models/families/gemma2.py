"""Gemma 2: sliding and full attention layers alternating (the first slides), the attention scores and the final
logits soft-capped (``attn_logit_softcapping``, ``final_logit_softcapping``: cap * tanh(x / cap)), ``(1 + w)`` RMS norms
around attention and the MLP (Gemma 3's layer, without its q/k norms), a GeGLU MLP, the embedding scaled by
sqrt(hidden), queries by ``query_pre_attn_scalar ** -0.5``, tied embeddings.

llama.cpp's converter writes the caps and the window as ``gemma2.attn_logit_softcapping``,
``.final_logit_softcapping`` and ``.attention.sliding_window`` and stores the norms with their 1 added; its loader
slides every other layer (``attention.sliding_window_pattern`` may say otherwise; an absent window is 4096) and
scales queries by head_dim ** -0.5 (hidden / heads for the 46-layer 27B), writing no key for it; absent caps are 50
and 30 (llama.cpp's src/models/gemma2.cpp, src/llama-hparams.h)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dtorch.core.errors import ModelError
from dtorch.models.families.base import (
    TINY_DENSE,
    Family,
    GgufMeta,
    decoder,
    gguf_swa_layers,
    gguf_window,
    shifted_norms,
)
from dtorch.models.families.gemma3 import sandwich_layer

# the caps' fields -> their config.json keys (llama.cpp's converter writes the same names after "gemma2."), and the
# value a file that omits one gets: transformers' Gemma2Config defaults, which llama.cpp's loader assumes too
_CAPS = {"attn_softcap": "attn_logit_softcapping", "logits_softcap": "final_logit_softcapping"}
_CAP_DEFAULTS = {"attn_softcap": 50.0, "logits_softcap": 30.0}


def _caps(read: Callable[[str, float], Any]) -> dict[str, Any]:
    """Each cap from its key through ``read(key, default)`` (``dict.get`` of a config.json, ``GgufMeta.get``)."""
    return {name: read(key, _CAP_DEFAULTS[name]) for name, key in _CAPS.items()}


def _alternating(layers: int) -> tuple[str, ...]:
    return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))


def _hf_config(c: dict[str, Any], source: str) -> dict[str, Any]:
    if c.get("use_bidirectional_attention"):
        raise ModelError(f"{source}: use_bidirectional_attention=true is not supported; expected false")
    c.setdefault("tie_word_embeddings", True)
    types = tuple(c.get("layer_types") or _alternating(c["num_hidden_layers"]))
    window = c.get("sliding_window", 4096)
    return dict(layer_types=types, sliding_window=window if "sliding_attention" in types else None,
                attention_multiplier=c.get("query_pre_attn_scalar", 256) ** -0.5,
                embedding_multiplier=c["hidden_size"] ** 0.5, **_caps(c.get))


def _gguf_config(m: GgufMeta, common: dict[str, Any]) -> dict[str, Any]:
    """As llama.cpp's gemma2 loader reads a file: layers sliding over ``attention.sliding_window`` (4096 when
    absent) as ``attention.sliding_window_pattern`` lays them out (every other one, the first sliding, when absent);
    the sliding layers' RoPE base ``rope.freq_base_swa`` (the global one when absent); the caps 50 and 30 when
    absent; queries scaled by head_dim ** -0.5 (hidden / heads for the 46-layer 27B)."""
    layers, window = common["num_layers"], gguf_window(m) or 4096
    types = gguf_swa_layers(m, layers, 2)
    scalar = common["hidden_size"] / common["num_heads"] if layers == 46 else common["head_dim"]
    out = dict(layer_types=types, sliding_window=window if "sliding_attention" in types else None,
               attention_multiplier=scalar ** -0.5, embedding_multiplier=common["hidden_size"] ** 0.5, **_caps(m.get))
    local = m.get("rope.freq_base_swa", common["rope_theta"])
    if local != common["rope_theta"]:  # llama.cpp scales the sliding layers' RoPE as the global one's
        if common["rope_scaling"] is not None:
            raise ModelError(f"{m.path}: {m.key('rope.freq_base_swa')} with rope scaling is not supported")
        out["rope_local_theta"] = local
    return out


FAMILY = Family(
    name="gemma2", hf_types=("gemma2",), gguf_arch="gemma2",
    fields={"norm_placement": "sandwich", "norm_plus_one": True, "hidden_act": "gelu_tanh"},
    hf_keys={"sliding_window": "sliding_window", "layer_types": "layer_types",
             "query_pre_attn_scalar": "query_pre_attn_scalar", **_CAPS},
    gguf_keys={"sliding_window": "attention.sliding_window", "rope_local_theta": "rope.freq_base_swa", **_CAPS},
    hf_config=_hf_config, gguf_config=_gguf_config, tensors=decoder(sandwich_layer), gguf_views=shifted_norms,
    hf_read=("use_bidirectional_attention",),
    # caps far below the models' 50 and 30, so that the tiny model's scores and logits are really capped; a window
    # shorter than the tests' prompts; queries scaled by head_dim ** -0.5, the one scale a GGUF file can say
    tiny={"gemma2": ("Gemma2Config", dict(TINY_DENSE, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                          attn_logit_softcapping=1.0, final_logit_softcapping=2.0, pad_token_id=0))},
)
