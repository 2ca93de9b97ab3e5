"""Qwen2: Llama with biases on the q, k and v projections."""

from dtorch.models.families.base import TINY_DENSE, Family, all_full_attention, is_false

FAMILY = Family(name="qwen2", hf_types=("qwen2",), gguf_arch="qwen2", fields={"attention_bias": True},
                # transformers' sliding window, off unless use_sliding_window
                hf_inert={"use_sliding_window": is_false, "sliding_window": None, "max_window_layers": None,
                          "layer_types": all_full_attention},
                tiny={"qwen2": ("Qwen2Config", dict(TINY_DENSE, tie_word_embeddings=True, rope_theta=1e6))})
