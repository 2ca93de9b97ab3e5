"""GGUF files (llama.cpp): metadata -> ModelConfig, tensors dequantized with the ``gguf`` package -> HF names.

Which architectures load, which metadata keys they read, and which llama.cpp tensor makes which Hugging Face one is
each family's declaration (``dtorch.models.families``): this module reads the common keys, builds a ``View`` of the
file's tensors for every entry of the family's tensor table, lets the family undo what its converter changed
(``Family.gguf_views``: Gemma's norms stored + 1, the hybrids' reordered heads ...), and reads slices of them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dtorch.core.errors import ModelError
from dtorch.models import families
from dtorch.models.config import ModelConfig
from dtorch.models.config_fields import check_field, check_fields, default, gguf_keys
from dtorch.models.families import GgufMeta, View
from dtorch.models.families.base import gguf_shape
from dtorch.models.loaders.checkpoint import Checkpoint, LazyCheckpoint, Reader, narrow_runs, used_shapes
from dtorch.models.loaders.files import regular_file
from dtorch.models.loaders.gguf_header import _open, _release, read_metadata
from dtorch.models.rope_scaling import GGUF_ROPE_TENSORS, rope_scaling_from_gguf

# quantization types this loader promises (the gguf package dequantizes more; those are let through too)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")


def permute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's q/k row permutation (its converter's ``LlamaModel.permute``), which ``unpermute_qk`` undoes."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation for interleaved RoPE.

    llama.cpp's converter reorders each head's rows from the "rotate half" order (i, i + D/2) to adjacent
    pairs (2i, 2i+1); this puts them back. w: [n_heads * D, ...] (a weight or a bias).
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_REQUIRED = object()  # ``config_from_gguf``'s read: no fallback


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str], path: Path,
                     rope_tensors: dict[str, torch.Tensor] | None = None) -> ModelConfig:
    """A ModelConfig from the ``{arch}.*`` metadata keys, read through the family of ``general.architecture``
    (``Family.gguf_config`` adds its own fields); tied embeddings when there is no ``output.weight``.

    ``rope_tensors``: the file's tensors of ``GGUF_ROPE_TENSORS`` (llama.cpp's per-frequency RoPE divisors of Llama
    3, Phi-3's LongRoPE factors), dequantized; with the ``rope.scaling.*`` keys they give the rope scaling.
    """
    arch = meta.get("general.architecture")
    fam = families.by_gguf_arch(arch) if isinstance(arch, str) else None
    if fam is None:
        raise ModelError(f"{path}: general.architecture {arch!r} is not supported; expected one of "
                         f"{', '.join(families.gguf_archs())}")
    m = GgufMeta(meta, arch, path, frozenset(tensor_names))
    keys = gguf_keys(arch, fam.gguf_keys)  # field -> its key, as the fields' specs and the family declare them
    check_fields(meta, keys, str(path))

    def read(name: str, fallback: Any = _REQUIRED) -> Any:
        """Field ``name`` from its key; when the file lacks it, ``fallback`` (none given: the key is required)."""
        if keys[name] in meta:
            return meta[keys[name]]
        if fallback is _REQUIRED:
            raise ModelError(f"{path}: metadata key {keys[name]} is missing; a {arch} GGUF must have it")
        return fallback

    hidden, heads = read("hidden_size"), read("num_heads")
    vocab = read("vocab_size", None)
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if isinstance(tokens, list) else 0
        if not vocab:
            raise ModelError(f"{path}: neither {keys['vocab_size']} nor tokenizer.ggml.tokens gives the vocabulary "
                             "size")
        check_field("vocab_size", vocab, f"{path}: the length of tokenizer.ggml.tokens")
    eos = [meta[keys[k]] for k in ("eos_token_id", "eot_token_id") if keys[k] in meta]
    head_dim = read("head_dim", hidden // heads)
    check_field("head_dim", head_dim, f"{path}: {keys['hidden_size']} / {keys['num_heads']}")
    common = dict(family=fam.name, vocab_size=vocab, hidden_size=hidden,
                  intermediate_size=read("intermediate_size", None), num_layers=read("num_layers"),
                  num_heads=heads, num_kv_heads=read("num_kv_heads", heads),
                  head_dim=head_dim, rope_theta=read("rope_theta", default("rope_theta")),
                  rms_norm_eps=read("rms_norm_eps"),
                  max_position_embeddings=read("max_position_embeddings", default("max_position_embeddings")),
                  tie_word_embeddings="output.weight" not in tensor_names,
                  bos_token_id=read("bos_token_id", None), eos_token_ids=tuple(dict.fromkeys(eos)))
    common["rope_scaling"] = rope_scaling_from_gguf(m, common["max_position_embeddings"], rope_tensors or {})
    kwargs = common | dict(fam.fields) | (fam.gguf_config(m, common) if fam.gguf_config is not None else {})
    if kwargs["intermediate_size"] is None:
        read("intermediate_size")  # raises, naming the key
    try:
        return ModelConfig(**kwargs)
    except ModelError as e:  # a key that passed alone but not with the others (head_count vs head_count_kv, ...)
        raise ModelError(f"{path}: {e} (from the {arch}.* metadata keys)") from None


def dequantize(t: Any, path: Path) -> torch.Tensor:
    """One GGUF tensor as float32 torch, in torch's (row-major, reversed-GGUF) shape."""
    return _dequantize(t, t.data, tuple(int(s) for s in reversed(t.shape)), path)  # GGUF lists dims fastest first


