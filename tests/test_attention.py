"""llm.flash_attention and llm.flash_attention_varlen against torch's own attention (float64, explicit mask).

Each case runs twice: with the active provider (sdpa) and with only the reference kernel.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import ops
from dtorch.core.dtypes import tolerance
from dtorch.dispatch import Call, KernelKey, KernelParams

PROVIDERS = ["active", "reference"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def providers(which: str):
    return contextlib.nullcontext() if which == "active" else dtorch.dispatcher.disabled("sdpa")


def torch_attention(q, k, v, causal, scale=None):
    """q [B, T, H, D], k/v [B, S, Hkv, D] -> float64 [B, T, H, D] via torch sdpa with a bottom-right mask;
    query rows that see no key are zero (flash-attn's convention)."""
    b, t, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    if s == 0:
        return torch.zeros(b, t, h, d, dtype=torch.float64)
    qh = q.double().transpose(1, 2)
    kh = k.double().transpose(1, 2).repeat_interleave(h // hkv, 1)
    vh = v.double().transpose(1, 2).repeat_interleave(h // hkv, 1)
    mask = torch.ones(t, s, dtype=torch.bool)
    if causal:
        mask = torch.ones(t, s, dtype=torch.bool).tril(diagonal=s - t)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale).transpose(1, 2)
    return o.masked_fill(~mask.any(-1).view(1, t, 1, 1), 0.0)


def close(got, want, dtype):
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol * 2, atol=atol * 2)


# (T, S, H, Hkv): square, chunked prefill T < S, decode T = 1, more queries than keys, MHA, MQA
SHAPES = [(6, 6, 4, 2), (3, 8, 4, 2), (1, 9, 4, 1), (5, 3, 2, 2), (4, 4, 6, 3)]


@pytest.mark.parametrize("which", PROVIDERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_flash_attention_matches_torch(which, dtype, causal, shape):
    t, s, h, hkv = shape
    q = torch.randn(2, t, h, 16).to(dtype)
    k = torch.randn(2, s, hkv, 16).to(dtype)
    v = torch.randn(2, s, hkv, 16).to(dtype)
    with providers(which):
        got = ops.flash_attention(q, k, v, causal=causal)
    assert got.shape == q.shape and got.dtype == dtype
    close(got, torch_attention(q, k, v, causal), dtype)


@pytest.mark.parametrize("which", PROVIDERS)
def test_flash_attention_scale_noncontiguous_and_out(which):
    # q, k, v as transposed views of [B, H, T, D] tensors: strided, not contiguous
    q = torch.randn(2, 4, 5, 8).transpose(1, 2)
    k = torch.randn(2, 2, 7, 8).transpose(1, 2)
    v = torch.randn(2, 2, 7, 8).transpose(1, 2)
    assert not q.is_contiguous()
    out = torch.empty(2, 5, 4, 8)
    with providers(which):
        ops.flash_attention_out(q, k, v, True, 0.3, out=out)
    close(out, torch_attention(q, k, v, True, scale=0.3), torch.float32)


@pytest.mark.parametrize("which", PROVIDERS)
def test_flash_attention_empty(which):
    q = torch.randn(1, 3, 2, 8)
    none = torch.randn(1, 0, 2, 8)
    with providers(which):
        assert ops.flash_attention(q, none, none, causal=True).abs().sum() == 0  # no keys: zeros
        empty = ops.flash_attention(torch.randn(1, 0, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8))
    assert empty.shape == (1, 0, 2, 8)


def test_flash_attention_decode_long_cache():
    q = torch.randn(3, 1, 8, 32)
    k = torch.randn(3, 512, 2, 32)
    v = torch.randn(3, 512, 2, 32)
    close(ops.flash_attention(q, k, v, causal=True), torch_attention(q, k, v, True), torch.float32)


def test_flash_attention_meta_shapes():
    q, k = torch.empty(2, 3, 4, 8, device="meta"), torch.empty(2, 9, 2, 8, device="meta")
    out = ops.flash_attention(q, k, k, causal=True)
    assert out.device.type == "meta" and out.shape == (2, 3, 4, 8)


@pytest.mark.parametrize("args, error", [
    (((2, 3, 4, 8), (2, 5, 2, 8), (2, 5, 2, 8)), None),
    (((3, 4, 8), (2, 5, 2, 8), (2, 5, 2, 8)), dtorch.ShapeError),  # q rank 3
    (((2, 3, 4, 8), (2, 5, 3, 8), (2, 5, 3, 8)), dtorch.ShapeError),  # H % Hkv != 0
    (((2, 3, 4, 8), (2, 5, 2, 4), (2, 5, 2, 4)), dtorch.ShapeError),  # head dims differ
    (((2, 3, 4, 8), (1, 5, 2, 8), (1, 5, 2, 8)), dtorch.ShapeError),  # batch differs
    (((2, 3, 4, 8), (2, 5, 2, 8), (2, 6, 2, 8)), dtorch.ShapeError),  # k, v differ
])
def test_flash_attention_bad_shapes(args, error):
    q, k, v = (torch.randn(s) for s in args)
    if error is None:
        ops.flash_attention(q, k, v)
    else:
        with pytest.raises(error, match="llm.flash_attention"):
            ops.flash_attention(q, k, v)


def test_flash_attention_bad_arguments():
    q, k = torch.randn(1, 2, 2, 4), torch.randn(1, 3, 2, 4)
    with pytest.raises(dtorch.DTypeError, match="dtypes disagree"):
        ops.flash_attention(q, k.double(), k.double())
    with pytest.raises(dtorch.DTypeError, match="'q'"):
        ops.flash_attention(q.int(), k.int(), k.int())
    with pytest.raises(dtorch.DTypeError, match="'k'"):
        ops.flash_attention(q, "k", k)
    with pytest.raises(dtorch.ArgumentError, match="causal"):
        ops.flash_attention(q, k, k, causal=1)
    with pytest.raises(dtorch.ArgumentError, match="scale"):
        ops.flash_attention(q, k, k, scale="big")
    with pytest.raises(dtorch.ShapeError, match="'out'"):
        ops.flash_attention_out(q, k, k, out=torch.empty(1, 2, 2, 5))


# -- varlen ----------------------------------------------------------------------------------------

def varlen_case(lens_q, lens_k, h=4, hkv=2, d=8, dtype=torch.float32):
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lens_q), h, d).to(dtype)
    k = torch.randn(sum(lens_k), hkv, d).to(dtype)
    v = torch.randn(sum(lens_k), hkv, d).to(dtype)
    return q, k, v, cu_q, cu_k, max(lens_q, default=0), max(lens_k, default=0)


