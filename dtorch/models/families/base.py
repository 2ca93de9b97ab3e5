"""What a model family declares (``Family``), and the pieces its tensor table is made of.

A family's tensor table is one list of ``Weight`` s: each weight the model runs ("layers.3.qkv"), the checkpoint
tensors it is made of (``Source``: the Hugging Face name, the llama.cpp name, the shape, how tensor parallelism cuts
it), how they are joined, and the shape the model holds. Both loaders read their names and shapes from it, and
``models.weights`` reads and places each weight by it. The builders below make the tables of the Llama-like
decoders; a family whose tensors differ writes its own pieces beside them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from dtorch.core.errors import ModelError
from dtorch.core.placement import Shard

if TYPE_CHECKING:
    from dtorch.models.config import ModelConfig
    from dtorch.models.layout import Layout

Combine = Callable[[list[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Source:
    """One checkpoint tensor of a weight: its Hugging Face name, the llama.cpp names a GGUF file holds it under (its
    rows concatenated from them, in order; empty: no GGUF tensor is it), its shape as transformers holds it, and how
    tensor parallelism cuts it: along ``dim`` (None: every device reads it whole) in whole ``unit`` s (an int, or a
    ``Shard`` for a tensor cut block by block)."""

    hf: str
    gguf: tuple[str, ...]
    shape: tuple[int, ...]
    dim: int | None = None
    unit: int | Shard = 1


@dataclass(frozen=True, slots=True)
class Weight:
    """A weight the model runs: ``name`` ("layers.3.qkv"), made of ``sources`` joined by ``combine`` into ``shape``
    (a projection as Wt [K, N]). ``combine.rows``, where set, reorders each source's rows before the join (applied to
    block-format rows too)."""

    name: str
    sources: tuple[Source, ...]
    combine: Combine
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GgufMeta:
    """A GGUF file's metadata as a family's config hook reads it: ``get("rope.freq_base_swa")`` reads
    ``{arch}.rope.freq_base_swa``; ``tensors`` are the names of the file's tensors."""

    meta: Mapping[str, Any]
    arch: str
    path: Path
    tensors: frozenset[str]

    def key(self, key: str) -> str:
        return f"{self.arch}.{key}"

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(self.key(key), default)

    def need(self, key: str) -> Any:
        if self.key(key) not in self.meta:
            raise ModelError(f"{self.path}: metadata key {self.key(key)} is missing; a {self.arch} GGUF must have it")
        return self.meta[self.key(key)]

    def positive(self, key: str) -> int:
        """``need(key)``, which must be an int >= 1."""
        v = self.need(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ModelError(f"{self.path}: metadata key {self.key(key)} is {v!r}; expected a positive integer")
        return v

    def rotary_fraction(self, head_dim: int, default: int | None = None) -> float:
        """``rope.dimension_count`` (the rotated dims of each head; ``default`` when absent) over ``head_dim``."""
        rot = self.get("rope.dimension_count", default) if default is not None else self.need("rope.dimension_count")
        if isinstance(rot, bool) or not isinstance(rot, int) or not 2 <= rot <= head_dim or rot % 2:
            raise ModelError(f"{self.path}: metadata key {self.key('rope.dimension_count')} is {rot!r}; expected an "
                             f"even number of rotated dims <= the head dim {head_dim}")
        return rot / head_dim


@dataclass(frozen=True, slots=True)
class View:
    """A Hugging Face tensor made of GGUF tensors: the rows of ``parts`` concatenated (a 1-D tensor's rows are its
    items), row i of the result taken from row ``rows[i]`` (None: in order), column j of a 2-D one from column
    ``cols[j]``, then ``value`` applied (undoing an elementwise change) and reshaped to ``shape``."""

    parts: tuple[Any, ...]
    shape: tuple[int, ...]
    rows: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    value: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def plain(self) -> bool:
        """Whether the tensor is one GGUF tensor as stored."""
        return len(self.parts) == 1 and self.rows is None and self.cols is None and self.value is None and \
            self.shape == gguf_shape(self.parts[0])


def gguf_shape(t: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape as torch has it (GGUF lists dims fastest first)."""
    return tuple(int(s) for s in reversed(t.shape))


def shift_norms(views: dict[str, View], keep: Callable[[str], bool] = lambda name: False) -> None:
    """Undo llama.cpp's converter storing (1 + w) RMS norm weights with the 1 added: every ``*norm.weight`` view but
    those ``keep`` names gives w - 1."""
    for name in [n for n in views if n.endswith("norm.weight") and not keep(n)]:
        views[name] = View(views[name].parts, views[name].shape, value=lambda w: w - 1)


def shifted_norms(views: dict[str, View], config: ModelConfig, path: Path) -> None:
    """A ``Family.gguf_views`` hook: every RMS norm of the file stored with its 1 added (``shift_norms``), as
    llama.cpp's converter stores Gemma's (1 + w) norms."""
    shift_norms(views)


# the common fields of the tiny random models (``Family.tiny``): hidden 64, 4 query heads over 2 KV heads, 2 layers,
# a vocabulary of 128; and those of the hybrid (gated delta net) ones, and of sparse MoE MLPs
TINY_DENSE = MappingProxyType(dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1,
    eos_token_id=2))
TINY_HYBRID = MappingProxyType(dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2,
    max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2))
TINY_EXPERTS = MappingProxyType(dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32))


def all_full_attention(types: Any) -> bool:
    """Whether a ``layer_types`` value (None or a list) has full attention layers only: an ``hf_inert`` predicate."""
    return types is None or (isinstance(types, list | tuple) and all(t == "full_attention" for t in types))


def is_false(value: Any) -> bool:
    """An ``hf_inert`` predicate: the value is false or null."""
    return value is None or value is False


def _empty() -> Mapping[str, Any]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Family:
    """Everything dtorch knows of one model family (``ModelConfig.family``), read by the config, both loaders and the
    weight placement (``dtorch/models/families/qwen2.py`` is the smallest).

    - ``hf_types`` / ``gguf_arch``: the ``model_type`` s of a ``config.json`` and the ``general.architecture`` of a
      GGUF file it reads (``hf_multimodal``: model types whose ``text_config`` is a model of the family, its tensors
      under ``language_model``);
    - ``fields``: the ``ModelConfig`` fields the family fixes (``attention_bias``, ``qk_norm``, ...);
    - ``hf_keys`` / ``gguf_keys``: its own config keys beyond the common ones, field -> key (GGUF: after ``{arch}.``),
      each type- and range-checked before anything reads it;
    - ``hf_config(c, source)`` / ``gguf_config(meta, common)``: its own fields from a ``config.json`` dict (which it
      may edit: the common parse runs after it) or from GGUF metadata (``common``: the fields read so far);
    - ``tensors(config, layout)``: its tensor table (``Weight`` s, made of ``Source`` s);
    - ``layer_types``: the mixers its layers may have; ``moe``: whether it may have sparse MoE layers;
    - ``gguf_permute_qk``: llama.cpp stores q/k rows permuted for interleaved RoPE; ``gguf_views(views, config,
      path)``: undo any other change its converter makes (``View`` s by Hugging Face name, edited in place);
    - ``unused``: name prefixes of checkpoint tensors a causal LM does not run (transformers skips them too);
    - ``hf_rope_theta``: the RoPE base of a ``config.json`` that gives none (transformers' ``default_theta`` of the
      family's config class);
    - ``hf_read``: the ``config.json`` keys its ``hf_config`` reads beyond ``hf_keys``; ``hf_inert``: keys that change
      nothing of its models, key -> a predicate of the values for which that holds (None: any). A key no list names
      is refused at load (``config_fields.check_known_keys``);
    - ``tiny``: model_type -> (transformers config class, its fields): the tiny random model of each of its
      ``model_type`` s that the tests, benchmarks and GPU check build (``models.tiny``; start from ``TINY_DENSE``).
    """

    name: str
    hf_types: tuple[str, ...]
    gguf_arch: str | None = None
    fields: Mapping[str, Any] = field(default_factory=_empty)
    hf_keys: Mapping[str, str] = field(default_factory=_empty)
    gguf_keys: Mapping[str, str] = field(default_factory=_empty)
    hf_config: Callable[[dict[str, Any], str], dict[str, Any]] | None = None
    gguf_config: Callable[[GgufMeta, dict[str, Any]], dict[str, Any]] | None = None
    tensors: Callable[[ModelConfig, Layout], Iterable[Weight]] | None = None
    layer_types: tuple[str, ...] = ("full_attention", "sliding_attention")
    moe: bool = False
    gguf_permute_qk: bool = False
    gguf_views: Callable[[dict[str, View], ModelConfig, Path], None] | None = None
    unused: tuple[str, ...] = ()
    hf_multimodal: tuple[str, ...] = ()
    tiny: Mapping[str, tuple[str, Mapping[str, Any]]] = field(default_factory=_empty)
    hf_rope_theta: float = 10000.0
    hf_read: tuple[str, ...] = ()
    hf_inert: Mapping[str, Callable[[Any], bool] | None] = field(default_factory=_empty)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier() or not self.hf_types:
            raise ModelError(f"Family: name must be an identifier and hf_types non-empty, got {self.name!r}, "
                             f"{self.hf_types!r}")
        for name in ("fields", "hf_keys", "gguf_keys", "tiny", "hf_inert"):  # frozen copies: a family is a constant
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        object.__setattr__(self, "tensors", self.tensors or decoder(dense_layer))
        from dtorch.models.config_fields import known

        unknown = sorted(f for f in (*self.hf_keys, *self.gguf_keys) if f not in known())
        if unknown:
            raise ModelError(f"Family {self.name!r}: hf_keys / gguf_keys name {unknown}, which config_fields does not "
                             "check; declare each with a spec (a ModelConfig field, or config_fields.FILE_ONLY)")


# -- joining sources -------------------------------------------------------------------------------------------------

def cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, 0) if len(parts) > 1 else parts[0]


def cat_t(parts: list[torch.Tensor]) -> torch.Tensor:
    """Rows joined, transposed: the W [N, K] of each source as one Wt [K, N]."""
    return torch.cat(parts, 0).t() if len(parts) > 1 else parts[0].t()


def plus_one(parts: list[torch.Tensor]) -> torch.Tensor:
    """A zero-centred RMS norm weight as the scale it stands for: 1 + weight (in float32)."""
    return parts[0].float() + 1


def transposed_rows(*rows: Callable[[torch.Tensor], torch.Tensor] | None) -> Combine:
    """A combine that reorders each source's rows with its function of ``rows`` (None: as they are), joins them and
    transposes (Wt [K, N]); ``combine.rows`` also reorders block-format rows, source by source."""
    def combine(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([p if f is None else f(p) for f, p in zip(rows, parts, strict=True)], 0).t()

    combine.rows = rows
    return combine


# -- the Llama-like decoder --------------------------------------------------------------------------------------------

Layer = Callable[["ModelConfig", "Layout", int], Iterable[Weight]]


def decoder(layer: Layer) -> Callable[[ModelConfig, Layout], Iterator[Weight]]:
    """The tensor table of a decoder whose layer i holds ``layer(config, layout, i)``: the embedding, the LM head (the
    embedding's rows when tied), the final norm, then the layers."""
    def tensors(c: ModelConfig, layout: Layout) -> Iterator[Weight]:
        V, E = c.vocab_size, c.hidden_size
        embed = Source("model.embed_tokens.weight", ("token_embd.weight",), (V, E), 0)
        head = embed if c.tie_word_embeddings else Source("lm_head.weight", ("output.weight",), (V, E), 0)
        yield Weight("embed", (embed,), cat, (V, E))
        yield Weight("lm_head", (head,), cat_t, (E, V))
        yield norm(c, "final_norm", "model.norm.weight", "output_norm.weight", E)
        for i in range(c.num_layers):
            yield from layer(c, layout, i)

    return tensors


def layer_source(i: int, hf: str, gguf: str | tuple[str, ...] | None, shape: tuple[int, ...], dim: int | None = None,
                 unit: int | Shard = 1) -> Source:
    """A ``Source`` of layer ``i``: ``hf`` under ``model.layers.{i}.``, each llama.cpp name under ``blk.{i}.``."""
    names = () if gguf is None else (gguf,) if isinstance(gguf, str) else gguf
    return Source(f"model.layers.{i}.{hf}", tuple(f"blk.{i}.{g}" for g in names), shape, dim, unit)


def norm(c: ModelConfig, name: str, hf: str, gguf: str, size: int) -> Weight:
    """An RMS norm weight [size], every device's whole; (1 + w) folded in where the config's norms are so."""
    return Weight(name, (Source(hf, (gguf,), (size,)),), plus_one if c.norm_plus_one else cat, (size,))


def layer_norm(c: ModelConfig, i: int, name: str, hf: str, gguf: str, size: int | None = None) -> Weight:
    """``norm`` of layer ``i``: model weight ``layers.{i}.{name}``, ``model.layers.{i}.{hf}.weight``,
    ``blk.{i}.{gguf}.weight``; ``size``: hidden_size unless given."""
    return norm(c, f"layers.{i}.{name}", f"model.layers.{i}.{hf}.weight", f"blk.{i}.{gguf}.weight",
                size or c.hidden_size)


def split_qkv(c: ModelConfig, i: int, what: str = "weight") -> tuple[Source, ...]:
    """q_proj, k_proj and v_proj (``what``: "weight" or "bias"), each device its KV heads' rows of each."""
    G, D, E = c.num_heads // c.num_kv_heads, c.head_dim, c.hidden_size
    a = "self_attn."
    rows = (c.q_size, c.kv_size, c.kv_size)
    return tuple(layer_source(i, f"{a}{p}_proj.{what}", f"attn_{p}.{what}", (n, E) if what == "weight" else (n,), 0, u)
                 for p, n, u in zip("qkv", rows, (G * D, D, D), strict=True))


def attention(c: ModelConfig, i: int, qkv: Iterable[Source] | None = None,
              combine: Combine = cat_t) -> Iterator[Weight]:
    """An attention layer's weights: ``qkv`` Wt [E, (H + 2 Hkv) D] (default: ``split_qkv``), its bias where the config
    has one, the q/k norms where it has them, and o Wt [H D, E] (row parallel)."""
    G, D, E = c.num_heads // c.num_kv_heads, c.head_dim, c.hidden_size
    n, a = f"layers.{i}.", "self_attn."
    width = c.q_size * (2 if c.attn_output_gate else 1) + 2 * c.kv_size
    yield Weight(n + "qkv", tuple(qkv or split_qkv(c, i)), combine, (E, width))
    if c.attention_bias:
        yield Weight(n + "qkv_bias", split_qkv(c, i, "bias"), cat, (c.q_size + 2 * c.kv_size,))
    if c.qk_norm:  # over each head's D dims, or over all of q's (k's) heads at once (``qk_norm_over``)
        every = c.qk_norm_over == "all"
        yield layer_norm(c, i, "q_norm", a + "q_norm", "attn_q_norm", c.q_size if every else D)
        yield layer_norm(c, i, "k_norm", a + "k_norm", "attn_k_norm", c.kv_size if every else D)
    yield Weight(n + "o", (layer_source(i, a + "o_proj.weight", "attn_output.weight", (E, c.q_size), 1, G * D),),
                 cat_t, (c.q_size, E))


def mlp(c: ModelConfig, i: int, gate_up: Iterable[Source] | None = None) -> Iterator[Weight]:
    """A dense SwiGLU / GeGLU MLP: gate_up Wt [E, 2 I] ([gate | up], default: gate_proj and up_proj, each device its
    rows of each) and down Wt [I, E] (row parallel)."""
    E, inter, m = c.hidden_size, c.intermediate_size, "mlp."
    if gate_up is None:
        gate_up = (layer_source(i, m + "gate_proj.weight", "ffn_gate.weight", (inter, E), 0),
                   layer_source(i, m + "up_proj.weight", "ffn_up.weight", (inter, E), 0))
    yield Weight(f"layers.{i}.gate_up", tuple(gate_up), cat_t, (E, 2 * inter))
    yield Weight(f"layers.{i}.down", (layer_source(i, m + "down_proj.weight", "ffn_down.weight", (E, inter), 1),),
                 cat_t, (inter, E))


def dense_layer(c: ModelConfig, layout: Layout, i: int, qkv: Iterable[Source] | None = None,
                gate_up: Iterable[Source] | None = None) -> Iterator[Weight]:
    """A Llama layer: the input norm, attention, the post-attention norm and a dense MLP (``qkv`` / ``gate_up``: their
    sources where a family's checkpoint stores them otherwise, see ``attention`` and ``mlp``)."""
    yield layer_norm(c, i, "input_norm", "input_layernorm", "attn_norm")
    yield layer_norm(c, i, "post_norm", "post_attention_layernorm", "ffn_norm")
    yield from attention(c, i, qkv)
    yield from mlp(c, i, gate_up)


def every_layer_slides(window: Any, layers: Any) -> dict[str, Any]:
    """The fields of a model whose every layer slides over ``window`` keys (none when ``window`` is None)."""
    if window is None or not isinstance(layers, int):
        return {}
    return dict(sliding_window=window, layer_types=("sliding_attention",) * layers)


def gguf_window(m: GgufMeta) -> int | None:
    """``attention.sliding_window`` of a GGUF file (checked), or None."""
    from dtorch.models.config_fields import check_field

    window = m.get("attention.sliding_window")
    if window is not None:
        check_field("sliding_window", window, f"{m.path}: {m.key('attention.sliding_window')}")
    return window


def gguf_swa_layers(m: GgufMeta, layers: int, period: int) -> tuple[str, ...]:
    """The layer types of a GGUF file as llama.cpp's ``set_swa_pattern`` lays them out from
    ``attention.sliding_window_pattern`` (``period`` when absent): an int n makes layer i slide unless
    i % n == n - 1 (0: every layer slides, 1: none); a list holds one bool a layer (true: it slides)."""
    key = m.key("attention.sliding_window_pattern")
    pattern = m.get("attention.sliding_window_pattern", period)
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(b, bool) for b in pattern):
            raise ModelError(f"{m.path}: {key} must hold one true/false per layer ({layers}), got {pattern!r}")
        slides = pattern
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and 0 <= pattern <= layers:
        slides = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    else:
        raise ModelError(f"{m.path}: {key} must be an int in [0, {layers}] or a list of bools, got {pattern!r}")
    return tuple("sliding_attention" if s else "full_attention" for s in slides)
