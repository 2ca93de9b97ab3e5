"""How model files spell the configuration's fields, and the type and range each may hold.

Every field is checked where it is read, before anything is computed from it, and an error names the file and the key
as the file spells it (``num_hidden_layers`` in a ``config.json``, ``llama.block_count`` in a GGUF): a file is
untrusted, and a null head count or a 10**9 layer count must stop here rather than in an allocator.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from functools import cache
from types import MappingProxyType
from typing import Any

from dtorch.core.errors import ModelError

# A field's knowledge is declared once, beside its default in ``ModelConfig`` (``field(metadata=spec(...))``): its
# kind and range, the key a Hugging Face config.json spells it with and the GGUF key llama.cpp's converter writes.
# The tables below (``limits``, ``hf_keys``, ``gguf_keys``, ``known``) are read from there; ``FILE_ONLY`` declares the
# few names a file holds that are no field (a family turns them into fields).
KINDS = ("size", "number", "bool", "token_id", "token_ids", "window", "mapping", "list")


@dataclass(frozen=True, slots=True)
class Spec:
    """What a file may give for one field: ``kind`` (one of ``KINDS``: ``size`` an int in [lo, hi], ``number`` a
    positive finite number, ``window`` an int >= 1, ``list`` at most one entry per possible layer...), the common
    config.json key ``hf`` and GGUF key ``gguf`` (``{arch}`` stands for the architecture), None where a family's own
    module reads it."""
    kind: str
    lo: int = 0
    hi: int = 0
    hf: str | None = None
    gguf: str | None = None


def spec(kind: str, lo: int = 0, hi: int = 0, *, hf: str | None = None, gguf: str | None = None) -> dict[str, Spec]:
    """A ``dataclasses.field`` metadata declaring a field's ``Spec``."""
    if kind not in KINDS or (kind == "size") != (hi > 0):
        raise ValueError(f"spec: kind must be one of {KINDS} (a size with its range), got {kind!r} [{lo}, {hi}]")
    return {"spec": Spec(kind, lo, hi, hf, gguf)}


# the sizes' ranges are generous for today's models (Llama 3 405B has 126 layers and hidden 16384, Llama 4 Scout a
# 10M context, Qwen3-Next 512 experts), small enough that what a file claims cannot make the shape tables, the layer
# schedule or the RoPE table exhaust memory before the memory estimate looks at it
MAX_LAYERS = 1 << 12
FILE_ONLY: dict[str, Spec] = {
    "num_local_experts": Spec("size", 0, 1 << 12),  # Mixtral's spelling of num_experts
    "full_attention_interval": Spec("size", 1, MAX_LAYERS),  # hybrid models: every n-th layer is full attention
    "query_pre_attn_scalar": Spec("number"),  # Gemma: q k^T times its -0.5th power
    "expert_weights_norm": Spec("bool"),  # GGUF's spelling of norm_topk_prob
    "rope_parameters": Spec("mapping", hf="rope_parameters"),  # transformers 5: rope_theta and rope_scaling together
    "eos_token_id": Spec("token_id", gguf="tokenizer.ggml.eos_token_id"),
    "eot_token_id": Spec("token_id", gguf="tokenizer.ggml.eot_token_id"),
}


@cache
def specs() -> Mapping[str, Spec]:
    """Every checked name -> its ``Spec``: the fields of ``ModelConfig`` that declare one, and ``FILE_ONLY``."""
    from dtorch.models.config import ModelConfig  # it declares the fields with this module's ``spec``

    declared = {f.name: f.metadata["spec"] for f in fields(ModelConfig) if "spec" in f.metadata}
    return MappingProxyType(declared | FILE_ONLY)


def default(name: str) -> Any:
    """The default of ``ModelConfig`` field ``name``: what a file that omits its key gets."""
    from dtorch.models.config import ModelConfig

    return ModelConfig.__dataclass_fields__[name].default


def known() -> frozenset[str]:
    """Every name ``check_field`` checks (a family's ``hf_keys`` / ``gguf_keys`` may name these only)."""
    return frozenset(specs())


def limits(name: str) -> tuple[int, int]:
    """(lowest, highest) of the size field ``name``."""
    s = specs()[name]
    return s.lo, s.hi


# keys config.json may set to null (transformers then derives or omits them)
_HF_NULLABLE = ("head_dim", "num_key_value_heads", "bos_token_id", "eos_token_id", "rope_scaling", "rope_parameters",
                "layer_types", "mlp_only_layers", "sliding_window", "partial_rotary_factor")


# config.json keys that ``ModelConfig.from_hf`` reads beside ``hf_keys`` (for every family)
HF_READ = ("model_type", "hidden_act", "hidden_activation", "mlp_bias", "attention_bias",
           "original_max_position_embeddings")
