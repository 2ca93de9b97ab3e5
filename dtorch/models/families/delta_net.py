"""What the hybrid families (Qwen3-Next, Qwen3.5) share: gated delta net layers among gated attention layers.

Their config fields from a ``config.json`` or GGUF metadata, their layers' tensors (the gated attention's q_proj gives
[q_h | gate_h] per head; a gated delta net layer's fused input projection, conv, decay parameters, gated norm and
output projection), and the changes llama.cpp's converter makes to them that every hybrid undoes. What differs (the
input projections' layout in the checkpoint, the converter's reordering of value heads) is in each family's module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dtorch.core.errors import ModelError
from dtorch.core.placement import Shard
from dtorch.models.families.base import (
    GgufMeta,
    View,
    Weight,
    attention,
    cat,
    cat_t,
    layer_norm,
    layer_source,
    shift_norms,
    transposed_rows,
)

if TYPE_CHECKING:
    from dtorch.models.config import ModelConfig
    from dtorch.models.layout import Layout

# the fields every hybrid fixes: gated attention with q/k norms, (1 + w) RMS norms (not the gated norm)
FIELDS = {"qk_norm": True, "attn_output_gate": True, "norm_plus_one": True}
LAYER_TYPES = ("full_attention", "linear_attention")
UNUSED = ("mtp.", "model.visual.")  # the multi-token prediction head, Qwen3.5's vision tower
HF_INERT = {"mtp_num_hidden_layers": None, "mtp_use_dedicated_embeddings": None}  # the unused head's shape
HF_KEYS = {"layer_types": "layer_types", "full_attention_interval": "full_attention_interval",
           "linear_conv_kernel_dim": "linear_conv_kernel_dim", "linear_num_key_heads": "linear_num_key_heads",
           "linear_num_value_heads": "linear_num_value_heads", "linear_key_head_dim": "linear_key_head_dim",
           "linear_value_head_dim": "linear_value_head_dim"}
GGUF_KEYS = {"full_attention_interval": "full_attention_interval"}


def hf_fields(c: dict[str, Any]) -> dict[str, Any]:
    """The fields of a Qwen3-Next / Qwen3.5 text ``config.json``: the layer schedule (transformers' default: every
    ``full_attention_interval``-th layer full attention), the gated delta net's shapes, and a quarter of each head
    rotated unless it says otherwise."""
    layers = c["num_hidden_layers"]
    types = c.get("layer_types")
    if types is None:
        interval = c.get("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    c.setdefault("partial_rotary_factor", 0.25)
    return dict(layer_types=tuple(types), linear_conv_kernel_dim=c.get("linear_conv_kernel_dim", 4),
                linear_num_key_heads=c.get("linear_num_key_heads", 16),
                linear_num_value_heads=c.get("linear_num_value_heads", 32),
                linear_key_head_dim=c.get("linear_key_head_dim", 128),
                linear_value_head_dim=c.get("linear_value_head_dim", 128))


def gguf_fields(m: GgufMeta, common: Mapping[str, Any]) -> dict[str, Any]:
    """The hybrid fields of a qwen3next / qwen35 file. The converter writes the gated delta net's shapes as SSM keys:
    ``ssm.conv_kernel`` (conv taps), ``ssm.state_size`` (key head dim), ``ssm.group_count`` (key heads),
    ``ssm.time_step_rank`` (value heads), ``ssm.inner_size`` (value heads * value head dim); the layer schedule as
    ``full_attention_interval`` (layer i is full attention when (i + 1) % interval == 0, as llama.cpp reads it);
    the partial rotary as ``rope.dimension_count`` (rotated dims of each head)."""
    interval, v_heads, inner = (m.positive(k) for k in ("full_attention_interval", "ssm.time_step_rank",
                                                         "ssm.inner_size"))
    if inner % v_heads:
        raise ModelError(f"{m.path}: metadata key {m.key('ssm.inner_size')} ({inner}) is not a multiple of "
                         f"{m.key('ssm.time_step_rank')} ({v_heads}, the value heads); expected heads * head dim")
    return dict(layer_types=tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                  for i in range(common["num_layers"])),
                linear_conv_kernel_dim=m.positive("ssm.conv_kernel"),
                linear_num_key_heads=m.positive("ssm.group_count"),
                linear_num_value_heads=v_heads, linear_key_head_dim=m.positive("ssm.state_size"),
                linear_value_head_dim=inner // v_heads,
                partial_rotary_factor=m.rotary_fraction(common["head_dim"]))


LinIn = Callable[["ModelConfig", "Layout", int], Weight]
Mlp = Callable[["ModelConfig", "Layout", int], Iterator[Weight]]


def hybrid_layer(lin_in: LinIn, mlp: Mlp) -> Callable[[ModelConfig, Layout, int], Iterator[Weight]]:
    """The layers of a hybrid whose gated delta net input projection is ``lin_in(config, layout, i)`` and whose MLPs
    are ``mlp(config, layout, i)``: the norms, then a gated delta net or gated attention, then the MLP."""
    def layer(c: ModelConfig, layout: Layout, i: int) -> Iterator[Weight]:
        yield layer_norm(c, i, "input_norm", "input_layernorm", "attn_norm")
        yield layer_norm(c, i, "post_norm", "post_attention_layernorm", "post_attention_norm")
        if c.is_linear(i):
            yield lin_in(c, layout, i)
            yield from _delta_net(c, layout, i)
        else:
            yield from _gated_attention(c, i)
        yield from mlp(c, layout, i)

    return layer


def _gated_attention(c: ModelConfig, i: int) -> Iterator[Weight]:
    """Attention whose q_proj gives [q_h | gate_h] per head: whole groups of 2 G D rows per device, reordered to
    [q | gate] before the join."""
    G, D, E, a = c.num_heads // c.num_kv_heads, c.head_dim, c.hidden_size, "self_attn."
    qkv = (layer_source(i, a + "q_proj.weight", "attn_q.weight", (2 * c.q_size, E), 0, 2 * G * D),
           layer_source(i, a + "k_proj.weight", "attn_k.weight", (c.kv_size, E), 0, D),
           layer_source(i, a + "v_proj.weight", "attn_v.weight", (c.kv_size, E), 0, D))
    yield from attention(c, i, qkv, transposed_rows(_gated_q_rows(D), None, None))


def _gated_q_rows(d: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """q_proj's rows [q_h | gate_h] per head -> [q | gate]."""
    def rows(q: torch.Tensor) -> torch.Tensor:
        qg = q.reshape(-1, 2, d, q.shape[-1])
        return torch.cat([qg[:, 0].flatten(0, 1), qg[:, 1].flatten(0, 1)], 0)

    return rows


