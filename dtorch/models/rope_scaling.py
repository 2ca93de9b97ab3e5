"""RoPE scaling: the kinds real configs and GGUF files carry, each checked once (``check_rope_scaling``) and turned
into inverse frequencies (``rope_inv_freq``) and a factor on cos and sin (``rope_attention_factor``) as transformers'
``ROPE_INIT_FUNCTIONS`` compute them.

- "linear": positions divided by ``factor``.
- "llama3": long wavelengths slowed by ``factor``, short ones kept, a smooth band between (Llama 3.1+).
- "factors": one divisor per frequency (llama.cpp's ``rope_freqs`` tensor: how GGUF files carry Llama 3 scaling).
- "yarn": NTK-by-parts (Qwen2.5 / Qwen3 long-context configs, DeepSeek): frequencies past ``beta_fast`` rotations
  over ``original_max_position_embeddings`` kept, those under ``beta_slow`` divided by ``factor``, a linear ramp
  between; cos and sin scaled by ``attention_factor`` (default ``0.1 ln(factor) + 1``, or the ratio of two such terms
  with ``mscale`` / ``mscale_all_dim``).
- "longrope": Phi-3 / Phi-3.5 128k: one divisor per frequency, ``short_factor`` or ``long_factor``; cos and sin scaled
  by ``attention_factor`` (default ``sqrt(1 + ln(factor) / ln(original))``, factor = max positions / original).
  Which list applies is fixed by the context the model is loaded for, as llama.cpp decides it: the long one when
  that context passes ``original_max_position_embeddings``. transformers switches by the longest position of each
  forward pass instead: the two agree for a context within the limit, and for sequences past it; a short sequence
  in a long context gets the long factors here, the short ones there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from dtorch.core.errors import ModelError

if TYPE_CHECKING:
    from dtorch.models.config import ModelConfig
    from dtorch.models.families.base import GgufMeta

# rope type -> (the keys its scaling mapping must hold besides "rope_type", the optional ones it reads)
ROPE_TYPES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "factors": (("factors",), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")),
    "longrope": (("short_factor", "long_factor", "original_max_position_embeddings"), ("factor", "attention_factor")),
}
_AT_LEAST_ZERO = ("mscale", "mscale_all_dim")  # 0 means unset, as transformers reads them
_LISTS = ("factors", "short_factor", "long_factor")  # one positive number per rotated frequency


def check_rope_scaling(scaling: Mapping[str, Any] | None, rotary_dim: int) -> Mapping[str, Any] | None:
    """``scaling`` checked (its kind known, its keys present, numbers positive, lists of ``rotary_dim / 2``) and
    frozen, lists as tuples; ``ModelError`` naming the key otherwise."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise ModelError(f"ModelConfig: rope_scaling must be None or a mapping, got {type(scaling).__name__}")
    kind = scaling.get("rope_type", "default")
    if not isinstance(kind, str) or kind not in ROPE_TYPES:
        raise ModelError(f"ModelConfig: rope_scaling type {kind!r} is not supported; expected one of "
                         f"{sorted(ROPE_TYPES)}")
    required, optional = ROPE_TYPES[kind]
    missing = [k for k in required if k not in scaling]
    if missing:
        raise ModelError(f"ModelConfig: rope_scaling of type {kind!r} needs keys {list(required)}, missing {missing}")
    out = {k: v for k, v in scaling.items() if k != "rope_type"}
    for k in (*required, *optional):
        v = out.get(k)
        if k in _LISTS:
            out[k] = _factor_list(k, v, rotary_dim)
        elif k == "truncate":
            if v is not None and not isinstance(v, bool):
                raise ModelError(f"ModelConfig: rope_scaling['truncate'] must be true or false, got {v!r}")
        elif v is not None or k in required:
            zero = k in _AT_LEAST_ZERO
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0 or \
                    (v == 0 and not zero):
                raise ModelError(f"ModelConfig: rope_scaling[{k!r}] must be a {'non-negative' if zero else 'positive'} "
                                 f"number, got {v!r}")
    if kind == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ModelError(f"ModelConfig: llama3 rope_scaling needs high_freq_factor > low_freq_factor, got "
                         f"{out['high_freq_factor']} and {out['low_freq_factor']}")
    return MappingProxyType({"rope_type": kind, **out})


def _factor_list(key: str, value: Any, rotary_dim: int) -> tuple[float, ...]:
    values = tuple(value) if isinstance(value, list | tuple) else ()
    ok = all(isinstance(f, int | float) and not isinstance(f, bool) and math.isfinite(f) and f > 0 for f in values)
    if not ok or len(values) != rotary_dim // 2:
        raise ModelError(f"ModelConfig: rope_scaling[{key!r}] must be {rotary_dim // 2} positive numbers (one per "
                         f"rotated frequency: rotary dims / 2), got {len(values) if ok else value!r:.80}"
                         f"{' values' if ok else ''}")
    return tuple(float(f) for f in values)


