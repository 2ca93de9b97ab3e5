"""The native ops declared as rows (csrc/ops/<group>.def) against the torch kernel each one replaces, per ISA.

    python bench/native_rows.py [--threads 1] [--repeat 15] [--isa avx512,avx2,portable] [--smoke]

For each ISA this CPU runs, each dtype (float32, bfloat16) and each case, the µs per call of the op's torch kernel
(the row's fallback: what the dispatcher runs without the native provider) and of the native row through its module
function, both writing into a preallocated out: the best of rounds timed in turn (the best, not the median: on a
shared machine the other work only ever adds). Each ISA runs in a child process whose torch runs the same ISA
(``ATEN_CPU_CAPABILITY``: avx512, avx2, default for portable) with ours forced to it (``nk.use_isa``), as on a CPU
that has no more. ``torch / native`` above 1 means the native row is faster. Shapes: softmax over a Qwen2.5
vocabulary row [1, 151936], attention-like [8, 4096] and [64, 128]; the MLP's gate/up halves and the norms at a
decode step's one row and at 16 rows. The priority of ``llm.softmax_last_dim``'s row (ops/softmax.def) is set from
this table. ``--smoke`` (what CI runs): tiny shapes, 2 rounds of few calls, figures meaningless, the table intact.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import table  # noqa: E402

import dtorch  # noqa: E402
import dtorch.kernels.native as nk  # noqa: E402
from dtorch.dispatch.meta import KernelParams  # noqa: E402
from dtorch.kernels.torch import llm as torch_llm  # noqa: E402

FULL = {"softmax_last_dim": [(1, 151936), (8, 4096), (64, 128)], "silu_and_mul": [(1, 8960), (16, 1536)],
        "rms_norm": [(1, 1024), (16, 1024)], "add_rms_norm": [(1, 1024), (16, 1024)]}
SMOKE = {"softmax_last_dim": [(2, 64)], "silu_and_mul": [(2, 32)], "rms_norm": [(2, 64)], "add_rms_norm": [(2, 64)]}
ATEN = {"avx512": "avx512", "avx2": "avx2", "portable": "default"}  # torch's ISA beside ours
HEAD = ["op [shape]", "dtype", "isa", "torch us", "native us", "torch / native"]


def case(op: str, shape: tuple[int, int], dtype: torch.dtype) -> tuple[Callable[[], object], Callable[[], object]]:
    """(the torch kernel's call, the native row's call) of ``op`` on ``shape``, each into its own out."""
    mod = nk.load()
    x = torch.randn(shape).to(dtype)
    ctx = dtorch.KernelContext(dtorch.Device("cpu"), params=KernelParams(eps=1e-6))
    out, out2 = torch.empty_like(x), torch.empty_like(x)
    if op == "softmax_last_dim":
        return (lambda: torch_llm.softmax_torch(ctx, (x,), (out,)), lambda: mod.softmax_last_dim(x, out2))
    if op == "silu_and_mul":
        gu = torch.randn(shape[0], 2 * shape[1]).to(dtype)
        return (lambda: torch_llm.silu_and_mul_torch(ctx, (gu, None), (out,)),
                lambda: mod.silu_and_mul(gu, None, out2))
    w = torch.rand(shape[-1]).to(dtype)
    if op == "rms_norm":
        return (lambda: torch_llm.rms_norm_torch(ctx, (x, w), (out,)), lambda: mod.rms_norm(x, w, out2, 1e-6))
    res, h, h2 = torch.randn(shape).to(dtype), torch.empty_like(x), torch.empty_like(x)
    return (lambda: torch_llm.add_rms_norm_torch(ctx, (x, res, w), (out, h)),
            lambda: mod.add_rms_norm(x, res, w, out2, h2, 1e-6))


def best_us(a: Callable[[], object], b: Callable[[], object], number: int, rounds: int) -> tuple[float, float]:
    """The best µs per call of ``a`` and of ``b`` over ``rounds`` rounds of ``number`` calls each, in turn."""
    ta = tb = float("inf")
    for _ in range(rounds):
        for f, which in ((a, 0), (b, 1)):
            t = time.perf_counter()
            for _ in range(number):
                f()
            us = (time.perf_counter() - t) / number * 1e6
            ta, tb = (min(ta, us), tb) if which == 0 else (ta, min(tb, us))
    return ta, tb


def child(isa: str, smoke: bool, rounds: int) -> None:
    """The rows of one ISA, as JSON lines."""
    cases = SMOKE if smoke else FULL
    with nk.use_isa(isa):
        for op, shapes in cases.items():
            for shape in shapes:
                for dtype in (torch.float32, torch.bfloat16):
                    base, native = case(op, shape, dtype)
                    number = 5 if smoke else max(10, int(3e5 // (shape[0] * shape[1])))
                    t, n = best_us(base, native, number, rounds)
                    print(json.dumps([f"{op} {list(shape)}", str(dtype)[6:], isa, t, n, f"{t / n:.2f}x"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--isa", default="", help="comma-separated ISAs (default: every one this CPU runs)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 2 rounds of few calls (CI)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rounds = 2 if args.smoke else args.rounds
    if args.child:
        return child(args.child, args.smoke, rounds)
    reason = nk.unavailable_reason()
    if reason:
        print(f"native kernels unavailable: {reason}")
        print(table(HEAD, []))
        return
    rows = []
    for isa in args.isa.split(",") if args.isa else nk.available_isas():
        cmd = [sys.executable, __file__, "--child", isa, "--threads", str(args.threads), "--rounds", str(rounds)]
        p = subprocess.run(cmd + (["--smoke"] if args.smoke else []), capture_output=True, text=True, check=True,
                           env={**os.environ, "ATEN_CPU_CAPABILITY": ATEN[isa]})
        rows += [json.loads(line) for line in p.stdout.splitlines() if line.startswith("[")]
    print(f"threads {args.threads}; the best of {rounds} rounds; torch on the same ISA (ATEN_CPU_CAPABILITY)")
    print(table(HEAD, rows))


if __name__ == "__main__":
    main()