def per_segment(q, k, v, cu_q, cu_k, causal):
    out = torch.zeros(q.shape, dtype=torch.float64)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bq) - 1):
        if bq[i + 1] > bq[i]:
            seg = torch_attention(q[None, bq[i]:bq[i + 1]], k[None, bk[i]:bk[i + 1]], v[None, bk[i]:bk[i + 1]], causal)
            out[bq[i]:bq[i + 1]] = seg[0]
    return out


VARLEN_CASES = [
    ([4, 2, 5], [4, 2, 5]),  # prefill
    ([2, 1, 0, 3], [5, 1, 3, 3]),  # chunked prefill with an empty segment
    ([1, 1, 1, 1], [1, 6, 9, 3]),  # batched decode, differing cache lengths
    ([3, 2], [1, 0]),  # more queries than keys, a segment without keys
]


@pytest.mark.parametrize("which", PROVIDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", VARLEN_CASES)
def test_varlen_matches_per_segment(which, dtype, causal, lens):
    q, k, v, cu_q, cu_k, mq, mk = varlen_case(*lens, dtype=dtype)
    with providers(which):
        got = ops.flash_attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=causal)
    close(got, per_segment(q, k, v, cu_q, cu_k, causal), dtype)


@pytest.mark.parametrize("which", PROVIDERS)
def test_varlen_loose_max_seqlen_and_mqa(which):
    q, k, v, cu_q, cu_k, mq, mk = varlen_case([2, 3], [4, 3], h=4, hkv=1)
    out = torch.empty_like(q)
    with providers(which):
        ops.flash_attention_varlen_out(q, k, v, cu_q, cu_k, mq + 3, mk + 2, True, 0.5, out=out)
    want = per_segment(q * (0.5 * 8 ** 0.5), k, v, cu_q, cu_k, True)  # scale 0.5 == default scale on rescaled q
    close(out, want, torch.float32)


def test_varlen_no_segments():
    q, k, v = torch.empty(0, 2, 4), torch.empty(0, 2, 4), torch.empty(0, 2, 4)
    cu = torch.zeros(1, dtype=torch.int32)
    assert ops.flash_attention_varlen(q, k, v, cu, cu, 0, 0).shape == (0, 2, 4)


def test_varlen_meta_shapes():
    q, k = torch.empty(7, 4, 8, device="meta"), torch.empty(9, 2, 8, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    assert ops.flash_attention_varlen(q, k, k, cu, cu, 4, 5, causal=True).shape == (7, 4, 8)


def _bad(cu_q=None, cu_k=None, mq=3, mk=5, **shapes):
    q = torch.randn(shapes.get("q", (5, 4, 8)))
    k = torch.randn(shapes.get("k", (8, 2, 8)))
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32) if cu_q is None else cu_q
    cu_k = torch.tensor([0, 3, 8], dtype=torch.int32) if cu_k is None else cu_k
    return ops.flash_attention_varlen(q, k, k, cu_q, cu_k, mq, mk, causal=True)


