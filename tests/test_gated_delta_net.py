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


# -- state pools (state_indices) ----------------------------------------------------------------------

def _pool(s=6, h=2, kd=8, vd=6, dtype=torch.float32):
    return torch.randn(s, h, kd, vd, dtype=dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_varlen_pool_rows_in_shuffled_order_equal_runs_alone(mode, index_dtype):
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    cu = [0, 5, 5, 6, 17, 30]                                   # an empty and a one-token segment
    (q, k, v, g, beta), _ = make(b=1, t=cu[-1], hk=2, h=4, normalize=False, init=False)
    pool = _pool(7, h=4)
    idx = torch.tensor([5, 0, 3, 6, 1], dtype=index_dtype)
    o, new = ops.gated_delta_net(q, k, v, g, beta, initial_state=pool, use_qk_l2norm=True, mode=mode, chunk_size=4,
                                 cu_seqlens=torch.tensor(cu, dtype=torch.int32), state_indices=idx)
    assert new.shape == pool.shape
    for n, (a, e) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        row = int(idx[n])
        seg = [x[:, a:e] for x in (q, k, v, g, beta)]
        want_o, want_s = qwen3_next.torch_recurrent_gated_delta_rule(
            *seg, initial_state=pool[row:row + 1], output_final_state=True, use_qk_l2norm_in_kernel=True)
        close(o[:, a:e], want_o, torch.float32)
        close(new[row], want_s[0], torch.float32)
    for row in (2, 4):                                          # not named: bit-identical
        assert torch.equal(new[row], pool[row])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_pool_in_place_equals_single_token_calls(mode, dtype):
    (q, k, v, g, beta), _ = make(b=4, t=1, hk=2, h=4, dtype=dtype, normalize=False, init=False)
    g = g.float()                                               # as gdn_gates gives it
    pool = _pool(6, h=4)
    before = pool.clone()
    idx = torch.tensor([3, 0, 5, 1])
    out = torch.empty_like(v)
    o, s = ops.gated_delta_net_out(q, k, v, g, beta, initial_state=pool, use_qk_l2norm=True, state_indices=idx,
                                   mode=mode, out=out, final_state_out=pool)
    assert o is out and s is pool
    for b in range(4):
        row = int(idx[b])
        one = [x[b:b + 1] for x in (q, k, v, g, beta)]
        want_o, want_s = ops.gated_delta_net(*one, initial_state=before[row:row + 1], use_qk_l2norm=True,
                                             mode="recurrent", chunk_size=8)
        want_n, _ = naive(*one, s0=before[row:row + 1], l2=True)
        close(out[b:b + 1], want_n, dtype)
        torch.testing.assert_close(out[b:b + 1], want_o)
        torch.testing.assert_close(pool[row], want_s[0])
    assert torch.equal(pool[[2, 4]], before[[2, 4]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alias", [True, False])
def test_one_sequence_pool_decode_equals_the_plain_state_step(dtype, alias):
    # one sequence decoding from its pool row (final pool aliased or not): the same step on the row alone as a plain
    # state and the naive recurrence agree with it, and the other rows stay bit-identical
    (q, k, v, g, beta), _ = make(b=1, t=1, hk=2, h=4, dtype=dtype, normalize=False, init=False)
    g = g.float()
    pool, idx = _pool(5, h=4), torch.tensor([3], dtype=torch.int32)
    before = pool.clone()
    final = pool if alias else torch.empty_like(pool)
    o, s = ops.gated_delta_net_out(q, k, v, g, beta, initial_state=pool, use_qk_l2norm=True, state_indices=idx,
                                   out=torch.empty_like(v), final_state_out=final)
    assert s is final
    want_o, want_s = ops.gated_delta_net(q, k, v, g, beta, initial_state=before[3:4], use_qk_l2norm=True)
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(s[3], want_s[0])
    want_n, want_ns = naive(q, k, v, g, beta, s0=before[3:4], l2=True)
    close(o, want_n, dtype)
    close(s[3], want_ns[0], torch.float32)
    assert torch.equal(s[[0, 1, 2, 4]], before[[0, 1, 2, 4]])
    if not alias:
        assert torch.equal(pool, before)


def test_decode_duplicate_scratch_rows_leave_the_others_alone():
    (q, k, v, g, beta), _ = make(b=4, t=1, init=False)
    pool = _pool(5)
    before = pool.clone()
    idx = torch.tensor([1, 0, 0, 3])                            # two padding sequences share scratch row 0
    ops.gated_delta_net_out(q, k, v, g, beta, initial_state=pool, state_indices=idx, out=torch.empty_like(v),
                            final_state_out=pool)
    for b, row in ((0, 1), (3, 3)):
        want = ops.gated_delta_net(*(x[b:b + 1] for x in (q, k, v, g, beta)), initial_state=before[row:row + 1])[1]
        torch.testing.assert_close(pool[row], want[0])
    assert torch.equal(pool[[2, 4]], before[[2, 4]])
    assert torch.isfinite(pool[0]).all()


def test_decode_reads_no_device_value_on_the_host(monkeypatch):
    (q, k, v, g, beta), _ = make(b=3, t=1, init=False)
    pool, idx = _pool(4), torch.tensor([2, 0, 1])
    want = ops.gated_delta_net(q, k, v, g, beta, initial_state=pool, state_indices=idx)
    metas = [x.to("meta") for x in (q, k, v, g, beta, pool, idx)]
    for name in ("tolist", "item", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, name=name: pytest.fail(f"host read: Tensor.{name}"))
    ops.gated_delta_net(*metas[:5], initial_state=metas[5], state_indices=metas[6])    # wrapper: meta passes
    from dtorch.kernels.torch.gated_delta_net import _step
    o, s = torch.empty_like(v), pool.clone()
    _step({"use_qk_l2norm": False}, (q, k, v, g, beta, s, None, idx), idx, (o, s))     # the kernel's decode form
    monkeypatch.undo()
    torch.testing.assert_close(o, want[0])
    torch.testing.assert_close(s, want[1])


def test_strided_column_views_as_q_k_v():
    t, hk, h, kd = 9, 2, 4, 8
    mixed = torch.randn(t, 2 * hk * kd + h * kd)                # [T, C] = [q | k | v], as after the conv
    q, k, v = (x.view(1, t, -1, kd) for x in mixed.split([hk * kd, hk * kd, h * kd], dim=1))
    g, beta = -torch.rand(1, t, h), torch.rand(1, t, h)
    pool, idx, cu = _pool(3, h=h, vd=kd), torch.tensor([2, 0]), torch.tensor([0, 4, 9])
    o, s = ops.gated_delta_net(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu, state_indices=idx,
                               use_qk_l2norm=True)
    dense = ops.gated_delta_net(*(x.contiguous() for x in (q, k, v)), g, beta, initial_state=pool, cu_seqlens=cu,
                                state_indices=idx, use_qk_l2norm=True)
    torch.testing.assert_close(o, dense[0])
    torch.testing.assert_close(s, dense[1])
    step = [x[:, :1].transpose(0, 1) for x in (q, k, v, g, beta)]    # decode: B = 1 token each, strided
    o1, s1 = ops.gated_delta_net(*step, initial_state=pool, state_indices=idx[:1], use_qk_l2norm=True)
    torch.testing.assert_close(o1[0, 0], o[0, 0])


def test_pool_meta_and_prepared():
    (q, k, v, g, beta), _ = make(b=2, t=1, init=False)
    pool, idx = _pool(5), torch.tensor([4, 1])
    o, s = ops.gated_delta_net(*(x.to("meta") for x in (q, k, v, g, beta)), initial_state=pool.to("meta"),
                               state_indices=idx.to("meta"))
    assert o.shape == (2, 1, 2, 6) and s.shape == pool.shape
    op = GatedDeltaNet().prepare(OperatorInitContext("cpu"))
    want = ops.gated_delta_net(q, k, v, g, beta, initial_state=pool, state_indices=idx)
    got = op.forward(q, k, v, g, beta, pool, None, idx)
    torch.testing.assert_close(got[1], want[1])
    op.forward_out(q, k, v, g, beta, pool, None, idx, out=torch.empty_like(v), final_state_out=pool)
    torch.testing.assert_close(pool, want[1])


@pytest.mark.parametrize("change,error,words", [
    (dict(initial_state=None), dtorch.ArgumentError, "needs 'initial_state'"),
    (dict(initial_state=torch.randn(4, 2, 8, 5)), dtorch.ShapeError, "'initial_state' must be a pool"),
    (dict(initial_state=torch.randn(0, 2, 8, 6)), dtorch.ShapeError, "S >= 1"),
    (dict(initial_state=torch.randn(4, 2, 8, 6, dtype=torch.float64)), dtorch.DTypeError, "state dtype"),
    (dict(state_indices=torch.tensor([0.0, 1.0])), dtorch.DTypeError, "'state_indices'"),
    (dict(state_indices=torch.tensor([[0, 1]])), dtorch.ShapeError, "'state_indices'"),
    (dict(state_indices=torch.tensor([0, 1, 2])), dtorch.ShapeError, "'state_indices'"),
    (dict(state_indices=torch.tensor([0, 4])), dtorch.ArgumentError, r"'state_indices' must lie in \[0, S=4\)"),
    (dict(state_indices=torch.tensor([-1, 0])), dtorch.ArgumentError, "'state_indices'"),
])
def test_bad_pools_and_indices_name_the_argument(change, error, words):
    (q, k, v, g, beta), _ = make(b=2, t=1, init=False)
    args = dict(initial_state=_pool(4), state_indices=torch.tensor([0, 3])) | change
    with pytest.raises(error, match=words) as info:
        ops.gated_delta_net(q, k, v, g, beta, **args)
    assert "llm.gated_delta_net" in str(info.value)


# -- the linear-attention block's ops in a graph: conv (varlen, pooled) -> split -> gated delta rule (pooled) ----

def _block_graph(n: int, feeds: dict, conv_pool: torch.Tensor, pool: torch.Tensor, w: torch.Tensor,
                 hk: int, h: int, kd: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """On a mesh of n: heads split when n > 1 (conv channels in blocks [q | k | v] of whole heads, pools on heads)."""
    from dtorch.graph import DeviceMesh, LogicalGraph, Replicate, Shard
    from dtorch.runtime import DistTensor, Runner

    t = feeds["x"].shape[0]
    blocks = (hk * kd, hk * kd, h * kd)
    split = n > 1
    chan = Shard(1, blocks, kd) if split else Replicate()
    g = LogicalGraph(DeviceMesh.cpu(n))
    x = g.input("x", feeds["x"].shape, placement=chan)
    gate = {k: g.input(k, feeds[k].shape, placement=Shard(2) if split else Replicate()) for k in ("g", "beta")}
    cu, idx = (g.input(k, feeds[k].shape, feeds[k].dtype) for k in ("cu", "idx"))
    weight = g.param("w", w, Shard(0, blocks, kd) if split else Replicate())

    def state(name, value, placement):
        if not split:
            return g.state(name, DistTensor.from_local([value.clone()], g.mesh, Replicate()))
        return g.state(name, DistTensor.from_full(value.clone(), g.mesh, placement))

    cpool, spool = state("conv", conv_pool, chan), state("ssm", pool, Shard(1))
    mixed, _ = g.call("llm.causal_conv1d_varlen", x, weight, cpool, cu, idx, activation="silu")
    q, k, v = (g.view(p, (1, t, -1, kd)) for p in g.split(mixed, blocks, dim=1))
    o, new = g.call("llm.gated_delta_net", q, k, v, gate["g"], gate["beta"], initial_state=spool, cu_seqlens=cu,
                    state_indices=idx, use_qk_l2norm=True, final_state_out=spool)
    assert o.placement == (Shard(2) if split else Replicate())
    g.output("o", o)
    with Runner(g) as r:
        got = r.run(feeds)
    return got, g.states["conv"][1].full(), g.states["ssm"][1].full()


def test_graph_conv_varlen_split_gated_delta_net_on_two_devices_equals_one():
    hk, h, kd, width = 2, 4, 8, 4
    lengths = [3, 0, 1, 6]
    t, c = sum(lengths), 2 * hk * kd + h * kd
    feeds = {"x": torch.randn(t, c), "g": -torch.rand(1, t, h), "beta": torch.rand(1, t, h),
             "cu": torch.tensor([0, 3, 3, 4, 10], dtype=torch.int32), "idx": torch.tensor([4, 0, 2, 1])}
    conv_pool, pool, w = torch.randn(5, c, width - 1), torch.randn(5, h, kd, kd), torch.randn(c, width)
    # the same with plain op calls
    cp, sp = conv_pool.clone(), pool.clone()
    mixed = ops.causal_conv1d_varlen(feeds["x"], w, cp, feeds["cu"], feeds["idx"], activation="silu")
    q, k, v = (p.view(1, t, -1, kd) for p in mixed.split([hk * kd, hk * kd, h * kd], dim=1))
    o_want, _ = ops.gated_delta_net_out(q, k, v, feeds["g"], feeds["beta"], initial_state=sp, cu_seqlens=feeds["cu"],
                                        state_indices=feeds["idx"], use_qk_l2norm=True, out=torch.empty_like(v),
                                        final_state_out=sp)
    for n in (1, 2):
        got, conv_after, pool_after = _block_graph(n, feeds, conv_pool, pool, w, hk, h, kd)
        torch.testing.assert_close(got["o"], o_want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(conv_after, cp, rtol=0, atol=0)
        torch.testing.assert_close(pool_after, sp, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool_after[3], pool[3])                    # not named
