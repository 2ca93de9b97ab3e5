"""Hugging Face directories: ``config.json`` + ``model.safetensors`` or ``pytorch_model.bin`` (or a sharded index)
+ tokenizer files."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from dtorch.core.errors import ModelError
from dtorch.core.memory import empty_in_huge_pages
from dtorch.models import families
from dtorch.models.chat_template import read_template
from dtorch.models.config import ModelConfig
from dtorch.models.config_fields import check_field, hf_keys
from dtorch.models.loaders.checkpoint import Checkpoint, LazyCheckpoint, Reader, used_shapes
from dtorch.models.loaders.files import inside, read_json, regular_file


def _shards(directory: Path, single: str, index: str) -> list[Path]:
    """The weight files of ``directory``: ``single`` when it exists, else the shards the ``index`` file names (no
    file of either: []). Each is a regular file inside ``directory`` (see ``files.inside``)."""
    if os.path.lexists(directory / single):
        return [regular_file(directory / single, f"a weights file ({single})")]
    index_path = directory / index
    if not os.path.lexists(index_path):
        return []
    weight_map = read_json(index_path, "a shard index").get("weight_map")
    if not isinstance(weight_map, dict):
        raise ModelError(f"{index_path}: expected a 'weight_map' object mapping tensor names to shard files")
    paths = {str(f): inside(directory, f, index_path, "weight_map") for f in weight_map.values()}
    missing = sorted(f for f, p in paths.items() if not os.path.lexists(p))
    if missing:
        raise ModelError(f"{index_path}: shard files {missing} named in the index do not exist in {directory}")
    return [regular_file(paths[f], f"a weights shard named in {index}") for f in sorted(paths)]


def _open_weights(directory: Path) -> tuple[dict[str, tuple[int, ...]], Reader, dict[str, torch.dtype]]:
    """Every tensor's shape, a ``Reader`` of the directory's weights and every tensor's dtype as stored: safetensors
    when there are any, else PyTorch's ``pytorch_model.bin`` (single or sharded)."""
    if files := _shards(directory, "model.safetensors", "model.safetensors.index.json"):
        return _open_safetensors(files)
    if files := _shards(directory, "pytorch_model.bin", "pytorch_model.bin.index.json"):
        return _open_torch_bins(files)
    raise ModelError(f"{directory}: no weights found; expected model.safetensors, model.safetensors.index.json, "
                     "pytorch_model.bin or pytorch_model.bin.index.json")


def _open_torch_bins(files: list[Path]) -> tuple[dict[str, tuple[int, ...]], Reader, dict[str, torch.dtype]]:
    """Every tensor's shape and a ``Reader`` of PyTorch ``.bin`` state dicts, loaded with ``weights_only=True`` (no
    code in the pickle runs) and ``mmap=True``: a slice reads only its pages, copied out of the map."""
    import pickle

    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError) as e:
            raise ModelError(f"{f}: not a readable PyTorch checkpoint ({str(e).splitlines()[0]}); expected a state "
                             "dict saved by torch.save (zip format, PyTorch >= 1.6) holding only tensors") from None
        bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)] if isinstance(state, dict) else None
        if bad is None or bad:
            what = type(state).__name__ if bad is None else f"non-tensor entries {bad[:4]}"
            raise ModelError(f"{f}: expected a state dict of tensors, found {what}")
        tensors |= state
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}

    def read(name: str, dim: int | None, runs: list[tuple[int, int]]) -> torch.Tensor:
        t = tensors[name]
        if dim is None:
            return t.clone()
        parts = [t.narrow(dim, a, n) for a, n in runs]
        return parts[0].clone() if len(parts) == 1 else torch.cat(parts, dim)

    return shapes, read, {k: v.dtype for k, v in tensors.items()}


