"""OLMo 2: Llama with its RMS norms after each block instead of before (``post_attention_layernorm`` on the attention
output, ``post_feedforward_layernorm`` on the MLP's, no input norms) and one RMS norm over all heads of q (of k)
before RoPE. llama.cpp's converter keeps q/k rows as they are (NeoX RoPE, as transformers') and names the norms
``post_attention_norm``, ``post_ffw_norm``, ``attn_q_norm`` [H D] and ``attn_k_norm`` [Hkv D]."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dtorch.core.errors import ModelError
from dtorch.models.families.base import (
    TINY_DENSE,
    Family,
    GgufMeta,
    Weight,
    attention,
    decoder,
    layer_norm,
    mlp,
)

if TYPE_CHECKING:
    from dtorch.models.config import ModelConfig
    from dtorch.models.layout import Layout


def _layer(c: ModelConfig, layout: Layout, i: int) -> Iterator[Weight]:
    yield layer_norm(c, i, "attn_out_norm", "post_attention_layernorm", "post_attention_norm")
    yield layer_norm(c, i, "mlp_out_norm", "post_feedforward_layernorm", "post_ffw_norm")
    yield from attention(c, i)
    yield from mlp(c, i)


def _gguf_config(m: GgufMeta, common: dict[str, Any]) -> dict[str, Any]:
    """No fields of its own; a file with ``attention.sliding_window`` > 0 (OLMo 3, converted as olmo2: llama.cpp's
    src/models/olmo2.cpp then slides three layers in four, their RoPE unscaled) is refused, not run without it."""
    window = m.get("attention.sliding_window")
    if window != 0 and window is not None:
        raise ModelError(f"{m.path}: {m.key('attention.sliding_window')}={window} (OLMo 3 sliding-window attention) "
                         "is not supported for olmo2 models; expected 0 or absent")
    return {}


FAMILY = Family(
    name="olmo2", hf_types=("olmo2",), gguf_arch="olmo2", gguf_config=_gguf_config,
    fields={"qk_norm": True, "qk_norm_over": "all", "norm_placement": "post"}, tensors=decoder(_layer),
    tiny={"olmo2": ("Olmo2Config", dict(TINY_DENSE, pad_token_id=0))},
)
