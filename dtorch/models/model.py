"""The shared skeleton of every decoder-only family (``dtorch.models.families``), written once as a graph with
placements; it names no family.

``Transformer`` holds the weights placed once on a ``DeviceMesh`` (``DistTensor`` s, one piece per device)
and builds the step graph of one shape bucket: T rows (tokens) of N sequences packed together, reading
and writing the KV cache in place. A mesh of one device is the same graph; on n devices the placements
of ``Layout`` make it tensor parallel and the graph inserts the all-reduces and the logits' all-gather.

Where a family's graph differs it says so by configuration (``ModelConfig``; its module sets the fields): each layer's
mixer (full or sliding-window attention, with its own RoPE base, or a gated delta net: a fused input projection, the
short causal conv over [q | k | v] and the delta rule, both reading and advancing the sequence's rows of the state
cache, then the gated RMS norm), q/k/v biases, q/k norms per head or over all heads, layers without RoPE, a gated
attention output, the norms' placement (before, around or after each block), the scales of the embedding, of each
block's output, of q k^T and of the logits, soft-caps of the scores and the logits, GeGLU or SwiGLU, and the layers
whose MLP is a sparse mixture of experts (``ModelConfig.is_sparse``: the router and experts ops, and a shared expert).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from dtorch.core.errors import ModelError
from dtorch.graph import DeviceMesh, LogicalGraph, Operand, Replicate
from dtorch.models.bucket import Bucket
from dtorch.models.config import ModelConfig, rope_attention_factor, rope_inv_freq
from dtorch.models.layout import Layout
from dtorch.models.pack_cache import PackCache
from dtorch.models.parallel import Stage, head_cost, pipeline_stages
from dtorch.models.rope_rows import RopeRows
from dtorch.models.weights import Getter, PackedGetter, load_weights
from dtorch.runtime.blob import DistTensor


class Transformer:
    """The model's weights placed on ``mesh`` (``layout`` says how) and its step graphs.

    Build it with ``Transformer.load(config, getter, mesh, ...)``: every device's piece of every weight is read
    through ``getter`` (so a process reads only the slices of its own devices) and fused/transposed there.
    """

    def __init__(self, config: ModelConfig, weights: Mapping[str, DistTensor], mesh: DeviceMesh,
                 dtype: torch.dtype, linear_weights: Iterable[str] = (),
                 parts: Mapping[str, tuple[str, ...]] | None = None, max_positions: int | None = None,
                 batch_invariant: bool = False, stages: tuple[Stage, ...] | None = None) -> None:
        self.config = config
        # float projections stored as W [N, K] (the checkpoint's orientation) for ``matmul.linear``; the others as
        # Wt [K, N] for ``matmul.mm`` (block-format weights are W [N, K] and run ``matmul.linear`` too)
        self.linear_weights = frozenset(linear_weights)
        # fused projections stored as parts (their sources differ in format): name -> the parts' names, in row order
        self.parts = dict(parts or {})
        self.mesh = mesh
        self.dtype = dtype
        self.batch_invariant = batch_invariant
        # pipeline stages (one without a "pp" axis): each a contiguous run of layers on its tp group, whose weights
        # (in ``weights``, placed on that group) no other stage holds
        self.stages = stages or pipeline_stages(mesh, config.num_layers, head_layers=head_cost(config))
        self.layout = Layout(config, mesh.tp_size)
        self.weights = dict(weights)
        positions = min(max_positions or config.max_position_embeddings, config.max_position_embeddings)

        # the most positions a sequence may use (the position check names it); the tables hold the rows reached so far
        self.rope_positions = positions

        def rows(local: bool) -> RopeRows:  # [rows, 2, R / 2]: one gather a step
            # float32 [R / 2] (R: the rotary dims), scaled as the config says for a context of `positions`
            inv_freq = rope_inv_freq(config, local, positions)
            scale = 1.0 if local else rope_attention_factor(config)  # YaRN / LongRoPE: on every rotated dim of q, k
            return RopeRows(inv_freq, scale, positions)

        self._rope = rows(False)
        # the sliding layers' own RoPE base, fed as cos_local / sin_local; None: one table for every layer
        self._rope_local = rows(True) if config.rope_local_theta is not None else None

    @property
    def rope_table(self) -> torch.Tensor:
        """float32 [rows, 2, R / 2]: cos, sin of positions 0 .. rows - 1 (the rows reached so far: ``rope_reach``)."""
        return self._rope.table

    @property
    def rope_local_table(self) -> torch.Tensor | None:
        """The sliding layers' table (as ``rope_table``, their own base), or None: one table for every layer."""
        return self._rope_local.table if self._rope_local is not None else None

    def rope_reach(self, top: int) -> None:
        """Grow the RoPE tables to hold position ``top`` (< ``rope_positions``); rows already there stay bit-equal."""
        if top >= self.rope_positions:
            raise ModelError(f"position {top} is past the {self.rope_positions} positions the model was loaded "
                             "for (max_model_len, at most max_position_embeddings)")
        self._rope.reach(top)
        if self._rope_local is not None:
            self._rope_local.reach(top)

    # -- weights -------------------------------------------------------------------------------

    @classmethod
    def load(cls, config: ModelConfig, get: Getter, mesh: DeviceMesh, local_ids: tuple[int, ...],
             dtype: torch.dtype, get_packed: PackedGetter | None = None,
             max_positions: int | None = None, batch_invariant: bool = False,
             cache: PackCache | None = None, hollow: bool = False,
             pp_layers: tuple[int, ...] | None = None) -> Transformer:
        """Place every weight: for each local device, read its pieces through ``get``, fuse, cast, move.

        With ``get_packed``, the projections and the embedding stay in their GGUF block format where the file
        has one (packed once per device, ``layout="gguf.q4_1"`` ...); everything else is read as float ``dtype``.
        ``max_positions``: the positions a sequence will use at most (the RoPE table's rows; default: the model's).
        ``batch_invariant``: the products of a batch of decodes are never told so (``_proj``). ``cache``: the packed
        weights' cache entry of the file (``pack_cache``), read where it has them and written where it lacks them.
        ``hollow``: nothing read or packed, every weight an uninitialized tensor of its shape (``dtorch info``).
        On a mesh with a "pp" axis each stage's weights (``pp_layers`` layers each, default an even split of the work,
        the head counted: ``pipeline_stages``) are read
        only for the devices of that stage, placed on its tp group.
        """
        stages = pipeline_stages(mesh, config.num_layers, pp_layers, head_cost(config))
        weights, linear, parts = {}, set(), {}
        for st in stages:
            mine = tuple(i for i in local_ids if i in st.mesh.ids)
            if mine:
                w, lin, par = load_weights(config, get, st.mesh, mine, dtype, get_packed, cache, hollow,
                                           None if len(stages) == 1 else st.holds)
                weights.update(w)
                linear |= lin
                parts.update(par)
        if cache is not None:
            cache.commit()  # written (on a thread) when the load made what the entry lacked
        return cls(config, weights, mesh, dtype, linear, parts, max_positions, batch_invariant, stages)

    def linear_provider(self) -> str:
        """Which kernel the first layer's q/k/v projection runs: "provider" or "provider (layout)"."""
        from dtorch.dispatch import KernelKey, dispatcher

        c = self.config
        # of the layers whose weights this process holds (a pipeline stage under torchrun: its own), the first attention
        # layer's, else the first gated delta net's
        held = {int(n.split(".")[1]) for n in self.weights if n.startswith("layers.")}
        attention = [i for i in c.attention_layers if i in held]
        name = f"layers.{attention[0]}.qkv" if attention else f"layers.{min(held)}.lin_in"
        name = self.parts.get(name, (name,))[0]
        w = self.weights[name]
        device = self.mesh.device(self.mesh.ids[0]).type
        if w.layout == "strided" and name in self.linear_weights:
            return f"{dispatcher.explain(KernelKey('matmul.linear', device, self.dtype)).winner.provider} (W [N, K])"
        if w.layout == "strided":
            return dispatcher.explain(KernelKey("matmul.mm", device, self.dtype)).winner.provider
        return f"{dispatcher.explain(KernelKey('matmul.linear', device, self.dtype, w.layout)).winner.provider} " \
               f"({w.layout})"

    def weight_bytes(self, device_id: int | None = None) -> int:
        """Bytes of the weights one device holds (default: every local device); a weight two names share (tied
        embeddings) counts once."""
        total = 0
        for w in {id(w): w for w in self.weights.values()}.values():
            for i, b in w.blobs.items():
                if device_id is None or i == device_id:
                    total += b.tensor.numel() * b.tensor.element_size()
        return total

    # -- the step graph ------------------------------------------------------------------------

    def graph(self, bucket: Bucket, cache: Mapping[str, DistTensor], table_width: int, stage: int = 0) -> LogicalGraph:
        """The step graph of ``bucket``: inputs ids [T] int64, cos/sin [T, R/2] float32 (RoPE rows of the step's
        positions), slot_mapping [T] int64, cu_seqlens_q [N+1] int32, seqlens_k [N] int32, block_table
        [N, table_width] int32 (each sequence's cache blocks), (unless every row is a sequence's last) last_rows [N]
        int64 (``bucket.rows``: [rows]), and (with gated delta net layers) state_slots [N] int64, each sequence's row
        of the state cache; output "logits" [N, V] (or [T, V] with ``all_logits``, [rows, V] with ``rows``; "hidden"
        [T, H] instead with ``hidden``). ``cache``: "k_cache.{l}" / "v_cache.{l}" ->
        [blocks, block_size, Hkv, D] for attention layers, "conv_state.{l}" / "ssm_state.{l}" -> [slots + 1, C, W - 1]
        / [slots + 1, Hv, Dk, Dv] for gated delta net layers, placed by the layout.

        ``stage``: the graph of that pipeline stage only, on its tp group: its layers; the first embeds ``ids``, the
        others receive the residual stream [T, E] ("hidden", from the previous stage's devices); all but the last
        send theirs on (and have no output), the last gives the logits."""
        c = self.config
        st = self.stages[stage]
        g = LogicalGraph(st.mesh)
        T, N = bucket.tokens, bucket.seqs
        inter, R = c.intermediate_size, c.rotary_dim
        step = _Step(
            cos=g.input("cos", (T, R // 2), torch.float32),  # the rows of the step's positions, gathered once
            sin=g.input("sin", (T, R // 2), torch.float32),
            slots=g.input("slot_mapping", (T,), torch.int64),
            cu_q=g.input("cu_seqlens_q", (N + 1,), torch.int32),
            lens_k=g.input("seqlens_k", (N,), torch.int32),
            table=g.input("block_table", (N, table_width), torch.int32),
            state_slots=g.input("state_slots", (N,), torch.int64) if c.linear_layers else None,
            bucket=bucket,
            cos_local=g.input("cos_local", (T, R // 2), torch.float32) if self.rope_local_table is not None else None,
            sin_local=g.input("sin_local", (T, R // 2), torch.float32) if self.rope_local_table is not None else None)
        w = {name: g.param(name, t) for name, t in self.weights.items() if t.mesh == st.mesh}
        eps = c.rms_norm_eps
        if st.first:  # row-parallel results (partial sums on n > 1 devices) are all-reduced into the residual stream
            x = g.redistribute(g.call("llm.embedding", g.input("ids", (T,), torch.int64), w["embed"]), Replicate())
            if c.embedding_multiplier is not None:  # rounded to the model's dtype first (as transformers does)
                x = g.call("binary.mul", x, float(torch.tensor(c.embedding_multiplier, dtype=self.dtype)))
        else:  # the previous stage's residual stream, each device's from its peer there
            x = g.recv("hidden", (T, c.hidden_size), self.dtype, self.stages[stage - 1].mesh.ids)
        act = "llm.gelu_tanh_and_mul" if c.hidden_act == "gelu_tanh" else "llm.silu_and_mul"
        o = None
        for i in st.layers:
            p = f"layers.{i}."
            h, x = self._residual(g, o, x, w, p + "input_norm")
            if c.is_linear(i):
                o = self._delta_net(g, i, h, w, cache, step)
            else:
                o = self._attention(g, i, h, w, cache, step)
            o = self._block_output(g, o, w, p + "attn_out_norm")
            h, x = self._residual(g, o, x, w, p + "post_norm")
            if c.is_sparse(i):
                o = self._moe(g, i, h, w, step)
            else:
                gate, up = self._proj_split(g, h, w, p + "gate_up", (inter, inter), step)
                o = self._proj(g, g.call(act, gate, up), w, p + "down", step)
            o = self._block_output(g, o, w, p + "mlp_out_norm")
        if not st.last:  # x + the last block's output goes on to the next stage
            g.send(g.call("binary.add", o, x), self.stages[stage + 1].mesh.ids)
            return g
        h, _ = g.call("llm.add_rms_norm", o, x, w["final_norm"], eps=eps)
        if bucket.hidden:  # [T, hidden], replicated
            g.output("hidden", h)
            return g
        if not bucket.all_logits and (T != N or bucket.rows):  # the last row (or rows) of each sequence
            h = g.call("llm.embedding", g.input("last_rows", (bucket.rows or N,), torch.int64), h)
        logits = g.redistribute(self._proj(g, h, w, "lm_head", step), Replicate())
        if c.logits_scaling is not None:
            logits = g.call("binary.div", logits, c.logits_scaling)
        if c.logits_softcap is not None:  # cap * tanh(logits / cap)
            cap = c.logits_softcap
            logits = g.call("binary.mul", g.call("unary.tanh", g.call("binary.div", logits, cap)), cap)
        g.output("logits", logits)
        return g

    def _residual(self, g: LogicalGraph, o, x, w, norm: str) -> tuple:
        """x += o (the previous block's output, None before the first); returns (the next block's input, x): x normed
        by weight ``norm``, or x itself where norms stand after the blocks only (``norm_placement`` "post")."""
        c = self.config
        if c.norm_placement == "post":
            x = x if o is None else g.call("binary.add", o, x)
            return x, x
        if o is None:
            return g.call("llm.rms_norm", x, w[norm], eps=c.rms_norm_eps), x
        return g.call("llm.add_rms_norm", o, x, w[norm], eps=c.rms_norm_eps)

    def _block_output(self, g: LogicalGraph, o, w, norm: str):
        """A block's output o (a partial sum on n > 1) as it joins the residual stream: all-reduced, normed by weight
        ``norm`` where norms stand after the blocks (``norm_placement`` "sandwich" or "post"), scaled by
        ``residual_multiplier``."""
        c = self.config
        o = g.redistribute(o, Replicate())
        if c.norm_placement != "pre":
            o = g.call("llm.rms_norm", o, w[norm], eps=c.rms_norm_eps)
        if c.residual_multiplier is not None:
            o = g.call("binary.mul", o, c.residual_multiplier)
        return o

    def _proj(self, g: LogicalGraph, x, w, name: str, step: _Step, bias=None):
        """x [T, K] times weight ``name`` (+ ``bias`` [N]): Wt [K, N] through ``matmul.mm`` (then the bias added);
        W [N, K] (block format, or float stored as the checkpoint has it) through ``matmul.linear`` with the bias (one
        kernel a decode step instead of two: the sum rounded once either way), told when each row's precision may be
        traded for speed (``coarse``): a batch of decodes and a prompt step of ``bucket.COARSE_PROMPT_ROWS`` rows or
        more whose prompts are all that long, as llama.cpp always does; not a step whose rows must each be what a lone
        decode makes of them
        (the rows a speculative step verifies, every row's logits), a step with a short prompt in it (its answer would
        then depend on what it was batched with), nor any step of a ``batch_invariant`` model (each row's result then
        never depends on the others')."""
        t = w[name]
        if t.layout == "strided" and name not in self.linear_weights:
            y = g.call("matmul.mm", x, t)
            return y if bias is None else g.call("binary.add", y, bias)
        return g.call("matmul.linear", x, t, bias, coarse=self.coarse(step.bucket))

    def coarse(self, b: Bucket) -> bool:
        """Whether the products of a step in bucket ``b`` may trade each row's precision for speed (``_proj``)."""
        return (b.decode or b.coarse) and not self.batch_invariant

    def _proj_split(self, g: LogicalGraph, x, w, name: str, sizes: tuple[int, ...], step: _Step, bias=None) -> tuple:
        """x [T, K] times fused weight ``name`` (+ ``bias`` [N]), split into ``sizes`` (adding up to N) on the features.

        A weight stored as parts (``self.parts``: its sources differ in format) runs one product per part, each in its
        own layout, and gives their pieces: every size must then lie within one part (``_parts_fit``)."""
        names = self.parts.get(name)
        if names is None:
            return g.split(self._proj(g, x, w, name, step, bias), sizes, 1)
        widths = [self.weights[part].shape[0] for part in names]
        biases = g.split(bias, widths, 0) if bias is not None else [None] * len(names)
        out, rest = [], list(sizes)
        for part, width, b in zip(names, widths, biases, strict=True):
            take = []
            while rest and sum(take) < width:
                take.append(rest.pop(0))
            if sum(take) != width:
                raise ModelError(f"{name}: the pieces {list(sizes)} straddle its parts {widths} (sources stored in "
                                 "different formats)")
            y = self._proj(g, x, w, part, step, b)
            out += g.split(y, take, 1) if len(take) > 1 else [y]
        return tuple(out)

    def _parts_fit(self, name: str, sizes: tuple[int, ...]) -> bool:
        """Whether every piece ``sizes`` of fused weight ``name`` lies within one of its parts (always when fused)."""
        bounds = set(itertools.accumulate(self.weights[p].shape[0] for p in self.parts.get(name, ())))
        return bounds <= set(itertools.accumulate(sizes))

    def _attention(self, g: LogicalGraph, i: int, h, w, cache, step: _Step):
        """Full attention of layer ``i`` on h [T, E]: its KV cache rows written, then read; a partial sum on n > 1."""
        c = self.config
        T = step.bucket.tokens
        H, Hkv, D, p = c.num_heads, c.num_kv_heads, c.head_dim, f"layers.{i}."
        eps, rot = c.rms_norm_eps, dict(rotary_dim=c.rotary_dim)
        window = c.window(i)
        cos, sin = (step.cos_local, step.sin_local) if window and step.cos_local is not None else (step.cos, step.sin)
        # x @ [q | (gate) | k | v]: on each device [q_r | (gate_r) | k_r | v_r], its own heads of each
        bias = w[p + "qkv_bias"] if c.attention_bias else None
        qk_size = c.q_size + c.kv_size
        if not c.qk_norm and c.rotates(i) and self._parts_fit(p + "qkv", (qk_size, c.kv_size)):
            # q and k heads side by side (each device's [q_r | k_r]), rotated by one call
            qk, v = self._proj_split(g, h, w, p + "qkv", (qk_size, c.kv_size), step, bias)
            qk = g.call("llm.rope_cached", g.view(qk, (T, H + Hkv, D)), cos, sin, **rot)
            q, k = g.split(qk, (H, Hkv), 1)
            v = g.view(v, (T, Hkv, D))
            gate = None
        else:
            gated = (c.q_size,) if c.attn_output_gate else ()
            q, *gate, k, v = self._proj_split(g, h, w, p + "qkv", (c.q_size, *gated, c.kv_size, c.kv_size), step,
                                              bias)
            gate = gate[0] if gate else None
            if c.qk_norm and c.qk_norm_over == "all":  # one norm over all heads of q, one over k's
                q, k = self._norm_all_heads(g, q, w[p + "q_norm"]), self._norm_all_heads(g, k, w[p + "k_norm"])
            q, k, v = g.view(q, (T, H, D)), g.view(k, (T, Hkv, D)), g.view(v, (T, Hkv, D))
            if c.qk_norm and c.qk_norm_over == "head":  # per-head norms on q and k, then each rotated
                q = g.call("llm.rms_norm", q, w[p + "q_norm"], eps=eps)
                k = g.call("llm.rms_norm", k, w[p + "k_norm"], eps=eps)
            if c.rotates(i):
                q = g.call("llm.rope_cached", q, cos, sin, **rot)
                k = g.call("llm.rope_cached", k, cos, sin, **rot)
        kc, vc = g.state(f"k_cache.{i}", cache[f"k_cache.{i}"]), g.state(f"v_cache.{i}", cache[f"v_cache.{i}"])
        kc, vc = g.call("llm.reshape_and_cache", k, v, kc, vc, step.slots)
        a = g.call("llm.flash_attention_with_kvcache", q, kc, vc, step.cu_q, step.lens_k, step.table, causal=True,
                   scale=c.attn_scale, window=window, softcap=c.attn_softcap)
        a = g.view(a, (T, H * D))
        if gate is not None:  # each head's output scaled by sigmoid(gate)
            a = g.call("binary.mul", a, g.call("unary.sigmoid", gate))
        return self._proj(g, a, w, p + "o", step)

    def _norm_all_heads(self, g: LogicalGraph, x, weight):
        """x [T, heads * D] (each device its heads on n > 1) normed over all its heads at once: gathered, normed by
        ``weight`` [heads * D], each device keeping its heads again."""
        placement = x.placement
        x = g.call("llm.rms_norm", g.redistribute(x, Replicate()), weight, eps=self.config.rms_norm_eps)
        return g.redistribute(x, placement)

    def _delta_net(self, g: LogicalGraph, i: int, h, w, cache, step: _Step):
        """The gated delta net of layer ``i`` on h [T, E]; a partial sum on n > 1.

        Prefill (packed sequences) runs the conv and the chunked delta rule over each sequence's rows, starting from
        and advancing its rows of the state cache; a decode step (one row per sequence) runs their per-step forms.
        """
        c = self.config
        T, N = step.bucket.tokens, step.bucket.seqs
        Hk, Hv = c.linear_num_key_heads, c.linear_num_value_heads
        Dk, Dv = c.linear_key_head_dim, c.linear_value_head_dim
        kd, vd, p = c.linear_key_dim, c.linear_value_dim, f"layers.{i}."
        # [T, 2 kd + 2 vd + 2 Hv]: each device [q_r | k_r | v_r | z_r | b_r | a_r]
        qkv, z, b, a = self._proj_split(g, h, w, p + "lin_in", (2 * kd + vd, vd, Hv, Hv), step)
        conv = g.state(f"conv_state.{i}", cache[f"conv_state.{i}"])
        ssm = g.state(f"ssm_state.{i}", cache[f"ssm_state.{i}"])
        if step.bucket.decode:
            qkv, _ = g.call("llm.causal_conv1d_update", qkv, conv_state=conv, weight=w[p + "lin_conv"],
                            activation="silu", state_indices=step.state_slots)
            batch, cu = (N, 1), None
        else:
            qkv, _ = g.call("llm.causal_conv1d_varlen", qkv, w[p + "lin_conv"], conv_states=conv, cu_seqlens=step.cu_q,
                            state_indices=step.state_slots, activation="silu")
            batch, cu = (1, T), step.cu_q
        q, k, v = g.split(qkv, (kd, kd, vd), 1)
        decay, beta = g.call("llm.gdn_gates", a, b, w[p + "lin_A_log"], w[p + "lin_dt_bias"])
        o, _ = g.call("llm.gated_delta_net", g.view(q, (*batch, Hk, Dk)), g.view(k, (*batch, Hk, Dk)),
                      g.view(v, (*batch, Hv, Dv)), g.view(decay, (*batch, Hv)), g.view(beta, (*batch, Hv)),
                      initial_state=ssm, cu_seqlens=cu, state_indices=step.state_slots, use_qk_l2norm=True,
                      final_state_out=ssm)
        # the gated RMS norm: norm(o) * weight * silu(z), per value head
        o = g.call("llm.rms_norm", g.view(o, (T, Hv, Dv)), w[p + "lin_norm"], eps=c.rms_norm_eps)
        o = g.call("llm.silu_and_mul", g.view(z, (T, Hv, Dv)), o)
        return self._proj(g, g.view(o, (T, vd)), w, p + "lin_out", step)

    def _moe(self, g: LogicalGraph, i: int, h, w, step: _Step):
        """The sparse MoE block of layer ``i`` on h [T, E]: route each row to its top-k experts (each device's experts
        give a partial sum), plus the shared expert scaled by its sigmoid gate where the family has one."""
        c = self.config
        p = f"layers.{i}."
        logits = self._proj(g, h, w, p + "router", step)  # [T, E] (+ the shared expert's gate column), replicated
        shared = c.shared_expert_intermediate_size
        if shared:
            logits, sg = g.split(logits, (c.num_experts, 1), 1)
        weights, ids = g.call("llm.moe_router", logits, c.num_experts_per_tok, c.norm_topk_prob)  # [T, k] each
        o = g.call("llm.moe_experts", h, w[p + "experts_gate_up"], w[p + "experts_down"], weights, ids)
        if not shared:
            return o
        gate, up = self._proj_split(g, h, w, p + "shared_gate_up", (shared, shared), step)
        s = self._proj(g, g.call("llm.silu_and_mul", gate, up), w, p + "shared_down", step)
        return g.call("binary.add", o, g.call("binary.mul", s, g.call("unary.sigmoid", sg)))


@dataclass(frozen=True, slots=True)
class _Step:
    """The step inputs every layer reads (shapes as in ``Transformer.graph``)."""

    cos: Operand  # [T, R/2] float32
    sin: Operand
    slots: Operand  # slot_mapping [T] int64
    cu_q: Operand  # cu_seqlens_q [N+1] int32
    lens_k: Operand  # seqlens_k [N] int32
    table: Operand  # block_table [N, table_width] int32
    state_slots: Operand | None  # [N] int64, with gated delta net layers only
    bucket: Bucket
    cos_local: Operand | None = None  # the sliding layers' RoPE rows where they have their own base
    sin_local: Operand | None = None