def test_varlen_good_baseline():
    assert _bad().shape == (5, 4, 8)


@pytest.mark.parametrize("kw, error, match", [
    (dict(q=(5, 4, 8, 1)), dtorch.ShapeError, "rank 3"),
    (dict(k=(8, 3, 8)), dtorch.ShapeError, "multiple"),
    (dict(cu_q=torch.tensor([0, 2, 5])), dtorch.DTypeError, "int32"),
    (dict(cu_q=torch.tensor([[0, 2, 5]], dtype=torch.int32)), dtorch.ShapeError, "cu_seqlens_q"),
    (dict(cu_q=torch.tensor([0, 5], dtype=torch.int32)), dtorch.ShapeError, "same length"),
    (dict(cu_q=torch.tensor([0, 4, 2, 5], dtype=torch.int32),
          cu_k=torch.tensor([0, 3, 4, 8], dtype=torch.int32)), dtorch.ArgumentError, "non-decreasing"),
    (dict(cu_q=torch.tensor([1, 2, 5], dtype=torch.int32)), dtorch.ArgumentError, "start at 0"),
    (dict(cu_q=torch.tensor([0, 2, 4], dtype=torch.int32)), dtorch.ArgumentError, "must end at 5"),
    (dict(cu_k=torch.tensor([0, 3, 9], dtype=torch.int32)), dtorch.ArgumentError, "must end at 8"),
    (dict(mq=2), dtorch.ArgumentError, "max_seqlen_q"),
    (dict(mk=4), dtorch.ArgumentError, "max_seqlen_k"),
    (dict(mk=-1), dtorch.ArgumentError, "max_seqlen_k"),
    (dict(mq=2.5), dtorch.ArgumentError, "max_seqlen_q"),
])
def test_varlen_bad_inputs(kw, error, match):
    with pytest.raises(error, match=match):
        _bad(**kw)


def test_varlen_out_wrong_shape():
    q, k, v, cu_q, cu_k, mq, mk = varlen_case([2, 3], [4, 3])
    with pytest.raises(dtorch.ShapeError, match="'out'"):
        ops.flash_attention_varlen_out(q, k, v, cu_q, cu_k, mq, mk, out=torch.empty(5, 4, 9))


# -- prepared operators and provider choice ----------------------------------------------------------

def test_prepared_attention_equals_functional_and_follows_disable():
    op = ops.Attention(True, None, 4, 2, 8).prepare(dtorch.OperatorInitContext("cpu", torch.float32))
    assert op.provider == "sdpa"
    assert "sdpa" in str(op.explain())
    q, k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    assert torch.equal(op.forward(q, k, v), ops.flash_attention(q, k, v, causal=True))
    with dtorch.dispatcher.disabled("sdpa"):
        got = op.forward(q, k, v)
        assert op.provider == "reference"
    close(got, torch_attention(q, k, v, True), torch.float32)
    with pytest.raises(dtorch.ShapeError, match="prepared for"):
        op.forward(torch.randn(2, 3, 2, 8), k, v)
    with pytest.raises(dtorch.DTypeError, match="prepared for"):
        op.forward(q.double(), k.double(), v.double())


def test_prepared_attention_varlen_equals_functional():
    op = ops.AttentionVarlen(True, 0.25, 4, 2, 8).prepare(dtorch.OperatorInitContext("cpu", torch.float32))
    q, k, v, cu_q, cu_k, mq, mk = varlen_case([1, 1, 1], [3, 7, 2])
    want = ops.flash_attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=True, scale=0.25)
    assert torch.equal(op.forward(q, k, v, cu_q, cu_k, mq, mk), want)
    with dtorch.dispatcher.disabled("sdpa"):
        close(op.forward(q, k, v, cu_q, cu_k, mq, mk), want, torch.float32)


def test_prepared_attention_bad_config():
    with pytest.raises(dtorch.ArgumentError, match="multiple"):
        ops.Attention(True, None, 6, 4, 8)
    with pytest.raises(dtorch.ArgumentError, match="head_dim"):
        ops.AttentionVarlen(False, None, 4, 2, 0)
    with pytest.raises(dtorch.ArgumentError, match="not prepared"):
        ops.Attention(True, None, 4, 2, 8).forward(*(torch.randn(1, 1, 4, 8),) * 3)