# config.json keys that change no output of a causal LM at inference, for every family: transformers'
# ``PretrainedConfig`` attributes, what its models read only in training (dropouts, initialization, auxiliary losses),
# generation defaults and other tokens' ids. Any other key a family neither reads nor lists (``Family.hf_inert``) is
# refused at load: a ``quantization_config`` or Granite's ``*_multiplier`` keys would otherwise run silently wrong.
HF_INERT = frozenset((
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "label2id",
    "is_encoder_decoder", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
    "transformers_version", "use_cache", "tokenizer_class", "auto_map", "pad_token_id", "sep_token_id",
    "unk_token_id", "cls_token_id", "decoder_start_token_id", "initializer_range", "attention_dropout",
    "hidden_dropout", "embd_pdrop", "resid_pdrop", "output_router_logits", "router_aux_loss_coef",
    "pretraining_tp",  # Llama's split of each product in training: the same sums
    "use_return_dict", "torchscript", "max_length", "min_length", "do_sample", "temperature", "top_k", "top_p",
    "num_beams", "repetition_penalty", "cache_implementation",
))


def check_known_keys(raw: Mapping[str, Any], read: Iterable[str], inert: Mapping[str, Any], family: str,
                     source: str) -> None:
    """Refuse a ``config.json`` key that neither the loader reads (``read``) nor changes nothing (``HF_INERT``, or the
    family's ``inert``: key -> a predicate its value must pass, or None for any value), naming the key: an unknown
    key may change the model (a quantization, a multiplier), and running without it would be silently wrong."""
    read = set(read) | HF_INERT
    unknown = sorted(k for k in raw if k not in read and k not in inert)
    if unknown:
        raise ModelError(f"{source}: {family} models do not read {unknown}; a key dtorch does not know may change the "
                         "model's output, so it is refused. If it changes nothing at inference, list it in the "
                         "family's hf_inert (or config_fields.HF_INERT for every family)")
    for key, ok in inert.items():
        if key in raw and ok is not None and not ok(raw[key]):
            raise ModelError(f"{source}: {key}={raw[key]!r} is not supported for {family} models")


def hf_keys(own: Mapping[str, str]) -> dict[str, str]:
    """field -> the key a family's ``config.json`` spells it with: the common ones (each ``Spec.hf``) and the family's
    ``own``."""
    return {name: s.hf for name, s in specs().items() if s.hf is not None} | dict(own)


def gguf_keys(arch: str, own: Mapping[str, str] | None = None) -> dict[str, str]:
    """field -> the metadata key a GGUF file of architecture ``arch`` spells it with: the common ones (each
    ``Spec.gguf``) and a family's ``own`` (field -> key after ``{arch}.``)."""
    common = {name: s.gguf.format(arch=arch) for name, s in specs().items() if s.gguf is not None}
    return common | {name: f"{arch}.{key}" for name, key in (own or {}).items()}


def check_field(field_name: str, value: Any, where: str) -> None:
    """Check one raw value a file gives for ``field_name`` (its type and range, as its ``Spec`` declares); ``where``
    names it in the message ("config.json: num_hidden_layers"). Raises ``ModelError`` saying what was expected and
    what came."""
    def bad(expected: str) -> ModelError:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        return ModelError(f"{where} must be {expected}, got {shown} ({type(value).__name__})")

    s = specs().get(field_name)
    if s is None:
        raise ModelError(f"check_field: no field {field_name!r} (checking {where}); known: {sorted(known())}")
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if s.kind == "size":
        if not is_int or not s.lo <= value <= s.hi:
            raise bad(f"an int in [{s.lo}, {s.hi}]")
    elif s.kind == "number":
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise bad("a positive finite number")
    elif s.kind == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
    elif s.kind == "token_id":
        if not is_int or value < 0:
            raise bad("an int >= 0")
    elif s.kind == "window":
        if not is_int or value < 1:
            raise bad("an int >= 1 (keys a query of a sliding layer sees)")
    elif s.kind == "token_ids":
        ids = value if isinstance(value, list | tuple) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise bad("a token id (an int >= 0) or a list of them")
    elif s.kind == "mapping":
        if not isinstance(value, Mapping):
            raise bad("an object (a mapping of rope settings)")
    elif not isinstance(value, list | tuple) or len(value) > MAX_LAYERS:  # a list
        raise bad(f"a list of at most {MAX_LAYERS} entries")


def check_fields(raw: Mapping[str, Any], keys: Mapping[str, str], source: str,
                 nullable: tuple[str, ...] = ()) -> None:
    """``check_field`` on each key of ``keys`` (field -> key as the file spells it) that ``raw`` holds (a null value
    too, unless its key is in ``nullable``), naming ``source`` and the key."""
    for name, key in keys.items():
        if key in raw and not (raw[key] is None and key in nullable):
            check_field(name, raw[key], f"{source}: {key}")
