"""GGUF files made on this machine, for ``bench/gguf_formats.py`` and the llama.cpp test fixtures.

- ``float_copy(src, dst)``: every tensor of a GGUF dequantized to F32 (``gguf.quants.dequantize``), its metadata and
  tokenizer copied: the default model as a float source for llama.cpp's quantizer.
- ``random_model(dst, shape)``: a model of ``shape`` with random weights (F16 projections, F32 norms and biases) and a
  gpt2 BPE tokenizer taken from the default model's file (cut or padded to the shape's vocab), written with gguf-py;
  ``qwen3``, ``qwen2`` (q/k/v biases), ``llama`` and ``gemma3`` (q/k norms, norms after attention and the MLP, a
  sliding window) tensors.
- ``quantize(src, dst, preset, python)``: llama.cpp's own quantizer, ``llama_cpp.llama_model_quantize``, run by the
  Python of the llama.cpp venv (``../shared/tools/llamacpp-venv.sh``); a preset is a ``LLAMA_FTYPE_MOSTLY_*``
  name ("Q4_K_M", "IQ4_XS" ...). Nothing here imports ``llama_cpp`` itself.
- ``tensor_types(path)``: how many tensors of each GGUF type a file holds.

Every writer goes to ``dst + ".part"`` first and renames at the end, so a cache never holds half a file.
"""

from __future__ import annotations

import os
import subprocess
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
LLAMACPP_PYTHON = ROOT / ".venv-llamacpp" / "bin" / "python"  # where llamacpp-venv.sh puts it for this checkout
Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType


@dataclass(frozen=True, slots=True)
class Shape:
    """A decoder-only transformer's sizes, as llama.cpp's ``{arch}.*`` keys state them. Tied: no ``output.weight``
    (the embedding is the head). ``scale``: the standard deviation of the random projections and embedding;
    ``norm_noise``: that of the norms' offsets from 1 (0: every norm is 1)."""

    arch: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = True
    context: int = 40960
    rope_theta: float = 1e6
    eps: float = 1e-6
    scale: float = 0.02
    norm_noise: float = 0.0
    window: int = 0  # gemma3: the sliding layers' window


# Qwen3's published sizes (config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-1.7B), vocab included
QWEN3_0_6B = Shape("qwen3", 1024, 3072, 28, 16, 8, 128, 151936)
QWEN3_1_7B = Shape("qwen3", 2048, 6144, 28, 16, 8, 128, 151936)
# Small models as users download them (issue #39): hidden sizes that are no multiple of 256 and tied heads of 49k-262k
# tokens (config.json of Qwen/Qwen2.5-0.5B-Instruct, Qwen/Qwen2.5-1.5B-Instruct, google/gemma-3-270m-it,
# google/gemma-3-1b-it, meta-llama/Llama-3.2-1B-Instruct, HuggingFaceTB/SmolLM2-360M-Instruct)
QWEN2_5_0_5B = Shape("qwen2", 896, 4864, 24, 14, 2, 64, 151936, context=32768)
QWEN2_5_1_5B = Shape("qwen2", 1536, 8960, 28, 12, 2, 128, 151936, context=32768)
GEMMA3_270M = Shape("gemma3", 640, 2048, 18, 4, 1, 256, 262144, context=32768, window=512)
GEMMA3_1B = Shape("gemma3", 1152, 6912, 26, 4, 1, 256, 262144, context=32768, window=512)
LLAMA3_2_1B = Shape("llama", 2048, 8192, 16, 32, 8, 64, 128256, context=131072, rope_theta=5e5, eps=1e-5)
SMOLLM2_360M = Shape("llama", 960, 2560, 32, 15, 5, 64, 49152, context=8192, rope_theta=1e5, eps=1e-5)


