"""OLMo 2: Llama with its RMS norms after each block instead of before (``post_attention_layernorm`` on the attention
output, ``post_feedforward_layernorm`` on the MLP's, no input norms) and one RMS norm over all heads of q (of k)
before RoPE. llama.cpp's converter keeps q/k rows as they are (NeoX RoPE, as transformers') and names the norms
``post_attention_norm``, ``post_ffw_norm``, ``attn_q_norm`` [H D] and ``attn_k_norm`` [Hkv D]."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from dtorch.models.families.base import TINY_DENSE, Family, Weight, attention, decoder, layer_norm, mlp

if TYPE_CHECKING:
    from dtorch.models.config import ModelConfig
    from dtorch.models.layout import Layout


def _layer(c: ModelConfig, layout: Layout, i: int) -> Iterator[Weight]:
    yield layer_norm(c, i, "attn_out_norm", "post_attention_layernorm", "post_attention_norm")
    yield layer_norm(c, i, "mlp_out_norm", "post_feedforward_layernorm", "post_ffw_norm")
    yield from attention(c, i)
    yield from mlp(c, i)


FAMILY = Family(
    name="olmo2", hf_types=("olmo2",), gguf_arch="olmo2",
    fields={"qk_norm": True, "qk_norm_over": "all", "norm_placement": "post"}, tensors=decoder(_layer),
    tiny={"olmo2": ("Olmo2Config", dict(TINY_DENSE, pad_token_id=0))},
)
