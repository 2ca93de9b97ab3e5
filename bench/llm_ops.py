"""LLM kernels: reference vs accelerated provider on decode- and prefill-shaped calls (SmolLM2-135M-like
shapes: 9 query heads, 3 kv heads, head dim 64, hidden 576), plus the prepared operators' per-call cost.

Run: ``python bench/llm_ops.py``. Prints one table; times are medians of repeated runs, in microseconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import per_call_us, table  # noqa: E402

import dtorch  # noqa: E402
from dtorch import ops  # noqa: E402

H, HKV, D, HIDDEN = 9, 3, 64, 576


def _cases():
    f32 = dtorch.OperatorInitContext("cpu", torch.float32)
    x, w = torch.randn(1, HIDDEN), torch.randn(HIDDEN)
    xp = torch.randn(128, HIDDEN)
    q1, kc, vc = torch.randn(1, 1, H, D), torch.randn(1, 1024, HKV, D), torch.randn(1, 1024, HKV, D)
    qp, kp, vp = torch.randn(1, 256, H, D), torch.randn(1, 256, HKV, D), torch.randn(1, 256, HKV, D)
    lens = [37, 500, 1024, 260, 801, 12, 640, 333]  # batched decode: 8 sequences, one query each
    cu_q = torch.arange(len(lens) + 1, dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    qv, kv, vv = torch.randn(len(lens), H, D), torch.randn(sum(lens), HKV, D), torch.randn(sum(lens), HKV, D)
    rope = ops.RoPE(D, max_positions=4096).prepare(f32)
    qr, pos = torch.randn(1, 1, H, D), torch.tensor([700])
    attn = ops.Attention(True, None, H, HKV, D).prepare(f32)
    gate = torch.randn(1, 2 * 1536)
    return [
        ("rms_norm [1, 576]", lambda: ops.rms_norm(x, w)),
        ("rms_norm [128, 576]", lambda: ops.rms_norm(xp, w)),
        ("silu_and_mul [1, 3072]", lambda: ops.silu_and_mul(gate)),
        ("softmax_last_dim [128, 576]", lambda: ops.softmax_last_dim(xp)),
        ("rope functional T=1", lambda: ops.rope(qr, pos)),
        ("RoPE prepared forward_ T=1", lambda: rope.forward_(qr, pos)),
        ("attention decode T=1, S=1024", lambda: ops.flash_attention(q1, kc, vc, causal=True)),
        ("Attention prepared decode", lambda: attn.forward(q1, kc, vc)),
        ("attention prefill T=S=256", lambda: ops.flash_attention(qp, kp, vp, causal=True)),
        ("varlen decode 8 seqs", lambda: ops.flash_attention_varlen(qv, kv, vv, cu_q, cu_k, 1, max(lens),
                                                                    causal=True)),
    ]


def main() -> None:
    torch.manual_seed(0)
    rows = []
    for name, fn in _cases():
        fast = per_call_us(fn, number=20, repeat=5)
        with dtorch.dispatcher.disabled("torch", "sdpa"):
            ref = per_call_us(fn, number=20, repeat=5)
        rows.append([name, ref, fast, ref / fast])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; us per call (median)")
    print(table(["case", "reference", "active", "speedup"], rows))


if __name__ == "__main__":
    main()
