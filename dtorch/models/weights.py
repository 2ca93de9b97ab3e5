"""Which checkpoint tensors make each weight of a ``Transformer``, and placing them on a mesh.

``load_weights`` reads every device's piece of every model weight through a getter (so a process reads only the
slices of its own devices), fuses the parts (q/k/v, gate/up, a gated delta net's six input projections), and
stores it as the model runs it: Wt [K, N] for ``matmul.mm``, or W [N, K] for ``matmul.linear`` (block-format
weights, and bf16 ones where a native one-row kernel is ``matmul.linear``'s provider). A fused weight whose sources
a file stores in different formats is kept as parts, one per run of sources sharing a format, each as stored. The
table of sources is ``_tensors``: (model name, [(HF name, dim split on, unit)], combine, shape).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from dtorch.core.errors import ModelError
from dtorch.core.memory import MemoryKind, adopt
from dtorch.core.placement import piece_ranges
from dtorch.graph import DeviceMesh, Shard
from dtorch.graph.views import split_placements
from dtorch.models.config import ModelConfig
from dtorch.models.layout import Layout
from dtorch.runtime.blob import Blob, DistTensor

# getter(hf_name, dim, runs) -> the rows/columns ``runs`` [(start, length)] of dim ``dim`` of a checkpoint tensor
# (the whole tensor when ``dim`` is None)
Getter = Callable[[str, "int | None", "list[tuple[int, int]]"], torch.Tensor]
# the same, as stored: (layout, GGUF block bytes uint8 [rows, row bytes]), or None where the tensor is float
PackedGetter = Callable[[str, "int | None", "list[tuple[int, int]]"], "tuple[str, torch.Tensor] | None"]


def load_weights(config: ModelConfig, get: Getter, mesh: DeviceMesh, local_ids: tuple[int, ...], dtype: torch.dtype,
                 get_packed: PackedGetter | None = None
                 ) -> tuple[dict[str, DistTensor], set[str], dict[str, tuple[str, ...]]]:
    """Every weight placed on ``mesh`` (this process's devices ``local_ids``), the names of the float ones stored as
    W [N, K], and the fused weights stored as parts (fused name -> its parts' names, in row order). With
    ``get_packed``, projections and the embedding stay in their GGUF block format where the file has one (packed
    once per device, ``layout="gguf.q4_1"`` ...); everything else is read as float ``dtype``. A fused projection
    whose sources differ in format is stored as parts ``"{name}[j]"`` of consecutive sources sharing one, each kept
    as stored (``_load_parts``), so no weight is widened because of its neighbour."""
    layout = Layout(config, mesh.size)
    weights: dict[str, DistTensor] = {}
    linear: set[str] = set()
    parts: dict[str, tuple[str, ...]] = {}
    rows_first = _float_linear(mesh, dtype)
    for name, sources, combine, shape in _tensors(config, layout):
        kind = _kind(name)
        if rows_first and kind == "lm_head" and config.tie_word_embeddings and name not in weights \
                and weights["embed"].layout == "strided":
            weights[name] = weights["embed"]  # tied: the embedding rows [V, E] are the head's W
            linear.add(name)
            continue
        if get_packed is not None and kind in PACKABLE:
            if kind == "lm_head" and config.tie_word_embeddings and weights["embed"].layout != "strided":
                weights[name] = weights["embed"]  # tied: the same rows [V, E] serve both
                continue
            stored = _load_parts(config, get, get_packed, mesh, local_ids, dtype, sources, combine, shape, kind,
                                 layout.placement(kind))
            if len(stored) == 1 and stored[0][1] is not None:
                weights[name] = stored[0][1]
                continue
            if len(stored) > 1:
                parts[name] = tuple(f"{name}[{j}]" for j in range(len(stored)))
                for part, (_, t) in zip(parts[name], stored, strict=True):
                    weights[part] = t
                    if t.layout == "strided":
                        linear.add(part)
                continue
        pl = layout.placement(kind)
        wdtype = torch.float32 if kind in FLOAT32 else dtype
        as_w = rows_first and kind in (*PACKABLE, "router") and kind != "embed"  # W [N, K] rather than Wt [K, N]
        blobs = {}
        for i in local_ids:
            parts_i = [get(hf, dim if runs else None, runs) for hf, dim, runs in _slices(config, sources, mesh, i)]
            t = combine(parts_i)
            t = (t.t() if as_w else t).to(device=mesh.device(i).torch, dtype=wdtype).contiguous()
            blobs[i] = Blob(mesh.device(i), MemoryKind.PERSISTENT, adopt(t, MemoryKind.PERSISTENT), pinned=True)
        if as_w:
            pl, shape = _transposed(pl), (shape[1], shape[0])
            linear.add(name)
        weights[name] = DistTensor(mesh, pl, shape, wdtype, blobs)
    return weights, linear, parts


# Weights that may stay in a block format, as W [N, K] (the checkpoint's own orientation) for matmul.linear.
PACKABLE = ("embed", "lm_head", "qkv", "o", "gate_up", "down", "lin_in", "lin_out", "shared_gate_up", "shared_down")
# Weights kept in float32 whatever the model's dtype: the gated delta net's decay parameters (transformers computes
# with them in float32 too)
FLOAT32 = ("lin_A_log", "lin_dt_bias")


def _slices(config: ModelConfig, sources, mesh: DeviceMesh, device_id: int):
    """(HF name, dim, runs) of device ``device_id``'s piece of each source of a weight."""
    rank = mesh.rank(device_id)
    for hf, dim, unit in sources:  # unit: an int, or the Shard itself for a tensor split in blocks
        if dim is None or mesh.size == 1:
            runs = []
        else:
            shard = unit if isinstance(unit, Shard) else Shard(dim, None, unit)
            runs = piece_ranges(shard, _hf_shape(config, hf)[dim], rank, mesh.size)
        yield hf, dim, runs


def _load_parts(config: ModelConfig, get: Getter, get_packed: PackedGetter, mesh: DeviceMesh,
                local_ids: tuple[int, ...], dtype: torch.dtype, sources, combine, shape: tuple[int, ...], kind: str,
                placement) -> list[tuple[str | None, DistTensor | None]]:
    """A projection (or the embedding) kept as stored: W [N, K] (logical) whose pieces are packed rows (or 16-bit
    rows, layout "f16" / "bf16", in a model computing in another dtype).

    Returns one (layout, weight) per run of consecutive sources that share a format: one entry for a weight
    stored in one format, several where the sources differ (q/k Q5_0 and v Q8_0, as llama.cpp's Q4_K_M writes
    576-wide models), each then W [N_j, K] of its own rows, placed as its rows of the fused placement. A run of
    float sources is (None, float W [N_j, K]) beside packed ones, and (None, None) when every source is float
    (the caller's float path then reads the weight). A source whose slice on some device would cut a block is
    read as float."""
    n, k = (shape[1], shape[0]) if kind != "embed" else shape  # Wt [K, N] in the float model
    slices = {i: list(_slices(config, sources, mesh, i)) for i in local_ids}
    got = {i: [get_packed(hf, dim if runs else None, runs) for hf, dim, runs in slices[i]] for i in local_ids}
    fmts = []
    for j in range(len(sources)):
        seen = {None if got[i][j] is None else got[i][j][0] for i in local_ids}
        fmts.append(seen.pop() if len(seen) == 1 else None)
    if all(f is None for f in fmts):
        return [(None, None)]
    rows = getattr(combine, "rows", None) or (None,) * len(sources)  # per source: a reorder of its rows, or None
    k_split = sources[0][1] == 1 and mesh.size > 1  # split on K (row parallel): one source, each device its columns
    runs = [(f, list(g)) for f, g in itertools.groupby(range(len(sources)), key=fmts.__getitem__)]
    sizes = [sum(_hf_shape(config, sources[j][0])[0] for j in js) for _, js in runs] if kind != "embed" else [n]
    pieces = _part_placements(placement, (k, n), sizes) if kind != "embed" else [placement]
    out = []
    for (fmt, js), size, pl in zip(runs, sizes, pieces, strict=True):
        blobs = {}
        for i in local_ids:
            raws = []
            for j in js:
                hf, dim, rs = slices[i][j]
                raw = got[i][j][1] if fmt is not None else get(hf, dim if rs else None, rs).to(dtype)
                raws.append(raw if rows[j] is None else rows[j](raw))
            raw = torch.cat(raws, 0) if len(raws) > 1 else raws[0]
            k_local = k
            if k_split:
                k_local = sum(r for _, r in piece_ranges(Shard(1, None, sources[0][2]), k, mesh.rank(i), mesh.size))
            t = (pack_stored(raw, fmt, k_local) if fmt is not None else raw.contiguous()).to(mesh.device(i).torch)
            blobs[i] = Blob(mesh.device(i), MemoryKind.PERSISTENT, adopt(t, MemoryKind.PERSISTENT), pinned=True)
        pl = pl if kind == "embed" else _transposed(pl)  # embed is [V, E] either way
        out.append((fmt, DistTensor(mesh, pl, (size, k), dtype, blobs, layout=fmt or "strided")))
    return out


PACK_CHUNK_BYTES = 1 << 22  # GGUF bytes packed at a time: packing makes a few copies of what it packs


def pack_stored(raw: torch.Tensor, layout: str, k: int) -> torch.Tensor:
    """The tensor kernels of ``layout`` read, from the rows [N, ...] a file stores: GGUF block bytes packed
    (``layouts.pack``) a chunk of rows at a time into the result (each packed row holds its own row alone), so a
    large weight (an embedding) costs no more than itself and a chunk; 16-bit float rows ("f16", "bf16") as they are."""
    from dtorch.kernels.half import HALF_LAYOUTS
    from dtorch.kernels.layouts import pack, row_bytes

    if layout in HALF_LAYOUTS:
        return raw.contiguous()
    n = raw.shape[0]
    step = max(1, PACK_CHUNK_BYTES // max(1, raw[:1].numel()))
    if step >= n:
        return pack(raw, layout, k)
    out = torch.empty(n, row_bytes(layout, k), dtype=torch.uint8)
    for r in range(0, n, step):
        out[r:r + step] = pack(raw[r:r + step], layout, k)
    return out


def _part_placements(placement, shape: tuple[int, int], sizes: list[int]) -> list:
    """The placements of the row runs ``sizes`` of a fused Wt [K, N] placed ``placement``: each its own blocks of a
    blocked column split (``split_placements``), the whole placement otherwise."""
    if len(sizes) == 1 or not isinstance(placement, Shard) or placement.dim != 1:
        return [placement] * len(sizes)
    return list(split_placements("parts", shape, sizes, 1, placement))


def _transposed(pl):
    """The placement of W [N, K] for that of Wt [K, N]: a shard of dim d becomes one of dim 1 - d."""
    if isinstance(pl, Shard):
        return Shard(1 - pl.dim, pl.blocks, pl.unit)
    return pl


def _float_linear(mesh: DeviceMesh, dtype: torch.dtype) -> bool:
    """Whether float projections run faster as W [N, K] through ``matmul.linear``: where a native one-row kernel of
    the registry is its active provider (bf16 on cpu: it streams W at about 1.6x torch's bf16 GEMV of Wt)."""
    from dtorch.dispatch import KernelKey, dispatcher

    device = mesh.device(mesh.ids[0]).type
    return dtype == torch.bfloat16 and device == "cpu" and \
        dispatcher.explain(KernelKey("matmul.linear", device, dtype)).winner.provider == "native"


def _kind(name: str) -> str:
    """The layout entry of a model tensor name ("layers.3.qkv" -> "qkv")."""
    return name.rpartition(".")[2] if name.startswith("layers.") else name


def _hf_shape(c: ModelConfig, hf: str) -> tuple[int, ...]:
    from dtorch.models.loaders.checkpoint import expected_shapes

    shapes = expected_shapes(c)
    if hf not in shapes:
        raise ModelError(f"no tensor {hf!r} in a {c.family} model with this config")
    return shapes[hf]


def _cat_t(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, 0).t() if len(parts) > 1 else parts[0].t()


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, 0) if len(parts) > 1 else parts[0]


def _cat_1(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, 1)


def _plus_one(parts: list[torch.Tensor]) -> torch.Tensor:
    """A zero-centred RMS norm weight as the scale it stands for: 1 + weight (in float32)."""
    return parts[0].float() + 1


def _first_channel(parts: list[torch.Tensor]) -> torch.Tensor:
    """A depthwise conv1d weight [C, 1, W] as [C, W]."""
    return parts[0][:, 0]


def _transposed_rows(*rows):
    """A combine that reorders each part's rows with its function of ``rows`` (None: as they are), joins them and
    transposes (Wt [K, N]); ``combine.rows`` also reorders block-format rows (``_load_parts``), part by part."""
    def combine(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([p if f is None else f(p) for f, p in zip(rows, parts, strict=True)], 0).t()

    combine.rows = rows
    return combine


def _gated_q_rows(d: int):
    """q_proj's rows [q_h | gate_h] per head -> [q | gate]."""
    def rows(q: torch.Tensor) -> torch.Tensor:
        qg = q.reshape(-1, 2, d, q.shape[-1])
        return torch.cat([qg[:, 0].flatten(0, 1), qg[:, 1].flatten(0, 1)], 0)

    return rows


def _qkvz_ba_rows(dk: int, dv: int, group: int):
    """Qwen3-Next's in_proj_qkvz rows [q_h | k_h | v_h | z_h] and in_proj_ba rows [b_h | a_h] per key head h (its
    ``group`` value heads each) -> [q | k | v | z] and [b | a], each part in head order (two row functions)."""
    def qkvz_rows(qkvz: torch.Tensor) -> torch.Tensor:
        parts = qkvz.reshape(-1, 2 * dk + 2 * group * dv, qkvz.shape[-1]).split((dk, dk, group * dv, group * dv), 1)
        return torch.cat([x.flatten(0, 1) for x in parts], 0)

    def ba_rows(ba: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.flatten(0, 1) for x in ba.reshape(-1, 2 * group, ba.shape[-1]).split((group, group), 1)])

    return qkvz_rows, ba_rows


def _tensors(c: ModelConfig, layout: Layout):
    """(model name, [(HF name, HF dim it is split on or None, unit)], combine, global shape) of every weight."""
    H, Hkv, D, E, inter, V = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size, c.vocab_size
    G = H // Hkv
    head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    norm = _plus_one if c.norm_plus_one else _cat
    yield "embed", [("model.embed_tokens.weight", 0, 1)], _cat, (V, E)
    yield "lm_head", [(head, 0, 1)], _cat_t, (E, V)
    yield "final_norm", [("model.norm.weight", None, 1)], norm, (E,)
    Q = (H + 2 * Hkv) * D
    for i in range(c.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        n = f"layers.{i}."
        yield n + "input_norm", [(p + "input_layernorm.weight", None, 1)], norm, (E,)
        if c.sandwich_norm:  # Gemma: post_attention_layernorm is the attention output's; the MLP has its own two
            yield n + "attn_out_norm", [(p + "post_attention_layernorm.weight", None, 1)], norm, (E,)
            yield n + "post_norm", [(p + "pre_feedforward_layernorm.weight", None, 1)], norm, (E,)
            yield n + "mlp_out_norm", [(p + "post_feedforward_layernorm.weight", None, 1)], norm, (E,)
        else:
            yield n + "post_norm", [(p + "post_attention_layernorm.weight", None, 1)], norm, (E,)
        if c.is_linear(i):
            yield from _delta_net_tensors(c, layout, n, p + "linear_attn.")
        elif c.attn_output_gate:  # q_proj gives [q_h | gate_h] per head: whole groups of 2 G D rows per device
            yield n + "qkv", [(a + "q_proj.weight", 0, 2 * G * D), (a + "k_proj.weight", 0, D),
                              (a + "v_proj.weight", 0, D)], _transposed_rows(_gated_q_rows(D), None, None), \
                (E, Q + H * D)
        elif c.family == "phi3":  # fused [q | k | v] rows: each device its heads' rows of each part
            yield n + "qkv", [(a + "qkv_proj.weight", 0, Shard(0, (H * D, Hkv * D, Hkv * D), (G * D, D, D)))], \
                _cat_t, (E, Q)
        else:
            yield n + "qkv", [(a + "q_proj.weight", 0, G * D), (a + "k_proj.weight", 0, D),
                              (a + "v_proj.weight", 0, D)], _cat_t, (E, Q)
        if c.attention_bias:
            yield n + "qkv_bias", [(a + "q_proj.bias", 0, G * D), (a + "k_proj.bias", 0, D),
                                   (a + "v_proj.bias", 0, D)], _cat, (Q,)
        if not c.is_linear(i):
            if c.qk_norm:
                yield n + "q_norm", [(a + "q_norm.weight", None, 1)], norm, (D,)
                yield n + "k_norm", [(a + "k_norm.weight", None, 1)], norm, (D,)
            yield n + "o", [(a + "o_proj.weight", 1, G * D)], _cat_t, (H * D, E)
        if c.is_sparse(i):
            yield from _moe_tensors(c, layout, n, m)
            continue
        if c.family == "phi3":  # fused [gate | up] rows: each device its rows of each half
            yield n + "gate_up", [(m + "gate_up_proj.weight", 0, Shard(0, (inter, inter), 1))], _cat_t, (E, 2 * inter)
        else:
            yield n + "gate_up", [(m + "gate_proj.weight", 0, 1), (m + "up_proj.weight", 0, 1)], _cat_t,\
                (E, 2 * inter)
        yield n + "down", [(m + "down_proj.weight", 1, 1)], _cat_t, (inter, E)


def _moe_tensors(c: ModelConfig, layout: Layout, n: str, m: str):
    """A sparse layer's router Wt [H, E] and experts [E, 2I, H] ([gate | up] rows, as llm.moe_experts takes them) and
    [E, H, I]: the stacked checkpoint tensors split on the dim of their layout placement (experts or features)."""
    E, H, inter = c.num_experts, c.hidden_size, c.moe_intermediate_size
    x = m + "experts."
    fs = c.shared_expert_intermediate_size
    if fs:  # the shared expert's gate is one more router column: [T, E + 1] from one product
        yield n + "router", [(m + "gate.weight", None, 1), (m + "shared_expert_gate.weight", None, 1)], _cat_t, \
            (H, E + 1)
        s = m + "shared_expert."
        yield n + "shared_gate_up", [(s + "gate_proj.weight", 0, 1), (s + "up_proj.weight", 0, 1)], _cat_t, (H, 2 * fs)
        yield n + "shared_down", [(s + "down_proj.weight", 1, 1)], _cat_t, (fs, H)
    else:
        yield n + "router", [(m + "gate.weight", None, 1)], _cat_t, (H, E)
    gu = layout.placement("experts_gate_up")
    d = gu.dim if isinstance(gu, Shard) else None  # 0: experts; 1: each expert's rows of gate and of up
    yield n + "experts_gate_up", [(x + "gate_proj", d, 1), (x + "up_proj", d, 1)], _cat_1, (E, 2 * inter, H)
    dn = layout.placement("experts_down")
    yield n + "experts_down", [(x + "down_proj", dn.dim if isinstance(dn, Shard) else None, 1)], _cat, (E, H, inter)


def _delta_net_tensors(c: ModelConfig, layout: Layout, n: str, a: str):
    """A gated delta net layer's weights: the fused input projection Wt [E, 2 kd + 2 vd + 2 Hv] ([q | k | v | z | b |
    a], each device its key heads' share of every part), the conv weight [C, W] over [q | k | v], A_log and dt_bias
    [Hv] (float32), the gated norm's weight [Dv] and the output projection Wt [vd, E]."""
    E, kd, vd, hv = c.hidden_size, c.linear_key_dim, c.linear_value_dim, c.linear_num_value_heads
    dk, dv, gl = c.linear_key_head_dim, c.linear_value_head_dim, layout.linear_group
    blocks = Shard(0, (kd, kd, vd), (dk, dk, gl * dv))  # [q | k | v] rows, split by whole key heads
    shape = (E, 2 * kd + 2 * vd + 2 * hv)
    if c.family == "qwen3_next":  # interleaved per key head
        sources = [(a + "in_proj_qkvz.weight", 0, 2 * dk + 2 * gl * dv), (a + "in_proj_ba.weight", 0, 2 * gl)]
        yield n + "lin_in", sources, _transposed_rows(*_qkvz_ba_rows(dk, dv, gl)), shape
    else:
        yield n + "lin_in", [(a + "in_proj_qkv.weight", 0, blocks), (a + "in_proj_z.weight", 0, gl * dv),
                             (a + "in_proj_b.weight", 0, gl), (a + "in_proj_a.weight", 0, gl)], _cat_t, shape
    yield n + "lin_conv", [(a + "conv1d.weight", 0, blocks)], _first_channel, (2 * kd + vd, c.linear_conv_kernel_dim)
    yield n + "lin_A_log", [(a + "A_log", 0, gl)], _cat, (hv,)
    yield n + "lin_dt_bias", [(a + "dt_bias", 0, gl)], _cat, (hv,)
    yield n + "lin_norm", [(a + "norm.weight", None, 1)], _cat, (dv,)
    yield n + "lin_out", [(a + "out_proj.weight", 1, gl * dv)], _cat_t, (vd, E)