# safetensors dtype names -> torch dtypes (the ones checkpoints hold)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _layout(f: Path) -> tuple[int, dict[str, Any]]:
    """(where the data starts, the header: name -> {"dtype", "shape", "data_offsets"}) of a safetensors file
    (read after ``safe_open`` validated it: the header size is bounded by the file's)."""
    with open(f, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        if not 0 < size <= os.fstat(fh.fileno()).st_size - 8:
            raise ValueError(f"header size {size} does not fit in the file")
        header = json.loads(fh.read(size))
    if not isinstance(header, dict):
        raise ValueError(f"header is {type(header).__name__}, expected a JSON object")
    header.pop("__metadata__", None)
    return 8 + size, header


def _pread(f: Path, offset: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes of ``f`` from ``offset`` into memory of their own (uint8): read with pread, not mapped, so
    the file's pages never count in this process's resident memory (a map of a whole checkpoint doubles the peak).
    Its whole 2 MiB pages are marked for huge pages before the read writes them (``empty_in_huge_pages``): a weight
    kept as read is then in 2 MiB pages from the start, where ``huge_pages`` would copy it into them after the load
    (0.5-1 s for a 1 GiB checkpoint)."""
    buf = empty_in_huge_pages((nbytes,), torch.uint8)
    view = memoryview(buf.numpy()).cast("B")
    fd = os.open(f, os.O_RDONLY)
    try:
        got = 0
        while got < nbytes:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n <= 0:
                raise OSError(f"the file ends {nbytes - got} bytes early")
            got += n
    finally:
        os.close(fd)
    return buf


def _open_safetensors(files: list[Path]) -> tuple[dict[str, tuple[int, ...]], Reader, dict[str, torch.dtype]]:
    """Every tensor's shape and dtype (from the headers; no data is read) and a ``Reader`` of slices of them."""
    from safetensors import SafetensorError, safe_open

    where: dict[str, tuple[Path, int, dict[str, Any]]] = {}  # tensor name -> (file, data start, header entry)
    shapes: dict[str, tuple[int, ...]] = {}
    errors = (SafetensorError, OSError, RuntimeError, ValueError, KeyError, TypeError, RecursionError, OverflowError)
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:  # validates the header (offsets, sizes, dtypes)
                names = list(st.keys())
            start, header = _layout(f)
            for k in names:
                where[k] = (f, start, header[k])
                shapes[k] = tuple(int(d) for d in header[k]["shape"])
        except errors as e:
            raise ModelError(f"{f}: not a readable safetensors file ({e}); expected a complete safetensors "
                             "file as written by safetensors.torch.save_file") from None

    def read(name: str, dim: int | None, runs: list[tuple[int, int]]) -> torch.Tensor:
        f, start, entry = where[name]
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape = tuple(entry["shape"])
            lo, hi = entry["data_offsets"]
            row = (hi - lo) // shape[0] if shape and shape[0] else 0  # bytes of one index of dim 0
            if dim == 0:  # rows: read only those
                parts = [_pread(f, start + lo + a * row, n * row).view(dtype).view(n, *shape[1:]) for a, n in runs]
                return parts[0] if len(parts) == 1 else torch.cat(parts, 0)
            whole = _pread(f, start + lo, hi - lo).view(dtype).view(shape)
            if dim is None:
                return whole
            parts = [whole.narrow(dim, a, n) for a, n in runs]
            return parts[0].clone() if len(parts) == 1 else torch.cat(parts, dim)
        except errors as e:
            raise ModelError(f"{f}: tensor {name!r} is unreadable ({e}); the file may be damaged") from None

    return shapes, read, {k: _DTYPES.get(entry["dtype"], torch.float32) for k, (_, _, entry) in where.items()}


_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stack_experts(shapes: dict[str, tuple[int, ...]], read: Reader, num_experts: int,
                  source: str) -> tuple[dict[str, tuple[int, ...]], Reader]:
    """A file's per-expert ``{prefix}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight`` tensors (as
    transformers' ``save_pretrained`` and the published Qwen3-MoE checkpoints store them) presented as three stacked
    ones per layer, ``{prefix}.mlp.experts.gate_proj`` [E, I, H] and so on, for experts 0..``num_experts``-1; other
    tensors pass through. Reading a slice of dim 0 reads only those experts' tensors."""
    groups: dict[str, dict[int, tuple[int, ...]]] = {}
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        m = _EXPERT_RE.match(name)
        if m is None or int(m.group(2)) >= num_experts:  # experts beyond the config stay, and are refused later
            out[name] = shape
            continue
        groups.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = shape
    parts: dict[str, list[str]] = {}  # stacked name -> its experts' tensor names, in order
    for stacked, found in groups.items():
        prefix, _, proj = stacked.rpartition(".")
        names = [f"{prefix}.{e}.{proj}.weight" for e in range(num_experts)]
        missing = [n for e, n in enumerate(names) if e not in found]
        if missing:
            raise ModelError(f"{source}: missing tensor {missing[0]!r} ({len(missing)} of the {num_experts} experts' "
                             f"{proj} tensors of {prefix} are absent)")
        if len(set(found.values())) != 1:
            raise ModelError(f"{source}: the experts' {proj} tensors of {prefix} differ in shape "
                             f"({sorted(set(found.values()))}); expected one shape for all {num_experts}")
        out[stacked] = (num_experts, *found[0])
        parts[stacked] = names

    def read_stacked(name: str, dim: int | None, runs: list[tuple[int, int]]) -> torch.Tensor:
        names = parts.get(name)
        if names is None:
            return read(name, dim, runs)
        if dim is None:
            return torch.stack([read(n, None, []) for n in names])
        if dim == 0:  # only these experts
            return torch.stack([read(names[e], None, []) for a, k in runs for e in range(a, a + k)])
        return torch.stack([read(n, dim - 1, runs) for n in names])

    return out, read_stacked


# where a multimodal checkpoint keeps its language model (transformers' saved names, older and newer), and the towers
# a text model does not run
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))
_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _language_model(shapes: dict[str, tuple[int, ...]], read: Reader, dtypes: dict[str, torch.dtype]
                    ) -> tuple[dict[str, tuple[int, ...]], Reader, dict[str, torch.dtype]]:
    """The tensors of a multimodal checkpoint's language model under the names a text model has them
    (``language_model.model.layers.0...`` -> ``model.layers.0...``), the vision tower and projector left out."""
    names: dict[str, str] = {}  # text name -> the file's
    for name in shapes:
        if name.startswith(_NOT_TEXT):
            continue
        text = next((new + name[len(old):] for old, new in _TEXT_PREFIXES if name.startswith(old)), name)
        names[text] = name

    def read_text(name: str, dim: int | None, runs: list[tuple[int, int]]) -> torch.Tensor:
        return read(names[name], dim, runs)

    return ({t: shapes[f] for t, f in names.items()}, read_text, {t: dtypes[f] for t, f in names.items()})