# the layer kinds a transformers 5 ``rope_parameters`` may hold one RoPE set each for (Gemma 3's)
_LAYER_KINDS = ("full_attention", "sliding_attention")
# the keys of a RoPE set that are no scaling: its base, the rotated part of each head, the old name of its type, and
# Qwen3.5's multimodal sections (all one position for text)
_NOT_SCALING = ("rope_theta", "rope_type", "type", "partial_rotary_factor", "mrope_section", "mrope_interleaved")
# the types whose pre-training context transformers takes from a top-level config.json key where there is one (Phi-3
# keeps it there), else from the set, else ``max_position_embeddings``
_ORIGINAL_CONTEXT = ("llama3", "yarn", "longrope")


def rope_from_hf(c: Mapping[str, Any], default_theta: float, source: str, kind: str = "full_attention",
                 theta_key: str = "rope_theta") -> dict[str, Any]:
    """One RoPE set of a ``config.json`` dict ``c`` as transformers' ``standardize_rope_params`` makes it: 4.x's
    ``rope_scaling`` (with ``rope_theta`` beside it), else 5.x's ``rope_parameters`` (its ``kind`` entry where it
    holds one set per layer kind); the base from the set, else ``c[theta_key]``, else ``default_theta`` (the family's,
    as transformers' config class ``default_theta``); ``partial_rotary_factor`` from the set, else ``c``'s; the type
    under ``rope_type`` ("default" when none is named; 4.x spelled it ``type``); a llama3 / YaRN / LongRoPE set's
    ``original_max_position_embeddings`` from ``c`` where it has one (Phi-3), else the set's, else
    ``max_position_embeddings``. Returns the set (unchecked: ``check_rope_scaling`` follows); ``source`` names the
    file in errors."""
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if isinstance(rope, Mapping) and any(k in _LAYER_KINDS for k in rope):
        rope = rope.get(kind) or {}
    if not isinstance(rope, Mapping):
        raise ModelError(f"{source}: rope_parameters (or rope_scaling) must be an object, got {rope!r:.80}")
    out = dict(rope)
    out.setdefault("rope_theta", c.get(theta_key, default_theta))
    if c.get("partial_rotary_factor") is not None:
        out.setdefault("partial_rotary_factor", c["partial_rotary_factor"])
    out["rope_type"] = out.get("rope_type", out.pop("type", "default"))
    out.pop("type", None)
    if out["rope_type"] in _ORIGINAL_CONTEXT:
        if c.get("original_max_position_embeddings") is not None:
            out["original_max_position_embeddings"] = c["original_max_position_embeddings"]
        else:
            out.setdefault("original_max_position_embeddings", c.get("max_position_embeddings"))
    return out


def scaling_of(rope: Mapping[str, Any]) -> dict[str, Any] | None:
    """The scaling of a RoPE set (``rope_from_hf``): its type and the keys that are neither its base nor its rotated
    part; None for the default type."""
    if rope.get("rope_type", "default") == "default":
        return None
    return {"rope_type": rope["rope_type"], **{k: v for k, v in rope.items() if k not in _NOT_SCALING}}


def rope_inv_freq(config: ModelConfig, local: bool = False, context: int | None = None) -> torch.Tensor:
    """RoPE inverse frequencies, ``[rotary_dim // 2]`` float32, with the config's scaling applied (``local``: the
    sliding layers' own base ``rope_local_theta``, unscaled). ``context``: the positions the model is loaded for
    (default ``max_position_embeddings``), which picks LongRoPE's short or long factors.

    Rotation i of a head turns by ``position * inv_freq[i]`` (the "rotate half" pairing: dims i and
    i + rotary_dim/2; rotary_dim is head_dim unless the config rotates only part of each head).
    """
    dim = config.rotary_dim
    theta = config.rope_local_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = None if local else config.rope_scaling
    kind = "default" if s is None else s["rope_type"]
    if kind == "linear":
        return inv_freq / float(s["factor"])
    if kind == "factors":
        return inv_freq / torch.tensor(s["factors"], dtype=torch.float32)
    if kind == "llama3":
        return _llama3(inv_freq, s)
    if kind == "yarn":
        return _yarn(inv_freq, s, dim, theta)
    if kind == "longrope":
        long = (context or config.max_position_embeddings) > s["original_max_position_embeddings"]
        return inv_freq / torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32)
    return inv_freq.to(torch.float32)


def _llama3(inv_freq: torch.Tensor, s: Mapping[str, Any]) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths (> old_len / low) are slowed by `factor`, short ones (< old_len / high) kept,
    # the band between is interpolated smoothly
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled).to(torch.float32)


