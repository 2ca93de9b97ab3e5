"""Attention at one row (a decode step's ``llm.flash_attention_with_kvcache``) on the real small models' head shapes:
the native kernel against torch's ``scaled_dot_product_attention`` on the same keys, in one run (issue #39).

    python bench/attention_decode.py [--threads 1] [--lengths 128 512 2048] [--smoke]

Shapes: Qwen2.5-0.5B (14 query heads over 2 KV heads of 64), Qwen2.5-1.5B (12 over 2 of 128), Gemma 3 270M and 1B (4
over 1 of 256), Llama 3.2 1B (32 over 8 of 64); one sequence whose keys sit in a paged float32 cache of 16-token
blocks, as the engine keeps it. Each row:
- native, hot: the kernel called back to back (its keys and values in the caches);
- native, cold: each call after 48 MiB were written, so the keys come from memory, as in a decode step, where a
  layer's weights pass through the caches between two attentions;
- torch: ``scaled_dot_product_attention(enable_gqa=True)`` on the same keys gathered contiguous beforehand (the
  gather not timed: a lower bound for a paged cache), hot;
GMAC/s counts q k and p v (2 H D n multiply-adds). Medians of alternating rounds. ``--smoke`` (what CI runs): one
short length, few calls. The kernel's answer is checked against torch's before timing.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import table  # noqa: E402

SHAPES = [("Qwen2.5-0.5B", 14, 2, 64), ("Qwen2.5-1.5B", 12, 2, 128), ("Gemma 3 270M / 1B", 4, 1, 256),
          ("Llama 3.2 1B", 32, 8, 64)]
BLOCK = 16


def inputs(h: int, hkv: int, d: int, n: int) -> tuple:
    """The kernel's arguments for one decode row over ``n`` keys in shuffled 16-token blocks, and torch's (q, k, v)."""
    g = torch.Generator().manual_seed(0)
    nb = -(-n // BLOCK)
    kc, vc = torch.randn(nb + 2, BLOCK, hkv, d, generator=g), torch.randn(nb + 2, BLOCK, hkv, d, generator=g)
    table = torch.randperm(nb + 2, generator=g)[:nb].to(torch.int32)[None]
    q = torch.randn(1, h, d, generator=g)
    args = (q, kc, vc, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([n], dtype=torch.int32), table,
            torch.empty_like(q), True, d ** -0.5, 0)
    rows = (table[0].long()[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:n]
    k, v = (c.flatten(0, 1)[rows].transpose(0, 1)[None].contiguous() for c in (kc, vc))  # [1, Hkv, n, D]
    return args, (q[0][None, :, None], k, v)


def timed(fn, calls: int, before=None) -> float:
    """Median seconds of one call of ``fn`` over ``calls`` calls, ``before()`` untimed ahead of each."""
    samples = []
    for _ in range(calls):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--smoke", action="store_true", help="one length of 64 keys, few calls (CI)")
    a = ap.parse_args()
    import dtorch.kernels.native as nk

    if nk.unavailable_reason() is not None:
        print(f"native kernels unavailable: {nk.unavailable_reason()}")
        return
    torch.set_num_threads(a.threads)
    lib = nk.load()
    lengths, calls, rounds = ([64], 5, 1) if a.smoke else (a.lengths, 200, 5)
    flush = torch.empty(48 << 20, dtype=torch.uint8)
    rows = []
    for name, h, hkv, d in SHAPES:
        for n in lengths:
            args, (q, k, v) = inputs(h, hkv, d, n)
            lib.paged_attention(*args)
            want = F.scaled_dot_product_attention(q, k, v, scale=d ** -0.5, enable_gqa=True)[0, :, 0]
            torch.testing.assert_close(args[6][0], want, rtol=1e-4, atol=1e-5)
            native = functools.partial(lib.paged_attention, *args)
            sdpa = functools.partial(F.scaled_dot_product_attention, q, k, v, scale=d ** -0.5, enable_gqa=True)
            got: dict[str, list[float]] = {"hot": [], "cold": [], "torch": []}
            for _ in range(rounds):
                got["hot"].append(timed(native, calls))
                got["cold"].append(timed(native, max(2, calls // 10), functools.partial(flush.add_, 1)))
                got["torch"].append(timed(sdpa, calls))
            s = {key: statistics.median(v) for key, v in got.items()}
            macs = 2 * h * d * n
            rows.append([name, f"{h}/{hkv} x {d}", n, f"{s['hot'] * 1e6:.1f}", f"{macs / s['hot'] / 1e9:.1f}",
                         f"{s['cold'] * 1e6:.1f}", f"{s['torch'] * 1e6:.1f}", f"{s['torch'] / s['hot']:.2f}x"])
    print(f"one decode row, {a.threads} thread(s), float32 cache in blocks of {BLOCK}; times in us")
    print(table(["model", "heads x dim", "keys", "native hot", "GMAC/s", "native cold", "torch sdpa",
                 "native vs torch"], rows))


if __name__ == "__main__":
    main()
