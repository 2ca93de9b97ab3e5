"""llm.causal_conv1d and llm.causal_conv1d_update against torch.nn.functional.conv1d (depthwise, groups=D, left
padding W-1), both providers, the update form step by step against the full form, prepared, meta, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import ops
from dtorch.dispatch import dispatcher
from dtorch.ops import CausalConv1d, OperatorInitContext

TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2),
       torch.float16: (2e-3, 2e-3)}
PROVIDERS = ("torch", "reference")


def conv_ref(x, weight, bias=None, initial_states=None, activation=None):
    """torch's depthwise conv1d in float64 over (initial_states or W-1 zeros) ++ x; returns (out, last W-1 inputs)."""
    x, weight = x.double(), weight.double()
    width = weight.shape[1]
    head = torch.zeros(*x.shape[:2], width - 1, dtype=torch.float64) if initial_states is None \
        else initial_states.double()
    xp = torch.cat([head, x], -1)
    out = F.conv1d(xp, weight.unsqueeze(1), None if bias is None else bias.double(), groups=x.shape[1])
    return (F.silu(out) if activation else out), xp[..., xp.shape[-1] - (width - 1):]


def close(got, want, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol)


def only(provider):
    """Run with ``provider`` active (the torch provider is disabled to reach the reference)."""
    return dispatcher.disabled("torch") if provider == "reference" else dispatcher.disabled()


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias,init,activation", [(False, False, None), (True, True, "silu"), (True, False, "swish")])
def test_matches_torch_conv1d(provider, dtype, bias, init, activation):
    b, d, length, width = 2, 5, 9, 4
    x = torch.randn(b, d, length).to(dtype)
    w = torch.randn(d, width).to(dtype)
    bb = torch.randn(d).to(dtype) if bias else None
    s0 = torch.randn(b, d, width - 1).to(dtype) if init else None
    with only(provider):
        out, final = ops.causal_conv1d(x, w, bb, s0, return_final_states=True, activation=activation)
    want, want_final = conv_ref(x, w, bb, s0, activation)
    assert out.dtype == dtype and final.shape == (b, d, width - 1)
    close(out, want, dtype)
    close(final, want_final, dtype)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("length,width", [(2, 4), (1, 1), (6, 2)])
def test_short_sequences_and_widths(provider, length, width):
    x, w, s0 = torch.randn(1, 3, length), torch.randn(3, width), torch.randn(1, 3, width - 1)
    with only(provider):
        out, final = ops.causal_conv1d(x, w, initial_states=s0, return_final_states=True)
        assert ops.causal_conv1d(x, w)[1] is None
    want, want_final = conv_ref(x, w, initial_states=s0)
    close(out, want, torch.float32)
    close(final, want_final, torch.float32)   # for L < W-1 it still holds part of the initial states


@pytest.mark.parametrize("state_width", [3, 4, 6])             # W-1, W (Qwen3-Next) and wider
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_step_by_step_matches_full_form(state_width, dtype):
    b, d, length, width = 2, 4, 7, 4
    x, w, bb = torch.randn(b, d, length).to(dtype), torch.randn(d, width).to(dtype), torch.randn(d).to(dtype)
    want, _ = ops.causal_conv1d(x, w, bb, activation="silu")
    state = torch.zeros(b, d, state_width, dtype=dtype)
    for t in range(length):
        out = ops.causal_conv1d_update(x[:, :, t], state, w, bb, activation="silu")
        assert out.shape == (b, d)
        close(out, want[:, :, t], dtype)
        close(state[..., -1], x[:, :, t], dtype)             # the state now ends with the newest input


def test_update_with_several_tokens_continues_a_prefix():
    d, width = 3, 4
    x, w = torch.randn(1, d, 10), torch.randn(d, width)
    _, final = ops.causal_conv1d(x[..., :6], w, return_final_states=True)
    want, _ = conv_ref(x, w)
    state = final.clone()
    out = torch.empty(1, d, 4)
    ops.causal_conv1d_update_out(x[..., 6:], state, w, out=out)
    close(out, want[..., 6:], torch.float32)
    torch.testing.assert_close(state, x[..., -(width - 1):])


