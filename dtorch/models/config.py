"""Model configuration: one slotted dataclass for every family of ``dtorch.models.families``.

The families differ by configuration: Qwen2 has q/k/v projection biases (``attention_bias``), Qwen3 per-head RMS
norms on q and k (``qk_norm``), Llama 3 scales its RoPE frequencies (``rope_scaling`` of type "llama3"); sparse MoE
MLPs sit on the layers ``is_sparse`` names (``num_experts`` > 0, ``decoder_sparse_step``, ``mlp_only_layers``, a
shared expert of ``shared_expert_intermediate_size``). Each layer mixes tokens by full attention, sliding-window
attention (``sliding_window``: each query sees its own position and the ``sliding_window - 1`` before it) or a gated
delta net (``layer_types``); attention may gate its output (``attn_output_gate``) and rotate part of each head
(``partial_rotary_factor``) or none of it (``nope_layers``); RMS norms may scale by ``1 + weight``
(``norm_plus_one``) and stand before each block, around it or after it (``norm_placement``); the MLP is SwiGLU or
GeGLU (``hidden_act``); the embedding, each block's output, q k^T and the logits may be scaled (``*_multiplier``,
``logits_scaling``) and the attention scores and logits soft-capped; the sliding layers' RoPE may have their own base
(``rope_local_theta``). Which family sets which is its module's business (``families.<name>``); ``from_hf``
reads a ``config.json`` through it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from dtorch.core.errors import ModelError
from dtorch.models.config_fields import (
    _HF_NULLABLE,
    HF_READ,
    MAX_LAYERS,
    check_field,
    check_fields,
    check_known_keys,
    default,
    hf_keys,
    limits,
    spec,
)
from dtorch.models.rope_scaling import (
    check_rope_scaling,
    rope_attention_factor as rope_attention_factor,
    rope_from_hf,
    rope_inv_freq as rope_inv_freq,
    scaling_of,
)

LAYER_TYPES = ("full_attention", "linear_attention", "sliding_attention")
NORM_PLACEMENTS = ("pre", "sandwich", "post")
ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP's gate: SwiGLU or GeGLU (GELU with the tanh approximation)
# activation -> how a config.json spells it (the first is transformers' own)
_HF_ACTIVATIONS = {"silu": ("silu",), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_tanh")}

@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape and constants of a decoder-only transformer of one of ``families.names()``."""

    family: str
    vocab_size: int = field(metadata=spec("size", 1, 1 << 22, hf="vocab_size", gguf="{arch}.vocab_size"))
    hidden_size: int = field(metadata=spec("size", 1, 1 << 16, hf="hidden_size", gguf="{arch}.embedding_length"))
    intermediate_size: int = field(metadata=spec("size", 1, 1 << 18, hf="intermediate_size",
                                                 gguf="{arch}.feed_forward_length"))
    num_layers: int = field(metadata=spec("size", 1, MAX_LAYERS, hf="num_hidden_layers", gguf="{arch}.block_count"))
    num_heads: int = field(metadata=spec("size", 1, 1 << 12, hf="num_attention_heads",
                                         gguf="{arch}.attention.head_count"))
    num_kv_heads: int = field(metadata=spec("size", 1, 1 << 12, hf="num_key_value_heads",
                                            gguf="{arch}.attention.head_count_kv"))
    head_dim: int = field(metadata=spec("size", 1, 1 << 12, hf="head_dim", gguf="{arch}.attention.key_length"))
    rope_theta: float = field(default=10000.0, metadata=spec("number", hf="rope_theta", gguf="{arch}.rope.freq_base"))
    # None: plain RoPE; else {"rope_type": ..., ...}, frozen
    rope_scaling: Mapping[str, Any] | None = field(default=None, metadata=spec("mapping", hf="rope_scaling"))
    rms_norm_eps: float = field(default=1e-6, metadata=spec("number", hf="rms_norm_eps",
                                                            gguf="{arch}.attention.layer_norm_rms_epsilon"))
    max_position_embeddings: int = field(default=2048, metadata=spec("size", 1, 1 << 24, hf="max_position_embeddings",
                                                                     gguf="{arch}.context_length"))
    tie_word_embeddings: bool = field(default=False, metadata=spec("bool", hf="tie_word_embeddings"))
    attention_bias: bool = field(default=False, metadata=spec("bool"))  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool = field(default=False, metadata=spec("bool"))  # Qwen3: RMS norm over head_dim on q and k before RoPE
    bos_token_id: int | None = field(default=None, metadata=spec("token_id", hf="bos_token_id",
                                                                 gguf="tokenizer.ggml.bos_token_id"))
    eos_token_ids: tuple[int, ...] = field(default=(), metadata=spec("token_ids", hf="eos_token_id"))
    # Qwen3-MoE: layer l has a sparse MoE block (a softmax top-k router over ``num_experts`` SwiGLU experts of width
    # ``moe_intermediate_size``) when ``is_sparse(l)``; the other layers a dense MLP of ``intermediate_size``
    num_experts: int = field(default=0, metadata=spec("size", 0, 1 << 12))
    num_experts_per_tok: int = field(default=0, metadata=spec("size", 0, 1 << 12))
    moe_intermediate_size: int = field(default=0, metadata=spec("size", 0, 1 << 18))
    # renormalize the top-k routing weights to sum to 1
    norm_topk_prob: bool = field(default=False, metadata=spec("bool"))
    decoder_sparse_step: int = field(default=1, metadata=spec("size", 1, MAX_LAYERS))
    mlp_only_layers: tuple[int, ...] = field(default=(), metadata=spec("list"))
    # Qwen3-Next: a sigmoid-gated SwiGLU expert every token goes through
    shared_expert_intermediate_size: int = field(default=0, metadata=spec("size", 0, 1 << 18))
    # hybrid models: the mixer of each layer (``LAYER_TYPES``; empty: full attention everywhere), and the gated delta
    # net's shapes: a causal conv of ``linear_conv_kernel_dim`` taps over [q | k | v], then ``linear_num_value_heads``
    # heads of state [key dim, value dim], each q/k head serving num_value_heads / num_key_heads value heads
    layer_types: tuple[str, ...] = field(default=(), metadata=spec("list"))
    linear_conv_kernel_dim: int = field(default=0, metadata=spec("size", 0, 1 << 10))
    linear_num_key_heads: int = field(default=0, metadata=spec("size", 0, 1 << 12))
    linear_num_value_heads: int = field(default=0, metadata=spec("size", 0, 1 << 12))
    linear_key_head_dim: int = field(default=0, metadata=spec("size", 0, 1 << 12))
    linear_value_head_dim: int = field(default=0, metadata=spec("size", 0, 1 << 12))
    # RoPE turns the first head_dim * factor dims of each head, passes the rest
    partial_rotary_factor: float = field(default=1.0, metadata=spec("number", hf="partial_rotary_factor"))
    # q_proj also gives a gate per head: attention output * sigmoid(gate)
    attn_output_gate: bool = field(default=False, metadata=spec("bool"))
    # RMS norms scale by (1 + weight) (zero-centred weights); the gated norm does not
    norm_plus_one: bool = field(default=False, metadata=spec("bool"))
    # sliding-window attention: the keys a "sliding_attention" layer's query sees, itself included (None: no such layer)
    sliding_window: int | None = field(default=None, metadata=spec("window"))
    # the sliding layers' RoPE base, unscaled (None: the global rope_theta)
    rope_local_theta: float | None = field(default=None, metadata=spec("number"))
    hidden_act: str = "silu"  # one of ACTIVATIONS
    # where a family's graph differs from Llama's (``Transformer.graph`` reads these, never a family's name):
    # the embedding output times it, rounded to the model's dtype
    embedding_multiplier: float | None = field(default=None, metadata=spec("number"))
    # each block's output times it before the residual add
    residual_multiplier: float | None = field(default=None, metadata=spec("number"))
    # the factor of q k^T (None: head_dim ** -0.5)
    attention_multiplier: float | None = field(default=None, metadata=spec("number"))
    # the scaled q k^T capped: cap * tanh(scores / cap)
    attn_softcap: float | None = field(default=None, metadata=spec("number"))
    logits_scaling: float | None = field(default=None, metadata=spec("number"))  # the logits divided by it
    # the logits capped: cap * tanh(logits / cap)
    logits_softcap: float | None = field(default=None, metadata=spec("number"))
    # RMS norms: "pre" on each block's input (Llama), "sandwich" on its input and output (Gemma), "post" on its
    # output only (OLMo 2); the final norm in every case
    norm_placement: str = "pre"
    qk_norm_over: str = "head"  # the q/k norms (``qk_norm``) over each head's dims, or "all" of its heads' at once
    # attention layers whose q and k are not rotated (SmolLM3's NoPE layers)
    nope_layers: tuple[int, ...] = field(default=(), metadata=spec("list"))

    def __post_init__(self) -> None:
        if self.family not in families.names():
            raise ModelError(f"ModelConfig: family must be one of {families.names()}, got {self.family!r}")
        for f in fields(self):  # each value's type and range, as its ``spec`` declares it for the files too
            v = getattr(self, f.name)
            if "spec" in f.metadata and not (v is None and f.default is None):
                check_field(f.name, v, f"ModelConfig: {f.name}")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(f"ModelConfig: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ModelError(f"ModelConfig: head_dim must be even for RoPE, got {self.head_dim}")
        for f in fields(self):
            if "spec" in f.metadata and f.metadata["spec"].kind == "number" and getattr(self, f.name) is not None:
                # an int given for a float field, stored as the float it stands for
                object.__setattr__(self, f.name, float(getattr(self, f.name)))
        eos = self.eos_token_ids
        if isinstance(eos, int):
            eos = (eos,)
        eos = tuple(eos)
        for tid in (*eos, *(() if self.bos_token_id is None else (self.bos_token_id,))):
            if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < self.vocab_size:
                raise ModelError(f"ModelConfig: token ids must be ints in [0, vocab_size={self.vocab_size}), "
                                 f"got bos_token_id={self.bos_token_id!r}, eos_token_ids={eos!r}")
        object.__setattr__(self, "eos_token_ids", eos)
        self._check_moe()
        self._check_hybrid()
        self._check_window()
        object.__setattr__(self, "rope_scaling", check_rope_scaling(self.rope_scaling, self.rotary_dim))

    def _check_window(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ModelError(f"ModelConfig: hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        for name, allowed in (("norm_placement", NORM_PLACEMENTS), ("qk_norm_over", ("head", "all"))):
            if getattr(self, name) not in allowed:
                raise ModelError(f"ModelConfig: {name} must be one of {allowed}, got {getattr(self, name)!r}")
        nope = tuple(self.nope_layers)
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.num_layers for i in nope):
            raise ModelError(f"ModelConfig: nope_layers must be layer indices in [0, num_layers={self.num_layers}), "
                             f"got {list(nope)}")
        object.__setattr__(self, "nope_layers", nope)
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ModelError("ModelConfig: layer_types has sliding_attention layers but sliding_window is None; give "
                             "the window (keys each query of those layers sees)")

    def _check_moe(self) -> None:
        only = tuple(self.mlp_only_layers)
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.num_layers for i in only):
            raise ModelError(f"ModelConfig: mlp_only_layers must be layer indices in [0, num_layers={self.num_layers}),"
                             f" got {list(only)}")
        object.__setattr__(self, "mlp_only_layers", only)
        if self.num_experts == 0:
            return
        if not families.get(self.family).moe:
            moe = tuple(f for f in families.names() if families.get(f).moe)
            raise ModelError(f"ModelConfig: num_experts={self.num_experts} needs a family of {moe}, got "
                             f"{self.family!r}; use num_experts=0 for a dense model")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ModelError(f"ModelConfig: num_experts_per_tok must be in 1..num_experts={self.num_experts}, got "
                             f"{self.num_experts_per_tok}")
        if self.moe_intermediate_size < 1:
            raise ModelError(f"ModelConfig: moe_intermediate_size must be a positive int with num_experts > 0, got "
                             f"{self.moe_intermediate_size}")

    def _check_hybrid(self) -> None:
        f = self.partial_rotary_factor
        if not f <= 1:
            raise ModelError(f"ModelConfig: partial_rotary_factor must be a number in (0, 1], got {f!r}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ModelError(f"ModelConfig: head_dim * partial_rotary_factor = {self.head_dim} * {f} must give an "
                             f"even rotary dim >= 2, got {self.rotary_dim}")
        if self.shared_expert_intermediate_size and not self.num_experts:
            raise ModelError("ModelConfig: shared_expert_intermediate_size > 0 needs num_experts > 0 (the shared "
                             "expert sits in the sparse MoE blocks)")
        types = tuple(self.layer_types)
        object.__setattr__(self, "layer_types", types)
        if not types:
            return
        if len(types) != self.num_layers:
            raise ModelError(f"ModelConfig: layer_types has {len(types)} entries, expected one per layer "
                             f"(num_layers={self.num_layers})")
        bad = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
        if bad:
            raise ModelError(f"ModelConfig: layer_types holds {bad}; each entry must be one of {LAYER_TYPES}")
        own = families.get(self.family).layer_types
        if "linear_attention" in types and "linear_attention" not in own:
            hybrid = tuple(f for f in families.names() if "linear_attention" in families.get(f).layer_types)
            raise ModelError(f"ModelConfig: linear_attention layers need a family of {hybrid}, got {self.family!r}")
        other = sorted({t for t in types if t not in own})
        if other:
            raise ModelError(f"ModelConfig: layer_types holds {other}; the layers of a {self.family} model are "
                             f"{' or '.join(own)}")
        if "linear_attention" not in types:
            return
        for name in ("linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= limits(name)[1]:
                raise ModelError(f"ModelConfig: {name} must be a positive int (at most {limits(name)[1]}) when "
                                 f"layer_types has linear_attention layers, got {v!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelError(f"ModelConfig: linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple "
                             f"of linear_num_key_heads ({self.linear_num_key_heads})")

    def is_linear(self, layer: int) -> bool:
        """Whether layer ``layer`` mixes tokens with the gated delta net (else with full attention)."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The gated delta net layers, in order."""
        if "linear_attention" not in self.layer_types:  # most models: no loop over the layers (asked every step)
            return ()
        return tuple(i for i in range(self.num_layers) if self.is_linear(i))

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The full-attention layers (they alone use the KV cache), in order."""
        return tuple(i for i in range(self.num_layers) if not self.is_linear(i))

    def window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: it attends to every earlier key)."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == "sliding_attention" else None

    @property
    def kv_window(self) -> int | None:
        """The window past which no layer reads a key (None: some layer reads them all): the widest window when
        every attention layer slides. A sequence's cache blocks older than it can be freed."""
        windows = [self.window(i) for i in self.attention_layers]
        return None if not windows or None in windows else max(windows)

    @property
    def attn_scale(self) -> float:
        """The factor of q k^T: attention_multiplier, else head_dim ** -0.5."""
        return self.head_dim ** -0.5 if self.attention_multiplier is None else self.attention_multiplier

    def rotates(self, layer: int) -> bool:
        """Whether attention layer ``layer`` turns q and k by RoPE (not one of ``nope_layers``)."""
        return layer not in self.nope_layers

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE turns: head_dim * partial_rotary_factor."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        """Width of the gated delta net's q and k: linear_num_key_heads * linear_key_head_dim."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        """Width of its v, z and output: linear_num_value_heads * linear_value_head_dim."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer`` has the sparse MoE block (else a dense MLP), as transformers' Qwen3-MoE decides."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def q_size(self) -> int:
        """Width of the q projection output: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the k and v projection outputs: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, config_json: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        """A config from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x spelling), read through the family
        of its ``model_type`` (``families``). Each field is checked for type and range first (``check_fields``);
        errors name ``source`` (the file) and the key as it spells it."""
        c = dict(config_json)
        fam = families.by_hf_type(c.get("model_type"))
        if fam is None:
            raise ModelError(f"{source}: model_type {c.get('model_type')!r} is not supported; expected one of "
                             f"{families.hf_types()}")
        if c["model_type"] in fam.hf_multimodal:  # a multimodal checkpoint: its text model
            text = c.get("text_config")
            if not isinstance(text, Mapping):
                raise ModelError(f"{source}: a {c['model_type']} config.json needs a text_config object (the language "
                                 "model)")
            c = {"model_type": fam.hf_types[0], **{k: v for k, v in text.items() if k != "model_type"}}
            source = f"{source}: text_config"
        keys = hf_keys(fam.hf_keys)  # field -> its config.json key, as the fields' specs and the family declare them
        check_fields(c, keys, source, _HF_NULLABLE)
        check_known_keys(c, (*keys.values(), *HF_READ, *fam.hf_read), fam.hf_inert, fam.name, source)
        act_key = "hidden_activation" if "hidden_activation" in c else "hidden_act"
        spellings = _HF_ACTIVATIONS[fam.fields.get("hidden_act", "silu")]
        if act_key in c and c[act_key] not in spellings:
            raise ModelError(f"{source}: {act_key}={c[act_key]!r} is not supported; expected {spellings[0]!r}")
        for flag in ("mlp_bias", "attention_bias"):  # biases beyond the q/k/v ones a family declares: not modelled
            if c.get(flag) and not fam.fields.get("attention_bias"):
                raise ModelError(f"{source}: {flag}=true is not supported for {fam.name} models; expected false")
        try:
            own = fam.hf_config(c, source) if fam.hf_config is not None else {}  # may edit c: it runs first
            hidden, heads = c[keys["hidden_size"]], c[keys["num_heads"]]
            rope = rope_from_hf(c, fam.hf_rope_theta, source)  # as transformers standardizes it
            theta = rope["rope_theta"]
            partial = rope.get("partial_rotary_factor")
            partial = default("partial_rotary_factor") if partial is None else partial
            check_field("rope_theta", theta, f"{source}: rope_theta")
            check_field("partial_rotary_factor", partial, f"{source}: partial_rotary_factor")
            scaling = scaling_of(rope)
            eos = c.get(keys["eos_token_ids"])
            eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
            kwargs = dict(
                family=fam.name, vocab_size=c[keys["vocab_size"]], hidden_size=hidden,
                intermediate_size=c[keys["intermediate_size"]], num_layers=c[keys["num_layers"]], num_heads=heads,
                num_kv_heads=c.get(keys["num_kv_heads"]) or heads, head_dim=c.get(keys["head_dim"]) or hidden // heads,
                rope_theta=theta, rope_scaling=scaling, bos_token_id=c.get(keys["bos_token_id"]),
                **{name: c.get(keys[name], default(name))  # absent: the field's default
                   for name in ("rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")},
                eos_token_ids=eos, partial_rotary_factor=partial) | dict(fam.fields) | own
        except KeyError as e:
            raise ModelError(f"{source}: missing key {e.args[0]!r} needed for a {fam.name} model") from None
        try:
            return cls(**kwargs)
        except ModelError as e:  # a field that passed alone but not with the others (heads vs kv heads, ...)
            raise ModelError(f"{source}: {e}") from None

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """One of ``PRESETS`` by name, with fields optionally overridden."""
        if name not in PRESETS:
            raise ModelError(f"ModelConfig.preset: unknown preset {name!r}; known: {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides)


# imported after ModelConfig: discovering the families declares each, and a declaration checks its config keys against
# the fields' specs above (``config_fields.specs``)
from dtorch.models import families  # noqa: E402

PRESETS: dict[str, ModelConfig] = {
    # tiny random models for tests: 2 layers, GQA 4:2
    "tiny-llama": ModelConfig("llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                              max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,)),
    "tiny-llama3": ModelConfig("llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                               num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=500000.0,
                               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                               max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
                               eos_token_ids=(2, 3)),
    "tiny-qwen2": ModelConfig("qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1000000.0,
                              max_position_embeddings=256, tie_word_embeddings=True, attention_bias=True,
                              eos_token_ids=(2,)),
    "tiny-qwen3": ModelConfig("qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1000000.0,
                              max_position_embeddings=256, tie_word_embeddings=True, qk_norm=True,
                              eos_token_ids=(2,)),
    # the default model (its GGUF metadata)
    "smollm2-135m": ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                                max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
                                eos_token_ids=(2,)),
}
