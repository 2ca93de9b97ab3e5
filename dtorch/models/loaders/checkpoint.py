"""What every loader returns: a ``Checkpoint`` of Hugging Face named tensors checked against its config."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch

from dtorch.core.errors import ModelError
from dtorch.core.memory import MemoryKind, adopt
from dtorch.models.config import ModelConfig

if TYPE_CHECKING:
    from dtorch.models.tokenizer import Tokenizer

T = TypeVar("T")


@dataclass
class Checkpoint:
    """A model's config, its weights keyed by Hugging Face names, and its tokenizer when the files have one.

    Weight shapes follow torch's ``nn.Linear``: ``q_proj.weight`` is ``[num_heads * head_dim, hidden]``.
    """

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None = None
    source: str = ""
    chat_template: str | None = None
    # loader extras: GGUF files give "tensor_types" (HF name -> quantization type) and "gguf" (scalar metadata keys)
    metadata: dict[str, object] = field(default_factory=dict)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of ``config`` needs, by Hugging Face name, with its shape."""
    h, q, kv, ff = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h), p + "mlp.down_proj.weight": (h, ff),
        }
        if config.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (config.head_dim,),
                       p + "self_attn.k_norm.weight": (config.head_dim,)}
    return shapes


def finish_tensors(raw: dict[str, torch.Tensor], config: ModelConfig, dtype: torch.dtype,
                   source: str) -> dict[str, torch.Tensor]:
    """Check ``raw`` against ``config`` (missing / misshapen tensors raise), cast to ``dtype``, tag PERSISTENT.

    Tensors the model would not use raise, except rotary caches and an lm_head beside tied embeddings (dropped).
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ModelError(f"load_checkpoint: dtype must be a floating torch.dtype, got {dtype!r}")
    expected = expected_shapes(config)
    # a tensor the model would not use means a variant it does not implement (llama biases, ...): refuse, don't drop.
    # Exceptions: rotary caches, and lm_head.weight stored beside tied embeddings.
    extra = sorted(n for n in raw if n not in expected and not n.endswith("rotary_emb.inv_freq")
                   and not (n == "lm_head.weight" and config.tie_word_embeddings))
    if extra:
        raise ModelError(f"{source}: unexpected tensors {extra[:4]}{' ...' if len(extra) > 4 else ''}; a "
                         f"{config.family} model with this config (attention_bias={config.attention_bias}, "
                         f"qk_norm={config.qk_norm}) has no such weights")
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected.items():
        t = raw.get(name)
        if t is None:
            raise ModelError(f"{source}: missing tensor {name!r} (expected shape {list(shape)} for a "
                             f"{config.family} model with {config.num_layers} layers)")
        if tuple(t.shape) != shape:
            raise ModelError(f"{source}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)} "
                             f"from the config")
        out[name] = adopt(t.to(dtype).contiguous(), MemoryKind.PERSISTENT)
    return out


def progress(items: Iterable[T], total: int, desc: str) -> Iterator[T]:
    """``items``, with a tqdm bar on stderr when stderr is a terminal."""
    if not sys.stderr.isatty():
        yield from items
        return
    from tqdm import tqdm

    yield from tqdm(items, total=total, desc=desc, unit="tensor", leave=False)
