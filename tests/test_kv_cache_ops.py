"""``llm.reshape_and_cache`` and ``llm.flash_attention_with_kvcache`` against plain torch: every provider, blocks of
one sequence and paged tables, chunked prefill (queries after cached keys), padding slots, GQA and bad inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import ops

H, HKV, D = 4, 2, 8
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [T, H, D], k/v [S, Hkv, D]; bottom-right causal; float64 sdpa."""
    t, s = q.shape[0], k.shape[0]
    if s == 0:
        return torch.zeros_like(q)
    mask = torch.arange(s)[None] <= torch.arange(t)[:, None] + s - t
    g = q.shape[1] // k.shape[1]
    qh, kh, vh = (x.double().transpose(0, 1) for x in (q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)))
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask).transpose(0, 1)
    return torch.where(mask.any(-1)[:, None, None], o, 0).to(q.dtype)


@pytest.mark.parametrize("provider", ["reference", "sdpa"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [4, 32])
def test_cache_then_attend_matches_torch(provider, dtype, block_size):
    torch.manual_seed(0)
    per = -(-32 // block_size)  # blocks per sequence
    blocks = 3 * per + 1
    kc = torch.zeros(blocks, block_size, HKV, D, dtype=dtype)
    vc = torch.zeros_like(kc)
    # three sequences: 9 cached + 3 new (chunked prefill), 1 cached + 1 new (decode), 6 new (a fresh prompt)
    cached, new = [9, 1, 0], [3, 1, 6]
    table = (torch.randperm(blocks - 1)[:3 * per] + 1).view(3, per).to(torch.int32)  # blocks in any order
    keys = [torch.randn(c + m, HKV, D, dtype=dtype) for c, m in zip(cached, new, strict=True)]
    vals = [torch.randn_like(k) for k in keys]

    def rows(i: int, positions: range) -> list[int]:
        return [int(table[i, p // block_size]) * block_size + p % block_size for p in positions]

    with dtorch.dispatcher.disabled(*(["sdpa"] if provider == "reference" else [])):
        for i, c in enumerate(cached):
            if c:
                ops.reshape_and_cache(keys[i][:c], vals[i][:c], kc, vc, torch.tensor(rows(i, range(c))))
        slot = torch.tensor(sum((rows(i, range(c, c + m)) for i, (c, m) in enumerate(zip(cached, new, strict=True))),
                                []) + [-1])  # one padding token writes nothing
        k_new = torch.cat([k[c:] for k, c in zip(keys, cached, strict=True)] + [torch.randn(1, HKV, D, dtype=dtype)])
        v_new = torch.cat([v[c:] for v, c in zip(vals, cached, strict=True)] + [torch.randn(1, HKV, D, dtype=dtype)])
        before = kc.clone()
        out_k, out_v = ops.reshape_and_cache(k_new, v_new, kc, vc, slot)
        assert out_k is kc and out_v is vc
        written = torch.zeros(blocks * block_size, dtype=torch.bool)
        written[slot[slot >= 0]] = True
        assert torch.equal(kc.view(-1, HKV, D)[~written], before.view(-1, HKV, D)[~written])  # nothing else moved
        for i, (c, m) in enumerate(zip(cached, new, strict=True)):
            assert torch.equal(kc.view(-1, HKV, D)[rows(i, range(c + m))], keys[i])
        q = torch.randn(sum(new) + 1, H, D, dtype=dtype)
        cu = torch.tensor([0, 3, 4, 10, 11], dtype=torch.int32)
        lens = torch.tensor([12, 2, 6, 0], dtype=torch.int32)  # the padding sequence has no keys
        bt = torch.cat([table, torch.zeros(1, per, dtype=torch.int32)])
        out = ops.flash_attention_with_kvcache(q, kc, vc, cu, lens, bt)
    for i in range(3):
        want = _reference(q[cu[i]:cu[i + 1]], keys[i], vals[i])
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], want, **TOL[dtype])
    assert torch.equal(out[10], torch.zeros_like(out[10]))


@pytest.mark.parametrize("kernel", ["reference", "sdpa", "padded"])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                               (torch.bfloat16, torch.float32)])
def test_a_cache_of_another_dtype_is_rounded_once_and_read_widened(kernel, dtype, cache_dtype):
    """The torch kernels on caches whose dtype is not the activations' (LLM(kv_cache_dtype=...))."""
    from dtorch.dispatch.context import KernelContext, KernelParams
    from dtorch.kernels.torch import kv_cache as torch_kv_cache

    torch.manual_seed(1)
    bs, per = 4, 3
    kc = torch.zeros(2 * per, bs, HKV, D, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    table = torch.randperm(2 * per).view(2, per).to(torch.int32)
    n = [10, 7]
    keys = [torch.randn(m, HKV, D, dtype=dtype) for m in n]
    vals = [torch.randn_like(k) for k in keys]
    slots = torch.tensor([int(table[i, p // bs]) * bs + p % bs for i, m in enumerate(n) for p in range(m)])
    ctx = KernelContext(dtorch.Device("cpu"), None, None, KernelParams())
    torch_kv_cache.reshape_and_cache_reference(ctx, (torch.cat(keys), torch.cat(vals), kc, vc, slots), (kc, vc))
    assert torch.equal(kc.flatten(0, 1)[slots], torch.cat(keys).to(cache_dtype))  # rounded once, as .to() does
    q = torch.randn(3, H, D, dtype=dtype)
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    lens = torch.tensor(n, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    run = {"reference": torch_kv_cache.flash_attention_with_kvcache_reference,
           "sdpa": torch_kv_cache.flash_attention_with_kvcache_sdpa,
           "padded": torch_kv_cache.flash_attention_with_kvcache_padded}[kernel]
    run(KernelContext(dtorch.Device("cpu"), None, None, KernelParams(causal=True, scale=D ** -0.5)),
        (q, kc, vc, cu, lens, table), (out,))
    for i in range(2):  # the reference on the cache's values, widened exactly
        want = _reference(q[cu[i]:cu[i + 1]], keys[i].to(cache_dtype).to(dtype), vals[i].to(cache_dtype).to(dtype))
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], want, **TOL[dtype])


def test_bad_inputs_name_the_argument():
    kc = torch.zeros(2, 4, HKV, D)
    k = torch.randn(3, HKV, D)
    with pytest.raises(dtorch.ArgumentError, match="slot_mapping.*slot 8.*8 rows"):
        ops.reshape_and_cache(k, k, kc, kc.clone(), torch.tensor([0, 1, 8]))
    with pytest.raises(dtorch.ShapeError, match="'key' \\[T, Hkv, D\\]"):
        ops.reshape_and_cache(torch.randn(3, 3, D), torch.randn(3, 3, D), kc, kc.clone(), torch.tensor([0, 1, 2]))
    with pytest.raises(dtorch.ShapeError, match="must be contiguous"):
        ops.reshape_and_cache(k, k, kc.transpose(0, 1), kc.transpose(0, 1), torch.tensor([0, 1, 2]))
    q = torch.randn(2, H, D)
    i32 = dict(dtype=torch.int32)
    with pytest.raises(dtorch.ArgumentError, match="block_table row 0.*outside 0..1"):
        ops.flash_attention_with_kvcache(q, kc, kc, torch.tensor([0, 2], **i32), torch.tensor([6], **i32),
                                         torch.tensor([[0, 5]], **i32))
    with pytest.raises(dtorch.ArgumentError, match="more than its 1 blocks"):
        ops.flash_attention_with_kvcache(q, kc, kc, torch.tensor([0, 2], **i32), torch.tensor([6], **i32),
                                         torch.tensor([[0]], **i32))
    with pytest.raises(dtorch.ArgumentError, match="cu_seqlens_q"):
        ops.flash_attention_with_kvcache(q, kc, kc, torch.tensor([0, 3], **i32), torch.tensor([3], **i32),
                                         torch.tensor([[0]], **i32))
    with pytest.raises(dtorch.ShapeError, match="multiple of the cache's Hkv"):
        ops.flash_attention_with_kvcache(torch.randn(2, 3, D), kc, kc, torch.tensor([0, 2], **i32),
                                         torch.tensor([2], **i32), torch.tensor([[0]], **i32))


@pytest.mark.parametrize("where", ["q", "k_inf", "k_nan", "v_nan", "v_inf", "masked"])
def test_every_provider_agrees_on_non_finite_input(where):
    """The rule of every attention provider: an output row (a query head) is NaN when its q row, or a k or v row of a
    key it sees (its kv head's), holds a NaN or an inf; a key it does not see (causal) changes nothing."""
    torch.manual_seed(0)
    kc, vc = torch.randn(4, 4, HKV, D), torch.randn(4, 4, HKV, D)
    q = torch.randn(3, H, D)
    table = torch.tensor([[2, 0]], dtype=torch.int32)  # keys 0..3 in block 2, 4..6 in block 0
    want_nan = torch.zeros(3, H, dtype=torch.bool)
    if where == "q":
        q[1, 2, 3] = float("nan")
        want_nan[1, 2] = True
    elif where == "masked":  # key 6 (block 0, row 2) is seen only by the last query
        kc[0, 2, 1, 0] = float("nan")
        want_nan[2, 2:] = True  # query heads 2, 3 read kv head 1
    else:
        cache = kc if where[0] == "k" else vc
        cache[2, 1, 0, 2] = float("nan") if where.endswith("nan") else float("inf")  # key 1, kv head 0: seen by all
        want_nan[:, :2] = True
    cu, lens = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([7], dtype=torch.int32)
    providers = [c.provider for c, _ in dtorch.dispatcher.explain(
        dtorch.KernelKey("llm.flash_attention_with_kvcache", "cpu", torch.float32)).rows]
    outs = {}
    for p in providers:
        with dtorch.dispatcher.disabled(*[o for o in providers if o not in (p, "reference")]):
            if p != "native":
                outs[p] = ops.flash_attention_with_kvcache(q, kc, vc, cu, lens, table, causal=True)
                continue
            from dtorch.kernels import native

            for isa in native.available_isas():  # each instruction set this CPU runs, the portable one included
                with native.use_isa(isa):
                    outs[f"native/{isa}"] = ops.flash_attention_with_kvcache(q, kc, vc, cu, lens, table, causal=True)
    for p, o in outs.items():
        assert torch.equal(torch.isnan(o).all(-1), want_nan), (p, where)
        assert torch.isfinite(o[~want_nan]).all(), (p, where)
        torch.testing.assert_close(o, outs["reference"], equal_nan=True, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3], ids=["decode", "prefill"])
def test_unwritten_slots_change_nothing(rows):
    """Slots past a sequence's keys hold whatever the cache's memory held, huge finite values too: a score of such a
    key overflows to inf, and under the mask's -inf it turns NaN unless the key is never multiplied (the padded torch
    kernel gathers whole blocks). Every provider gives the reference's output."""
    torch.manual_seed(0)
    kc, vc = torch.full((4, 4, HKV, D), 3e38), torch.full((4, 4, HKV, D), -3e38)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    lens = torch.tensor([6, 2], dtype=torch.int32)
    for b, n in ((2, 4), (0, 2), (1, 2)):  # the written slots: sequence 0 keys 0..5, sequence 1 keys 0..1
        kc[b, :n], vc[b, :n] = torch.randn(n, HKV, D), torch.randn(n, HKV, D)
    q = torch.randn(2 * rows, H, D)
    cu = torch.tensor([0, rows, 2 * rows], dtype=torch.int32)
    key = dtorch.KernelKey("llm.flash_attention_with_kvcache", "cpu", torch.float32)
    providers = [c.provider for c in dtorch.dispatcher.candidates(key)]
    want = None
    for p in ["reference"] + [p for p in providers if p != "reference"]:
        with dtorch.dispatcher.disabled(*[o for o in providers if o not in (p, "reference")]):
            got = ops.flash_attention_with_kvcache(q, kc, vc, cu, lens, table, causal=True)
        assert torch.isfinite(got).all(), p
        want = got if want is None else want
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, p=p: f"{p}: {m}")


def test_soft_capped_scores_match_torch_and_other_kernels_decline():
    """``softcap``: each score capped as cap * tanh(score / cap) before the softmax (Gemma 2), against plain torch;
    the kernels that cannot cap (sdpa, padded, native, triton) decline, saying so."""
    torch.manual_seed(0)
    cap, t = 0.5, 5
    q, k, v = torch.randn(t, H, D) * 3, torch.randn(t, HKV, D) * 3, torch.randn(t, HKV, D)
    kc, vc = k[None].clone(), v[None].clone()  # one block of t rows
    out = ops.flash_attention_with_kvcache(q, kc, vc, torch.tensor([0, t], dtype=torch.int32),
                                           torch.tensor([t], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                                           softcap=cap)
    g = H // HKV
    scores = torch.einsum("thd,shd->hts", q.double(), k.repeat_interleave(g, 1).double()) * D ** -0.5
    scores = (torch.tanh(scores / cap) * cap).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hts,shd->thd", scores.softmax(-1), v.repeat_interleave(g, 1).double()).float()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    uncapped = ops.flash_attention_with_kvcache(q, kc, vc, torch.tensor([0, t], dtype=torch.int32),
                                                torch.tensor([t], dtype=torch.int32),
                                                torch.zeros(1, 1, dtype=torch.int32))
    assert not torch.allclose(out, uncapped, atol=1e-2)  # the cap bites
    from dtorch.core.device import Device
    from dtorch.dispatch import KernelKey
    from dtorch.dispatch.meta import Call
    from dtorch.ops.kv_cache import kvcache_params

    call = Call(Device("cpu"), torch.float32, kvcache_params(D, softcap=cap), (q, kc, vc))
    report = dtorch.dispatcher.explain(KernelKey("llm.flash_attention_with_kvcache", "cpu", torch.float32), call)
    assert report.winner.provider == "reference"
    assert "softcap" in str(report)
    with pytest.raises(dtorch.ArgumentError, match="'softcap' must be None"):
        ops.flash_attention_with_kvcache(q, kc, vc, torch.tensor([0, t], dtype=torch.int32),
                                         torch.tensor([t], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                                         softcap=-1.0)