def _yarn(inv_freq: torch.Tensor, s: Mapping[str, Any], dim: int, theta: float) -> torch.Tensor:
    """Frequency i keeps its value (extrapolation) below the ramp's start, is divided by ``factor`` (interpolation)
    past its end, and is blended linearly between; the ramp runs over the dims whose wavelengths turn between
    ``beta_fast`` and ``beta_slow`` times in ``original_max_position_embeddings`` positions."""
    factor, old_len = float(s["factor"]), float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = s.get("beta_fast") or 32.0, s.get("beta_slow") or 1.0

    def dim_of(rotations: float) -> float:  # the dim whose wavelength turns `rotations` times in old_len positions
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # 0: keep, 1: divide
    return (inv_freq / factor * ramp + inv_freq * (1 - ramp)).to(torch.float32)


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor YaRN and LongRoPE put on cos and sin (so on each rotated dim of q and k); 1.0 for the others."""
    s = config.rope_scaling
    kind = "default" if s is None else s["rope_type"]
    if kind not in ("yarn", "longrope"):
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    if kind == "longrope":
        old_len = s["original_max_position_embeddings"]
        factor = s.get("factor") or config.max_position_embeddings / old_len
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    return _yarn_attention(s)


def _yarn_attention(s: Mapping[str, Any]) -> float:
    """YaRN's default factor on cos and sin: ``mscale`` terms of ``factor`` (their ratio with ``mscale_all_dim``)."""
    factor, mscale, mscale_all = float(s["factor"]), s.get("mscale"), s.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    return yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term: ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# llama.cpp's RoPE tensors: Llama 3's divisors, Phi-3 128k's LongRoPE factors (read into the config, not weights)
GGUF_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def rope_scaling_from_gguf(m: GgufMeta, context_length: int, tensors: Mapping[str, torch.Tensor]
                           ) -> dict[str, Any] | None:
    """The rope scaling of a GGUF file as llama.cpp reads it (unchecked: ``check_rope_scaling`` follows):
    ``rope_freqs.weight`` (Llama 3); ``rope_factors_long`` / ``_short.weight`` (Phi-3 128k LongRoPE, with
    ``rope.scaling.attn_factor``); else ``rope.scaling.type`` "linear" (``.factor``) or "yarn" (``.factor``,
    ``.original_context_length`` defaulting to ``context_length``, ``.yarn_beta_fast`` / ``_slow``,
    ``.yarn_attn_factor``: the config's attention_factor, ``.yarn_log_multiplier``: mscale_all_dim with mscale 1, and
    ``.attn_factor``, a further factor on the attention scale). ``tensors``: those of ``GGUF_ROPE_TENSORS`` the file
    has, dequantized."""
    if "rope_freqs.weight" in tensors:
        return {"rope_type": "factors", "factors": tensors["rope_freqs.weight"].tolist()}
    kind = m.get("rope.scaling.type")
    old_len = m.get("rope.scaling.original_context_length", context_length)
    attn = m.get("rope.scaling.attn_factor")
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if long is not None or short is not None or kind == "longrope":
        if long is None or short is None:
            has = [n for n, t in (("long", long), ("short", short)) if t is not None]
            raise ModelError(f"{m.path}: LongRoPE scaling needs both rope_factors_long.weight and "
                             f"rope_factors_short.weight; the file has {' '.join(has) or 'neither'}")
        return {"rope_type": "longrope", "long_factor": long.tolist(), "short_factor": short.tolist(),
                "original_max_position_embeddings": old_len, "attention_factor": attn}
    if kind in (None, "none"):
        return None
    factor = m.get("rope.scaling.factor")
    if kind == "linear":  # llama.cpp reads a missing or 0 factor as no scaling
        return {"rope_type": "linear", "factor": factor} if factor else None
    if kind != "yarn":
        raise ModelError(f"{m.path}: metadata key {m.key('rope.scaling.type')} is {kind!r}; expected one of 'none', "
                         "'linear', 'yarn', 'longrope' (llama.cpp's rope scaling types)")
    if factor is None:
        raise ModelError(f"{m.path}: metadata key {m.key('rope.scaling.type')} is 'yarn' but "
                         f"{m.key('rope.scaling.factor')} is missing; YaRN needs its factor")
    s = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": old_len,
         "beta_fast": m.get("rope.scaling.yarn_beta_fast"), "beta_slow": m.get("rope.scaling.yarn_beta_slow"),
         "attention_factor": m.get("rope.scaling.yarn_attn_factor")}
    log_mul = m.get("rope.scaling.yarn_log_multiplier")
    if log_mul:
        s |= {"mscale": 1.0, "mscale_all_dim": log_mul}
    if attn is not None and attn != 1 and s["attention_factor"] is None:
        checked = check_rope_scaling(s, 2)  # its numbers, before computing with them
        s["attention_factor"] = _yarn_attention(checked) * _number(attn, m.key("rope.scaling.attn_factor"), m)
    return s


def _number(value: Any, key: str, m: GgufMeta) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ModelError(f"{m.path}: metadata key {key} is {value!r}; expected a positive number")
    return float(value)
