"""Tiny random Llama, Qwen2 and Qwen3 checkpoints written with transformers, for tests against it."""

from __future__ import annotations

from pathlib import Path

import torch


def families(transformers, heads: int, kv_heads: int, vocab: int, qwen3_head_dim: int) -> dict:
    """family -> a config factory: 2 layers, hidden 64, ``heads`` / ``kv_heads`` attention heads."""
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
                  rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    return {
        "llama": lambda: transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0),
        "qwen2": lambda: transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=qwen3_head_dim, tie_word_embeddings=True,
                                                  rope_theta=1e6),
    }


def save_random(transformers, config, path: Path):
    """A random model of ``config`` saved to ``path``; returns the transformers model (eval, float32)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms at 1 and biases at 0 would hide mistakes in how they are applied or split
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(path)
    return hf


def random_hybrid(transformers, config):
    """A random Qwen3-Next / Qwen3.5 transformers model (eval, float32) with every norm, A_log and dt_bias moved off
    its initial value (a norm of zeros, i.e. a scale of 1, would hide a missing ``1 +``)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(("dt_bias", "A_log")):
                p.add_(torch.randn_like(p) * 0.3)
    return hf


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``ids`` by ``n`` tokens (a full forward per token, no cache)."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]
