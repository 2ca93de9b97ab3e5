"""Native CPU kernels vs torch on SmolLM2-135M's and Qwen3-0.6B's linear shapes: y [M, N] = x [M, K] @ W[N, K].T.

Run: ``python bench/native_kernels.py [--isa avx512,avx2] [--rounds 5] [--threads 1,2] [--m 1,128]
[--formats q4_1,q4_k,...] [--shapes smollm2,qwen3] [--smoke]``.

Rows per (shape, M, threads): torch float32 and bfloat16 matmul, native float GEMV (M = 1), native products of
every packed GGUF format per ISA (K-quants only where K % 256 == 0); each gives µs per call and GB/s of weight
bytes streamed. Times
are medians over rounds in which every variant runs once in turn (so drift of this shared machine hits all
alike). For M = 1 each call takes the next of several distinct copies of the weight, enough to overflow the
last-level cache (at least 256 MiB in all, at most 60 copies), so each call streams its weight from memory, as a
decode step does. ``--smoke`` (what CI runs): one 256 x 512 shape, M = 1 and 4, 1 thread, 1 round, q4_1 and q4_k,
two copies of each weight.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import table  # noqa: E402

import dtorch.kernels.native as nk  # noqa: E402
from dtorch.core.dtypes import GGUF_LAYOUTS  # noqa: E402
from dtorch.kernels import layouts  # noqa: E402

SHAPES = {  # (N, K): q/o, k/v, gate/up, down, head
    "smollm2": [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)],
    "qwen3": [(2048, 1024), (1024, 2048), (1024, 1024), (3072, 1024), (1024, 3072)],
    "gemma3_270m": [(1024, 640), (256, 640), (640, 1024), (2048, 640), (640, 2048), (262144, 640)],
    "qwen2_5_1_5b": [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960), (151936, 1536)],
    "smoke": [(256, 512)],  # K a multiple of 256: the K-quants run too
}
FOOTPRINT = 256 << 20
# byte offsets of the fp16 scales in a GGUF block (the other bytes: any value is valid)
FP16_AT = {"gguf.q8_0": [0], "gguf.q4_0": [0], "gguf.q4_1": [0, 2], "gguf.q5_0": [0], "gguf.q5_1": [0, 2],
           "gguf.iq4_nl": [0], "gguf.q2_k": [80, 82], "gguf.q3_k": [108], "gguf.q4_k": [0, 2], "gguf.q5_k": [0, 2],
           "gguf.q6_k": [208], "gguf.iq4_xs": [0]}


def _raw(fmt: str, n: int, k: int) -> torch.Tensor:
    """Random GGUF blocks (speed does not depend on the values; any bytes with finite scales are valid)."""
    block, size = layouts.block_size(fmt), layouts.gguf_block_bytes(fmt)
    gen = np.random.default_rng(0)
    raw = gen.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    scale = np.full((n, k // block, 2), 1e-3, dtype=np.float16).view(np.uint8)
    for off in FP16_AT[fmt]:
        raw[..., off:off + 2] = scale[..., :2]
    return torch.from_numpy(raw.reshape(n, -1))


def _copies(nbytes: int, m: int) -> int:
    return 1 if m > 1 else max(2, min(60, -(-FOOTPRINT // nbytes)))


def _variants(n: int, k: int, m: int, isas: list[str],
              formats: list[str]) -> list[tuple[str, int, Callable[[int], None]]]:
    """(name, weight bytes, call(i)) where call(i) runs once on copy i % copies."""
    out = []
    x32, xbf = torch.randn(m, k), torch.randn(m, k).bfloat16()
    y32, ybf = torch.empty(m, n), torch.empty(m, n, dtype=torch.bfloat16)
    w32 = [torch.randn(n, k) for _ in range(_copies(n * k * 4, m))]
    wbf = [w.bfloat16() for w in w32[: _copies(n * k * 2, m)]]
    out.append(("torch f32", n * k * 4, lambda i: torch.matmul(x32, w32[i % len(w32)].T, out=y32)))
    out.append(("torch bf16", n * k * 2, lambda i: torch.matmul(xbf, wbf[i % len(wbf)].T, out=ybf)))
    if m == 1:
        out.append(("gemv f32", n * k * 4, lambda i: nk.gemv(x32, w32[i % len(w32)], y32)))
        out.append(("gemv bf16", n * k * 2, lambda i: nk.gemv(x32, wbf[i % len(wbf)], y32)))
    for fmt in formats:
        if k % layouts.block_size(fmt):  # K-quants need K % 256 == 0 (llama.cpp stores such tensors otherwise)
            continue
        packed = layouts.pack(_raw(fmt, n, k), fmt, k)
        nbytes = packed.numel()
        ws = [packed] + [packed.clone() for _ in range(_copies(nbytes, m) - 1)]
        for isa in isas:
            def call(i, ws=ws, isa=isa, fmt=fmt):
                nk.set_isa(isa)
                nk.qlinear(x32, ws[i % len(ws)], fmt, out=y32)
            out.append((f"{fmt[5:]} {isa}", nbytes, call))
    return out


def _measure(variants, m: int, rounds: int) -> list[float]:
    """Median µs per call of each variant; a round runs each variant over all its copies (M = 1) or thrice."""
    per = {name: [] for name, _, _ in variants}
    calls = [3 if m > 1 else max(1, _copies(b, m)) for _, b, _ in variants]
    for _, _, f in variants:  # warm up: page in every copy, settle the thread pool
        for i in range(2):
            f(i)
    for _ in range(rounds):
        for (name, _, f), c in zip(variants, calls, strict=True):
            t0 = time.perf_counter()
            for i in range(c):
                f(i)
            per[name].append((time.perf_counter() - t0) / c * 1e6)
    return [statistics.median(per[name]) for name, _, _ in variants]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default=",".join(i for i in nk.available_isas() if i != "portable"),
                    help="native ISA paths to time (comma separated; portable is slow)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--m", default="1,128")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--formats", default="q4_1,q8_0,q4_k,q6_k", help="GGUF formats (comma separated) or 'all'")
    ap.add_argument("--shapes", default="smollm2", help=f"shape sets: {', '.join(SHAPES)}")
    ap.add_argument("--no-torch", action="store_true", help="time the native products only")
    ap.add_argument("--smoke", action="store_true", help="one small shape, 1 thread, 1 round (CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        global FOOTPRINT
        FOOTPRINT = 0  # _copies' floor: two copies of each weight, nothing sized to overflow the cache
        args.shapes, args.m, args.threads, args.rounds, args.formats = "smoke", "1,4", "1", 1, "q4_1,q4_k"
    formats = list(GGUF_LAYOUTS) if args.formats == "all" else [f"gguf.{f}" for f in args.formats.split(",")]
    shapes = [s for name in args.shapes.split(",") for s in SHAPES[name]]
    isas = args.isa.split(",")
    nk.load()
    print(f"torch {torch.__version__}; native ISAs on this CPU: {', '.join(nk.available_isas())}\n")
    head, rows = None, []
    for m in (int(v) for v in args.m.split(",")):
        for n, k in shapes:
            variants = _variants(n, k, m, isas, formats)
            if args.no_torch:
                variants = [v for v in variants if not v[0].startswith(("torch", "gemv"))]
            for t in (int(v) for v in args.threads.split(",")):
                torch.set_num_threads(t)
                us = _measure(variants, m, args.rounds)
                for (name, nbytes, _), u in zip(variants, us, strict=True):
                    rows.append([f"{n}x{k}", m, t, name, round(u, 1), round(nbytes / u / 1e3, 1)])
                head = ["N x K", "M", "threads", "kernel", "us/call", "GB/s weights"]
                print(table(head, rows[-len(variants):]), "\n", flush=True)
    nk.set_isa("auto")


if __name__ == "__main__":
    main()
