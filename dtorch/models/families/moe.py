"""Sparse mixture-of-experts layers (Qwen3-MoE, Qwen3-Next): their config fields from a ``config.json`` or GGUF
metadata, and their tensors: the router, the experts stacked [E, ...], and a shared expert where the config has one."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from dtorch.core.placement import Shard
from dtorch.models.families.base import GgufMeta, Weight, cat, cat_t, layer_source, mlp

if TYPE_CHECKING:
    from dtorch.models.config import ModelConfig
    from dtorch.models.layout import Layout

# field -> the key a config.json spells it with
HF_KEYS = {"num_experts": "num_experts", "num_local_experts": "num_local_experts",
           "num_experts_per_tok": "num_experts_per_tok", "moe_intermediate_size": "moe_intermediate_size",
           "norm_topk_prob": "norm_topk_prob", "decoder_sparse_step": "decoder_sparse_step",
           "mlp_only_layers": "mlp_only_layers"}
# field -> the GGUF key after "{arch}."
GGUF_KEYS = {"num_experts": "expert_count", "num_experts_per_tok": "expert_used_count",
             "moe_intermediate_size": "expert_feed_forward_length", "expert_weights_norm": "expert_weights_norm"}


def hf_fields(c: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The MoE fields of a ``config.json``, ``defaults`` (transformers' for the family) where absent; transformers 5
    writes ``num_experts`` as ``num_local_experts``."""
    d = defaults
    return dict(num_experts=c.get("num_experts", c.get("num_local_experts", d["num_experts"])),
                num_experts_per_tok=c.get("num_experts_per_tok", d["num_experts_per_tok"]),
                moe_intermediate_size=c.get("moe_intermediate_size", d["moe_intermediate_size"]),
                norm_topk_prob=c.get("norm_topk_prob", d["norm_topk_prob"]),
                decoder_sparse_step=c.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(c.get("mlp_only_layers") or ()))


def gguf_fields(m: GgufMeta, layers: int) -> dict[str, Any]:
    """The MoE fields of a GGUF file: ``expert_count``, ``expert_used_count`` and ``expert_feed_forward_length`` give
    the experts; a layer is sparse when the file has its router ``blk.N.ffn_gate_inp.weight`` (the others are
    ``mlp_only_layers``, dense MLPs of ``feed_forward_length``). llama.cpp always renormalizes the top-k weights (its
    converter writes no ``norm_topk_prob``), so ``norm_topk_prob`` is true unless ``expert_weights_norm`` says false.
    With every layer sparse, ``feed_forward_length`` is unused and may be absent."""
    dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in m.tensors)
    out = dict(num_experts=m.need("expert_count"), num_experts_per_tok=m.need("expert_used_count"),
               moe_intermediate_size=m.need("expert_feed_forward_length"),
               norm_topk_prob=m.get("expert_weights_norm", True), decoder_sparse_step=1, mlp_only_layers=dense)
    out["intermediate_size"] = m.need("feed_forward_length") if dense \
        else m.get("feed_forward_length", out["moe_intermediate_size"])
    return out


def sparse_mlp(c: ModelConfig, layout: Layout, i: int) -> Iterator[Weight]:
    """Layer ``i``'s MLP: a dense one unless ``config.is_sparse(i)``; then the router Wt [H, E] (replicated; with a
    shared expert its gate is one more column, [H, E + 1] from one product), the shared expert like a dense MLP, and
    the experts [E, 2I, H] ([gate | up] rows, as ``llm.moe_experts`` takes them) and [E, H, I], the stacked tensors
    split on the dim of their layout placement (experts, or each expert's features)."""
    if not c.is_sparse(i):
        yield from mlp(c, i)
        return
    E, H, inter, fs = c.num_experts, c.hidden_size, c.moe_intermediate_size, c.shared_expert_intermediate_size
    n, m = f"layers.{i}.", "mlp."
    router = layer_source(i, m + "gate.weight", "ffn_gate_inp.weight", (E, H))
    if fs:
        s = m + "shared_expert."
        gate = layer_source(i, m + "shared_expert_gate.weight", "ffn_gate_inp_shexp.weight", (1, H))
        yield Weight(n + "router", (router, gate), cat_t, (H, E + 1))
        gate_up = (layer_source(i, s + "gate_proj.weight", "ffn_gate_shexp.weight", (fs, H), 0),
                   layer_source(i, s + "up_proj.weight", "ffn_up_shexp.weight", (fs, H), 0))
        yield Weight(n + "shared_gate_up", gate_up, cat_t, (H, 2 * fs))
        yield Weight(n + "shared_down", (layer_source(i, s + "down_proj.weight", "ffn_down_shexp.weight", (H, fs), 1),),
                     cat_t, (fs, H))
    else:
        yield Weight(n + "router", (router,), cat_t, (H, E))
    x = m + "experts."  # no ``.weight``: the loaders stack a file's per-expert tensors into these (hf.stack_experts)
    gu, dn = layout.placement("experts_gate_up"), layout.placement("experts_down")
    d = gu.dim if isinstance(gu, Shard) else None  # 0: experts; 1: each expert's rows of gate and of up
    yield Weight(n + "experts_gate_up", (layer_source(i, x + "gate_proj", "ffn_gate_exps.weight", (E, inter, H), d),
                                         layer_source(i, x + "up_proj", "ffn_up_exps.weight", (E, inter, H), d)),
                 _cat_1, (E, 2 * inter, H))
    yield Weight(n + "experts_down", (layer_source(i, x + "down_proj", "ffn_down_exps.weight", (E, H, inter),
                                                   dn.dim if isinstance(dn, Shard) else None),), cat, (E, H, inter))


def _cat_1(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, 1)
