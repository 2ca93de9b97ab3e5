"""What every loader returns: a ``LazyCheckpoint`` (config, tokenizer, tensor shapes checked against the config,
and a getter that reads only the slices asked for) or, read whole, a ``Checkpoint`` of Hugging Face named tensors."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from dtorch.core.errors import ModelError
from dtorch.core.memory import MemoryKind, adopt
from dtorch.models import families
from dtorch.models.config import ModelConfig

if TYPE_CHECKING:
    from dtorch.models.tokenizer import Tokenizer

T = TypeVar("T")


@dataclass
class Checkpoint:
    """A model's config, its weights keyed by Hugging Face names, and its tokenizer when the files have one.

    Weight shapes follow torch's ``nn.Linear``: ``q_proj.weight`` is ``[num_heads * head_dim, hidden]``.
    """

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None = None
    source: str = ""
    chat_template: str | None = None
    tokenizer_error: str | None = None  # why the file's vocabulary was not built (None: built, or there is none)
    # loader extras: GGUF files give "tensor_types" (HF name -> quantization type) and "gguf" (scalar metadata keys)
    metadata: dict[str, object] = field(default_factory=dict)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of ``config`` needs, by Hugging Face name, with its shape: its family's tensor table
    (``families.sources``). A sparse layer's experts are three stacked tensors, ``mlp.experts.gate_proj`` /
    ``up_proj`` [E, I, H] and ``down_proj`` [E, H, I] (no ``.weight``: the loader stacks a file's per-expert
    ``mlp.experts.{e}.gate_proj.weight`` ... into them)."""
    return {name: s.shape for name, s in families.sources(config).items()}


def _unused(name: str, config: ModelConfig) -> bool:
    """Tensors a causal LM of the family does not run, as transformers skips them (a multi-token prediction head, a
    vision tower: ``Family.unused``)."""
    prefixes = families.get(config.family).unused
    return bool(prefixes) and name.startswith(prefixes)


