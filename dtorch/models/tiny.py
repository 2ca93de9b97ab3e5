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


def tiny_config(transformers, family: str, **overrides: Any):
    """A tiny transformers config of ``family`` (a dtorch family, or "mistral"): hidden 64, 4 query heads over 2 KV
    heads, vocabulary 128, 2 layers (4 for the hybrids, 6 for Gemma 3: one of each layer kind at least), every
    family's particulars on (sliding windows shorter than a test's prompts, partial rotary, experts ...).
    ``overrides`` replace or add fields."""
    tiny = tiny_models()
    if family not in tiny:
        raise ValueError(f"tiny_config: no tiny {family!r}; known: {sorted(tiny)}. A family declares its tiny models "
                         "in its module: Family(tiny={model_type: (transformers config class, fields)})")
    cls, fields = tiny[family]
    return getattr(transformers, cls)(**(dict(fields) | overrides))


def tiny_models() -> dict[str, tuple[str, Any]]:
    """model_type -> (transformers config class, its fields): every registered family's tiny models
    (``Family.tiny``)."""
    from dtorch.models import families

    return {key: spec for name in families.names() for key, spec in families.get(name).tiny.items()}


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
    """Write the transformers model ``hf`` (of a dense family: every checkpoint tensor one llama.cpp tensor) to the
    GGUF file ``path`` as llama.cpp's converter does: the family's tensor names (``Family.tensors``), q/k rows permuted
    where it says so (``gguf_permute_qk``), (1 + w) norms with their 1 added, and the ``{arch}.*`` keys of the common
    fields and of the family's ``gguf_keys``, each from the ``ModelConfig`` of ``hf.config``.

    ``arch``: the architecture written (default: the family's ``gguf_arch``: "llama" for "mistral", as llama.cpp
    converts it). ``qtype(gguf_name)`` gives each
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
            raise ValueError(f"write_gguf: {name} is not one llama.cpp tensor (a dense family's model only)")
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
    meta = _config_keys(config, arch, fam.gguf_keys)
    rope_meta, rope_tensors = _rope_scaling_keys(c, arch)
    meta |= rope_meta
    tensors |= rope_tensors
    V = gguf.GGUFValueType
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


def _config_keys(config, arch: str, own) -> dict[str, tuple[Any, Any]]:
    """The ``{arch}.*`` metadata of ``config`` (a ``ModelConfig``) as the converter writes it: every field the common
    keys and the family's ``own`` (``Family.gguf_keys``) name, where the config sets it (not None, not a field the
    config lacks), typed by its value; and ``rope.dimension_count``, the rotated dims of each head."""
    import gguf

    from dtorch.models.config_fields import gguf_keys

    V = gguf.GGUFValueType
    meta = {f"{arch}.rope.dimension_count": (config.rotary_dim, V.UINT32)}
    for name, key in gguf_keys(arch, own).items():
        value = getattr(config, name, None)
        if value is None or not key.startswith(f"{arch}."):  # the tokenizer's ids are written with the vocabulary
            continue
        kind = V.BOOL if isinstance(value, bool) else V.UINT32 if isinstance(value, int) else \
            V.FLOAT32 if isinstance(value, float) else V.STRING if isinstance(value, str) else None
        if kind is None:
            raise ValueError(f"write_gguf: field {name} = {value!r} has no GGUF type here")
        meta[key] = (value, kind)
    return meta


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
    if kind == "linear":
        meta = {"type": ("linear", V.STRING), "factor": (rope["factor"], V.FLOAT32)}
    elif kind == "yarn":
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
