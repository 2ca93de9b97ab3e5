"""Sliding-window attention over the paged KV cache: every provider of ``llm.flash_attention_with_kvcache`` (and the
native kernel on every instruction set this CPU runs) against a masked softmax written here in float64, for windows
of one key, shorter than a block and spanning several blocks, in prefill, chunked prefill and decode rows.

The blocks that lie wholly before every query's window are the ones the engine frees: here they are filled with NaN
and the table names them, so a kernel that reads one shows it."""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import ops

H, HKV, D = 4, 2, 16
I32 = dict(dtype=torch.int32)


def _masked(q, kc, vc, cu, lens, table, window: int, scale: float) -> torch.Tensor:
    """float64 softmax(q k^T * scale) v per query over the keys j with pos - window < j <= pos (pos: the query's own
    position, bottom-right), gathering the keys through the block table by hand."""
    bs, g = kc.shape[1], q.shape[1] // kc.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(lens.shape[0]):
        q0, q1, n = int(cu[s]), int(cu[s + 1]), int(lens[s])
        for i in range(q1 - q0):
            pos = n - (q1 - q0) + i
            keys = [j for j in range(max(0, pos - window + 1), pos + 1)]
            if not keys:
                continue
            rows = [int(table[s, j // bs]) * bs + j % bs for j in keys]
            k = kc.flatten(0, 1)[rows].double().repeat_interleave(g, 1)  # [n, H, D]
            v = vc.flatten(0, 1)[rows].double().repeat_interleave(g, 1)
            w = torch.softmax(torch.einsum("hd,khd->hk", q[q0 + i].double(), k) * scale, -1)
            out[q0 + i] = torch.einsum("hk,khd->hd", w, v)
    return out


def _inputs(queries: list[int], keys: list[int], block_size: int, window: int, seed: int = 0,
            dtype: torch.dtype = torch.float32):
    """Sequence i: queries[i] new rows over keys[i] cached keys. Blocks every query's window has left point at one
    block full of NaN (freed and reused, as far as the kernel may know); the others are the sequence's own."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in keys)
    poison = sum(-(-n // block_size) for n in keys)  # the last block: all NaN
    kc = torch.randn(poison + 1, block_size, HKV, D, generator=g).to(dtype)
    vc = torch.randn(poison + 1, block_size, HKV, D, generator=g).to(dtype)
    kc[poison], vc[poison] = float("nan"), float("nan")
    table = torch.full((len(keys), width), poison, **I32)
    order = torch.randperm(poison, generator=g).tolist()
    for s, (nq, n) in enumerate(zip(queries, keys, strict=True)):
        used = -(-n // block_size)
        dead = max(0, n - nq - window + 1) // block_size  # blocks before the first query's window
        table[s, dead:used] = torch.tensor(order[dead:used], **I32)
        order = order[used:]
    cu = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], **I32)
    q = torch.randn(sum(queries), H, D, generator=g).to(dtype)
    return q, kc, vc, cu, torch.tensor(keys, **I32), table


CASES = {  # name: (queries per sequence, keys per sequence, block size, window)
    "window_1": ([1, 3, 5], [9, 3, 20], 4, 1),
    "window_inside_a_block_decode": ([1, 1, 1, 1], [1, 5, 33, 70], 16, 5),
    "window_inside_a_block_prefill": ([12, 4, 1], [12, 40, 17], 16, 5),
    "window_over_blocks_chunked": ([7, 2, 1, 16], [30, 41, 29, 16], 4, 11),
    "window_longer_than_keys": ([3, 1], [6, 9], 4, 64),
}


def _providers() -> dict[str, object]:
    """name -> a context manager that leaves that provider active (the native one on each instruction set)."""
    import contextlib

    key = dtorch.KernelKey("llm.flash_attention_with_kvcache", "cpu", torch.float32)
    names = [c.provider for c in dtorch.dispatcher.candidates(key)]
    out = {}
    for p in names:
        off = [o for o in names if o not in (p, "reference")]
        if p != "native":
            out[p] = lambda off=off: dtorch.dispatcher.disabled(*off)
            continue
        from dtorch.kernels import native

        for isa in native.available_isas():
            def both(off=off, isa=isa):
                stack = contextlib.ExitStack()
                stack.enter_context(dtorch.dispatcher.disabled(*off))
                stack.enter_context(native.use_isa(isa))
                return stack
            out[f"native/{isa}"] = both
    return out


PROVIDERS = _providers()


@pytest.mark.parametrize("provider", sorted(PROVIDERS))
@pytest.mark.parametrize("case", CASES)
def test_every_provider_masks_keys_older_than_the_window(case, provider):
    queries, keys, bs, window = CASES[case]
    q, kc, vc, cu, lens, table = _inputs(queries, keys, bs, window)
    want = _masked(q, kc, vc, cu, lens, table, window, D ** -0.5)
    with PROVIDERS[provider]():
        got = ops.flash_attention_with_kvcache(q, kc, vc, cu, lens, table, causal=True, window=window)
    assert torch.isfinite(got).all(), "a block before the window was read"
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("provider", sorted(PROVIDERS))
def test_bf16_caches_too(provider):
    if provider == "sdpa" or provider == "reference":
        pytest.skip("float32-only comparison target: the bf16 path of these is torch's own")
    q, kc, vc, cu, lens, table = _inputs([5, 1], [21, 30], 4, 7, seed=3, dtype=torch.bfloat16)
    want = _masked(q, kc, vc, cu, lens, table, 7, D ** -0.5)
    with PROVIDERS[provider]():
        got = ops.flash_attention_with_kvcache(q, kc, vc, cu, lens, table, window=7)
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


def test_no_window_and_a_window_past_every_key_agree():
    q, kc, vc, cu, lens, table = _inputs([3, 1], [6, 9], 4, 64)
    full = ops.flash_attention_with_kvcache(q, kc, vc, cu, lens, table)
    torch.testing.assert_close(ops.flash_attention_with_kvcache(q, kc, vc, cu, lens, table, window=64), full)
    narrow = ops.flash_attention_with_kvcache(q, kc, vc, cu, lens, table, window=2)
    assert not torch.allclose(narrow, full)  # the window changes what a query sees


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_a_bad_window_is_named(bad):
    q, kc, vc, cu, lens, table = _inputs([1], [4], 4, 4)
    with pytest.raises(dtorch.ArgumentError, match="'window' must be None"):
        ops.flash_attention_with_kvcache(q, kc, vc, cu, lens, table, window=bad)
