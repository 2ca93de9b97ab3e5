"""Tiny random checkpoints for the tests: they live in ``dtorch.models.tiny``, shared with the benchmarks and the GPU
check; re-exported here under the names the tests import."""

from dtorch.models.tiny import (
    families as families,
    hf_greedy as hf_greedy,
    random_hybrid as random_hybrid,
    save_random as save_random,
)


def save_hybrid(transformers, config, path):
    """A random model of ``config`` (``random_hybrid``) saved to ``path``; returns the transformers model."""
    hf = random_hybrid(transformers, config)
    hf.save_pretrained(path)
    return hf


def hybrid_sizes(**overrides) -> dict:
    """Keyword arguments of a tiny transformers config of a gated delta net family (``Qwen3_5TextConfig``, and
    ``Qwen3NextConfig`` with its expert sizes added): 4 layers, linear and full attention alternating, 4 query heads
    over 2 KV heads of 16, 2 key and 4 value heads of 16 in the linear layers. ``overrides`` replace or add entries."""
    return dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                layer_types=["linear_attention", "full_attention"] * 2, max_position_embeddings=1024,
                rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1,
                eos_token_id=2) | overrides
