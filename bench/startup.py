"""Start-up: how long ``dtorch.LLM(path)`` takes against llama.cpp's ``Llama(path)`` on the same file, cold (no packed
cache) and warm (its cache), and what ``dtorch info`` and ``dtorch serve`` cost before they answer (issue #39).

    python bench/startup.py [--repeats 3] [--threads 1] [--cache DIR] [--llamacpp-python PATH] [--smoke]

The file: a Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, FFN 4864, 14 heads / 2 KV heads of 64, a tied
151,936-token head; random F16 weights, normal * 0.02, the SmolLM2 tokenizer padded to the vocabulary) quantized to
Q4_K_M by llama.cpp's own quantizer (``llama_cpp.llama_model_quantize``): K = 896 is no multiple of 256, so its
projections are Q5_0 with some Q8_0 and Q6_K, and the head Q8_0, as a real Qwen2.5-0.5B-Instruct Q4_K_M is. Made
once into ``--cache`` (default ``~/.cache/dtorch/bench-gguf``).

Each measure runs in a fresh subprocess (the OS page cache is warm for all: the file was read just before), medians
of ``--repeats``:
- ``load``: ``Llama(path, n_ctx=1024)`` (llama.cpp, mmap) and ``LLM(path, max_model_len=1024)``: cold (the packed
  cache off: ``DTORCH_PACK_CACHE=0``, the file repacked) and warm (the cache entry there, made by the run before);
- ``info``: ``dtorch info PATH --json`` end to end (imports included);
- ``serve``: ``dtorch serve PATH --port 0`` from the start of the process to the first completion answered, and
  to ``/health`` saying ``ok`` (every step shape built); its banner's load and warm-up seconds are shown too.
``--smoke``: the shipped SmolLM2-135M Q4_1 file instead (no quantizer needed), one repeat, no serve; what CI runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import gguf_files as gf
import numpy as np
from decode import _llamacpp_python, _print

# Qwen2.5-0.5B's published sizes (config.json of Qwen/Qwen2.5-0.5B-Instruct)
QWEN2_5_0_5B = gf.Shape("qwen2", 896, 4864, 24, 14, 2, 64, 151936, context=32768)
CONTEXT = 1024


def qwen2_model(dst: Path, shape: gf.Shape, tokenizer_from: Path, seed: int = 0) -> Path:
    """``gf.random_model`` with Qwen2's q/k/v biases (F32, normal * ``shape.scale``)."""
    if dst.exists():
        return dst
    writer = gf.gguf.GGUFWriter(str(gf._atomic(dst)), shape.arch)
    writer.add_name(f"random {shape.arch} {shape.hidden}x{shape.layers}")
    gf._metadata(writer, shape)
    gf._tokenizer(writer, gf.gguf.GGUFReader(str(tokenizer_from)), shape.vocab)
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    names = gf._tensor_shapes(shape)
    for i in range(shape.layers):
        names += [(f"blk.{i}.attn_q.bias", (q,)), (f"blk.{i}.attn_k.bias", (kv,)), (f"blk.{i}.attn_v.bias", (kv,))]
    for name, dims in names:
        dt = np.dtype(np.float32 if len(dims) == 1 else np.float16)
        writer.add_tensor_info(name, dims, dt, int(np.prod(dims)) * dt.itemsize)

    def arrays():
        rng = np.random.default_rng(seed)
        for name, dims in names:
            if name.endswith(".bias"):
                yield (rng.standard_normal(dims, dtype=np.float32) * shape.scale).astype(np.float32)
            elif len(dims) == 1:
                yield np.ones(dims, dtype=np.float32)
            else:
                yield (rng.standard_normal(dims, dtype=np.float32) * shape.scale).astype(np.float16)

    gf._write(dst, writer, arrays())
    return dst


def make_file(cache: Path, python: str) -> Path:
    """The Qwen2.5-0.5B-shaped Q4_K_M file (made when missing)."""
    from dtorch.models.default import default_model_path

    src = qwen2_model(cache / "qwen2.5-0.5b-F16.gguf", QWEN2_5_0_5B, default_model_path())
    return gf.quantize(src, cache / "qwen2.5-0.5b-Q4_K_M.gguf", "Q4_K_M", Path(python), threads=2)
