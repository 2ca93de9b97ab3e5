"""llm.gated_delta_net: both providers against a plain per-step recurrence (and transformers' Qwen3-Next torch
reference), chunked against recurrent, varlen against per-segment runs, in-place decode, prepared, meta, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import ops
from dtorch.dispatch import dispatcher
from dtorch.dispatch.key import KernelKey
from dtorch.ops import GatedDeltaNet, OperatorInitContext

MODES = ("recurrent", "chunked")
TOL = {torch.float64: (1e-9, 1e-9), torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2),
       torch.float16: (1e-2, 1e-2)}


def make(b=2, t=13, hk=2, h=None, kd=8, vd=6, dtype=torch.float32, normalize=True, init=True, n=None):
    """Random inputs of a well-behaved delta rule: unit keys (unless the op normalises), beta in (0, 1), g < 0."""
    h = h or hk
    q = torch.randn(b, t, hk, kd, dtype=torch.float64)
    k = torch.randn(b, t, hk, kd, dtype=torch.float64)
    if normalize:
        k = F.normalize(k, dim=-1)
    v = torch.randn(b, t, h, vd, dtype=torch.float64)
    g = -F.softplus(torch.randn(b, t, h, dtype=torch.float64)) * 0.5
    beta = torch.rand(b, t, h, dtype=torch.float64)
    s0 = torch.randn(n or b, h, kd, vd, dtype=torch.float64) if init else None
    return [x.to(dtype) for x in (q, k, v, g, beta)], s0


def naive(q, k, v, g, beta, scale=None, s0=None, l2=False):
    """The gated delta rule step by step in float64: S = S exp(g); u = beta (v - S^T k); S += k u^T; o = S^T q."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    b, t, hk, kd = q.shape
    h, vd = v.shape[2:]
    if l2:
        q, k = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt(), k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    q, k = q.repeat_interleave(h // hk, 2), k.repeat_interleave(h // hk, 2)
    q = q * (kd ** -0.5 if scale is None else scale)
    state = torch.zeros(b, h, kd, vd, dtype=torch.float64) if s0 is None else s0.double().clone()
    o = torch.zeros(b, t, h, vd, dtype=torch.float64)
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        u = beta[:, i, :, None] * (v[:, i] - torch.einsum("bhkv,bhk->bhv", state, k[:, i]))
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, i], u)
        o[:, i] = torch.einsum("bhkv,bhk->bhv", state, q[:, i])
    return o, state


