"""The tensor-parallel layout of a decoder: which weight is split how over a mesh of n devices.

The standard (Megatron) layout, as placements of the graph:
- q/k/v fused into one column-parallel ``[E, (H + 2 Hkv) D]`` projection, blocked so that each device
  holds ``[q_r | k_r | v_r]``; gate/up fused the same way into ``[E, 2 I]`` with ``[gate_r | up_r]``;
- o and down row-parallel (``Shard(0)`` of their transposed weights), so their products are partial
  sums that the graph all-reduces;
- heads split by whole KV groups: device r holds KV heads ``shard_sizes(Hkv, n)[r]`` and the G = H / Hkv
  query heads of each, so n need not divide the heads, only not exceed the KV heads;
- the vocabulary split for the embedding (partial sums) and the LM head (gathered logits);
- MoE experts (``experts_gate_up`` [E, 2I, H], ``experts_down`` [E, H, I]) split over experts (expert parallel,
  ``Shard(0)``) when n divides E, else each expert's matrices split like gate_up / down (tensor parallel); either
  way their output is a partial sum the graph all-reduces. The router stays replicated; a shared expert is split
  like a dense MLP;
- gated attention (``attn_output_gate``): the fused projection is ``[q_r | gate_r | k_r | v_r]`` on each device;
- gated delta net layers split by whole key heads, each with its value heads: the fused input projection
  ``lin_in`` gives each device ``[q_r | k_r | v_r | z_r | b_r | a_r]``, the conv weight and conv state its
  ``[q_r | k_r | v_r]`` channels, ``A_log``, ``dt_bias`` and the recurrent state its value heads; ``lin_out`` is
  row-parallel like o.

Weights are stored transposed (``Wt [in, out]``, contiguous per device): a decode row then streams each
weight front to back, which is what CPU BLAS reads fastest.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtorch.core.errors import ModelError
from dtorch.core.placement import Placement, Replicate, Shard
from dtorch.models.config import ModelConfig

R = Replicate()


@dataclass(frozen=True, slots=True)
class Layout:
    """Placements of every model tensor for ``config`` over ``n`` devices."""

    config: ModelConfig
    n: int

    def __post_init__(self) -> None:
        c, n = self.config, self.n
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ModelError(f"tensor_parallel_size must be an int >= 1, got {n!r}")
        if n > c.num_kv_heads:
            raise ModelError(f"tensor_parallel_size {n} exceeds the model's {c.num_kv_heads} KV heads "
                             f"({c.num_heads} attention heads): each device needs at least one KV head and its "
                             f"{c.num_heads // c.num_kv_heads} query heads; use at most {c.num_kv_heads} devices")
        if c.linear_layers and n > c.linear_num_key_heads:
            raise ModelError(f"tensor_parallel_size {n} exceeds the model's {c.linear_num_key_heads} linear-attention "
                             f"key heads: each device needs at least one; use at most {c.linear_num_key_heads} devices")
        if c.num_experts and not self.expert_parallel and n > c.moe_intermediate_size:
            raise ModelError(f"tensor_parallel_size {n} neither divides the model's {c.num_experts} experts (for "
                             f"expert parallelism) nor fits their moe_intermediate_size {c.moe_intermediate_size} "
                             f"(for tensor parallelism); use a divisor of {c.num_experts}")

    @property
    def expert_parallel(self) -> bool:
        """Whether the MoE experts are split whole over the devices (n > 1 divides num_experts)."""
        return self.n > 1 and self.config.num_experts > 0 and self.config.num_experts % self.n == 0

    @property
    def linear_group(self) -> int:
        """Value heads per key head of the gated delta net layers."""
        c = self.config
        return c.linear_num_value_heads // c.linear_num_key_heads if c.linear_layers else 1

    @property
    def group(self) -> int:
        """Query heads per KV head (G)."""
        return self.config.num_heads // self.config.num_kv_heads

    def placement(self, name: str) -> Placement:
        """The placement of model tensor ``name`` (see ``Transformer.TENSORS``)."""
        c = self.config
        if self.n == 1:
            return R
        d, g = c.head_dim, self.group
        qkv = (c.q_size, c.kv_size, c.kv_size)
        units = (g * d, d, d)
        if c.attn_output_gate:  # [q | gate | k | v]
            qkv, units = (c.q_size, *qkv), (g * d, *units)
        table = {
            "embed": Shard(0), "lm_head": Shard(1),
            "qkv": Shard(1, qkv, units), "qkv_bias": Shard(0, qkv, units), "o": Shard(0, None, g * d),
            "gate_up": Shard(1, (c.intermediate_size, c.intermediate_size)), "down": Shard(0),
            "k_cache": Shard(2), "v_cache": Shard(2),
            "experts_gate_up": Shard(1, (c.moe_intermediate_size, c.moe_intermediate_size)), "experts_down": Shard(2),
        }
        if c.shared_expert_intermediate_size:
            fs = c.shared_expert_intermediate_size
            table |= {"shared_gate_up": Shard(1, (fs, fs)), "shared_down": Shard(0)}
        if c.linear_layers:
            kd, vd, hv, dk, dv = (c.linear_key_dim, c.linear_value_dim, c.linear_num_value_heads,
                                  c.linear_key_head_dim, c.linear_value_head_dim)
            gl = self.linear_group
            conv = Shard(0, (kd, kd, vd), (dk, dk, gl * dv))
            table |= {
                "lin_in": Shard(1, (kd, kd, vd, vd, hv, hv), (dk, dk, gl * dv, gl * dv, gl, gl)),
                "lin_conv": conv, "lin_A_log": Shard(0, None, gl), "lin_dt_bias": Shard(0, None, gl),
                "lin_out": Shard(0, None, gl * dv),
                "conv_state": Shard(1, conv.blocks, conv.unit), "ssm_state": Shard(1, None, gl),
            }
        if self.expert_parallel:
            table |= {"experts_gate_up": Shard(0), "experts_down": Shard(0)}
        return table.get(name, R)
