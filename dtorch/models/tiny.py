"""Tiny random checkpoints written the way transformers and llama.cpp write them, for the tests, the benchmarks and
the GPU check (which writes its own models on the machine: nothing is downloaded or carried).

Needs ``transformers`` (passed in, so importing this module imports neither it nor ``gguf``) and, for GGUF files,
the ``gguf`` package.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# the common fields of the dense tiny configs, and of the hybrid (gated delta net) ones
_DENSE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.2,
              bos_token_id=1, eos_token_id=2)
_HYBRID = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
               layer_types=["linear_attention", "full_attention"] * 2, max_position_embeddings=1024,
               rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
# family -> (transformers config class, its fields beyond the common ones)
_TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(_DENSE, tie_word_embeddings=False, rope_theta=10000.0)),
    # every layer slides over 16 keys
    "mistral": ("MistralConfig", dict(_DENSE, head_dim=16, sliding_window=16, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(_DENSE, tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", dict(_DENSE, head_dim=32, tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_DENSE, **_EXPERTS, head_dim=16, tie_word_embeddings=False)),
    # transformers' default 5:1 schedule (layers 0-4 slide over 8 keys, 5 is global), the global layers' RoPE scaled
    # linearly, the local ones on their own base; query_pre_attn_scalar not head_dim
    "gemma3": ("Gemma3TextConfig", dict(
        _DENSE, num_hidden_layers=6, head_dim=16, sliding_window=8, query_pre_attn_scalar=24, pad_token_id=0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # fused qkv_proj and gate_up_proj, 3/4 of each head rotated, every layer sliding over 12 keys
    "phi3": ("Phi3Config", dict(_DENSE, sliding_window=12, pad_token_id=0,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                 "partial_rotary_factor": 0.75})),
    # linear and full attention layers alternating; 2 key and 4 value heads of 16 in the linear ones
    "qwen3_5_text": ("Qwen3_5TextConfig", _HYBRID),
    "qwen3_next": ("Qwen3NextConfig", dict(_HYBRID, **_EXPERTS, shared_expert_intermediate_size=48,
                                           norm_topk_prob=True)),
}


def tiny_config(transformers, family: str, **overrides: Any):
    """A tiny transformers config of ``family`` (a dtorch family, or "mistral"): hidden 64, 4 query heads over 2 KV
    heads, vocabulary 128, 2 layers (4 for the hybrids, 6 for Gemma 3: one of each layer kind at least), every
    family's particulars on (sliding windows shorter than a test's prompts, partial rotary, experts ...).
    ``overrides`` replace or add fields."""
    if family not in _TINY:
        raise ValueError(f"tiny_config: no tiny {family!r}; known: {sorted(_TINY)}")
    cls, fields = _TINY[family]
    return getattr(transformers, cls)(**(fields | overrides))


def families(transformers, heads: int, kv_heads: int, vocab: int, qwen3_head_dim: int, **sizes: int) -> dict:
    """family -> a ``tiny_config`` factory of the dense Llama, Qwen2 and Qwen3 with ``heads`` / ``kv_heads`` attention
    heads and ``vocab`` tokens; ``sizes`` overrides the common fields (``hidden_size=512, num_hidden_layers=4``)."""
    common = dict(vocab_size=vocab, num_attention_heads=heads, num_key_value_heads=kv_heads) | sizes
    return {"llama": lambda: tiny_config(transformers, "llama", **common),
            "qwen2": lambda: tiny_config(transformers, "qwen2", **common),
            "qwen3": lambda: tiny_config(transformers, "qwen3", **(dict(head_dim=qwen3_head_dim) | common))}


def random_model(transformers, config):
    """A random transformers model of ``config`` (eval, float32, seeded) with every norm, bias, A_log and dt_bias moved
    off its initial value: norms at 1 (or a zero-centred 0) and biases at 0 would hide mistakes in how they are
    applied or split (a missing ``1 +``)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith((".bias", "dt_bias", "A_log")):
                p.add_(torch.randn_like(p) * 0.3)
    return hf


