"""Qwen3: Llama with per-head RMS norms on q and k before RoPE."""

from dtorch.models.families.base import TINY_DENSE, Family, all_full_attention, is_false

FAMILY = Family(name="qwen3", hf_types=("qwen3",), gguf_arch="qwen3", fields={"qk_norm": True},
                # transformers' sliding window, off unless use_sliding_window
                hf_inert={"use_sliding_window": is_false, "sliding_window": None, "max_window_layers": None,
                          "layer_types": all_full_attention},
                tiny={"qwen3": ("Qwen3Config", dict(TINY_DENSE, head_dim=32, tie_word_embeddings=True,
                                                    rope_theta=1e6))})