def conv_blocks(c: ModelConfig, layout: Layout) -> Shard:
    """How [q | k | v] rows (of in_proj_qkv, of the conv) split: by whole key heads, each with its value heads."""
    kd, vd, gl = c.linear_key_dim, c.linear_value_dim, layout.linear_group
    return Shard(0, (kd, kd, vd), (c.linear_key_head_dim, c.linear_key_head_dim, gl * c.linear_value_head_dim))


def lin_in_shape(c: ModelConfig) -> tuple[int, int]:
    """The fused input projection Wt [E, 2 kd + 2 vd + 2 Hv]: [q | k | v | z | b | a], each device its key heads'
    share of every part."""
    return c.hidden_size, 2 * c.linear_key_dim + 2 * c.linear_value_dim + 2 * c.linear_num_value_heads


def _delta_net(c: ModelConfig, layout: Layout, i: int) -> Iterator[Weight]:
    """A gated delta net layer's weights but its input projection: the conv weight [C, W] over [q | k | v] (stored
    [C, 1, W]), A_log and dt_bias [Hv] (float32 in the model), the gated norm's weight [Dv] (a plain scale) and the
    output projection Wt [vd, E]."""
    E, kd, vd, hv = c.hidden_size, c.linear_key_dim, c.linear_value_dim, c.linear_num_value_heads
    gl, n, a = layout.linear_group, f"layers.{i}.", "linear_attn."
    conv = 2 * kd + vd
    yield Weight(n + "lin_conv", (layer_source(i, a + "conv1d.weight", "ssm_conv1d.weight",
                                               (conv, 1, c.linear_conv_kernel_dim), 0, conv_blocks(c, layout)),),
                 _first_channel, (conv, c.linear_conv_kernel_dim))
    yield Weight(n + "lin_A_log", (layer_source(i, a + "A_log", "ssm_a", (hv,), 0, gl),), cat, (hv,))
    yield Weight(n + "lin_dt_bias", (layer_source(i, a + "dt_bias", "ssm_dt.bias", (hv,), 0, gl),), cat, (hv,))
    dv = c.linear_value_head_dim
    yield Weight(n + "lin_norm", (layer_source(i, a + "norm.weight", "ssm_norm.weight", (dv,)),), cat, (dv,))
    yield Weight(n + "lin_out", (layer_source(i, a + "out_proj.weight", "ssm_out.weight", (E, vd), 1, gl * dv),),
                 cat_t, (vd, E))


def _first_channel(parts: list[torch.Tensor]) -> torch.Tensor:
    """A depthwise conv1d weight [C, 1, W] as [C, W]."""
    return parts[0][:, 0]


def change(views: dict[str, View], name: str, **kw: Any) -> None:
    """Replace the view ``name`` (where the file has it) by one of the same parts with ``kw`` (``shape``, ``rows``,
    ``cols``, ``value``)."""
    if name in views:
        old = views[name]
        views[name] = View(old.parts, kw.pop("shape", old.shape), **kw)


def gguf_views(views: dict[str, View], c: ModelConfig, path: Path, head_rows: torch.Tensor | None = None,
               qkv_rows: torch.Tensor | None = None) -> None:
    """Undo what ``convert_hf_to_gguf.py`` changes in every hybrid's tensors (in place on ``views``): the (1 + weight)
    RMS norms (all but the gated ``linear_attn.norm``) are stored with 1 added; ``A_log`` is stored as A =
    -exp(A_log) (``ssm_a``); ``conv1d`` [C, 1, W] is stored squeezed. ``head_rows`` / ``qkv_rows``: where the
    converter put each value head's row of A_log / each conv channel (None: in order)."""
    shift_norms(views, keep=lambda name: ".linear_attn." in name)
    for i in c.linear_layers:
        p = f"model.layers.{i}.linear_attn."
        change(views, p + "A_log", rows=head_rows, value=lambda a: torch.log(-a))
        conv = views.get(p + "conv1d.weight")
        if conv is not None:
            change(views, p + "conv1d.weight", shape=(conv.shape[0], 1, conv.shape[-1]), rows=qkv_rows)
