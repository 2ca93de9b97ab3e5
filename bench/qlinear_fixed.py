"""What a one-row qlinear call costs besides its product: the fixed part (x's quantization to the integer levels, their
layout for the kernel, the checks, the thread split, the Python call) against the product part, per K of the real
models (Gemma 3 270M 640, Qwen2.5-0.5B 896, SmolLM2-360M 960, Qwen2.5-1.5B 1536, Llama 3.2 1B 2048, the down
projections' 4864 / 8960).

Run: ``python bench/qlinear_fixed.py [--formats q8_0,q4_k] [--ks 640,896] [--n 896] [--threads 1] [--rounds 15]
[--smoke]``.

Per (format, K): µs of ``lib.qlinear`` on one row of x with a hot weight of N = 16 rows and of N rows (the same weight
called over and over: the call's work, not the memory), medians over rounds; the product costs (t(N) - t(16)) / (N -
16) a row, and the fixed part is t(16) less 16 such rows: what every product of a decode step pays once, whatever
its N (a Qwen2.5-0.5B token makes 7 products a layer). One thread is timed by the thread's CPU time (the machine may
be shared), more by the wall clock. K-quants only where K % 256 == 0. ``--smoke`` (what CI runs): K = 512, N = 64,
q8_0 and q4_k, 1 round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import table  # noqa: E402
from native_kernels import _raw  # noqa: E402

from dtorch.kernels import layouts  # noqa: E402
from dtorch.kernels.native import loader  # noqa: E402

KS = [640, 896, 960, 1536, 2048, 4864, 8960]
SMALL = 16  # rows of the weight whose call is nearly all fixed part


def _per_call(lib, x: torch.Tensor, w: torch.Tensor, code: int, rounds: int, clock) -> float:
    """Median µs of one call over rounds of 100 calls (after 20 warm-up calls)."""
    y = torch.empty(1, w.shape[0])
    for _ in range(20):
        lib.qlinear(x, w, code, None, y, 0)
    times = []
    for _ in range(rounds):
        t0 = clock()
        for _ in range(100):
            lib.qlinear(x, w, code, None, y, 0)
        times.append((clock() - t0) / 100 * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="q8_0,q4_k")
    ap.add_argument("--ks", default=",".join(map(str, KS)))
    ap.add_argument("--n", type=int, default=896, help="rows of the larger weight")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--smoke", action="store_true", help="K = 512, N = 64, 1 round (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.ks, args.n, args.rounds = "512", 64, 1
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    lib = loader._mod or loader.load()
    torch.manual_seed(0)
    rows = []
    for fmt in (f"gguf.{f}" for f in args.formats.split(",")):
        code = layouts.format_code(fmt)
        for k in map(int, args.ks.split(",")):
            if k % layouts.block_size(fmt):
                continue
            x = torch.randn(1, k)
            small = layouts.pack(_raw(fmt, SMALL, k), fmt, k)
            big = layouts.pack(_raw(fmt, args.n, k), fmt, k)
            t_small = _per_call(lib, x, small, code, args.rounds, clock)
            t_big = _per_call(lib, x, big, code, args.rounds, clock)
            per_row = max(0.0, (t_big - t_small) / (args.n - SMALL))
            fixed = max(0.0, t_small - SMALL * per_row)
            rows.append([fmt[5:], k, f"{t_small:.2f}", f"{t_big:.1f}", f"{fixed:.2f}",
                         f"{per_row * 1e3:.1f}", f"{big.numel() / (t_big - fixed) / 1e3:.2f}",
                         f"{fixed / t_big:.1%}"])
    print(f"one-row qlinear, hot weights, {args.threads} thread(s): fixed part vs product (N = {args.n})")
    print(table(["format", "K", f"N = {SMALL} us", f"N = {args.n} us", "fixed us", "ns/row",
                 "product GB/s", "fixed share"], rows))


if __name__ == "__main__":
    main()