def _dequantize(t: Any, data: np.ndarray, shape: tuple[int, ...], path: Path) -> torch.Tensor:
    """``data`` (all or some whole blocks of tensor ``t``'s raw rows) as float32 torch of ``shape``."""
    from gguf.quants import dequantize as gguf_dequantize

    try:
        arr = np.array(gguf_dequantize(data, t.tensor_type), dtype=np.float32, copy=True).reshape(shape)
    except NotImplementedError:
        raise ModelError(f"{path}: tensor {t.name!r} has quantization type {t.tensor_type.name}, which the gguf "
                         f"package cannot dequantize; supported: {', '.join(SUPPORTED_TYPES)}") from None
    except Exception as e:
        raise ModelError(f"{path}: tensor {t.name!r} ({t.tensor_type.name}, shape {list(shape)}) is unreadable "
                         f"({type(e).__name__}: {e}); the file may be truncated") from None
    return torch.from_numpy(arr)


def _read_runs(t: Any, dim: int | None, runs: list[tuple[int, int]], path: Path) -> torch.Tensor:
    """The runs ``runs`` of dim ``dim`` of GGUF tensor ``t`` (2-D, or 3-D stacked experts [E, rows, cols]) as
    float32, dequantizing only the blocks they cover: any dim but the last takes whole rows of blocks (dim 0 of
    stacked experts: only those experts' bytes), the last takes whole blocks when aligned (else the tensor is read
    whole)."""
    import gguf

    shape = tuple(int(s) for s in reversed(t.shape))
    data = t.data  # a map of the file: [..., rows, bytes (or items) of one row]; slicing it reads only those pages
    if dim is None or len(shape) not in (2, 3):
        return narrow_runs(_dequantize(t, data, shape, path), dim, runs)
    last = len(shape) - 1
    if dim < last:
        lead = (slice(None),) * dim
        parts = [_dequantize(t, data[(*lead, slice(a, a + n))], (*shape[:dim], n, *shape[dim + 1:]), path)
                 for a, n in runs]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)
    block = gguf.GGML_QUANT_SIZES[t.tensor_type][0] if t.tensor_type in gguf.GGML_QUANT_SIZES else 0
    per_block = data.shape[-1] * block // shape[-1] if block else 0  # items of ``data`` per block of a row
    if not block or any(a % block or n % block for a, n in runs):
        return narrow_runs(_dequantize(t, data, shape, path), dim, runs)
    parts = [_dequantize(t, data[..., a // block * per_block:(a + n) // block * per_block], (*shape[:-1], n), path)
             for a, n in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _read_view(v: View, dim: int | None, runs: list[tuple[int, int]], path: Path) -> torch.Tensor:
    """``_read_runs`` of a view; columns of a 2-D view whose columns stay in place are read alone, anything else
    whole (these are the hybrids' small or per-layer tensors)."""
    cols_only = dim == 1 and len(v.shape) == 2 and v.cols is None
    parts = [_read_runs(t, 1, runs, path) if cols_only else dequantize(t, path) for t in v.parts]
    x = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
    if v.rows is not None:
        x = x[v.rows]
    if v.cols is not None:
        x = x[:, v.cols]
    if v.value is not None:
        x = v.value(x)
    return x if cols_only else narrow_runs(x.reshape(v.shape), dim, runs)


def stored_layout(ggml_type: Any, dtype: torch.dtype) -> str | None:
    """The layout a tensor of GGUF type ``ggml_type`` keeps in a model computing in ``dtype``: its block format's
    ("gguf.q4_1"), "f16" / "bf16" for 16-bit floats of another dtype than ``dtype``, else None (read as ``dtype``)."""
    from dtorch.kernels.half import HALF_LAYOUTS
    from dtorch.kernels.layouts import layout_of_gguf

    layout = layout_of_gguf(ggml_type)
    if layout is None and ggml_type.name in ("F16", "BF16"):
        layout = ggml_type.name.lower()
        return None if HALF_LAYOUTS[layout] == dtype else layout
    return layout


def _read_bytes(path: Path, t: Any) -> np.ndarray:
    """GGUF tensor ``t``'s bytes read from ``path`` into memory of their own, shaped and typed as its map ``t.data``."""
    from dtorch.core.memory import empty_in_huge_pages

    # a transient buffer: faulted in 2 MiB pages, 512x fewer faults than 4 KiB ones
    out = empty_in_huge_pages((int(t.data.nbytes),), torch.uint8).numpy().view(t.data.dtype).reshape(t.data.shape)
    view = memoryview(out).cast("B")
    with open(path, "rb", buffering=0) as f:
        f.seek(int(t.data_offset))
        got = f.readinto(view)
    if got != len(view):
        raise ModelError(f"{path}: truncated: tensor {t.name!r} needs {len(view)} bytes at {int(t.data_offset)}, "
                         f"read {got}")
    return out


def _packed_rows(data: np.ndarray, shape: tuple[int, ...], layout: str, dim: int | None,
                 runs: list[tuple[int, int]], own: bool = False) -> torch.Tensor | None:
    """GGUF block bytes ``data`` [rows, row bytes] of a 2-D tensor ``shape``, sliced: uint8 torch, or None when the
    slice cuts blocks; a 16-bit float tensor ("f16", "bf16") as torch float16 / bfloat16 [rows, cols]. ``own``:
    ``data`` is memory of its own, not a view of the file map (no copy needed)."""
    from dtorch.kernels.half import HALF_LAYOUTS
    from dtorch.kernels.layouts import block_size

    if dim == 1:
        block = 1 if layout in HALF_LAYOUTS else block_size(layout)
        per_block = data.shape[1] * block // shape[1]
        if any(a % block or n % block for a, n in runs):
            return None
        data = np.concatenate([data[:, a // block * per_block:(a + n) // block * per_block] for a, n in runs], 1)
    elif dim == 0 and runs:
        data = np.concatenate([data[a:a + n] for a, n in runs], 0)
    own = own and not runs
    if layout in HALF_LAYOUTS:  # F16 maps as float16, BF16 as its bytes
        return torch.from_numpy(data if own else np.array(data, copy=True)).view(HALF_LAYOUTS[layout])
    # the map is read-only: one tensor's copy
    return torch.from_numpy(data.view(np.uint8) if own else np.array(data, dtype=np.uint8, copy=True))


def _views(reader: Any, config: ModelConfig, path: Path) -> tuple[dict[str, View], dict[str, tuple[int, ...]]]:
    """A ``View`` of the file's tensors for every entry of the family's tensor table the file has (by Hugging Face
    name), changed back by the family's ``gguf_views``; and the shapes of the file's tensors no entry names, by their
    own names (``check_shapes`` refuses them: a variant the model does not implement)."""
    fam = families.get(config.family)
    by_name = {t.name: t for t in reader.tensors}
    views: dict[str, View] = {}
    named = set(GGUF_ROPE_TENSORS)  # read into the config
    for hf, source in families.sources(config).items():
        named.update(source.gguf)
        found = [by_name[g] for g in source.gguf if g in by_name]
        if not found:
            continue  # check_shapes names it missing
        if len(found) < len(source.gguf) or len({gguf_shape(t)[1:] for t in found}) > 1:
            raise ModelError(f"{path}: {hf!r} is made of the tensors {list(source.gguf)} (rows joined), but the file "
                             f"has {[(t.name, list(gguf_shape(t))) for t in found]}; expected all, of one width")
        shapes = [gguf_shape(t) for t in found]
        views[hf] = View(tuple(found), (sum(s[0] for s in shapes), *shapes[0][1:]) if len(found) > 1 else shapes[0])
    if fam.gguf_views is not None:
        fam.gguf_views(views, config, path)
    return views, {t.name: gguf_shape(t) for t in reader.tensors if t.name not in named}


def _gguf_reader(reader: Any, config: ModelConfig, path: Path, views: dict[str, View],
                 dtype: torch.dtype = torch.float32) -> tuple[Reader, Any, Any]:
    """A ``Reader`` of slices of the tensors ``views`` (Llama q/k un-permuted, the hybrids' tensors as transformers
    holds them) and its packed reader."""
    heads = {}
    if families.get(config.family).gguf_permute_qk:  # each head's q/k rows permuted; a run of whole heads undoes alone
        heads = {n: (config.num_heads if ".q_proj." in n else config.num_kv_heads) for n in views
                 if ".self_attn.q_proj." in n or ".self_attn.k_proj." in n}

    def read(name: str, dim: int | None, runs: list[tuple[int, int]]) -> torch.Tensor:
        v, d = views[name], config.head_dim
        if not v.plain:
            return _read_view(v, dim, runs, path)
        t = v.parts[0]
        if name not in heads:
            return _read_runs(t, dim, runs, path)
        if dim == 0 and all(a % d == 0 and n % d == 0 for a, n in runs):
            parts = [unpermute_qk(_read_runs(t, 0, [(a, n)], path), n // d) for a, n in runs]
            return parts[0] if len(parts) == 1 else torch.cat(parts, 0)
        return narrow_runs(unpermute_qk(_read_runs(t, None, [], path), heads[name]), dim, runs)

    def read_packed(name: str, dim: int | None, runs: list[tuple[int, int]]) -> tuple[str, torch.Tensor] | None:
        """(layout, GGUF bytes uint8 [rows, row bytes]) of the slice, or None when the tensor is not in a block
        format the kernels keep (or the slice cuts its blocks, or its values are changed): then ``read``
        dequantizes it instead. A view that only reorders or joins rows is served packed. A 16-bit float tensor of a
        model computing in another dtype comes as ("f16" | "bf16", its values [rows, cols])."""
        v = views[name]
        layouts = {stored_layout(t.tensor_type, dtype) for t in v.parts}
        layout = layouts.pop() if len(layouts) == 1 else None
        if layout is None or len(v.shape) != 2 or v.cols is not None or v.value is not None:
            return None
        own = len(v.parts) == 1 and v.rows is None and dim is None and reader.byte_order == "I"
        if own:  # the whole tensor: one read of its bytes (a copy of the map would fault in each 4 KiB page)
            data = _read_bytes(path, v.parts[0])
        else:
            data = v.parts[0].data if len(v.parts) == 1 else np.concatenate([t.data for t in v.parts], 0)
        if v.rows is not None:
            data = data[v.rows.numpy()]
        if name in heads:
            d = config.head_dim
            if dim == 0 and not all(a % d == 0 and n % d == 0 for a, n in runs):
                return None
            rows = _packed_rows(data, v.shape, layout, dim, runs, own)
            return None if rows is None else (layout, unpermute_qk(rows, rows.shape[0] // d).contiguous())
        rows = _packed_rows(data, v.shape, layout, dim, runs, own)
        return None if rows is None else (layout, rows)

    def packed_layout(name: str, dim: int | None, runs: list[tuple[int, int]]):
        """(layout, shape, dtype) of what ``read_packed`` gives for the slice, or None where it gives None; from the
        metadata alone (``LazyCheckpoint.hollow``)."""
        from dtorch.kernels.half import HALF_LAYOUTS
        from dtorch.kernels.layouts import block_size, gguf_block_bytes

        v = views[name]
        layouts = {stored_layout(t.tensor_type, dtype) for t in v.parts}
        layout = layouts.pop() if len(layouts) == 1 else None
        if layout is None or len(v.shape) != 2 or v.cols is not None or v.value is not None:
            return None
        d = config.head_dim
        if name in heads and dim == 0 and not all(a % d == 0 and n % d == 0 for a, n in runs):
            return None
        rows, cols = v.shape
        block = 1 if layout in HALF_LAYOUTS else block_size(layout)
        if dim == 1 and runs:
            if any(a % block or n % block for a, n in runs):
                return None
            cols = sum(n for _, n in runs)
        elif dim == 0 and runs:
            rows = sum(n for _, n in runs)
        if layout in HALF_LAYOUTS:
            return layout, (rows, cols), HALF_LAYOUTS[layout]
        return layout, (rows, cols // block * gguf_block_bytes(layout)), torch.uint8

    def released(fn: Callable) -> Callable:
        """``fn``, then the pages of the file map under the tensor dropped (``_release``): what was read is a copy."""
        def read_then_release(name: str, dim: int | None, runs: list[tuple[int, int]]) -> Any:
            try:
                return fn(name, dim, runs)
            finally:
                _release(reader, views[name].parts)
        return read_then_release

    return released(read), released(read_packed), packed_layout


def check_tensor_layout(reader: Any, path: Path) -> None:
    """Every tensor's bytes lie inside the file's data section, start at a multiple of ``general.alignment`` (32 when
    absent) from it, as llama.cpp writes them, and overlap no other tensor's. Raises ``ModelError`` naming the
    tensor."""
    size, start, align = path.stat().st_size, int(reader.data_offset), int(reader.alignment)
    spans = []
    for t in reader.tensors:
        lo, n = int(t.data_offset), int(t.n_bytes)
        if (lo - start) % align:
            raise ModelError(f"{path}: tensor {t.name!r} starts at byte {lo - start} of the data section; expected a "
                             f"multiple of general.alignment = {align}")
        if lo + n > size:
            raise ModelError(f"{path}: truncated: tensor {t.name!r} needs bytes [{lo}, {lo + n}) but the file has "
                             f"{size}")
        spans.append((lo, lo + n, t.name))
    spans.sort()
    for (_, end, a), (lo, _, b) in zip(spans, spans[1:], strict=False):
        if lo < end:
            raise ModelError(f"{path}: tensors {a!r} and {b!r} overlap (bytes [{lo}, {end}) of the file); expected "
                             "each tensor's bytes to be its own")


def open_gguf(path: str | Path, dtype: torch.dtype = torch.float32, check_finite: bool = True) -> LazyCheckpoint:
    """Open a GGUF file without reading its weights: config from its metadata (types and ranges checked), tensor
    offsets, alignment, names and shapes checked, the memory it implies compared with what is available, and its
    tokenizer; the returned ``LazyCheckpoint.get`` dequantizes only the blocks of the slices asked for, and refuses
    non-finite values unless ``check_finite`` is False."""
    path = regular_file(path, "a .gguf model file")
    reader = _open(path)
    check_tensor_layout(reader, path)  # the reader maps lazily: bad offsets would show only when read
    meta = read_metadata(reader, path)
    reader.fields.clear()  # read: its views of every vocabulary string (~80 MB for 49k tokens) go before the weights
    rope = {t.name: dequantize(t, path) for t in reader.tensors if t.name in GGUF_ROPE_TENSORS}
    config = config_from_gguf(meta, {t.name for t in reader.tensors}, path, rope)
    views, unnamed = _views(reader, config, path)
    read, read_packed, packed_layout = _gguf_reader(reader, config, path, views, dtype)
    packed = {name: sum(int(t.n_bytes) for t in v.parts) for name, v in views.items()
              if all(stored_layout(t.tensor_type, dtype) is not None for t in v.parts)}
    shapes = used_shapes({name: v.shape for name, v in views.items()} | unnamed, config, dtype, str(path),
                         gguf_keys(meta["general.architecture"], families.get(config.family).gguf_keys), packed)
    types = {name: views[name].parts[0].tensor_type.name for name in shapes}
    template = meta.get("tokenizer.chat_template")
    tokenizer, why = _file_tokenizer(meta, path)
    scalars = {k: v for k, v in meta.items() if not isinstance(v, list)}  # the vocabulary stays in the tokenizer
    return LazyCheckpoint(config=config, shapes=shapes, read=read, dtype=dtype, tokenizer=tokenizer,
                          source=str(path), chat_template=template if isinstance(template, str) else None,
                          read_packed=read_packed, metadata={"tensor_types": types, "gguf": scalars},
                          check_finite=check_finite, stored=_stored_formats(views, types), tokenizer_error=why,
                          packed_layout=packed_layout)


def _file_tokenizer(meta: dict[str, Any], path: Path) -> tuple[Any, str | None]:
    """(the file's tokenizer, None), (None, None) when it has no vocabulary, or (None, why) when its vocabulary cannot
    be built (a kind or pre-tokenizer dtorch does not build, or a malformed one): the weights still load, and the
    model runs on token ids (``info``, ``bench``, generation from ids); what needs text says ``why``."""
    from dtorch.models.tokenizer import Tokenizer

    if "tokenizer.ggml.tokens" not in meta:
        return None, None
    try:
        return Tokenizer.from_gguf(meta, chat_template=meta.get("tokenizer.chat_template"), source=str(path)), None
    except ModelError as e:
        return None, str(e).removeprefix(f"{path}: ")


def _stored_formats(views: dict[str, View], types: dict[str, str]) -> dict[str, tuple[str, str, float]]:
    """HF name -> (the file's tensor name, its GGUF type name, bits per weight) of every tensor the model uses."""
    import gguf

    out = {}
    for name, kind in types.items():
        qtype = gguf.GGMLQuantizationType[kind]
        block, size = gguf.GGML_QUANT_SIZES.get(qtype, (1, 4))
        out[name] = (views[name].parts[0].name, kind, size * 8 / block)
    return out


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, check_finite: bool = True) -> Checkpoint:
    """Load a GGUF file: config from its metadata, weights dequantized (Llama q/k un-permuted; Qwen2/Qwen3 q/k are
    stored as transformers has them), its tokenizer (see ``open_gguf``)."""
    with open_gguf(path, dtype, check_finite) as lazy:
        return lazy.load()


def load_gguf_tokenizer(path: str | Path) -> Any:
    """Only the tokenizer of a GGUF file (no weights are read), or None when the file has no vocabulary."""
    from dtorch.models.tokenizer import Tokenizer

    path = regular_file(path, "a .gguf model file")
    meta = read_metadata(_open(path), path)
    if "tokenizer.ggml.tokens" not in meta:
        return None
    return Tokenizer.from_gguf(meta, chat_template=meta.get("tokenizer.chat_template"), source=str(path))