def test_out_forms_and_prepared_operator_match_functional():
    x, w, bb, s0 = torch.randn(2, 3, 8), torch.randn(3, 4), torch.randn(3), torch.randn(2, 3, 3)
    want, want_final = ops.causal_conv1d(x, w, bb, s0, return_final_states=True, activation="silu")
    out, final = torch.empty_like(x), torch.empty(2, 3, 3)
    ops.causal_conv1d_out(x, w, bb, s0, "silu", out=out, final_states_out=final)
    torch.testing.assert_close((out, final), (want, want_final))
    op = CausalConv1d(activation="silu").prepare(OperatorInitContext("cpu", torch.float32))
    assert op.provider == "torch"
    torch.testing.assert_close(op.forward(x, w, bb, s0, return_final_states=True), (want, want_final))
    assert op.forward(x, w, bb, s0)[1] is None
    out2 = torch.empty_like(x)
    op.forward_out(x, w, bb, s0, out=out2)
    torch.testing.assert_close(out2, want)
    s1 = torch.randn(2, 3, 4)
    s2 = s1.clone()
    want_step = ops.causal_conv1d_update(x[..., 0], s1, w, bb, activation="silu")
    torch.testing.assert_close(op.update(x[..., 0], s2, w, bb), want_step)
    torch.testing.assert_close(s2, s1)
    with pytest.raises(dtorch.DTypeError, match="prepared for float32"):
        op.update(x[..., 0].double(), s2.double(), w.double())


def test_verify_and_meta():
    x, w = torch.randn(1, 2, 5), torch.randn(2, 3)
    with dtorch.verify():
        ops.causal_conv1d(x, w, activation="silu", return_final_states=True)
    out, final = ops.causal_conv1d(x.to("meta"), w.to("meta"), return_final_states=True)
    assert out.device.type == "meta" and out.shape == (1, 2, 5) and final.shape == (1, 2, 2)
    state = torch.empty(1, 2, 3, device="meta")
    assert ops.causal_conv1d_update(x[..., 0].to("meta"), state, w.to("meta")).shape == (1, 2)


@pytest.mark.parametrize("call,error,words", [
    (lambda x, w: ops.causal_conv1d(x, w, activation="relu"), dtorch.ArgumentError, "'activation'"),
    (lambda x, w: ops.causal_conv1d(x, torch.randn(5, 4)), dtorch.ShapeError, "weight.shape\\[0\\]"),
    (lambda x, w: ops.causal_conv1d(x, torch.randn(3, 4, 1)), dtorch.ShapeError, "rank 2"),
    (lambda x, w: ops.causal_conv1d(x[0], w), dtorch.ShapeError, "rank 3"),
    (lambda x, w: ops.causal_conv1d(x, w, torch.randn(4)), dtorch.ShapeError, "bias"),
    (lambda x, w: ops.causal_conv1d(x, w.double()), dtorch.DTypeError, "disagree"),
    (lambda x, w: ops.causal_conv1d(x, w, initial_states=torch.randn(2, 3, 4)), dtorch.ShapeError, "W-1"),
    (lambda x, w: ops.causal_conv1d(x.int(), w.int()), dtorch.DTypeError, "float"),
    (lambda x, w: ops.causal_conv1d_out(x, w, out=torch.empty(2, 3, 7)), dtorch.ShapeError, "'out'"),
    (lambda x, w: ops.causal_conv1d_update(x[..., 0], torch.zeros(2, 3, 2), w), dtorch.ShapeError, "S >= W - 1"),
    (lambda x, w: ops.causal_conv1d_update(x[..., 0], torch.zeros(2, 3), w), dtorch.ShapeError, "rank 3"),
    (lambda x, w: ops.causal_conv1d_update(x[..., 0], torch.zeros(2, 3, 4), w, activation="gelu"),
     dtorch.ArgumentError, "'activation'"),
    (lambda x, w: ops.causal_conv1d_update(x[..., 0], torch.zeros(2, 3, 4).double(), w), dtorch.DTypeError,
     "disagree"),
])
def test_bad_inputs_raise_clear_errors(call, error, words):
    x, w = torch.randn(2, 3, 8), torch.randn(3, 4)
    with pytest.raises(error, match=words) as info:
        call(x, w)
    assert "llm.causal_conv1d" in str(info.value)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_empty_sequence_passes_the_state_through(provider):
    x, w, s0 = torch.randn(2, 3, 0), torch.randn(3, 4), torch.randn(2, 3, 3)
    with only(provider):
        out, final = ops.causal_conv1d(x, w, initial_states=s0, return_final_states=True)
    assert out.shape == (2, 3, 0)
    torch.testing.assert_close(final, s0)


