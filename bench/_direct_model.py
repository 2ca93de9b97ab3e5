"""One decoder-only transformer for Llama, Qwen2 and Qwen3, run as a fixed sequence of prepared operators.

A step runs T rows (tokens) of N sequences packed together: a prefill step holds whole prompts, a
decode step one token per sequence. ``Step`` describes the packing once; every layer then runs the
same prepared ops on preallocated buffers (``_Buffers``): no kernel lookup, and per step only small
allocations (the step's position and offset tensors, the logits, what the kernels make inside).

Family differences are configuration: ``attention_bias`` (Qwen2's q/k/v biases), ``qk_norm``
(Qwen3's per-head RMS norms on q and k), ``tie_word_embeddings``, ``rope_scaling``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from _direct_kv_cache import KVCache
from _direct_layers import DecoderLayer, LayerWeights, Projection, SharedOps, check_shape

from dtorch.core.device import Device, as_device
from dtorch.core.errors import ModelError
from dtorch.core.memory import MemoryKind, allocate
from dtorch.models.config import ModelConfig, rope_inv_freq
from dtorch.ops import Attention, AttentionVarlen, OperatorInitContext


@dataclass(slots=True)
class Step:
    """How T rows are packed: N sequences, sequence i has ``counts[i]`` new tokens after ``starts[i]`` cached.

    positions: [T] int64. cu_q / cu_k: [N+1] int32 cumulative query / key counts (keys = start + count).
    last_rows: [N] int64, the row of each sequence's last token. slots: cache slot of each sequence.
    """

    counts: list[int]
    starts: list[int]
    slots: list[int] | None
    positions: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    last_rows: torch.Tensor
    row_slots: torch.Tensor | None  # [T] int64: the cache slot of each row
    fresh: bool  # every sequence starts at 0: attention can read the step's own k/v

    @staticmethod
    def build(counts: Sequence[int], starts: Sequence[int], slots: Sequence[int] | None,
              device: torch.device) -> Step:
        counts, starts = list(counts), list(starts)
        ends = [s + c for s, c in zip(starts, counts, strict=True)]
        if counts == [1] * len(counts):
            positions = torch.tensor(starts, dtype=torch.int64)
        else:
            positions = torch.cat([torch.arange(s, e, dtype=torch.int64) for s, e in zip(starts, ends, strict=True)])
        cu_q = torch.tensor([0] + counts, dtype=torch.int32).cumsum_(0, dtype=torch.int32)
        cu_k = torch.tensor([0] + ends, dtype=torch.int32).cumsum_(0, dtype=torch.int32)
        last = (cu_q[1:] - 1).to(torch.int64)
        row_slots = None
        if slots is not None:
            slots = list(slots)
            row_slots = torch.tensor(slots, dtype=torch.int64).repeat_interleave(torch.tensor(counts)).to(device)
        return Step(counts, starts, slots, positions.to(device), cu_q.to(device), cu_k.to(device), max(counts),
                    max(ends), last.to(device), row_slots, not any(starts))


class _Buffers:
    """Every activation of one step size T, allocated once as WORKSPACE memory and reused."""

    def __init__(self, c: ModelConfig, rows: int, dtype: torch.dtype, device: Device) -> None:
        def buf(*shape: int) -> torch.Tensor:
            return allocate(shape, dtype, device, MemoryKind.WORKSPACE)

        qs, kvs = c.q_size, c.kv_size
        self.x = buf(rows, c.hidden_size)  # the residual stream
        self.h = buf(rows, c.hidden_size)  # normed input of a block
        self.o = buf(rows, c.hidden_size)  # a block's output, added to x by the next norm
        self.qkv = buf(rows, qs + 2 * kvs)
        self.qk = buf(rows, c.num_heads + c.num_kv_heads, c.head_dim)  # q and k after Qwen3's per-head norms
        self.q, self.k = self.qk[:, :c.num_heads], self.qk[:, c.num_heads:]
        self.attn = buf(rows, c.num_heads, c.head_dim)
        self.gu = buf(rows, 2 * c.intermediate_size)
        self.act = buf(rows, c.intermediate_size)
        # views of the fused qkv output: [T, H, D], [T, Hkv, D], [T, Hkv, D]
        self.q_in = self.qkv[:, :qs].view(rows, c.num_heads, c.head_dim)
        self.k_in = self.qkv[:, qs:qs + kvs].view(rows, c.num_kv_heads, c.head_dim)
        self.v_in = self.qkv[:, qs + kvs:].view(rows, c.num_kv_heads, c.head_dim)
        # q and k heads side by side, rotated by one rope call: [T, H + Hkv, D]
        self.qk_in = self.qkv[:, :qs + kvs].view(rows, c.num_heads + c.num_kv_heads, c.head_dim)
        self.attn_flat = self.attn.view(rows, qs)


class Transformer:
    """The model: weights bound to prepared operators for one (device, dtype).

    ``tensors`` uses Hugging Face names (``model.layers.{i}.self_attn.q_proj.weight`` ...).
    """

    def __init__(self, config: ModelConfig, tensors: Mapping[str, torch.Tensor], *, device: Device | str = "cpu",
                 dtype: torch.dtype = torch.float32, source: str = "checkpoint") -> None:
        self.config = c = config
        self.device = as_device(device)
        self.dtype = dtype
        init = OperatorInitContext(self.device, dtype)

        def get(name: str, *shape: int) -> torch.Tensor:
            t = check_shape(name, tensors.get(name), shape, source)
            return t.to(device=self.device.torch, dtype=dtype)

        H, Hkv, D, E, inter = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size
        self.embed = get("model.embed_tokens.weight", c.vocab_size, E).contiguous()
        self.final_norm = get("model.norm.weight", E)
        head = self.embed if c.tie_word_embeddings or "lm_head.weight" not in tensors else \
            get("lm_head.weight", c.vocab_size, E)
        self.lm_head = Projection([head], None, init)
        self.layers: list[DecoderLayer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = c.attention_bias
            w = LayerWeights(
                input_norm=get(p + "input_layernorm.weight", E),
                post_norm=get(p + "post_attention_layernorm.weight", E),
                q=get(a + "q_proj.weight", H * D, E), k=get(a + "k_proj.weight", Hkv * D, E),
                v=get(a + "v_proj.weight", Hkv * D, E), o=get(a + "o_proj.weight", E, H * D),
                gate=get(p + "mlp.gate_proj.weight", inter, E), up=get(p + "mlp.up_proj.weight", inter, E),
                down=get(p + "mlp.down_proj.weight", E, inter),
                q_bias=get(a + "q_proj.bias", H * D) if bias else None,
                k_bias=get(a + "k_proj.bias", Hkv * D) if bias else None,
                v_bias=get(a + "v_proj.bias", Hkv * D) if bias else None,
                q_norm=get(a + "q_norm.weight", D) if c.qk_norm else None,
                k_norm=get(a + "k_norm.weight", D) if c.qk_norm else None)
            self.layers.append(DecoderLayer(w, init))
        self.ops = SharedOps(c.rms_norm_eps, D, c.max_position_embeddings, rope_inv_freq(c), init)
        heads = dict(causal=True, scale=D ** -0.5, num_heads=H, num_kv_heads=Hkv, head_dim=D)
        self.attention = AttentionVarlen(**heads).prepare(init)
        self.dense_attention = Attention(**heads).prepare(init)
        self._buffers: dict[int, _Buffers] = {}

    # -- memory ---------------------------------------------------------------------------------

    def weight_bytes(self) -> int:
        """Bytes of the weights one decode step reads (every projection, the norms and the LM head)."""
        ts = [self.lm_head.wt, self.final_norm]
        for layer in self.layers:
            ts += [layer.qkv.wt, layer.o.wt, layer.gate_up.wt, layer.down.wt, layer.input_norm, layer.post_norm]
        return sum(t.numel() * t.element_size() for t in ts)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_slots, max_len, self.dtype, self.device)

    def _buffers_for(self, rows: int) -> _Buffers:
        """Buffers for a step of ``rows`` rows: decode sizes (up to 64 rows) are kept, a prefill size only until
        the next prefill of another size."""
        b = self._buffers.get(rows)
        if b is None:
            if rows > 64:
                self._buffers = {r: v for r, v in self._buffers.items() if r <= 64}
            b = self._buffers[rows] = _Buffers(self.config, rows, self.dtype, self.device)
        return b

    # -- forward --------------------------------------------------------------------------------

    def forward(self, ids: torch.Tensor, step: Step, cache: KVCache | None, all_logits: bool = False) -> torch.Tensor:
        """Run one step. ids: [T] int64 -> logits [N, V] (last row of each sequence) or [T, V] if ``all_logits``.

        With ``cache`` the new keys and values are written to the sequences' slots and attention reads
        them from there; without it every sequence must start at position 0 (a full forward pass).
        """
        T = ids.shape[0]
        b = self._buffers_for(T)
        ops, attn = self.ops, self.attention
        if cache is None and not step.fresh:
            raise ModelError("Transformer.forward: a step that continues cached sequences needs the cache")
        qk_norm = self.config.qk_norm
        dense, single = self.dense_attention, len(step.counts) == 1
        ops.embed.forward_out(ids, self.embed, out=b.x)
        rot = ops.rope.tables(step.positions)  # cos/sin of the step's positions, shared by every layer
        qk = b.qk if qk_norm else b.qk_in
        for i, layer in enumerate(self.layers):
            if i == 0:
                ops.norm.forward_out(b.x, layer.input_norm, out=b.h)
            else:  # x += previous MLP output; h = norm(x)
                ops.add_norm.forward_out(b.o, b.x, layer.input_norm, out=b.h, residual_out=b.x)
            layer.qkv(b.h, out=b.qkv)
            q, k = b.q_in, b.k_in  # views of the fused qkv output
            if qk_norm:
                q = ops.norm.forward_out(q, layer.q_norm, out=b.q)
                k = ops.norm.forward_out(k, layer.k_norm, out=b.k)
            ops.rope.forward_(qk, rot)  # q and k in place, one call
            keys = values = None
            if cache is not None:  # a fresh batch of prompts attends to its own k/v, others read the cache
                keys, values = cache.write(i, step, k, b.v_in, read=single or not step.fresh)
            if keys is None:
                keys, values = k, b.v_in
            if single:  # one sequence: dense attention reads the cache in place (bottom-right causal)
                dense.forward_out(q[None], keys[None], values[None], out=b.attn[None])
            else:
                attn.forward_out(q, keys, values, step.cu_q, step.cu_k, step.max_q, step.max_k, out=b.attn)
            layer.o(b.attn_flat, out=b.o)
            ops.add_norm.forward_out(b.o, b.x, layer.post_norm, out=b.h, residual_out=b.x)
            layer.gate_up(b.h, out=b.gu)
            ops.silu_mul.forward_out(b.gu, out=b.act)
            layer.down(b.act, out=b.o)
        ops.add_norm.forward_out(b.o, b.x, self.final_norm, out=b.h, residual_out=b.x)
        h = b.h if all_logits or T == len(step.counts) else b.h.index_select(0, step.last_rows)
        logits = self.lm_head.mm.forward(h, self.lm_head.wt)
        return logits if logits.dtype == torch.float32 else logits.float()