def _chat_template(directory: Path, tok_config: dict[str, Any]) -> str | None:
    jinja = directory / "chat_template.jinja"  # transformers 5 writes the template beside tokenizer_config.json
    if os.path.lexists(jinja):
        return read_template(jinja)  # a regular file of bounded UTF-8 text, else a ModelError naming it
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def open_hf(directory: str | Path, dtype: torch.dtype = torch.float32, check_finite: bool = True) -> LazyCheckpoint:
    """Open a Hugging Face model directory without reading its weights: every file checked to be a regular file
    inside it, ``config.json`` checked for types and ranges, tensor names and shapes checked against it and the
    memory they imply against what is available; ``LazyCheckpoint.get`` reads only the slices asked for, refusing
    non-finite values unless ``check_finite`` is False. The tokenizer is None when there is no ``tokenizer.json``."""
    from dtorch.models.tokenizer import Tokenizer

    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not os.path.lexists(cfg_path):
        raise ModelError(f"{directory}: no config.json and no .gguf file; expected a Hugging Face model directory "
                         "(config.json + weights) or a .gguf file")
    cfg_json = read_json(cfg_path, "the model's config.json")
    gen_path = directory / "generation_config.json"
    if os.path.lexists(gen_path):  # generation stops at the union of both files' eos ids
        gen_eos = read_json(gen_path, "a generation_config.json").get("eos_token_id")
        if gen_eos is not None:
            check_field("eos_token_ids", gen_eos, f"{gen_path}: eos_token_id")
        ids = [cfg_json.get("eos_token_id"), gen_eos]
        if all(v is None or isinstance(v, int | list) for v in ids):  # else from_hf names config.json's bad value
            flat = [i for v in ids if v is not None for i in (v if isinstance(v, list) else [v])]
            if all(isinstance(i, int) for i in flat):
                cfg_json["eos_token_id"] = list(dict.fromkeys(flat)) or None
    config = ModelConfig.from_hf(cfg_json, str(cfg_path))
    fam = families.get(config.family)
    shapes, read, dtypes = _open_weights(directory)
    if cfg_json.get("model_type") in fam.hf_multimodal:  # a multimodal checkpoint: its language model alone
        shapes, read, dtypes = _language_model(shapes, read, dtypes)
    if config.num_experts:
        shapes, read = stack_experts(shapes, read, config.num_experts, str(directory))
    shapes = used_shapes(shapes, config, dtype, str(directory), hf_keys(fam.hf_keys))

    tokenizer, template = None, None
    tok_path = directory / "tokenizer_config.json"
    tok_config = read_json(tok_path, "a tokenizer_config.json") if os.path.lexists(tok_path) else {}
    template = _chat_template(directory, tok_config)
    if os.path.lexists(directory / "tokenizer.json"):
        tokenizer = Tokenizer.from_hf(regular_file(directory / "tokenizer.json", "a tokenizer.json"), tok_config,
                                      chat_template=template, eos_token_ids=config.eos_token_ids)
    return LazyCheckpoint(config=config, shapes=shapes, read=read, dtype=dtype, tokenizer=tokenizer,
                          source=str(directory), chat_template=template, check_finite=check_finite,
                          read_packed=_read_half(read, dtypes, shapes, dtype),
                          packed_layout=_half_layout(dtypes, shapes, dtype))


