"""Gated delta rule: the per-step recurrence against the chunked (WY / UT-transform) form, over T.

    python bench/gated_delta_net.py [--threads 1] [--repeat 5] [--heads 4] [--dim 64] [--chunk 64]

For B=1, H heads, K = V = dim in float32 it prints the median ms of ``dtorch.ops.gated_delta_net`` with
``mode="recurrent"`` and ``mode="chunked"`` for several T, the speed-up of chunked and their largest output
difference. Expect chunked to win more as T grows (T / chunk sequential steps instead of T).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1, 64, 256, 1024, 4096])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for t in args.lengths:
        h, d = args.heads, args.dim
        q, k, v = torch.randn(1, t, h, d), torch.randn(1, t, h, d), torch.randn(1, t, h, d)
        g, beta = -F.softplus(torch.randn(1, t, h)), torch.rand(1, t, h)
        inputs = (q, k, v, g, beta)
        runs = {mode: (lambda mode=mode, inputs=inputs: dtorch.ops.gated_delta_net(
                    *inputs, use_qk_l2norm=True, mode=mode, chunk_size=args.chunk))
                for mode in ("recurrent", "chunked")}
        diff = (runs["recurrent"]()[0] - runs["chunked"]()[0]).abs().max().item()
        ms = {mode: median_ms(fn, args.repeat) for mode, fn in runs.items()}
        rows.append([str(t), ms["recurrent"], ms["chunked"], f"{ms['recurrent'] / ms['chunked']:.1f}x", f"{diff:.1e}"])
    print(f"torch {torch.__version__}, {args.threads} thread(s); B=1, H={args.heads}, K=V={args.dim}, float32, "
          f"chunk {args.chunk}, l2norm; medians of {args.repeat} runs, ms per call\n")
    print(table(["T", "recurrent", "chunked", "chunked speed-up", "max |diff|"], rows))


if __name__ == "__main__":
    main()
