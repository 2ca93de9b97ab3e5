"""How model files spell the configuration's fields, and the type and range each may hold.

Every field is checked where it is read, before anything is computed from it, and an error names the file and the key
as the file spells it (``num_hidden_layers`` in a ``config.json``, ``llama.block_count`` in a GGUF): a file is
untrusted, and a null head count or a 10**9 layer count must stop here rather than in an allocator.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from dtorch.core.errors import ModelError

# the integer sizes, field -> (lowest, highest): generous for today's models (Llama 3 405B has 126 layers and hidden
# 16384, Llama 4 Scout a 10M context, Qwen3-Next 512 experts), small enough that what a file claims cannot make the
# shape tables, the layer schedule or the RoPE table exhaust memory before the memory estimate looks at it
LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 22), "hidden_size": (1, 1 << 16), "intermediate_size": (1, 1 << 18),
    "num_layers": (1, 1 << 12), "num_heads": (1, 1 << 12), "num_kv_heads": (1, 1 << 12), "head_dim": (1, 1 << 12),
    "max_position_embeddings": (1, 1 << 24), "num_experts": (0, 1 << 12), "num_experts_per_tok": (0, 1 << 12),
    "moe_intermediate_size": (0, 1 << 18), "decoder_sparse_step": (1, 1 << 12),
    "shared_expert_intermediate_size": (0, 1 << 18), "linear_conv_kernel_dim": (0, 1 << 10),
    "linear_num_key_heads": (0, 1 << 12), "linear_num_value_heads": (0, 1 << 12), "linear_key_head_dim": (0, 1 << 12),
    "linear_value_head_dim": (0, 1 << 12), "full_attention_interval": (1, 1 << 12), "num_local_experts": (0, 1 << 12),
}
_NUMBERS = ("rope_theta", "rms_norm_eps", "partial_rotary_factor", "rope_local_theta",
            "query_pre_attn_scalar", "attention_multiplier", "embedding_multiplier", "residual_multiplier",
            "logits_scaling", "logits_softcap", "attn_softcap")  # positive finite
_BOOLS = ("tie_word_embeddings", "norm_topk_prob", "expert_weights_norm", "attention_bias", "qk_norm",
          "attn_output_gate", "norm_plus_one")
_LISTS = ("layer_types", "mlp_only_layers", "nope_layers")

# field -> the key every Hugging Face config.json spells it with (each checked by ``check_fields`` when present); a
# family's own keys are in its module (``Family.hf_keys``)
HF_KEYS: dict[str, str] = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "max_position_embeddings": "max_position_embeddings", "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps", "partial_rotary_factor": "partial_rotary_factor",
    "rope_scaling": "rope_scaling", "rope_parameters": "rope_parameters",
    "tie_word_embeddings": "tie_word_embeddings", "bos_token_id": "bos_token_id", "eos_token_ids": "eos_token_id",
}
# keys config.json may set to null (transformers then derives or omits them)
_HF_NULLABLE = ("head_dim", "num_key_value_heads", "bos_token_id", "eos_token_id", "rope_scaling", "rope_parameters",
                "layer_types", "mlp_only_layers", "sliding_window", "partial_rotary_factor")


# config.json keys that ``ModelConfig.from_hf`` reads beside ``HF_KEYS`` (for every family)
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
    """field -> the key a family's ``config.json`` spells it with: the common ``HF_KEYS`` and the family's ``own``."""
    return HF_KEYS | dict(own)


def gguf_keys(arch: str, own: Mapping[str, str] | None = None) -> dict[str, str]:
    """field -> the metadata key a GGUF file of architecture ``arch`` spells it with: the common ones and a family's
    ``own`` (field -> key after ``{arch}.``)."""
    keys = {"vocab_size": "vocab_size", "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
            "num_layers": "block_count", "num_heads": "attention.head_count", "num_kv_heads": "attention.head_count_kv",
            "head_dim": "attention.key_length", "max_position_embeddings": "context_length",
            "rope_theta": "rope.freq_base", "rms_norm_eps": "attention.layer_norm_rms_epsilon"} | dict(own or {})
    return {f: f"{arch}.{k}" for f, k in keys.items()} | {"bos_token_id": "tokenizer.ggml.bos_token_id",
                                                          "eos_token_id": "tokenizer.ggml.eos_token_id",
                                                          "eot_token_id": "tokenizer.ggml.eot_token_id"}


def check_field(field_name: str, value: Any, where: str) -> None:
    """Check one raw value a file gives for ``field_name`` (its type and, for sizes, ``LIMITS``); ``where`` names it
    in the message ("config.json: num_hidden_layers"). Raises ``ModelError`` saying what was expected and what came."""
    def bad(expected: str) -> ModelError:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        return ModelError(f"{where} must be {expected}, got {shown} ({type(value).__name__})")

    is_int = isinstance(value, int) and not isinstance(value, bool)
    if field_name in LIMITS:
        lo, hi = LIMITS[field_name]
        if not is_int or not lo <= value <= hi:
            raise bad(f"an int in [{lo}, {hi}]")
    elif field_name in _NUMBERS:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise bad("a positive finite number")
    elif field_name in _BOOLS:
        if not isinstance(value, bool):
            raise bad("true or false")
    elif field_name in ("bos_token_id", "eos_token_id", "eot_token_id"):
        if not is_int or value < 0:
            raise bad("an int >= 0")
    elif field_name == "sliding_window":
        if not is_int or value < 1:
            raise bad("an int >= 1 (keys a query of a sliding layer sees)")
    elif field_name == "eos_token_ids":
        ids = value if isinstance(value, list | tuple) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise bad("a token id (an int >= 0) or a list of them")
    elif field_name in ("rope_scaling", "rope_parameters"):
        if not isinstance(value, Mapping):
            raise bad("an object (a mapping of rope settings)")
    elif field_name in _LISTS:
        if not isinstance(value, list | tuple) or len(value) > LIMITS["num_layers"][1]:
            raise bad(f"a list of at most {LIMITS['num_layers'][1]} entries")
    else:
        raise ModelError(f"check_field: no field {field_name!r} (checking {where}); known: {sorted(KNOWN)}")


# every name ``check_field`` checks (a family's ``hf_keys`` / ``gguf_keys`` may name these only)
KNOWN = frozenset((*LIMITS, *_NUMBERS, *_BOOLS, *_LISTS, "bos_token_id", "eos_token_id", "eot_token_id",
                   "sliding_window", "eos_token_ids", "rope_scaling", "rope_parameters"))


def check_fields(raw: Mapping[str, Any], keys: Mapping[str, str], source: str,
                 nullable: tuple[str, ...] = ()) -> None:
    """``check_field`` on each key of ``keys`` (field -> key as the file spells it) that ``raw`` holds (a null value
    too, unless its key is in ``nullable``), naming ``source`` and the key."""
    for name, key in keys.items():
        if key in raw and not (raw[key] is None and key in nullable):
            check_field(name, raw[key], f"{source}: {key}")
