"""Llama, and Mistral: Llama whose every layer slides over ``sliding_window`` keys when its config gives one.

The smallest family: the common config keys, the Llama tensor table (``base.decoder(base.dense_layer)``), llama.cpp's
q/k row permutation, and the sliding window. A Llama-like family is a module like this one.
"""

from __future__ import annotations

from typing import Any

from dtorch.models.families.base import TINY_DENSE, Family, GgufMeta, every_layer_slides, gguf_window, is_false


def _hf_config(c: dict[str, Any], source: str) -> dict[str, Any]:
    if c.get("model_type") != "mistral":
        return {}
    return every_layer_slides(c.get("sliding_window"), c.get("num_hidden_layers"))


def _gguf_config(m: GgufMeta, common: dict[str, Any]) -> dict[str, Any]:
    return every_layer_slides(gguf_window(m), common["num_layers"])  # Mistral, which llama.cpp converts to llama


FAMILY = Family(
    name="llama", hf_types=("llama", "mistral"), gguf_arch="llama",
    hf_keys={"sliding_window": "sliding_window"},
    gguf_keys={"sliding_window": "attention.sliding_window"}, hf_config=_hf_config, gguf_config=_gguf_config,
    gguf_permute_qk=True,  # llama.cpp's converter reorders each head's q/k rows for interleaved RoPE
    # SmolLM2's config.json (a Llama): a marker, and the half-split RoPE transformers' Llama always runs
    hf_inert={"is_llama_config": None, "rope_interleaved": is_false},
    tiny={"llama": ("LlamaConfig", dict(TINY_DENSE, tie_word_embeddings=False, rope_theta=10000.0)),
          # every layer slides over 16 keys
          "mistral": ("MistralConfig", dict(TINY_DENSE, head_dim=16, sliding_window=16, tie_word_embeddings=False))},
)
