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
