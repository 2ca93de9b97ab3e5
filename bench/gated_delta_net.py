"""Gated delta rule: the per-step recurrence against the chunked (WY / UT-transform) form, over T.

    python bench/gated_delta_net.py [--threads 1 2] [--repeat 3] [--heads 16] [--qk-heads 8] [--dim 128]
                                    [--chunk 64] [--lengths 256 1024 2048 4096] [--smoke]

For B=1, H value heads over Hk q/k heads (16 and 8: Qwen3-Next's linear attention at tp 2),
K = V = dim in float32 with l2-normalised q/k, it prints per thread count the median ms of
``dtorch.ops.gated_delta_net`` with ``mode="recurrent"`` and ``mode="chunked"`` for each T, the speed-up of
chunked and their largest output difference. Expect chunked to win more as T grows (T / chunk sequential steps
of dense matmuls instead of T rank-1 updates). ``--smoke`` (what CI runs): 1 thread, 1 run, T=128, 4 heads over 2,
dim 32, chunk 32.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _timing import median_ms, table  # noqa: E402

import dtorch  # noqa: E402


def rows_for(args: argparse.Namespace) -> list[list[object]]:
    rows = []
    for t in args.lengths:
        h, hk, d = args.heads, args.qk_heads, args.dim
        q, k, v = torch.randn(1, t, hk, d), torch.randn(1, t, hk, d), torch.randn(1, t, h, d)
        g, beta = -F.softplus(torch.randn(1, t, h)), torch.rand(1, t, h)
        inputs = (q, k, v, g, beta)
        runs = {mode: (lambda mode=mode, inputs=inputs: dtorch.ops.gated_delta_net(
                    *inputs, use_qk_l2norm=True, mode=mode, chunk_size=args.chunk))
                for mode in ("recurrent", "chunked")}
        diff = (runs["recurrent"]()[0] - runs["chunked"]()[0]).abs().max().item()
        ms = {mode: median_ms(fn, args.repeat) for mode, fn in runs.items()}
        rows.append([str(t), ms["recurrent"], ms["chunked"], f"{ms['recurrent'] / ms['chunked']:.1f}x", f"{diff:.1e}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--heads", type=int, default=16, help="value heads H")
    ap.add_argument("--qk-heads", type=int, default=8, help="q/k heads Hk (H a multiple of it)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    ap.add_argument("--smoke", action="store_true", help="1 thread, 1 run, tiny shapes (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.threads, args.repeat, args.lengths = [1], 1, [128]
        args.heads, args.qk_heads, args.dim, args.chunk = 4, 2, 32, 32
    for threads in args.threads:
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        rows = rows_for(args)
        print(f"torch {torch.__version__}, {threads} thread(s); B=1, H={args.heads}, Hk={args.qk_heads}, "
              f"K=V={args.dim}, float32, chunk {args.chunk}, l2norm; medians of {args.repeat} runs, ms per call\n")
        print(table(["T", "recurrent", "chunked", "chunked speed-up", "max |diff|"], rows) + "\n")


if __name__ == "__main__":
    main()
