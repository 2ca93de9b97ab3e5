"""Seed-OSS (ByteDance): Llama with biases on the q, k and v projections (none on o: ``attention_out_bias`` false).
llama.cpp's converter writes it as ``seed_oss`` without permuting q/k rows (NeoX RoPE, as transformers') and names the
MLP's input norm ``post_attention_norm`` (Llama's ``ffn_norm``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from dtorch.models.families.base import TINY_DENSE, Family, Weight, attention, decoder, is_false, layer_norm, mlp

if TYPE_CHECKING:
    from dtorch.models.config import ModelConfig
    from dtorch.models.layout import Layout


def _layer(c: ModelConfig, layout: Layout, i: int) -> Iterator[Weight]:
    yield layer_norm(c, i, "input_norm", "input_layernorm", "attn_norm")
    yield layer_norm(c, i, "post_norm", "post_attention_layernorm", "post_attention_norm")
    yield from attention(c, i)
    yield from mlp(c, i)


FAMILY = Family(name="seed_oss", hf_types=("seed_oss",), gguf_arch="seed_oss", fields={"attention_bias": True},
                tensors=decoder(_layer), hf_inert={"attention_out_bias": is_false, "residual_dropout": None},
                tiny={"seed_oss": ("SeedOssConfig", dict(TINY_DENSE, head_dim=16))})
