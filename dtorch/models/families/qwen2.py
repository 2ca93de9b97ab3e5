"""Qwen2: Llama with biases on the q, k and v projections."""

from dtorch.models.families.base import Family

FAMILY = Family(name="qwen2", hf_types=("qwen2",), gguf_arch="qwen2", fields={"attention_bias": True})