def _half_layout(dtypes: dict[str, torch.dtype], shapes: dict[str, tuple[int, ...]], dtype: torch.dtype):
    """The ``packed_layout`` of a directory: ``_read_half``'s answer from the metadata alone."""
    from dtorch.kernels.half import half_layout

    def packed_layout(name: str, dim: int | None, runs: list[tuple[int, int]]):
        stored, shape = dtypes.get(name), list(shapes.get(name, ()))
        layout = half_layout(stored) if stored is not None and stored != dtype else None
        if layout is None or len(shape) != 2:
            return None
        if dim is not None and runs:
            shape[dim] = sum(n for _, n in runs)
        return layout, tuple(shape), stored

    return packed_layout


def _read_half(read: Reader, dtypes: dict[str, torch.dtype], shapes: dict[str, tuple[int, ...]],
               dtype: torch.dtype):
    """The ``read_packed`` of a directory: a 2-D float16 / bfloat16 tensor of a model computing in another dtype is
    served as stored, ("f16" | "bf16", its slice), so it stays 16-bit; anything else is None (read as ``dtype``)."""
    from dtorch.kernels.half import half_layout

    def read_packed(name: str, dim: int | None, runs: list[tuple[int, int]]) -> tuple[str, torch.Tensor] | None:
        stored = dtypes.get(name)
        layout = half_layout(stored) if stored is not None and stored != dtype else None
        if layout is None or len(shapes.get(name, ())) != 2:
            return None
        return layout, read(name, dim, runs)

    return read_packed


def load_hf(directory: str | Path, dtype: torch.dtype = torch.float32, check_finite: bool = True) -> Checkpoint:
    """Load a Hugging Face model directory, every tensor read whole (see ``open_hf``)."""
    with open_hf(directory, dtype, check_finite) as lazy:
        return lazy.load()
