"""MoE experts: the reference kernel (a loop over experts with masks) against the torch kernel, decode and prefill.

    python bench/moe.py [--threads 4] [--repeat 20] [--hidden 576] [--inter 256] [--dtype float32] [--smoke]

For E experts with top-k routing (random router logits) it prints the median ms of ``llm.moe_experts`` with only
the reference or only the torch provider, for T = 1 (decode: on cpu the torch kernel's host path, each selected
expert on views of its own matrices; off cpu its gathered path, no host read) and T = 512 (prefill: grouped by
expert), the speed-up and the largest output difference. ``--smoke`` (what CI runs): 1 thread, 1 run, H=64, I=32,
E=8 top-2 only, T = 1 and 32.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import median_ms, table  # noqa: E402

import dtorch  # noqa: E402
from dtorch import ops  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--smoke", action="store_true", help="1 thread, 1 run, tiny shapes (CI)")
    a = p.parse_args(argv)
    routings, lengths = ((8, 2), (32, 4), (64, 8)), (1, 512)  # (experts E, top-k), tokens T
    if a.smoke:
        a.threads, a.repeat, a.hidden, a.inter = 1, 1, 64, 32
        routings, lengths = ((8, 2),), (1, 32)
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    rows = []
    for experts, k in routings:
        wgu = torch.randn(experts, 2 * a.inter, a.hidden, dtype=dtype) * 0.05
        wd = torch.randn(experts, a.hidden, a.inter, dtype=dtype) * 0.05
        for tokens in lengths:
            x = torch.randn(tokens, a.hidden, dtype=dtype)
            w, ids = ops.moe_router(torch.randn(tokens, experts, dtype=dtype), k, True)
            out = {}

            def run(provider: str, x=x, wgu=wgu, wd=wd, w=w, ids=ids, out=out):
                other = {"reference", "torch"} - {provider}
                with dtorch.dispatcher.disabled(*other):
                    out[provider] = ops.moe_experts(x, wgu, wd, w, ids)

            ref = median_ms(lambda: run("reference"), a.repeat)
            fast = median_ms(lambda: run("torch"), a.repeat)
            diff = (out["reference"].float() - out["torch"].float()).abs().max().item()
            rows.append([f"E={experts} k={k}", tokens, ref, fast, ref / fast, f"{diff:.1e}"])
    print(f"llm.moe_experts, H={a.hidden}, I={a.inter}, {a.dtype}, {a.threads} threads: median ms")
    print(table(["experts", "T", "reference", "torch", "speed-up", "max diff"], rows))


if __name__ == "__main__":
    main()
