"""Which checkpoint tensors make each weight of a ``Transformer``, and placing them on a mesh.

``load_weights`` reads every device's piece of every model weight through a getter (so a process reads only the
slices of its own devices), fuses the parts (q/k/v, gate/up, a gated delta net's six input projections), and
stores it as the model runs it: Wt [K, N] for ``matmul.mm``, or W [N, K] for ``matmul.linear`` (block-format
weights, and bf16 ones where a native one-row kernel is ``matmul.linear``'s provider). A fused weight whose sources
a file stores in different formats is kept as parts, one per run of sources sharing a format, each as stored. The
table of weights and their sources is the family's (``families.get(config.family).tensors``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from dtorch.core.memory import HUGE_PAGE, MemoryKind, adopt, current_weight_arena, empty_weight, weight_arena
from dtorch.core.placement import piece_ranges
from dtorch.graph import DeviceMesh, Shard
from dtorch.graph.views import split_placements
from dtorch.models import families
from dtorch.models.config import ModelConfig
from dtorch.models.families import Source
from dtorch.models.layout import Layout
from dtorch.models.loaders.checkpoint import progress
from dtorch.models.pack_cache import PackCache, Part
from dtorch.runtime.blob import Blob, DistTensor

# getter(hf_name, dim, runs) -> the rows/columns ``runs`` [(start, length)] of dim ``dim`` of a checkpoint tensor
# (the whole tensor when ``dim`` is None)
Getter = Callable[[str, "int | None", "list[tuple[int, int]]"], torch.Tensor]
# the same, as stored: (layout, GGUF block bytes uint8 [rows, row bytes]), or None where the tensor is float
PackedGetter = Callable[[str, "int | None", "list[tuple[int, int]]"], "tuple[str, torch.Tensor] | None"]


def load_weights(config: ModelConfig, get: Getter, mesh: DeviceMesh, local_ids: tuple[int, ...], dtype: torch.dtype,
                 get_packed: PackedGetter | None = None, cache: PackCache | None = None, hollow: bool = False,
                 keep: Callable[[str], bool] | None = None
                 ) -> tuple[dict[str, DistTensor], set[str], dict[str, tuple[str, ...]]]:
    """Every weight placed on ``mesh`` (this process's devices ``local_ids``), the names of the float ones stored as
    W [N, K], and the fused weights stored as parts (fused name -> its parts' names, in row order). With
    ``get_packed``, projections and the embedding stay in their GGUF block format where the file has one (packed
    once per device, ``layout="gguf.q4_1"`` ...); everything else is read as float ``dtype``. A fused projection
    whose sources differ in format is stored as parts ``"{name}[j]"`` of consecutive sources sharing one, each kept
    as stored (``_load_parts``), so no weight is widened because of its neighbour. ``cache``: the packed weights are
    read from it where it has them, and recorded where it lacks them (the caller commits it once every stage is
    loaded). ``hollow``:
    the getters read nothing (``LazyCheckpoint.hollow``), and nothing is packed either: each packed weight is an
    uninitialized tensor of its packed shape (``dtorch info``). ``keep``: which weights to load
    (a pipeline stage's own; default all), so a stage never reads another's from the file."""
    layout = Layout(config, mesh.size)
    tensors = [w for w in families.get(config.family).tensors(config, layout) if keep is None or keep(w.name)]
    try:
        with weight_arena():  # the packed weights, small ones too, in 2 MiB pages (where the kernel gives them)
            return _load_all(config, get, mesh, local_ids, dtype, get_packed, cache, hollow, layout, tensors)
    except BaseException:
        if cache is not None:
            cache.close()  # nothing written for a load that failed
        raise


def _load_all(config: ModelConfig, get: Getter, mesh: DeviceMesh, local_ids: tuple[int, ...], dtype: torch.dtype,
              get_packed: PackedGetter | None, cache: PackCache | None, hollow: bool, layout: Layout, tensors: list
              ) -> tuple[dict[str, DistTensor], set[str], dict[str, tuple[str, ...]]]:
    """``load_weights``' loop over the family's weight table ``tensors``."""
    weights: dict[str, DistTensor] = {}
    linear: set[str] = set()
    parts: dict[str, tuple[str, ...]] = {}
    rows_first = _float_linear(mesh, dtype)
    for weight in progress(tensors, len(tensors), "loading weights"):  # a bar on a terminal
        name, sources, combine, shape = weight.name, weight.sources, weight.combine, weight.shape
        kind = _kind(name)
        tied = kind == "lm_head" and config.tie_word_embeddings and "embed" in weights  # else read from the file
        if tied and weights["embed"].layout == "strided":
            weights[name] = weights["embed"]  # tied: the embedding rows [V, E] are the head's W, one tensor
            linear.add(name)
            continue
        if get_packed is not None and kind in PACKABLE:
            if tied and weights["embed"].layout != "strided":
                weights[name] = weights["embed"]  # tied: the same rows [V, E] serve both
                continue
            stored = _load_parts(get, get_packed, mesh, local_ids, dtype, sources, combine, shape, kind,
                                 layout.placement(kind), name, cache, hollow)
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
            parts_i = [get(hf, dim if runs else None, runs) for hf, dim, runs in _slices(sources, mesh, i)]
            t = combine(parts_i)
            t = (t.t() if as_w else t).to(device=mesh.device(i).torch, dtype=wdtype)
            t = t.contiguous() if hollow else _placed(t)  # (hollow: nothing is read, nothing copied)
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


def _slices(sources: tuple[Source, ...], mesh: DeviceMesh, device_id: int):
    """(HF name, dim, runs) of device ``device_id``'s piece of each source of a weight."""
    rank = mesh.rank(device_id)
    for s in sources:  # unit: an int, or the Shard itself for a tensor split in blocks
        if s.dim is None or mesh.size == 1:
            runs = []
        else:
            shard = s.unit if isinstance(s.unit, Shard) else Shard(s.dim, None, s.unit)
            runs = piece_ranges(shard, s.shape[s.dim], rank, mesh.size)
        yield s.hf, s.dim, runs


def _load_parts(get: Getter, get_packed: PackedGetter, mesh: DeviceMesh, local_ids: tuple[int, ...],
                dtype: torch.dtype, sources: tuple[Source, ...], combine, shape: tuple[int, ...], kind: str,
                placement, name: str, cache: PackCache | None = None,
                hollow: bool = False) -> list[tuple[str | None, DistTensor | None]]:
    """A projection (or the embedding) kept as stored: W [N, K] (logical) whose pieces are packed rows (or 16-bit
    rows, layout "f16" / "bf16", in a model computing in another dtype).

    Returns one (layout, weight) per run of consecutive sources that share a format: one entry for a weight
    stored in one format, several where the sources differ (q/k Q5_0 and v Q8_0, as llama.cpp's Q4_K_M writes
    576-wide models), each then W [N_j, K] of its own rows, placed as its rows of the fused placement. A run of
    float sources is (None, float W [N_j, K]) beside packed ones, and (None, None) when every source is float
    (the caller's float path then reads the weight). A source whose slice on some device would cut a block is
    read as float. ``cache``: the parts are taken from it when it has weight ``name``, else made and put there.
    ``hollow``: packed parts are left unpacked (see ``load_weights``)."""
    n, k = (shape[1], shape[0]) if kind != "embed" else shape  # Wt [K, N] in the float model
    parts = cache.get(name) if cache is not None else None
    if parts is None:
        parts = _make_parts(get, get_packed, mesh, local_ids, dtype, sources, combine, n, k, kind, hollow)
        if parts is None:
            return [(None, None)]
        if cache is not None:
            cache.put(name, parts)
    sizes = [p.rows for p in parts]
    pieces = _part_placements(placement, (k, n), sizes) if kind != "embed" else [placement]
    out = []
    for part, pl in zip(parts, pieces, strict=True):
        blobs = {i: Blob(mesh.device(i), MemoryKind.PERSISTENT,
                         adopt(t.to(mesh.device(i).torch), MemoryKind.PERSISTENT), pinned=True)
                 for i, t in part.tensors.items()}
        pl = pl if kind == "embed" else _transposed(pl)  # embed is [V, E] either way
        out.append((part.layout, DistTensor(mesh, pl, (part.rows, k), dtype, blobs, layout=part.layout or "strided")))
    return out


def _make_parts(get: Getter, get_packed: PackedGetter, mesh: DeviceMesh, local_ids: tuple[int, ...],
                dtype: torch.dtype, sources: tuple[Source, ...], combine, n: int, k: int, kind: str,
                hollow: bool = False) -> list[Part] | None:
    """``_load_parts``' parts read from the checkpoint: each device's tensor of each run of sources sharing a format,
    packed (on the cpu); None when every source is float."""
    slices = {i: list(_slices(sources, mesh, i)) for i in local_ids}
    got = {i: [get_packed(hf, dim if runs else None, runs) for hf, dim, runs in slices[i]] for i in local_ids}
    fmts = []
    for j in range(len(sources)):
        seen = {None if got[i][j] is None else got[i][j][0] for i in local_ids}
        fmts.append(seen.pop() if len(seen) == 1 else None)
    if all(f is None for f in fmts):
        return None
    rows = getattr(combine, "rows", None) or (None,) * len(sources)  # per source: a reorder of its rows, or None
    k_split = sources[0].dim == 1 and mesh.size > 1  # split on K (row parallel): one source, each device its columns
    runs = [(f, list(g)) for f, g in itertools.groupby(range(len(sources)), key=fmts.__getitem__)]
    sizes = [sum(sources[j].shape[0] for j in js) for _, js in runs] if kind != "embed" else [n]
    parts = []
    for (fmt, js), size in zip(runs, sizes, strict=True):
        tensors = {}

        def k_of(i: int) -> int:
            if not k_split:
                return k
            return sum(r for _, r in piece_ranges(Shard(1, None, sources[0].unit), k, mesh.rank(i), mesh.size))

        fmt = _interleaved(fmt, kind, mesh, dtype, {i: (sum(got[i][j][1].shape[0] for j in js), k_of(i))
                                                    for i in local_ids} if fmt is not None else {})
        for i in local_ids:
            k_local = k_of(i)
            if hollow and fmt is not None:  # its packed shape, nothing read or packed
                tensors[i] = _unpacked(fmt, sum(got[i][j][1].shape[0] for j in js), k_local)
                continue
            raws = []
            for j in js:
                hf, dim, rs = slices[i][j]
                raw = got[i][j][1] if fmt is not None else get(hf, dim if rs else None, rs).to(dtype)
                raws.append(raw if rows[j] is None else rows[j](raw))
            raw = torch.cat(raws, 0) if len(raws) > 1 else raws[0]
            tensors[i] = pack_stored(raw, fmt, k_local) if fmt is not None else \
                raw.contiguous() if hollow else _placed(raw)
        parts.append(Part(fmt, size, tensors))
    return parts


def _interleaved(fmt: str | None, kind: str, mesh: DeviceMesh, dtype: torch.dtype,
                 shapes: dict[int, tuple[int, int]]) -> str | None:
    """The layout a run of packed sources in ``fmt`` is kept in: Q8_0 / Q5_0 projections (not the embedding, whose
    rows are gathered, nor a head tied to it: that is the embedding; nor the experts of a mixture) with 16 rows
    interleaved (``layouts.X16``) where every device of the load is the cpu and its piece ``shapes[i]`` = (rows, K)
    interleaves whole (``layouts.x16_fits``) and pays (``layouts.x16_pays``: Q8_0 from a long K), on AVX-512 VNNI
    (``repack.x16_wanted``); else ``fmt``."""
    from dtorch.kernels.layouts import x16_fits, x16_of, x16_pays
    from dtorch.kernels.native.repack import x16_wanted

    # not the embedding, nor a mixture's experts (their rows are read per expert by the MoE kernels, in rows)
    x16 = x16_of(fmt) if fmt is not None and kind != "embed" and not kind.startswith("experts") else None
    if x16 is None or not shapes or any(mesh.device(i).type != "cpu" for i in shapes):
        return fmt
    if not all(x16_fits(rows, k) and x16_pays(fmt, k) for rows, k in shapes.values()) or not x16_wanted(dtype):
        return fmt
    return x16


def _unpacked(layout: str, rows: int, k: int) -> torch.Tensor:
    """An uninitialized tensor of the shape and dtype ``pack_stored`` gives a weight of ``rows`` rows of ``k`` in
    ``layout`` (no page of it is touched)."""
    from dtorch.kernels.half import HALF_LAYOUTS
    from dtorch.kernels.layouts import row_bytes

    if layout in HALF_LAYOUTS:
        return torch.empty(rows, k, dtype=HALF_LAYOUTS[layout])
    return torch.empty(rows, row_bytes(layout, k), dtype=torch.uint8)


PACK_CHUNK_BYTES = 1 << 22  # GGUF bytes packed at a time: packing makes a few copies of what it packs


def pack_stored(raw: torch.Tensor, layout: str, k: int) -> torch.Tensor:
    """The tensor kernels of ``layout`` read, from the rows [N, ...] a file stores: GGUF block bytes packed in one
    native pass (``kernels.native.repack``), else by ``layouts.pack`` a chunk of rows at a time into the result (each
    packed row holds its own row alone), so a large weight (an embedding) costs no more than itself and a chunk;
    16-bit float rows ("f16", "bf16") as they are."""
    from dtorch.kernels.half import HALF_LAYOUTS
    from dtorch.kernels.layouts import pack, row_bytes
    from dtorch.kernels.native.repack import repack

    if layout in HALF_LAYOUTS:
        return _placed(raw)
    packed = repack(raw, layout, k)  # native, one pass at memory speed; None where it does not serve the format
    if packed is not None:
        return packed
    n = raw.shape[0]
    step = max(16, PACK_CHUNK_BYTES // max(1, raw[:1].numel()) // 16 * 16)  # whole groups of an interleaved layout
    out = empty_weight((n, row_bytes(layout, k)), torch.uint8)  # in the load's weight arena, where it has one
    for r in range(0, n, step):
        out[r:r + step] = pack(raw[r:r + step], layout, k)
    return out


def _placed(t: torch.Tensor) -> torch.Tensor:
    """Weight ``t`` as the load made it, in the memory it is kept in: a cpu weight that is no view of its own
    memory as read (a transpose, a slice) is copied into ``empty_weight``'s (the load's arena; 2 MiB pages from the
    first write, where ``.contiguous()``'s 4 KiB pages would cost ``huge_pages`` a copy after the load), and so is
    one under 4 MiB (in memory of its own it sits in 4 KiB pages, where the native one-row products read small
    packed weights ~1.4x slower at one thread, ``bench/weight_pages.py``; torch's float32 one showed no difference);
    a larger one as read stays (its read went into 2 MiB pages: ``_read_bytes``, ``hf._pread``). On another
    device: ``t.contiguous()``."""
    if t.device.type != "cpu":
        return t.contiguous()
    own = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    if own and (current_weight_arena() is None or t.numel() * t.element_size() >= 2 * HUGE_PAGE):
        return t
    return empty_weight(t.shape, t.dtype).copy_(t)


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
