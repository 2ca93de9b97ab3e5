"""Qwen3: Llama with per-head RMS norms on q and k before RoPE."""

from dtorch.models.families.base import Family

FAMILY = Family(name="qwen3", hf_types=("qwen3",), gguf_arch="qwen3", fields={"qk_norm": True})