def close(got, want, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("init,l2,grouped", [(True, False, False), (False, True, False), (True, True, True)])
def test_matches_per_step_recurrence(mode, dtype, init, l2, grouped):
    (q, k, v, g, beta), s0 = make(dtype=dtype, h=4 if grouped else None, normalize=not l2, init=init)
    o, s = ops.gated_delta_net(q, k, v, g, beta, initial_state=s0, use_qk_l2norm=l2, mode=mode, chunk_size=4)
    want_o, want_s = naive(q, k, v, g, beta, s0=s0, l2=l2)
    assert o.dtype == dtype and s.dtype == dtype
    close(o, want_o, dtype)
    close(s, want_s, dtype)


@pytest.mark.parametrize("mode", MODES)
def test_matches_transformers_qwen3_next_reference(mode):
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    (q, k, v, g, beta), s0 = make(b=1, t=21, hk=2, h=4, normalize=False)
    want_o, want_s = qwen3_next.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, initial_state=s0.float(),
                                                             output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = ops.gated_delta_net(q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True, mode=mode, chunk_size=16)
    close(o, want_o, torch.float32)
    close(s, want_s, torch.float32)


@pytest.mark.parametrize("t", [1, 7, 16, 33, 70])
@pytest.mark.parametrize("init,l2", [(False, False), (True, True)])
def test_chunked_matches_recurrent(t, init, l2):
    (q, k, v, g, beta), s0 = make(b=1, t=t, normalize=not l2, init=init)
    chunk = 64 if t == 70 else 16
    o_r, s_r = ops.gated_delta_net(q, k, v, g, beta, initial_state=s0, use_qk_l2norm=l2, mode="recurrent")
    o_c, s_c = ops.gated_delta_net(q, k, v, g, beta, initial_state=s0, use_qk_l2norm=l2, chunk_size=chunk)
    close(o_c, o_r, torch.float32)
    close(s_c, s_r, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
def test_low_precision_accumulates_in_float32(dtype, mode):
    (q, k, v, g, beta), s0 = make(b=1, t=20, dtype=dtype)
    o, s = ops.gated_delta_net(q, k, v, g, beta, initial_state=s0, scale=0.5, mode=mode, chunk_size=8)
    want_o, want_s = naive(q, k, v, g, beta, scale=0.5, s0=s0)   # the same rounded inputs, in float64
    assert o.dtype == dtype and s.dtype == torch.float32
    close(o, want_o, dtype)
    close(s, want_s, torch.float32 if dtype == torch.float16 else dtype)


@pytest.mark.parametrize("mode", MODES)
def test_varlen_matches_per_segment_runs(mode):
    cu = [0, 5, 5, 17, 30]                                      # includes an empty segment
    (q, k, v, g, beta), s0 = make(b=1, t=cu[-1], n=len(cu) - 1)
    o, s = ops.gated_delta_net(q, k, v, g, beta, initial_state=s0, mode=mode, chunk_size=8,
                               cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    for n, (a, e) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        seg = [x[:, a:e] for x in (q, k, v, g, beta)]
        want_o, want_s = naive(*seg, s0=s0[n:n + 1])
        close(o[:, a:e], want_o, torch.float32)
        close(s[n:n + 1], want_s, torch.float32)


def test_varlen_without_initial_state_or_final_state():
    (q, k, v, g, beta), _ = make(b=1, t=12, init=False)
    cu = torch.tensor([0, 4, 12], dtype=torch.int64)
    o, s = ops.gated_delta_net(q, k, v, g, beta, cu_seqlens=cu, output_final_state=False)
    assert s is None
    torch.testing.assert_close(o[:, 4:], ops.gated_delta_net(*(x[:, 4:] for x in (q, k, v, g, beta)))[0])


@pytest.mark.parametrize("mode", MODES)
def test_decode_steps_update_state_in_place(mode):
    (q, k, v, g, beta), s0 = make(b=2, t=6)
    want_o, want_s = ops.gated_delta_net(q, k, v, g, beta, initial_state=s0.float(), mode="recurrent")
    state = s0.float().clone()
    out = torch.empty(2, 1, 2, 6)
    for i in range(6):
        step = [x[:, i:i + 1] for x in (q, k, v, g, beta)]
        ops.gated_delta_net_out(*step, initial_state=state, mode=mode, out=out, final_state_out=state)
        close(out, want_o[:, i:i + 1], torch.float32)
    close(state, want_s, torch.float32)


def test_prepared_operator_matches_functional_and_names_its_provider():
    (q, k, v, g, beta), s0 = make(normalize=False)
    for mode, provider in (("chunked", "chunked"), ("recurrent", "reference")):
        op = GatedDeltaNet(use_qk_l2norm=True, mode=mode, chunk_size=8).prepare(OperatorInitContext("cpu"))
        assert op.provider == provider
        o, s = op.forward(q, k, v, g, beta, s0)
        want_o, want_s = ops.gated_delta_net(q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True, mode=mode,
                                             chunk_size=8)
        torch.testing.assert_close(o, want_o)
        torch.testing.assert_close(s, want_s)
        out = torch.empty_like(o)
        assert op.forward_out(q, k, v, g, beta, s0, out=out)[1] is None
        torch.testing.assert_close(out, want_o)
    no_state = GatedDeltaNet(output_final_state=False).prepare(OperatorInitContext("cpu"))
    assert no_state.forward(q, k, v, g, beta)[1] is None
    with pytest.raises(dtorch.DTypeError, match="prepared for float32"):
        no_state.forward(q.double(), k.double(), v.double(), g, beta)


def test_providers_disabled_and_verified():
    (q, k, v, g, beta), s0 = make()
    key = KernelKey("llm.gated_delta_net", "cpu", torch.float32)
    assert "chunked" in {c.provider for c in dispatcher.candidates(key)}
    want = ops.gated_delta_net(q, k, v, g, beta, initial_state=s0, mode="recurrent")[0]
    with dispatcher.disabled("chunked"):
        torch.testing.assert_close(ops.gated_delta_net(q, k, v, g, beta, initial_state=s0)[0], want)
    with dtorch.verify():                                       # chunked checked against the recurrence
        ops.gated_delta_net(q, k, v, g, beta, initial_state=s0, chunk_size=4)


def test_meta_tensors_infer_shapes():
    (q, k, v, g, beta), _ = make(b=1, t=9, hk=1, h=2, dtype=torch.bfloat16, init=False)
    meta = [x.to("meta") for x in (q, k, v, g, beta)]
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device="meta")
    o, s = ops.gated_delta_net(*meta, cu_seqlens=cu)
    assert o.device.type == "meta" and o.shape == (1, 9, 2, 6) and o.dtype == torch.bfloat16
    assert s.shape == (2, 2, 8, 6) and s.dtype == torch.float32


def _bad(**change):
    (q, k, v, g, beta), s0 = make(b=1, t=8)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0) | change
    return ops.gated_delta_net(**args)


@pytest.mark.parametrize("change,error,words", [
    (dict(k=torch.randn(1, 8, 2, 7)), dtorch.ShapeError, "'k'"),
    (dict(v=torch.randn(1, 8, 3, 6)), dtorch.ShapeError, "multiple"),
    (dict(g=torch.randn(1, 8)), dtorch.ShapeError, "'g'"),
    (dict(beta=torch.randn(1, 7, 2)), dtorch.ShapeError, "'beta'"),
    (dict(initial_state=torch.randn(1, 2, 8, 5)), dtorch.ShapeError, "'initial_state'"),
    (dict(q=torch.randn(1, 8, 2, 8, dtype=torch.float64)), dtorch.DTypeError, "disagree"),
    (dict(q=torch.randn(8, 2, 8)), dtorch.ShapeError, "rank 4"),
    (dict(cu_seqlens=torch.tensor([0, 3, 8])), dtorch.ShapeError, "'initial_state'"),
    (dict(cu_seqlens=torch.tensor([1, 8], dtype=torch.int32)), dtorch.ArgumentError, "start at 0"),
    (dict(cu_seqlens=torch.tensor([0, 5, 3, 8], dtype=torch.int32)), dtorch.ArgumentError, "never decrease"),
    (dict(cu_seqlens=torch.tensor([0, 7], dtype=torch.int32)), dtorch.ArgumentError, "end at T=8"),
    (dict(cu_seqlens=torch.tensor([0.0, 8.0])), dtorch.DTypeError, "int32 or int64"),
    (dict(cu_seqlens=torch.tensor([[0, 8]])), dtorch.ShapeError, "rank 1"),
    (dict(mode="fast"), dtorch.ArgumentError, "'mode'"),
    (dict(chunk_size=0), dtorch.ArgumentError, "'chunk_size'"),
    (dict(scale=float("nan")), dtorch.ArgumentError, "'scale'"),
    (dict(use_qk_l2norm=1), dtorch.ArgumentError, "'use_qk_l2norm'"),
    (dict(q="q"), dtorch.DTypeError, "torch.Tensor"),
])
def test_bad_inputs_raise_clear_errors(change, error, words):
    with pytest.raises(error, match=words) as info:
        _bad(**change)
    assert "llm.gated_delta_net" in str(info.value)


def test_varlen_needs_batch_one_and_out_state_dtype():
    (q, k, v, g, beta), _ = make(b=2, t=8, init=False)
    with pytest.raises(dtorch.ShapeError, match="B must be 1"):
        ops.gated_delta_net(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(dtorch.DTypeError, match="float32"):
        ops.gated_delta_net_out(q, k, v, g, beta, out=torch.empty_like(v),
                                final_state_out=torch.empty(2, 2, 8, 6, dtype=torch.bfloat16))


@pytest.mark.parametrize("mode", MODES)
def test_empty_sequence_and_segments_keep_their_state(mode):
    (q, k, v, g, beta), s0 = make(b=1, t=0)
    o, s = ops.gated_delta_net(q, k, v, g, beta, initial_state=s0, mode=mode)
    assert o.shape == (1, 0, 2, 6)
    torch.testing.assert_close(s, s0.float())
    o, s = ops.gated_delta_net(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 0], dtype=torch.int32), mode=mode)
    assert s.shape == (1, 2, 8, 6) and not s.any()
