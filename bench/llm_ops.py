"""LLM kernels: reference vs accelerated provider on decode- and prefill-shaped calls (SmolLM2-135M-like
shapes: 9 query heads, 3 kv heads, head dim 64, hidden 576), plus the prepared operators' per-call cost.

Run: ``python bench/llm_ops.py [threads] [--smoke]`` (default 1 thread). Prints two tables; times are medians of
alternating repeated runs, in microseconds. ``--smoke`` (what CI runs): 1 round of 2 calls per case.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import per_call_us, table  # noqa: E402

import dtorch  # noqa: E402
from dtorch import ops  # noqa: E402

H, HKV, D, HIDDEN = 9, 3, 64, 576


def _cases():
    """(name, call) pairs for ops that have an accelerated provider over their reference."""
    f32 = dtorch.OperatorInitContext("cpu", torch.float32)
    x, w = torch.randn(1, HIDDEN), torch.randn(HIDDEN)
    xp = torch.randn(128, HIDDEN)
    q1, kc, vc = torch.randn(1, 1, H, D), torch.randn(1, 1024, HKV, D), torch.randn(1, 1024, HKV, D)
    qp, kp, vp = torch.randn(1, 256, H, D), torch.randn(1, 256, HKV, D), torch.randn(1, 256, HKV, D)
    lens = [37, 500, 1024, 260, 801, 12, 640, 333]  # batched decode: 8 sequences, one query each
    cu_q = torch.arange(len(lens) + 1, dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    qv, kv, vv = torch.randn(len(lens), H, D), torch.randn(sum(lens), HKV, D), torch.randn(sum(lens), HKV, D)
    attn = ops.Attention(True, None, H, HKV, D).prepare(f32)
    gate = torch.randn(1, 2 * 1536)
    return [
        ("rms_norm [1, 576]", lambda: ops.rms_norm(x, w)),
        ("rms_norm [128, 576]", lambda: ops.rms_norm(xp, w)),
        ("silu_and_mul [1, 3072]", lambda: ops.silu_and_mul(gate)),
        ("softmax_last_dim [128, 576]", lambda: ops.softmax_last_dim(xp)),
        ("attention decode T=1, S=1024", lambda: ops.flash_attention(q1, kc, vc, causal=True)),
        ("Attention prepared decode", lambda: attn.forward(q1, kc, vc)),
        ("attention prefill T=S=256", lambda: ops.flash_attention(qp, kp, vp, causal=True)),
        ("varlen decode 8 seqs", lambda: ops.flash_attention_varlen(qv, kv, vv, cu_q, cu_k, 1, max(lens),
                                                                    causal=True)),
    ]


def _overhead_cases():
    """(name, raw torch call, dtorch call) for decode-shaped steps: the wrapper's per-call cost."""
    f32 = dtorch.OperatorInitContext("cpu", torch.float32)
    x, w, out = torch.randn(1, HIDDEN), torch.randn(HIDDEN), torch.empty(1, HIDDEN)
    norm = ops.RMSNorm(1e-6).prepare(f32)
    q, pos = torch.randn(1, H, D), torch.tensor([700])
    rope = ops.RoPE(D, max_positions=4096).prepare(f32)
    inv = ops.rope_inv_freq(D)

    def raw_rope():  # the LlamaRotaryEmbedding formula with a precomputed table, in place
        c, s = (inv * pos[:, None]).cos()[:, None], (inv * pos[:, None]).sin()[:, None]
        x1, x2 = q[..., : D // 2], q[..., D // 2:]
        y1 = x1 * c - x2 * s
        x2.copy_(x2 * c + x1 * s)
        x1.copy_(y1)

    return [
        ("rms_norm [1, 576] out=", lambda: torch.mul(w, F.rms_norm(x, (HIDDEN,), None, 1e-6), out=out),
         lambda: norm.forward_out(x, w, out=out)),
        ("rope [1, 9, 64] in place", raw_rope, lambda: rope.forward_(q, pos)),
    ]


def _interleaved(a, b, number: int = 20, repeat: int = 7, a_disabled: tuple[str, ...] = ()) -> tuple[float, float]:
    """Medians of alternating timings of a (with ``a_disabled`` providers off) and b; the machine may be
    shared, and alternation cancels drift."""
    ta, tb = [], []
    for _ in range(repeat):
        with dtorch.dispatcher.disabled(*a_disabled):
            ta.append(per_call_us(a, number=number, repeat=1))
        tb.append(per_call_us(b, number=number, repeat=1))
    return statistics.median(ta), statistics.median(tb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # One intra-op thread by default: on a shared 2-core machine two threads jitter by 10x under load.
    ap.add_argument("threads", type=int, nargs="?", default=1)
    ap.add_argument("--smoke", action="store_true", help="1 round of 2 calls per case (CI)")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    # (calls per round, rounds) of the kernel table and of the overhead table
    kernels, overhead = ((2, 1), (2, 1)) if args.smoke else ((20, 7), (200, 7))
    rows = []
    for name, fn in _cases():
        ref, fast = _interleaved(fn, fn, *kernels, a_disabled=("torch", "sdpa"))
        rows.append([name, ref, fast, ref / fast])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; us per call (median)")
    print(table(["case", "reference", "active", "speedup"], rows))
    rows = []
    for name, raw, wrapped in _overhead_cases():
        t_raw, t_wrapped = _interleaved(raw, wrapped, *overhead)
        rows.append([name, t_raw, t_wrapped, t_wrapped - t_raw])
    print()
    print(table(["decode step", "raw torch", "prepared op", "overhead"], rows))


if __name__ == "__main__":
    main()