# -- state pools: causal_conv1d_update with state_indices, causal_conv1d_varlen ----------------------------

def _varlen_case(lengths=(0, 1, 2, 5, 17), d=6, width=4, keep=3, rows=8, dtype=torch.float32, columns=None):
    """x [T, D] (a column view of a wider [T, C] when ``columns``), weight, bias, a pool, cu_seqlens, shuffled
    indices."""
    t = sum(lengths)
    wide = torch.randn(t, columns or d, dtype=dtype)
    x = wide[:, 1:1 + d] if columns else wide
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    idx = torch.randperm(rows)[:len(lengths)]
    return x, torch.randn(d, width, dtype=dtype), torch.randn(d, dtype=dtype), \
        torch.randn(rows, d, keep, dtype=dtype), cu, idx


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keep,columns", [(3, None), (4, 11)])  # S = W - 1; S = W (Qwen3-Next) on a column view
def test_varlen_matches_transformers_per_sequence(provider, dtype, keep, columns):
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    lengths = (0, 1, 2, 5, 17)
    x, w, bb, pool, cu, idx = _varlen_case(lengths, dtype=dtype, keep=keep, columns=columns)
    before = pool.clone()
    with only(provider):
        out = ops.causal_conv1d_varlen(x, w, pool, cu, idx, bb, activation="silu")
    assert out.shape == x.shape and out.dtype == dtype
    # every sequence behind its state's last W-1 inputs, right-padded to one batch (a causal conv ignores the pad)
    spans = list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
    seqs = torch.zeros(len(spans), 6, 3 + max(lengths), dtype=torch.float64)
    for n, (a, e) in enumerate(spans):
        seqs[n, :, :3 + e - a] = torch.cat([before[int(idx[n]), :, keep - 3:], x[a:e].t()], -1)
    want = qwen3_next.causal_conv1d_fn(seqs, w.double(), bb.double(), activation="silu")[..., 3:]
    for n, (a, e) in enumerate(spans):
        row = int(idx[n])
        close(out[a:e].t(), want[n, :, :e - a], dtype)
        last = torch.cat([before[row], x[a:e].t()], -1)[:, -keep:]      # older state entries when L < S
        assert torch.equal(pool[row], last if e > a else before[row])
    untouched = sorted(set(range(8)) - set(idx.tolist()))
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("provider", PROVIDERS)
def test_varlen_one_token_and_pooled_decode_agree(provider):
    x, w, bb, pool, cu, idx = _varlen_case((1, 1, 1), rows=5)           # T = 3 one-token segments
    pool_update = pool.clone()
    with only(provider):
        out = ops.causal_conv1d_varlen(x, w, pool, cu, idx, bb, "silu")
        step = ops.causal_conv1d_update(x, pool_update, w, bb, "silu", state_indices=idx)   # x [B, D]
    torch.testing.assert_close(step, out)
    torch.testing.assert_close(pool_update, pool)
    one = ops.causal_conv1d_varlen(x[:1], w, pool.clone(), torch.tensor([0, 1]), idx[:1], bb)
    assert one.shape == (1, 6)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_update_with_indices_equals_per_row_updates(provider):
    x, w, bb = torch.randn(3, 6, 2), torch.randn(6, 4), torch.randn(6)
    pool = torch.randn(5, 6, 4)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    want_pool = pool.clone()
    want = torch.stack([ops.causal_conv1d_update(x[b:b + 1], want_pool[r:r + 1], w, bb, "silu")[0]
                        for b, r in enumerate(idx.tolist())])
    with only(provider):
        got = ops.causal_conv1d_update(x, pool, w, bb, "silu", state_indices=idx)
    torch.testing.assert_close(got, want)
    assert torch.equal(pool, want_pool)
    prepared = CausalConv1d(activation="silu").prepare(OperatorInitContext("cpu"))
    torch.testing.assert_close(prepared.update(x, pool, w, bb, idx), ops.causal_conv1d_update(
        x, want_pool, w, bb, "silu", state_indices=idx))
    assert torch.equal(pool, want_pool)


def test_update_with_duplicate_scratch_rows():
    x, w = torch.randn(3, 6), torch.randn(6, 4)
    pool = torch.randn(4, 6, 3)
    before = pool.clone()
    ops.causal_conv1d_update(x, pool, w, state_indices=torch.tensor([2, 0, 0]))
    assert torch.equal(pool[[1, 3]], before[[1, 3]])
    assert torch.equal(pool[2], torch.cat([before[2], x[0, :, None]], -1)[:, 1:])


