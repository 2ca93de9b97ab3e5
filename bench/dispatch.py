"""Dispatch overhead: dtorch's prepared and functional paths against the direct torch call.

    python bench/dispatch.py [--threads 1] [--repeat 15] [--smoke]

For a small op (add on [1, 576]), a small linear ([1, 576] x [1536, 576]) and an rms_norm ([1, 576]) it
prints the median time per call of the direct torch call (its out= form beside the prepared path, its
allocating form beside the functional path; rms_norm has no out= form) and the µs each dtorch path adds.
Targets: prepared +1 µs, functional +3 µs (for add and linear). ``--smoke`` (what CI runs): 2 rounds of 1/100 the
calls each, figures meaningless, the table and the correctness checks intact.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _timing import paired_us, table  # noqa: E402

import dtorch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--smoke", action="store_true", help="2 rounds of 1/100 the calls (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.repeat = 2
    calls = 100 if args.smoke else 1  # divides each case's calls per round
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    init = dtorch.OperatorInitContext("cpu", torch.float32)

    a, b, o = torch.randn(1, 576), torch.randn(1, 576), torch.empty(1, 576)
    add = dtorch.ops.Binary("add").prepare(init)
    x, w, y = torch.randn(1, 576), torch.randn(1536, 576), torch.empty(1, 1536)
    linear = dtorch.ops.Linear(has_bias=False).prepare(init)
    h, g, r = torch.randn(1, 576), torch.randn(576), torch.empty(1, 576)
    norm = dtorch.ops.RMSNorm(1e-6).prepare(init)
    torch.testing.assert_close(add.forward_out(a, b, out=o), a + b)
    # the prepared linear may run another provider (oneDNN, native) than F.linear: another summation order over
    # K=576, so float32 results differ by a few ulps of the ~25-sized sums (2e-5 seen), past assert_close's 1e-5
    torch.testing.assert_close(linear.forward_out(x, w, out=y), F.linear(x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(norm.forward_out(h, g, out=r), F.rms_norm(h, (576,), g, 1e-6))

    xs, ws, ys = torch.randn(1, 64), torch.randn(256, 64), torch.empty(1, 256)
    cases = {
        "add [1,576]": dict(
            torch_out=lambda: torch.add(a, b, out=o), prepared=lambda: add.forward_out(a, b, out=o),
            torch_fn=lambda: torch.add(a, b), functional=lambda: dtorch.ops.add(a, b), number=20000),
        "linear [1,576]x[1536,576]": dict(
            torch_out=lambda: torch._C._nn.linear(x, w, out=y), prepared=lambda: linear.forward_out(x, w, out=y),
            torch_fn=lambda: F.linear(x, w), functional=lambda: dtorch.ops.linear(x, w), number=500),
        # the same calls on a weight that stays in L1: the dispatch cost without the large product's cache noise
        "linear [1,64]x[256,64]": dict(
            torch_out=lambda: torch._C._nn.linear(xs, ws, out=ys), prepared=lambda: linear.forward_out(xs, ws, out=ys),
            torch_fn=lambda: F.linear(xs, ws), functional=lambda: dtorch.ops.linear(xs, ws), number=20000),
        "rms_norm [1,576]": dict(  # torch has no out= form: its allocating call stands beside both paths
            torch_out=lambda: F.rms_norm(h, (576,), g, 1e-6), prepared=lambda: norm.forward_out(h, g, out=r),
            torch_fn=lambda: F.rms_norm(h, (576,), g, 1e-6), functional=lambda: dtorch.ops.rms_norm(h, g),
            number=20000),
    }
    rows = []
    for name, c in cases.items():
        t_out, t_prep, d_prep = paired_us(c["torch_out"], c["prepared"], c["number"] // calls, args.repeat)
        t_fn, t_func, d_func = paired_us(c["torch_fn"], c["functional"], c["number"] // calls, args.repeat)
        rows.append([name, t_out, t_prep, d_prep, t_fn, t_func, d_func])
    print(f"torch {torch.__version__}, {args.threads} thread(s); µs per call, medians of {args.repeat} rounds; "
          "each + column is the median of per-round differences (the two timed in alternating rounds)\n")
    print(table(["op", "torch out=", "prepared", "+prepared", "torch", "functional", "+functional"], rows))
    print("\ntargets: +prepared <= 1 µs, +functional <= 3 µs "
          f"(providers of the prepared linear: {linear.provider}, add: {add.provider}, rms_norm: {norm.provider})")


if __name__ == "__main__":
    main()
