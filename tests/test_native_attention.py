"""The native KV-cache kernels (llm.flash_attention_with_kvcache, llm.reshape_and_cache) and the native llm.embedding
on GGUF weights, against the torch backend's kernels and plain torch math written here; every ISA path this CPU runs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from quant_bytes import gguf_bytes

import dtorch
import dtorch.kernels.native as nk
from dtorch import ops
from dtorch.core.device import Device
from dtorch.core.dtypes import GGUF_LAYOUTS
from dtorch.core.errors import ArgumentError
from dtorch.dispatch.context import KernelContext, KernelParams
from dtorch.dispatch.key import KernelKey
from dtorch.dispatch.registry import Dispatcher
from dtorch.kernels import layouts
from dtorch.kernels.native import kernels as native, products
from dtorch.kernels.torch import kv_cache as torch_kv_cache, quantized as torch_quantized

_REASON = nk.unavailable_reason()
# two intra-op threads (conftest gives one): the kernels split rows among threads, and each row's bits must not
# depend on the split
pytestmark = [pytest.mark.skipif(_REASON is not None, reason=f"native kernels unavailable: {_REASON}"),
              pytest.mark.usefixtures("two_threads")]
DTYPES = [torch.float32, torch.bfloat16]
# bf16: the reference rounds the same float32 result once; the sums' order differs, so one bf16 ulp apart
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def _ctx(**params) -> KernelContext:
    return KernelContext(Device("cpu"), None, None, KernelParams(**params))


# -- attention cases -------------------------------------------------------------------------------------------
# One row per case: (name, heads H, kv heads Hkv, D, block_size, [(queries, keys) per sequence], causal). The
# cache holds random rows everywhere, so a wrong block or slot shows; blocks are handed out in a shuffled order.

CASES = [
    ("decode", 9, 3, 64, 160, [(1, 140), (1, 1), (1, 33)], True),                 # one block per sequence
    ("decode_paged", 9, 3, 64, 16, [(1, 140), (1, 17), (1, 16)], True),
    ("prefill", 9, 3, 64, 16, [(40, 40)], True),
    ("chunked_prefill", 4, 2, 32, 16, [(5, 14), (3, 70), (1, 9)], True),      # queries after cached keys
    ("padding", 4, 2, 64, 16, [(2, 5), (0, 7), (3, 0), (6, 3)], True),        # zero queries; zero keys; q > keys
    ("mha_d128", 2, 2, 128, 32, [(3, 50), (1, 64)], True),
    ("mqa_20_heads", 20, 1, 80, 64, [(2, 65)], True),                        # 40 rows: items of at most 16
    ("not_causal", 6, 3, 64, 16, [(4, 30), (2, 2)], False),
]


def _attention_inputs(case, dtype, seed=0):
    _, h, hkv, d, bs, seqs, causal = case
    gen = torch.Generator().manual_seed(seed)
    per = max(1, max(-(-n // bs) for _, n in seqs))
    blocks = len(seqs) * per + 2
    kc = torch.randn(blocks, bs, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(blocks, bs, hkv, d, generator=gen).to(dtype)
    table = torch.randperm(blocks, generator=gen)[:len(seqs) * per].view(len(seqs), per).to(torch.int32)
    total = sum(nq for nq, _ in seqs)
    qkv = torch.randn(total, (h + 2 * hkv) * d, generator=gen).to(dtype)
    q = qkv[:, :h * d].view(total, h, d)  # a fused qkv output's q heads: token-strided, as the model passes them
    cu = torch.tensor([0, *np.cumsum([nq for nq, _ in seqs])], dtype=torch.int32)
    lens = torch.tensor([n for _, n in seqs], dtype=torch.int32)
    return (q, kc, vc, cu, lens, table), dict(causal=causal, scale=1 / math.sqrt(d))


def _plain_attention(inputs, causal, scale) -> torch.Tensor:
    """float64 softmax(q k^T * scale) v per sequence, gathering keys through the block table by hand."""
    q, kc, vc, cu, lens, table = inputs
    bs, g = kc.shape[1], q.shape[1] // kc.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(lens.shape[0]):
        q0, q1, n = int(cu[s]), int(cu[s + 1]), int(lens[s])
        rows = [int(table[s, j // bs]) * bs + j % bs for j in range(n)]
        k = kc.flatten(0, 1)[rows].double().repeat_interleave(g, 1)  # [n, H, D]
        v = vc.flatten(0, 1)[rows].double().repeat_interleave(g, 1)
        for i in range(q1 - q0):
            seen = min(n, n - (q1 - q0) + i + 1) if causal else n
            if seen <= 0:
                continue  # no visible key: zeros
            w = torch.softmax(torch.einsum("hd,khd->hk", q[q0 + i].double(), k[:seen]) * scale, -1)
            out[q0 + i] = torch.einsum("hk,khd->hd", w, v[:seen])
    return out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_matches_torch_kernel_and_plain_math(case, dtype, isa):
    inputs, params = _attention_inputs(case, dtype)
    got = torch.full(inputs[0].shape, float("nan"), dtype=dtype)
    want = got.clone()
    native.flash_attention_with_kvcache(_ctx(**params), inputs, (got,))
    torch_kv_cache.flash_attention_with_kvcache_reference(_ctx(**params), inputs, (want,))
    # rows of zero-query sequences are not written by either kernel
    touched = torch.zeros(got.shape[0], dtype=torch.bool)
    touched[:int(inputs[3][-1])] = True
    torch.testing.assert_close(got[touched], want[touched], **TOL[dtype], msg=f"{case[0]} {isa}")
    plain = _plain_attention(inputs, **params).to(dtype)
    torch.testing.assert_close(got, plain, **TOL[dtype], msg=f"{case[0]} {isa} vs plain math")


# the real models' decode shapes: Qwen2.5-0.5B (14 query heads over 2 KV heads of 64), Gemma 3 270M (4 over 1 of 256),
# Llama 3.2 1B (32 over 8 of 64); one sequence's keys run over chunks of 64 with a tail, another's fit in one
REAL_DECODE = [("qwen2.5_0.5b", 14, 2, 64), ("gemma3_270m", 4, 1, 256), ("llama3.2_1b", 32, 8, 64)]


@pytest.mark.parametrize("shape", REAL_DECODE, ids=[s[0] for s in REAL_DECODE])
@pytest.mark.parametrize("cache_dtype", DTYPES)
def test_decode_on_real_shapes_matches_torch_sdpa(shape, cache_dtype, isa):
    name, h, hkv, d = shape
    inputs, params = _attention_inputs((name, h, hkv, d, 16, [(1, 150), (1, 7)], True), torch.float32)
    q, kc, vc, cu, lens, table = inputs
    inputs = (q, kc.to(cache_dtype), vc.to(cache_dtype), cu, lens, table)
    got, bound = torch.full(q.shape, float("nan")), torch.full(q.shape, float("nan"))
    native.flash_attention_with_kvcache(_ctx(**params), inputs, (got,))
    native.flash_attention_with_kvcache.bind(_ctx(**params), inputs, (bound,))()  # a static plan's bound call
    torch.testing.assert_close(bound, got, rtol=0, atol=0)
    for s, n in enumerate(lens.tolist()):
        rows = [int(table[s, j // 16]) * 16 + j % 16 for j in range(n)]
        k, v = (c.flatten(0, 1)[rows].float().transpose(0, 1)[None] for c in inputs[1:3])  # [1, Hkv, n, D]
        want = torch.nn.functional.scaled_dot_product_attention(q[s][None, :, None], k, v, scale=params["scale"],
                                                                enable_gqa=True)  # [1, H, 1, D]
        torch.testing.assert_close(got[s], want[0, :, 0], **TOL[torch.float32], msg=f"{name} {isa} sequence {s}")


# a cache whose dtype is not the activations' (LLM(kv_cache_dtype=...)): float32 activations over a bfloat16 cache
# (half the bytes each step reads), and the reverse
MIXED = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[5]], ids=[CASES[i][0] for i in (1, 3, 5)])
@pytest.mark.parametrize("dtype,cache_dtype", MIXED, ids=["f32_over_bf16", "bf16_over_f32"])
def test_attention_over_a_cache_of_another_dtype(case, dtype, cache_dtype, isa):
    inputs, params = _attention_inputs(case, dtype)
    q, kc, vc, *rest = inputs
    inputs = (q, kc.to(cache_dtype), vc.to(cache_dtype), *rest)
    got = torch.full(q.shape, float("nan"), dtype=dtype)
    want = got.clone()
    native.flash_attention_with_kvcache(_ctx(**params), inputs, (got,))
    torch_kv_cache.flash_attention_with_kvcache_reference(_ctx(**params), inputs, (want,))
    torch.testing.assert_close(got, want, **TOL[dtype], msg=f"{case[0]} {isa}")
    plain = _plain_attention(inputs, **params).to(dtype)  # the cache's values widened exactly
    torch.testing.assert_close(got, plain, **TOL[dtype], msg=f"{case[0]} {isa} vs plain math")


@pytest.mark.parametrize("dtype,cache_dtype", MIXED, ids=["f32_over_bf16", "bf16_over_f32"])
def test_reshape_and_cache_rounds_into_a_cache_of_another_dtype(dtype, cache_dtype):
    """Keys are rounded once as they are stored, bit for bit as torch's .to() rounds them (a NaN stays a NaN,
    whatever its payload)."""
    gen = torch.Generator().manual_seed(2)
    kc, vc = torch.zeros(4, 16, 2, 64, dtype=cache_dtype), torch.zeros(4, 16, 2, 64, dtype=cache_dtype)
    qkv = torch.randn(6, 8 * 64, generator=gen).to(dtype) * 1e3
    qkv[0, 4 * 64] = float("nan")
    qkv[1, 4 * 64 + 1] = float("inf")
    qkv[2, 4 * 64 + 2] = 1 + 2**-8 + 2**-10  # a bf16 rounding that is not a truncation
    k, v = qkv[:, 4 * 64:6 * 64].view(6, 2, 64), qkv[:, 6 * 64:].view(6, 2, 64)
    slots = torch.tensor([3, 9, -1, 40, 63, 17])
    got, want = (kc.clone(), vc.clone()), (kc.clone(), vc.clone())
    native.reshape_and_cache(_ctx(), (k, v, *got, slots), got)
    torch_kv_cache.reshape_and_cache_reference(_ctx(), (k, v, *want, slots), want)
    ok = slots >= 0
    for a, b in ((got[0], want[0]), (got[1], want[1]), (got[0].flatten(0, 1)[slots[ok]], k[ok].to(cache_dtype)),
                 (got[1].flatten(0, 1)[slots[ok]], v[ok].to(cache_dtype))):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    assert got[0].flatten(0, 1)[3, 0, 0].isnan() and got[0].flatten(0, 1)[9, 0, 1].isinf()


def test_attention_into_a_strided_out():
    inputs, params = _attention_inputs(CASES[3], torch.float32)
    big = torch.zeros(inputs[0].shape[0], inputs[0].shape[1] + 3, inputs[0].shape[2])
    out = big[:, 1:1 + inputs[0].shape[1]]
    native.flash_attention_with_kvcache(_ctx(**params), inputs, (out,))
    torch.testing.assert_close(out, _plain_attention(inputs, **params).float(), **TOL[torch.float32])
    assert big[:, 0].abs().sum() == 0 and big[:, -2:].abs().sum() == 0  # nothing outside out


def test_attention_falls_back_where_the_native_kernel_does_not_go():
    """A head dim that is not a multiple of 16 goes to the torch backend's kernel; bad values raise there."""
    case = ("d8", 4, 2, 8, 4, [(3, 9), (1, 5)], True)
    inputs, params = _attention_inputs(case, torch.float32)
    out = torch.empty_like(inputs[0])
    native.flash_attention_with_kvcache(_ctx(**params), inputs, (out,))
    torch.testing.assert_close(out, _plain_attention(inputs, **params).float(), **TOL[torch.float32])
    bound = torch.full_like(out, float("nan"))  # the call bound once, as a static plan's loop makes it
    native.flash_attention_with_kvcache.bind(_ctx(**params), inputs, (bound,))()
    torch.testing.assert_close(bound, out, rtol=0, atol=0)
    q, kc, vc, cu, lens, table = _attention_inputs(CASES[1], torch.float32)[0]
    bad = table.clone()
    bad[0, 0] = kc.shape[0]  # a block past the cache
    with pytest.raises(ArgumentError, match="block_table"):
        nk.load().paged_attention(q, kc, vc, cu, lens, bad, torch.empty_like(q), True, 0.125, 0)