def save_random(transformers, config, path: Path, **save: Any):
    """``random_model`` of ``config`` saved to ``path`` (``save``: ``save_pretrained``'s options); returns it."""
    hf = random_model(transformers, config)
    hf.save_pretrained(path, **save)
    return hf


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``ids`` by ``n`` tokens (a full forward per token, no cache)."""
    ids = list(ids)
    device = next(hf.parameters()).device
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids], device=device)).logits[0, -1].argmax()))
    return ids[-n:]


def vocab_metadata(path: Path) -> dict[str, tuple[Any, Any, Any]]:
    """The ``tokenizer.*`` metadata of the GGUF file ``path`` (a vocabulary-only file of llama.cpp's tokenizer suite,
    say: SentencePiece or BPE, with its special ids and template): key -> (value, ``gguf.GGUFValueType``, an array's
    element type or None), for ``write_gguf(vocab=...)``."""
    import gguf

    out = {}
    for key, field in gguf.GGUFReader(str(path)).fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            out[key] = (field.contents(), kind, field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    return out


def write_gguf(hf, path: Path, arch: str | None = None, qtype: Callable[[str], Any] | None = None,
               extra: dict[str, tuple[Any, Any]] | None = None,
               metadata: dict[str, tuple[Any, Any]] | None = None,
               vocab: dict[str, tuple[Any, Any, Any]] | None = None) -> None:
    """Write the transformers model ``hf`` (a dense Llama, Qwen2, Qwen3, Gemma 3 text or Phi-3) to the GGUF file
    ``path`` as llama.cpp's ``convert_hf_to_gguf.py`` does: its tensor names, Llama's q/k rows permuted, Gemma's norms
    with their 1 added, the ``{arch}.*`` metadata keys (a sliding window, Phi-3's rotated dims).

    ``arch``: "llama" | "qwen2" | "qwen3" | "gemma3" | "phi3" (default: the config's ``model_type``, "gemma3" for
    "gemma3_text", "llama" for "mistral", as llama.cpp converts it). ``qtype(gguf_name)`` gives each
    matrix's ``gguf.GGMLQuantizationType`` (default F32; Q8_0, Q4_0, Q4_1 ... are quantized by ``gguf.quants``, whose
    rows must be a multiple of 32 long); vectors stay F32. ``extra``: more tensors, name -> (array, type).
    ``metadata``: more keys (or keys replaced), key -> (value, ``gguf.GGUFValueType``). YaRN and LongRoPE scaling
    are written as the converter writes them (``_rope_scaling_keys``).
    ``vocab``: ``tokenizer.*`` metadata to write (``vocab_metadata``), the model's ``vocab_size`` at least its tokens;
    without it the file has no vocabulary, only the config's BOS and EOS ids.
    """
    import gguf
    import numpy as np

    from dtorch.models import families
    from dtorch.models.config import ModelConfig
    from dtorch.models.loaders.gguf import permute_qk

    c, Q = hf.config, gguf.GGMLQuantizationType
    config = ModelConfig.from_hf(c.to_dict())
    fam = families.get(config.family)
    arch = arch or fam.gguf_arch
    names = {hf_name: s.gguf for hf_name, s in families.sources(config).items()}  # the family's llama.cpp names
    tensors = dict(extra or {})
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if len(names.get(name, ())) != 1:
            raise ValueError(f"write_gguf: {name} is not one llama.cpp tensor (a dense llama, qwen2, qwen3, gemma3 or "
                             "phi3 model only)")
        g = names[name][0]
        t = t.detach().float().cpu()
        if config.norm_plus_one and name.endswith("norm.weight"):
            t = t + 1  # the converter's norm_shift: llama.cpp's RMS norm scales by w
        if fam.gguf_permute_qk and ".attn_q." in g:
            t = permute_qk(t, c.num_attention_heads)
        elif fam.gguf_permute_qk and ".attn_k." in g:
            t = permute_qk(t, c.num_key_value_heads)
        a = np.ascontiguousarray(t.numpy())
        kind = Q.F32 if a.ndim < 2 or qtype is None else qtype(g)
        tensors[g] = (a if kind == Q.F32 else gguf.quants.quantize(a, kind), kind)
    V = gguf.GGUFValueType
    meta = {f"{arch}.{k}": v for k, v in {
        "vocab_size": (c.vocab_size, V.UINT32), "embedding_length": (c.hidden_size, V.UINT32),
        "feed_forward_length": (c.intermediate_size, V.UINT32), "block_count": (c.num_hidden_layers, V.UINT32),
        "attention.head_count": (c.num_attention_heads, V.UINT32),
        "attention.head_count_kv": (c.num_key_value_heads, V.UINT32),
        "attention.key_length": (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads, V.UINT32),
        "attention.layer_norm_rms_epsilon": (c.rms_norm_eps, V.FLOAT32),
        "rope.freq_base": (c.rope_parameters.get("full_attention", c.rope_parameters)["rope_theta"], V.FLOAT32),
        "context_length": (c.max_position_embeddings, V.UINT32)}.items()}
    if getattr(c, "sliding_window", None) is not None:
        meta[f"{arch}.attention.sliding_window"] = (c.sliding_window, V.UINT32)
    if arch == "phi3":
        head_dim = c.hidden_size // c.num_attention_heads
        partial = c.rope_parameters.get("partial_rotary_factor") or 1.0
        meta[f"{arch}.rope.dimension_count"] = (int(head_dim * partial), V.UINT32)
    if arch == "gemma3":
        meta[f"{arch}.rope.freq_base_swa"] = (c.rope_parameters["sliding_attention"]["rope_theta"], V.FLOAT32)
        if c.query_pre_attn_scalar != c.head_dim:  # llama.cpp's default is head_dim ** -0.5
            meta[f"{arch}.attention.scale"] = (c.query_pre_attn_scalar ** -0.5, V.FLOAT32)
        full = c.rope_parameters["full_attention"]
        if full.get("rope_type", "default") == "linear":
            meta[f"{arch}.rope.scaling.type"] = ("linear", V.STRING)
            meta[f"{arch}.rope.scaling.factor"] = (full["factor"], V.FLOAT32)
    rope_meta, rope_tensors = _rope_scaling_keys(c, arch)
    meta |= rope_meta
    tensors |= rope_tensors
    for key, token in (("bos", c.bos_token_id), ("eos", c.eos_token_id)):
        if isinstance(token, int) and vocab is None:
            meta[f"tokenizer.ggml.{key}_token_id"] = (token, V.UINT32)
    tokens = (vocab or {}).get("tokenizer.ggml.tokens", ((),))[0]
    if len(tokens) > c.vocab_size:
        raise ValueError(f"write_gguf: the vocabulary has {len(tokens)} tokens, the model's embedding {c.vocab_size}")
    meta |= metadata or {}
    w = gguf.GGUFWriter(str(path), arch)
    for key, (value, vtype) in meta.items():
        w.add_key_value(key, value, vtype)
    for key, (value, vtype, sub_type) in (vocab or {}).items():
        if key not in meta:  # ``metadata`` replaces a vocabulary key
            w.add_key_value(key, value, vtype, sub_type=sub_type)
    for name, (data, kind) in tensors.items():  # shapes follow from the byte layout of `data`
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _rope_scaling_keys(c, arch: str) -> tuple[dict[str, tuple[Any, Any]], dict[str, tuple[Any, Any]]]:
    """(metadata, tensors) of a config's YaRN or LongRoPE scaling as llama.cpp's converter writes them: YaRN as
    ``rope.scaling.type`` / ``.factor`` / ``.original_context_length`` and, where the config sets them,
    ``.yarn_attn_factor`` / ``.yarn_beta_fast`` / ``.yarn_beta_slow``; Phi-3's LongRoPE as the
    ``rope_factors_long`` / ``_short.weight`` tensors, ``rope.scaling.original_context_length`` and
    ``rope.scaling.attn_factor`` (sqrt(1 + ln(s) / ln(original)), s = max positions / original)."""
    import math

    import gguf
    import numpy as np

    V, Q = gguf.GGUFValueType, gguf.GGMLQuantizationType
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    kind, meta, tensors = rope.get("rope_type", "default"), {}, {}
    if kind == "yarn":
        meta = {"type": ("yarn", V.STRING), "factor": (rope["factor"], V.FLOAT32),
                "original_context_length": (rope["original_max_position_embeddings"], V.UINT32)}
        for key, name in (("attention_factor", "yarn_attn_factor"), ("beta_fast", "yarn_beta_fast"),
                          ("beta_slow", "yarn_beta_slow")):
            if rope.get(key) is not None:
                meta[name] = (rope[key], V.FLOAT32)
    elif kind == "longrope":
        old = rope["original_max_position_embeddings"]
        scale = c.max_position_embeddings / old
        meta = {"original_context_length": (old, V.UINT32),
                "attn_factor": (math.sqrt(1 + math.log(scale) / math.log(old)) if scale > 1 else 1.0, V.FLOAT32)}
        tensors = {f"rope_factors_{n}.weight": (np.asarray(rope[f"{n}_factor"], dtype=np.float32), Q.F32)
                   for n in ("long", "short")}
    return {f"{arch}.rope.scaling.{k}": v for k, v in meta.items()}, tensors