def _atomic(dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    return dst.with_name(dst.name + ".part")


def _copy_fields(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, skip: tuple[str, ...] = ()) -> None:
    """Every metadata key of ``reader`` into ``writer`` with its own type, but the reader's own ``GGUF.*`` entries,
    the architecture (the writer adds it) and ``skip``."""
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in skip:
            continue
        sub = f.types[1] if f.types[0] == V.ARRAY else None
        writer.add_key_value(key, f.contents(), f.types[0], sub_type=sub)


def _write(dst: Path, writer: gguf.GGUFWriter, tensors: Iterator[np.ndarray]) -> None:
    """The header, metadata and tensor infos already added to ``writer``, then each array of ``tensors`` in the order
    of the infos (one in memory at a time)."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tensors:
        writer.write_tensor_data(t)
    writer.close()
    os.replace(writer.path, dst)


def float_copy(src: Path, dst: Path) -> Path:
    """``src`` with every tensor dequantized to F32, metadata and tokenizer as they are (``general.file_type`` 0:
    all F32)."""
    if dst.exists():
        return dst
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(_atomic(dst)), arch)
    _copy_fields(reader, writer, skip=("general.file_type",))
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # numpy order: [rows, row length]
        writer.add_tensor_info(t.name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)

    def arrays() -> Iterator[np.ndarray]:
        for t in reader.tensors:
            yield np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)

    _write(dst, writer, arrays())
    return dst


def _tokenizer(writer: gguf.GGUFWriter, source: gguf.GGUFReader, vocab: int) -> None:
    """The source file's tokenizer, cut to ``vocab`` tokens (only the merges whose parts and result are among them)
    or padded to it with ``[PAD{i}]`` tokens of type UNUSED (as convert_hf_to_gguf.py pads Qwen's vocab)."""
    tokens = list(source.fields["tokenizer.ggml.tokens"].contents())
    types = list(source.fields["tokenizer.ggml.token_type"].contents())
    merges = list(source.fields["tokenizer.ggml.merges"].contents())
    if vocab <= len(tokens):
        tokens, types = tokens[:vocab], types[:vocab]
        have = set(tokens)
        merges = [m for m in merges if set(m.split(" ")) <= have and m.replace(" ", "") in have]
    else:
        pad = vocab - len(tokens)
        tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab)]
        types += [int(gguf.TokenType.UNUSED)] * pad
    _copy_fields(source, writer, skip=tuple(k for k in source.fields if not k.startswith("tokenizer.")) +
                 ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)


def _metadata(writer: gguf.GGUFWriter, s: Shape) -> None:
    a = s.arch
    for key, value, vtype in (
            ("block_count", s.layers, V.UINT32), ("context_length", s.context, V.UINT32),
            ("embedding_length", s.hidden, V.UINT32), ("feed_forward_length", s.intermediate, V.UINT32),
            ("attention.head_count", s.heads, V.UINT32), ("attention.head_count_kv", s.kv_heads, V.UINT32),
            ("attention.key_length", s.head_dim, V.UINT32), ("attention.value_length", s.head_dim, V.UINT32),
            ("rope.dimension_count", s.head_dim, V.UINT32), ("rope.freq_base", s.rope_theta, V.FLOAT32),
            ("attention.layer_norm_rms_epsilon", s.eps, V.FLOAT32), ("vocab_size", s.vocab, V.UINT32)):
        writer.add_key_value(f"{a}.{key}", value, vtype)
    if s.window:
        writer.add_key_value(f"{a}.attention.sliding_window", s.window, V.UINT32)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))