# -- reshape_and_cache -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_reshape_and_cache_matches_torch_kernel(dtype, slot_dtype):
    gen = torch.Generator().manual_seed(1)
    kc = torch.randn(5, 16, 3, 64, generator=gen).to(dtype)
    vc = torch.randn(5, 16, 3, 64, generator=gen).to(dtype)
    for t in (1, 3, 20):  # decode (one row), a few, a prefill
        qkv = torch.randn(t, 15 * 64, generator=gen).to(dtype)
        k, v = qkv[:, 9 * 64:12 * 64].view(t, 3, 64), qkv[:, 12 * 64:].view(t, 3, 64)  # strided views
        slots = torch.randperm(80, generator=gen)[:t].to(slot_dtype)
        if t > 1:
            slots[t // 2] = -1  # padding: skipped
        got = (kc.clone(), vc.clone())
        want = (kc.clone(), vc.clone())
        native.reshape_and_cache(_ctx(), (k, v, *got, slots), got)
        torch_kv_cache.reshape_and_cache_reference(_ctx(), (k, v, *want, slots), want)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        rows = slots[slots >= 0].long()
        assert torch.equal(got[0].flatten(0, 1)[rows], k[slots >= 0])
        assert torch.equal(got[1].flatten(0, 1)[rows], v[slots >= 0])
        assert not torch.equal(got[0].flatten(0, 1)[rows], kc.flatten(0, 1)[rows])  # it did write


def test_reshape_and_cache_refuses_a_slot_past_the_cache():
    kc = torch.zeros(2, 4, 1, 16)
    k = torch.ones(1, 1, 16)
    with pytest.raises(ArgumentError, match="past the cache"):
        nk.load().cache_store(k, k, kc, kc.clone(), torch.tensor([8]))


# -- the ops through the dispatcher ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_dispatcher_runs_native_and_falls_back(dtype):
    d = Dispatcher()
    for op in ("llm.flash_attention_with_kvcache", "llm.reshape_and_cache"):
        exp = d.explain(KernelKey(op, "cpu", dtype))
        assert exp.winner is not None and exp.winner.provider == "native", str(exp)
        with d.disabled("native"):
            assert d.select(KernelKey(op, "cpu", dtype)).provider != "native"
    assert d.explain(KernelKey("llm.flash_attention_with_kvcache", "cpu", torch.float16)).winner.provider != "native"


@pytest.mark.parametrize("dtype", DTYPES)
def test_public_ops_cache_then_attend_native_and_without(dtype):
    """ops.reshape_and_cache then ops.flash_attention_with_kvcache on dtorch.dispatcher, with native and without."""
    exp = dtorch.dispatcher.explain(KernelKey("llm.flash_attention_with_kvcache", "cpu", dtype))
    assert exp.winner.provider == "native", str(exp)
    case = ("step", 9, 3, 64, 16, [(3, 20), (1, 41)], True)
    (q, kc, vc, cu, lens, table), params = _attention_inputs(case, dtype, seed=3)
    slots = torch.tensor([int(table[0, p // 16]) * 16 + p % 16 for p in (17, 18, 19)] + [-1] +
                         [int(table[1, 40 // 16]) * 16 + 40 % 16])
    k_new, v_new = torch.randn(5, 3, 64).to(dtype), torch.randn(5, 3, 64).to(dtype)
    results = []
    for off in ((), ("native",)):
        caches = (kc.clone(), vc.clone())
        with dtorch.dispatcher.disabled(*off):
            ops.reshape_and_cache(k_new, v_new, *caches, slots)
            q4 = torch.cat([q[:3], q[:1], q[3:]])  # a padding token's row too
            cu4 = torch.tensor([0, 3, 4, 5], dtype=torch.int32)
            lens4 = torch.tensor([20, 0, 41], dtype=torch.int32)
            table4 = torch.stack([table[0], table[0], table[1]])
            results.append((*caches, ops.flash_attention_with_kvcache(q4, *caches, cu4, lens4, table4, **params)))
    for g, w in zip(*results, strict=True):
        torch.testing.assert_close(g, w, **TOL[dtype])
    assert results[0][2][3].abs().sum() == 0  # the sequence with no keys gives zeros


# -- llm.embedding on GGUF weights -----------------------------------------------------------------------------

EMBED_LAYOUTS = GGUF_LAYOUTS


def _packed_embedding(layout: str, v: int, e: int) -> torch.Tensor:
    return layouts.pack(torch.from_numpy(gguf_bytes(layout, v, e, np.random.default_rng(4))), layout, e)


@pytest.mark.parametrize("layout", EMBED_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_is_the_reference_bit_for_bit(layout, dtype):
    # 32-block formats: one whole super-group of 16 blocks, then a partial one of 3 (groups of 128: 4 whole, 1 of 3)
    e = 576 + 32 if layouts.block_size(layout) == 32 else 768
    w = _packed_embedding(layout, 50, e)
    kernel, reference = products._embedding_kernel(layout), torch_quantized._embedding(layout)
    for ids in (torch.tensor([7]), torch.tensor([[0, 49, 3], [3, 3, 12]], dtype=torch.int32)):
        got, want = torch.empty(*ids.shape, e, dtype=dtype), torch.empty(*ids.shape, e, dtype=dtype)
        kernel(_ctx(), (w, ids), (got,))
        reference(_ctx(), (w, ids), (want,))
        assert torch.equal(got, want), (layout, dtype)
    full = layouts.dequantize(w, layout, e)
    got = torch.empty(3, e)
    kernel(_ctx(), (w, torch.tensor([2, 0, 49])), (got,))
    assert torch.equal(got, full[[2, 0, 49]])


@pytest.mark.parametrize("layout", EMBED_LAYOUTS)
def test_embedding_vocab_start_gives_zero_rows_outside(layout):
    """A vocabulary-parallel piece holds rows [vocab_start, vocab_start + V); other ids give zero rows."""
    e = layouts.block_size(layout) * 2
    w = _packed_embedding(layout, 20, e)
    ids = torch.tensor([99, 100, 119, 120, 5, 110])
    got, want = torch.full((6, e), float("nan")), torch.full((6, e), float("nan"))
    products._embedding_kernel(layout)(_ctx(vocab_start=100), (w, ids), (got,))
    torch_quantized._embedding(layout)(_ctx(vocab_start=100), (w, ids), (want,))
    assert torch.equal(got, want)
    assert got[[0, 3, 4]].abs().sum() == 0 and got[[1, 2, 5]].abs().sum() > 0


def test_embedding_dispatch():
    d = Dispatcher()
    for layout in EMBED_LAYOUTS:
        for dtype in DTYPES:
            key = KernelKey("llm.embedding", "cpu", dtype, layout)
            assert d.explain(key).winner.provider == "native", str(d.explain(key))
            with d.disabled("native"):
                assert d.select(key).provider != "native"