@pytest.mark.parametrize("call,error,words", [
    (lambda x, w, p, cu, i: ops.causal_conv1d_varlen(x, w, p[:, :, :2], cu, i), dtorch.ShapeError, "'conv_states'"),
    (lambda x, w, p, cu, i: ops.causal_conv1d_varlen(x, w, p[:, :5], cu, i), dtorch.ShapeError, "'conv_states'"),
    (lambda x, w, p, cu, i: ops.causal_conv1d_varlen(x, w, p, cu, i.float()), dtorch.DTypeError, "'state_indices'"),
    (lambda x, w, p, cu, i: ops.causal_conv1d_varlen(x, w, p, cu, i[None]), dtorch.ShapeError, "'state_indices'"),
    (lambda x, w, p, cu, i: ops.causal_conv1d_varlen(x, w, p, cu, i[:2]), dtorch.ShapeError, "'state_indices'"),
    (lambda x, w, p, cu, i: ops.causal_conv1d_varlen(x, w, p, cu, i + 8), dtorch.ArgumentError,
     r"'state_indices' must lie in \[0, 8\)"),
    (lambda x, w, p, cu, i: ops.causal_conv1d_varlen(x, w, p, cu[:-1], i[:-1]), dtorch.ArgumentError, "end at T"),
    (lambda x, w, p, cu, i: ops.causal_conv1d_varlen(x, w, p, cu.float(), i), dtorch.DTypeError, "'cu_seqlens'"),
    (lambda x, w, p, cu, i: ops.causal_conv1d_varlen(x[None], w, p, cu, i), dtorch.ShapeError, "rank 2"),
    (lambda x, w, p, cu, i: ops.causal_conv1d_varlen(x, w, p.double(), cu, i), dtorch.DTypeError, "disagree"),
    (lambda x, w, p, cu, i: ops.causal_conv1d_varlen(x, w, p, cu, i, activation="relu"), dtorch.ArgumentError,
     "'activation'"),
    (lambda x, w, p, cu, i: ops.causal_conv1d_update(x[:3], p, w, state_indices=i[:2]), dtorch.ShapeError,
     r"'state_indices' must have shape \[3\]"),
    (lambda x, w, p, cu, i: ops.causal_conv1d_update(x[:3], p, w, state_indices=i[:3] + 8), dtorch.ArgumentError,
     "'state_indices'"),
    (lambda x, w, p, cu, i: ops.causal_conv1d_update(x[:3], p[:, :, :2], w, state_indices=i[:3]), dtorch.ShapeError,
     "'conv_state'"),
])
def test_bad_pools_name_the_argument(call, error, words):
    x, w, _, pool, cu, idx = _varlen_case((2, 3, 4))
    with pytest.raises(error, match=words) as info:
        call(x, w, pool, cu, idx)
    assert "llm.causal_conv1d" in str(info.value)


def test_varlen_meta_shapes():
    x, w, bb, pool, cu, idx = (t.to("meta") for t in _varlen_case((2, 3)))
    assert ops.causal_conv1d_varlen(x, w, pool, cu, idx, bb).shape == (5, 6)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("keep", [3, 4, 6])                      # S = W - 1, W (Qwen3-Next) and wider
def test_pooled_update_reads_no_device_value_on_the_host(monkeypatch, provider, keep):
    x, w, bb, pool = torch.randn(3, 6), torch.randn(6, 4), torch.randn(6), torch.randn(5, 6, keep)
    idx = torch.tensor([4, 0, 2])
    want_pool = pool.clone()
    want = torch.stack([ops.causal_conv1d_update(x[b:b + 1], want_pool[r:r + 1], w, bb, "silu")[0]
                        for b, r in enumerate(idx.tolist())])   # unpooled, one row at a time
    from dtorch.kernels.torch import causal_conv1d as kernels
    kernel = {"reference": kernels.causal_conv1d_update_reference, "torch": kernels.causal_conv1d_update_torch}[
        provider]

    class Ctx:
        params = {"activation": "silu"}

    out = torch.empty_like(x)
    for name in ("tolist", "item", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, name=name: pytest.fail(f"host read: Tensor.{name}"))
    kernel(Ctx, (x, w, bb, pool, idx), (out, pool))
    monkeypatch.undo()
    torch.testing.assert_close(out, want)
    assert torch.equal(pool, want_pool)