def _tensor_shapes(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(llama.cpp name, numpy shape [rows, row length]) of every tensor, in llama.cpp's order (qwen2's biases after
    them all, as bench/startup.py writes its file)."""
    E, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [("token_embd.weight", (s.vocab, E))]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (E,)), (b + "attn_q.weight", (q, E)), (b + "attn_k.weight", (kv, E)),
                (b + "attn_v.weight", (kv, E)), (b + "attn_output.weight", (E, q))]
        if s.arch in ("qwen3", "gemma3"):
            out += [(b + "attn_q_norm.weight", (s.head_dim,)), (b + "attn_k_norm.weight", (s.head_dim,))]
        if s.arch == "gemma3":
            out.append((b + "post_attention_norm.weight", (E,)))
        out += [(b + "ffn_norm.weight", (E,)), (b + "ffn_gate.weight", (s.intermediate, E)),
                (b + "ffn_up.weight", (s.intermediate, E)), (b + "ffn_down.weight", (E, s.intermediate))]
        if s.arch == "gemma3":
            out.append((b + "post_ffw_norm.weight", (E,)))
    out.append(("output_norm.weight", (E,)))
    if not s.tied:
        out.append(("output.weight", (s.vocab, E)))
    if s.arch == "qwen2":
        for i in range(s.layers):
            out += [(f"blk.{i}.attn_q.bias", (q,)), (f"blk.{i}.attn_k.bias", (kv,)), (f"blk.{i}.attn_v.bias", (kv,))]
    return out


def random_model(dst: Path, shape: Shape, tokenizer_from: Path, seed: int = 0) -> Path:
    """A GGUF of ``shape`` with random weights: projections and embedding F16 normal * ``shape.scale``, biases F32
    normal * ``shape.scale``, norms F32 1 (+ normal * ``shape.norm_noise``); the tokenizer of ``tokenizer_from``
    fitted to ``shape.vocab``."""
    if dst.exists():
        return dst
    writer = gguf.GGUFWriter(str(_atomic(dst)), shape.arch)
    writer.add_name(f"random {shape.arch} {shape.hidden}x{shape.layers}")
    _metadata(writer, shape)
    _tokenizer(writer, gguf.GGUFReader(str(tokenizer_from)), shape.vocab)
    names = _tensor_shapes(shape)
    for name, dims in names:
        dt = np.dtype(np.float32 if len(dims) == 1 else np.float16)
        writer.add_tensor_info(name, dims, dt, int(np.prod(dims)) * dt.itemsize)

    def arrays() -> Iterator[np.ndarray]:
        rng = np.random.default_rng(seed)
        for name, dims in names:
            if name.endswith(".bias"):
                yield (rng.standard_normal(dims, dtype=np.float32) * shape.scale).astype(np.float32)
            elif len(dims) == 1:
                yield (1 + shape.norm_noise * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)
            else:
                yield (rng.standard_normal(dims, dtype=np.float32) * shape.scale).astype(np.float16)

    _write(dst, writer, arrays())
    return dst


QUANTIZE = r"""
import ctypes, sys
import llama_cpp
src, dst, preset, threads = sys.argv[1:5]
name = "LLAMA_FTYPE_MOSTLY_" + preset
if not hasattr(llama_cpp, name):
    sys.exit(f"llama_cpp {llama_cpp.__version__} has no {name}")
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, name)
params.nthread = int(threads)
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
sys.exit(f"llama_model_quantize returned {rc}" if rc else 0)
"""


class QuantizeError(RuntimeError):
    """llama.cpp's quantizer refused a preset for a file (the message holds the tail of its log)."""


def quantize(src: Path, dst: Path, preset: str, python: Path = LLAMACPP_PYTHON, threads: int = 2) -> Path:
    """``src`` quantized by llama.cpp to ``preset`` ("Q4_K_M", "Q8_0", "IQ4_XS" ...: a LLAMA_FTYPE_MOSTLY_* name),
    without an importance matrix. Raises QuantizeError with llama.cpp's last lines when it refuses."""
    if dst.exists():
        return dst
    part = _atomic(dst)
    proc = subprocess.run([str(python), "-c", QUANTIZE, str(src), str(part), preset, str(threads)],
                          capture_output=True, text=True)
    if proc.returncode or not part.exists():
        part.unlink(missing_ok=True)
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise QuantizeError(f"llama.cpp would not quantize {src.name} to {preset}: {tail}")
    os.replace(part, dst)
    return dst


def tensor_types(path: Path) -> Counter[str]:
    """GGUF type name -> how many tensors of the file have it."""
    return Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors)