def test_sdpa_declines_large_head_dim_on_cuda():
    # prepared facts (no tensors) for a CUDA call with head_dim 320: sdpa declines with a reason
    facts = Call(dtorch.Device("cuda"), torch.float16, KernelParams(causal=True, scale=0.1, head_dim=320))
    for op in ("llm.flash_attention", "llm.flash_attention_varlen"):
        choice = dtorch.dispatcher.choose(KernelKey(op, "cuda", torch.float16), facts)
        assert choice.winner.provider == "reference"
        assert any(c.provider == "sdpa" and "head_dim 320" in why for c, why in choice.passed_over)
    ok = Call(dtorch.Device("cpu"), torch.float16, KernelParams(causal=True, scale=0.1, head_dim=320))
    cpu_key = KernelKey("llm.flash_attention", "cpu", torch.float16)
    assert dtorch.dispatcher.choose(cpu_key, ok).winner.provider == "sdpa"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", VARLEN_CASES)
def test_varlen_padded_strategy(causal, lens):
    # the padded one-launch strategy the sdpa provider uses off-CPU, run here on CPU tensors
    from dtorch.kernels.torch.attention import varlen_sdpa_padded

    q, k, v, cu_q, cu_k, mq, mk = varlen_case(*lens)
    out = torch.full_like(q, float("nan"))
    params = KernelParams(causal=causal, scale=8 ** -0.5, max_seqlen_q=mq, max_seqlen_k=mk)
    varlen_sdpa_padded(dtorch.KernelContext(dtorch.Device("cpu"), params=params), (q, k, v, cu_q, cu_k), (out,))
    close(out, per_segment(q, k, v, cu_q, cu_k, causal), torch.float32)


def test_verify_mode_and_runtime_context():
    # verify mode runs the reference beside sdpa and compares; a RuntimeContext is accepted by the out forms
    q, k, v = torch.randn(1, 3, 4, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
    rt = dtorch.RuntimeContext("cpu")
    with dtorch.verify():
        dense = ops.flash_attention_out(q, k, v, True, out=torch.empty(1, 3, 4, 8), ctx=rt)
        vq, vk, vv, cu_q, cu_k, mq, mk = varlen_case([1, 2], [3, 4])
        ops.flash_attention_varlen_out(vq, vk, vv, cu_q, cu_k, mq, mk, True, out=torch.empty_like(vq), ctx=rt)
    close(dense, torch_attention(q, k, v, True), torch.float32)


def test_decode_on_strided_views_of_a_cache():
    """One query read from a fused qkv row against keys/values sliced from a [max_len, Hkv, D] cache (the model's
    single-sequence decode), with GQA heads folded."""
    qkv = torch.randn(1, 1, 6 + 2 * 2, 16)  # [B, T, H + 2 Hkv, D]
    q = qkv[:, :, :6]
    cache_k, cache_v = torch.randn(32, 2, 16), torch.randn(32, 2, 16)
    k, v = cache_k[:11][None], cache_v[:11][None]
    op = ops.Attention(True, 0.3, 6, 2, 16).prepare(dtorch.OperatorInitContext("cpu", torch.float32))
    out = torch.empty(1, 1, 6, 16)
    op.forward_out(q, k, v, out=out)
    close(out, torch_attention(q, k, v, True, scale=0.3), torch.float32)


@pytest.mark.parametrize("bad, error, match", [
    (dict(out=torch.empty(1, 2, 4, 8)), dtorch.ShapeError, "'out'"),  # out.copy_ would broadcast
    (dict(k=torch.randn(2, 5, 2, 8), v=torch.randn(2, 5, 2, 8)), dtorch.ShapeError, "batch sizes"),  # sdpa broadcasts
    (dict(v=torch.randn(1, 4, 2, 8)), dtorch.ShapeError, "same shape"),
    (dict(k=torch.randn(1, 5, 2, 8).double()), dtorch.DTypeError, "dtypes disagree"),
    (dict(q=torch.randn(1, 1, 2, 8)), dtorch.ShapeError, "prepared for"),
    (dict(out=torch.empty(1, 1, 4, 8, dtype=torch.float64)), dtorch.DTypeError, "'out'"),
    (dict(q=torch.randn(1, 4, 8)), dtorch.ShapeError, "rank 4"),
])
def test_prepared_attention_hot_path_rejects_bad_calls(bad, error, match):
    op = ops.Attention(True, None, 4, 2, 8).prepare(dtorch.OperatorInitContext("cpu", torch.float32))
    args = dict(q=torch.randn(1, 1, 4, 8), k=torch.randn(1, 5, 2, 8), v=torch.randn(1, 5, 2, 8),
                out=torch.empty(1, 1, 4, 8)) | bad
    with pytest.raises(error, match=match):
        op.forward_out(args["q"], args["k"], args["v"], out=args["out"])
