"""IBM Granite 3.x (dense): Llama with four scalars: the embedding times ``embedding_multiplier``, each block's output
times ``residual_multiplier`` before the residual add, q k^T times ``attention_multiplier`` (not head_dim ** -0.5) and
the logits divided by ``logits_scaling``. llama.cpp's converter writes them as ``embedding_scale``, ``residual_scale``,
``attention.scale`` and ``logit_scale`` (each only where config.json sets it) and permutes q/k rows as for Llama; its
loader requires ``logit_scale`` alone (src/models/granite.cpp)."""

from __future__ import annotations

from typing import Any

from dtorch.core.errors import ModelError
from dtorch.models.families.base import TINY_DENSE, Family, GgufMeta

# field -> the config.json key; transformers' GraniteConfig defaults each to 1.0
_HF = {"embedding_multiplier": "embedding_multiplier", "residual_multiplier": "residual_multiplier",
       "attention_multiplier": "attention_multiplier", "logits_scaling": "logits_scaling"}
_GGUF = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
         "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}


def _hf_config(c: dict[str, Any], source: str) -> dict[str, Any]:
    return {name: float(c.get(key, 1.0)) for name, key in _HF.items()}


def _gguf_config(m: GgufMeta, common: dict[str, Any]) -> dict[str, Any]:
    """As llama.cpp's granite loader reads a file: ``logit_scale`` required; an absent ``embedding_scale`` or
    ``residual_scale`` scales nothing and an absent ``attention.scale`` means head_dim ** -0.5 (the converter writes
    each only where config.json sets it); ``rope.scaling.finetuned`` false turns RoPE off, which is not modelled."""
    if m.get("rope.scaling.finetuned", True) is not True:
        raise ModelError(f"{m.path}: {m.key('rope.scaling.finetuned')}={m.get('rope.scaling.finetuned')!r} (no RoPE) "
                         "is not supported for granite models; expected true or absent")
    out = {name: m.get(key) for name, key in _GGUF.items()}
    out["logits_scaling"] = m.need(_GGUF["logits_scaling"])
    return {name: None if v is None else float(v) for name, v in out.items()}


FAMILY = Family(
    name="granite", hf_types=("granite",), gguf_arch="granite", hf_keys=_HF, gguf_keys=_GGUF,
    hf_config=_hf_config, gguf_config=_gguf_config, gguf_permute_qk=True,
    # multipliers far from 1 (Granite 3.x ships 12, 0.22, 1/128 and 8): a missing or misplaced one moves every logit
    tiny={"granite": ("GraniteConfig", dict(TINY_DENSE, embedding_multiplier=3.0, residual_multiplier=0.4,
                                            attention_multiplier=0.07, logits_scaling=2.5))},
)