def check_shapes(shapes: Mapping[str, tuple[int, ...]], config: ModelConfig, dtype: torch.dtype,
                 source: str) -> None:
    """Check a file's tensor names and shapes (from its metadata; no data is read) against ``config``.

    Missing / misshapen tensors raise, and so do tensors the model would not use (a variant it does not
    implement: refuse, don't drop), except rotary caches and an lm_head stored beside tied embeddings.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ModelError(f"load_checkpoint: dtype must be a floating torch.dtype, got {dtype!r}")
    expected = expected_shapes(config)
    extra = sorted(n for n in shapes if n not in expected and not n.endswith("rotary_emb.inv_freq")
                   and not (n == "lm_head.weight" and config.tie_word_embeddings) and not _unused(n, config))
    if extra:
        raise ModelError(f"{source}: unexpected tensors {extra[:4]}{' ...' if len(extra) > 4 else ''}; a "
                         f"{config.family} model with this config (attention_bias={config.attention_bias}, "
                         f"qk_norm={config.qk_norm}) has no such weights")
    for name, shape in expected.items():
        got = shapes.get(name)
        if got is None:
            raise ModelError(f"{source}: missing tensor {name!r} (expected shape {list(shape)} for a "
                             f"{config.family} model with {config.num_layers} layers)")
        if tuple(got) != shape:
            raise ModelError(f"{source}: tensor {name!r} has shape {list(got)}, expected {list(shape)} "
                             f"from the config")


# read(hf_name, dim, runs) -> the rows/columns ``runs`` [(start, length)] of dim ``dim`` (all of it when ``dim`` is
# None), in the file's dtype or float32, in memory of its own (never a view of a file map); one opened file
Reader = Callable[[str, "int | None", "list[tuple[int, int]]"], torch.Tensor]


@dataclass
class LazyCheckpoint:
    """A checkpoint opened but not read: its config, tokenizer and every tensor's shape (checked against the
    config); ``get`` reads only the slices asked for. Use it as a context manager, or ``close`` it.

    ``get(hf_name, dim, runs)`` is the getter ``Transformer.load`` takes, so a process reads only its shards.
    """

    config: ModelConfig
    shapes: dict[str, tuple[int, ...]]  # every tensor the model uses, HF name -> shape
    read: Reader
    dtype: torch.dtype = torch.float32
    tokenizer: Tokenizer | None = None
    source: str = ""
    chat_template: str | None = None
    metadata: dict[str, object] = field(default_factory=dict)
    # why the file's vocabulary was not built (the tokenizer is then None): the model runs on token ids alone
    tokenizer_error: str | None = None
    # (name, dim, runs) -> (layout, GGUF bytes uint8 [rows, row bytes], or 16-bit rows for "f16" / "bf16") or None;
    # None: no weight is kept as stored
    read_packed: Callable[[str, int | None, list[tuple[int, int]]], tuple[str, torch.Tensor] | None] | None = None
    check_finite: bool = True  # refuse a piece read with a NaN or inf (one isfinite pass over what is read)
    # name -> (the file's name of the tensor, its format as the file spells it, bits per weight stored); ``get``
    # records in ``widened`` each tensor it returns wider than stored (``report_widened`` says so)
    stored: Mapping[str, tuple[str, str, float]] = field(default_factory=dict)
    widened: dict[str, list[int]] = field(default_factory=dict)  # name -> [bytes as read, bytes as stored]
    # (name, dim, runs) -> (layout, shape, dtype) of what ``read_packed`` would give, from the metadata alone (None:
    # read as float); what ``hollow`` serves
    packed_layout: Callable[[str, int | None, list[tuple[int, int]]],
                            tuple[str, tuple[int, ...], torch.dtype] | None] | None = None

    def get_packed(self, name: str, dim: int | None = None,
                   runs: Sequence[tuple[int, int]] = ()) -> tuple[str, torch.Tensor] | None:
        """The slice ``runs`` of dim ``dim`` of tensor ``name`` as stored: (layout, GGUF block bytes [rows, row
        bytes]) when it is kept in a block format ("gguf.q4_1"), else None (read it with ``get``)."""
        if self.read_packed is None or name not in self.shapes:
            return None
        got = self.read_packed(name, dim if runs else None, [(int(a), int(n)) for a, n in runs])
        if got is not None and self.check_finite and not packed_scales_finite(*got):
            raise ModelError(f"{self.source}: tensor {name!r} holds a non-finite (NaN or inf) block scale; the "
                             "weights are damaged (pass check_finite=False to load them anyway)")
        return got

    def get(self, name: str, dim: int | None = None, runs: Sequence[tuple[int, int]] = ()) -> torch.Tensor:
        """The rows/columns ``runs`` [(start, length)] of dim ``dim`` of tensor ``name`` (concatenated), or the
        whole tensor when ``dim`` is None; cast to ``dtype``, contiguous, a fresh tensor."""
        shape = self.shapes.get(name)
        if shape is None:
            raise ModelError(f"{self.source}: no tensor {name!r} in this {self.config.family} checkpoint")
        runs = [(int(a), int(n)) for a, n in runs]
        if dim is not None:
            if not 0 <= dim < len(shape):
                raise ModelError(f"{self.source}: tensor {name!r} {list(shape)} has no dim {dim}")
            for a, n in runs:
                if a < 0 or n < 1 or a + n > shape[dim]:
                    raise ModelError(f"{self.source}: rows [{a}, {a + n}) of dim {dim} are outside tensor {name!r} "
                                     f"{list(shape)}")
        t = self.read(name, dim if runs else None, runs).to(self.dtype).contiguous()
        if self.check_finite and t.is_floating_point() and not all_finite(t):
            bad = (~torch.isfinite(t)).nonzero()[0].tolist()
            raise ModelError(f"{self.source}: tensor {name!r} {list(shape)} holds non-finite values (NaN or inf), "
                             f"e.g. at {bad}{'' if dim is None else f' of the slice of dim {dim} read'}; expected "
                             "finite weights: the file is damaged (pass check_finite=False to load it anyway)")
        if t.untyped_storage().nbytes() > t.numel() * t.element_size():  # a slice must not keep the whole alive
            t = t.clone()
        stored = self.stored.get(name)
        if stored is not None and t.element_size() * 8 > stored[2]:
            cost = self.widened.setdefault(name, [0, 0])
            cost[0] += t.numel() * t.element_size()
            cost[1] += math.ceil(t.numel() * stored[2] / 8)
        return t

    def hollow(self) -> LazyCheckpoint:
        """This checkpoint with nothing read: ``get`` gives an uninitialized tensor of the slice's shape, ``get_packed``
        one of the shape and layout the file stores it in (from the metadata; no byte of a weight is touched). What
        ``dtorch info`` loads: the formats, bytes and kernels of a model without reading or repacking it."""

        def read(name: str, dim: int | None, runs: list[tuple[int, int]]) -> torch.Tensor:
            shape = list(self.shapes[name])
            if dim is not None and runs:
                shape[dim] = sum(n for _, n in runs)
            return torch.empty(shape, dtype=self.dtype)

        def read_packed(name: str, dim: int | None, runs: list[tuple[int, int]]) -> tuple[str, torch.Tensor] | None:
            got = self.packed_layout(name, dim, runs) if self.packed_layout is not None else None
            return None if got is None else (got[0], torch.empty(got[1], dtype=got[2]))

        return dataclasses.replace(self, read=read, read_packed=read_packed, check_finite=False, widened={})

    def report_widened(self) -> str | None:
        """Log, once, the tensors ``get`` returned wider than the file stores them (a format no kernel keeps as
        stored, dequantized to ``dtype``): each with its format, and the memory that costs; returns the message (None
        when nothing was widened). Logged as a warning on the ``dtorch.models`` logger."""
        if not self.widened:
            return None
        by_format: dict[str, list[str]] = {}
        for name in self.widened:
            file_name, fmt, _ = self.stored[name]
            by_format.setdefault(fmt, []).append(file_name)
        read, stored = (sum(c[i] for c in self.widened.values()) for i in (0, 1))
        kinds = "; ".join(f"{fmt}: {len(names)} tensor{'s' * (len(names) > 1)} ({', '.join(names[:6])}"
                          f"{f' and {len(names) - 6} more' if len(names) > 6 else ''})"
                          for fmt, names in sorted(by_format.items()))
        message = (f"{self.source}: {len(self.widened)} weight tensor{'s' * (len(self.widened) > 1)} in a format no "
                   f"kernel keeps as stored {'were' if len(self.widened) > 1 else 'was'} dequantized to "
                   f"{str(self.dtype).removeprefix('torch.')} at load: {_mib(read)} instead of {_mib(stored)} "
                   f"as stored (+{_mib(read - stored)}). {kinds}")
        self.widened = {}
        logging.getLogger("dtorch.models").warning(message)
        return message

    def load(self) -> Checkpoint:
        """Every tensor read whole (cast to ``dtype``, PERSISTENT): the eager ``Checkpoint``."""
        tensors = {name: adopt(self.get(name), MemoryKind.PERSISTENT)
                   for name in progress(list(self.shapes), len(self.shapes), f"loading {Path(self.source).name}")}
        return Checkpoint(config=self.config, tensors=tensors, tokenizer=self.tokenizer, source=self.source,
                          chat_template=self.chat_template, metadata=self.metadata,
                          tokenizer_error=self.tokenizer_error)

    def close(self) -> None:
        """Drop the reader, and with it the file handles and maps it holds; ``get`` raises afterwards."""
        self.read = self._closed
        if self.read_packed is not None:
            self.read_packed = self._closed

    def _closed(self, name: str, dim: int | None, runs: list[tuple[int, int]]) -> torch.Tensor:
        raise ModelError(f"{self.source}: the checkpoint is closed; open it again to read {name!r}")

    def __enter__(self) -> LazyCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def used_shapes(shapes: Mapping[str, tuple[int, ...]], config: ModelConfig, dtype: torch.dtype, source: str,
                keys: Mapping[str, str] | None = None,
                stored_bytes: Mapping[str, int] | None = None) -> dict[str, tuple[int, ...]]:
    """``check_shapes`` and ``check_memory``, then the shapes of the tensors the model uses (the others dropped)."""
    check_shapes(shapes, config, dtype, source)
    used = {name: tuple(shapes[name]) for name in expected_shapes(config)}
    check_memory(config, used, dtype, source, keys or {}, stored_bytes or {})
    return used


def available_memory() -> int | None:
    """Bytes of memory this machine can still give: /proc/meminfo's MemAvailable (else free pages by sysconf), plus
    the free memory of its GPUs, where weights may go instead; None when the host does not say."""
    host = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    host = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if host is None:
        try:
            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    if torch.cuda.is_available():
        try:
            host += sum(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
        except RuntimeError:
            pass
    return host


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def memory_estimate(config: ModelConfig, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype,
                    stored_bytes: Mapping[str, int]) -> dict[str, int]:
    """Bytes a model needs by what drives them: "max_position_embeddings" (the RoPE table, [positions, rotary_dim
    / 2] cos and sin float32), "num_layers" (the layers' weights) and "vocab_size" (embeddings, lm_head, final
    norm). Weights count at ``dtype``, or at ``stored_bytes[name]`` for those kept packed as stored."""
    item = torch.empty((), dtype=dtype).element_size()
    weights = {n: stored_bytes.get(n, math.prod(s) * item) for n, s in shapes.items()}
    layers = sum(b for n, b in weights.items() if n.startswith("model.layers."))
    return {"max_position_embeddings": config.max_position_embeddings * (config.rotary_dim // 2) * 2 * 4,
            "num_layers": layers, "vocab_size": sum(weights.values()) - layers}


def check_memory(config: ModelConfig, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype, source: str,
                 keys: Mapping[str, str], stored_bytes: Mapping[str, int]) -> None:
    """Refuse, before anything is allocated, a model whose ``memory_estimate`` exceeds ``available_memory()``; the
    message names the estimate and the field driving most of it as the file spells it (``keys``: field -> key)."""
    parts = memory_estimate(config, shapes, dtype, stored_bytes)
    total, have = sum(parts.values()), available_memory()
    if have is None or total <= have:
        return
    field_name = max(parts, key=parts.__getitem__)
    raise ModelError(f"{source}: this model needs about {_gib(total)} of memory (weights "
                     f"{_gib(total - parts['max_position_embeddings'])} as {dtype}, RoPE table "
                     f"{_gib(parts['max_position_embeddings'])}) but {_gib(have)} is available; most of it comes from "
                     f"{keys.get(field_name, field_name)} = {getattr(config, field_name)}. Expected a model that "
                     "fits: use a smaller or more quantized one, a smaller dtype, or free memory")


# layout -> (bytes per GGUF block, byte offsets of its fp16 scales in the block)
_SCALES = {"gguf.q8_0": (34, (0,)), "gguf.q4_0": (18, (0,)), "gguf.q4_1": (20, (0, 2)), "gguf.q4_k": (144, (0, 2)),
           "gguf.q6_k": (210, (208,)), "gguf.q5_0": (22, (0,)), "gguf.q5_1": (24, (0, 2)), "gguf.iq4_nl": (18, (0,))}


def packed_scales_finite(layout: str, rows: torch.Tensor) -> bool:
    """Whether the fp16 scales of GGUF blocks ``rows`` (uint8 [rows, row bytes], GGUF's own block order) are all
    finite: the cheap check of a packed weight (its quants are small ints, finite by construction); a 16-bit float
    weight ("f16", "bf16") is checked whole."""
    if rows.is_floating_point():
        return all_finite(rows)
    size, offsets = _SCALES.get(layout, (0, ()))
    if not offsets or rows.numel() % size:
        return True
    blocks = rows.reshape(-1, size)
    # an fp16 is NaN or inf when its 5 exponent bits are all set: bits 2..6 of its high (little-endian: second) byte
    return not any(bool(blocks[:, o + 1].bitwise_and(0x7C).eq_(0x7C).any()) for o in offsets)


FINITE_CHUNK = 1 << 22  # elements checked at a time where torch.isfinite checks: it makes temporaries as large
_MINMAX_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of float tensor ``t`` is finite: its least and greatest elements are (``aminmax``
    gives NaN for both where any element is NaN): one pass at memory speed with no temporary, 20x faster than
    ``torch.isfinite(t).all()`` (a 1 GB checkpoint: 1.3 s of its load). Other float dtypes (float8): ``isfinite``
    a chunk at a time (its temporaries, a float and two bool masks, stay small)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return True
    if t.dtype in _MINMAX_DTYPES:
        lo, hi = torch.aminmax(flat)
        return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))
    return all(bool(torch.isfinite(flat[i:i + FINITE_CHUNK]).all()) for i in range(0, flat.numel(), FINITE_CHUNK))


def narrow_runs(t: torch.Tensor, dim: int | None, runs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The rows/columns ``runs`` of dim ``dim`` of ``t`` (all of ``t`` when ``dim`` is None), concatenated."""
    if dim is None or not runs:
        return t
    parts = [t.narrow(dim, a, n) for a, n in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def progress(items: Iterable[T], total: int, desc: str) -> Iterator[T]:
    """``items``, with a tqdm bar on stderr when stderr is a terminal."""
    if not sys.stderr.isatty():
        yield from items
        return
    from tqdm import tqdm

    yield from tqdm(items, total=total, desc=desc, unit="tensor", leave=False)
