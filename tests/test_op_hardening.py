"""Issue 14 for ops: aliased outputs refused, huge sizes and bad values named, attention providers agree on NaN
and on the causal T > S convention, and verify() flags a hidden NaN."""

from __future__ import annotations

import contextlib

import pytest
import torch

import dtorch
from dtorch import ops
from dtorch.dispatch import verification


def _both():
    return [contextlib.nullcontext, lambda: dtorch.dispatcher.disabled("sdpa")]


# -- aliased outputs ---------------------------------------------------------------------------------------------

def test_products_refuse_an_out_that_aliases_an_input():
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    for out, name in ((a, "'a'"), (b, "'b'")):
        with pytest.raises(dtorch.ArgumentError, match=f"'out' overlaps {name}"):
            ops.mm_out(a, b, out=out)
    with pytest.raises(dtorch.ArgumentError, match="'out' overlaps 'x'"):
        ops.linear_out(a, b, out=a)
    x = torch.randn(2, 3, 3)
    with pytest.raises(dtorch.ArgumentError, match="'out' overlaps 'b'"):
        ops.bmm_out(torch.randn(2, 3, 3), x, out=x)
    big = torch.randn(6, 3)  # a partial overlap: out is a view of rows 2..5 of a's storage
    with pytest.raises(dtorch.ArgumentError, match="overlaps 'a'"):
        ops.mm_out(big[:3], b, out=big[2:5])
    out = torch.empty(3, 3)
    torch.testing.assert_close(ops.mm_out(a, b, out=out), a @ b)  # separate tensors still work


def test_add_rms_norm_refuses_out_as_residual_out_but_keeps_the_in_place_residual():
    x, res, w = torch.randn(2, 8), torch.randn(2, 8), torch.randn(8)
    with pytest.raises(dtorch.ArgumentError, match="'out' overlaps 'residual_out'"):
        ops.add_rms_norm_out(x, res.clone(), w, out=(r := torch.empty(2, 8)), residual_out=r)
    with pytest.raises(dtorch.ArgumentError, match="'out' overlaps 'residual"):
        ops.add_rms_norm_out(x, res, w, out=res)
    want_out, want_res = ops.add_rms_norm(x, res, w)
    got_out, got_res = ops.add_rms_norm_out(x, res, w, out=torch.empty(2, 8))  # residual_out = residual: allowed
    assert got_res is res
    torch.testing.assert_close(got_out, want_out)
    torch.testing.assert_close(got_res, want_res)
    y = torch.randn(2, 8)
    want = ops.rms_norm(y, w)
    torch.testing.assert_close(ops.rms_norm_out(y, w, out=y), want)  # in place, as its docstring allows


def test_attention_refuses_an_out_that_overlaps_q_k_or_v():
    q = torch.randn(1, 4, 2, 8)
    k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    for out, name in ((q, "'q'"), (v, "'v'")):
        with pytest.raises(dtorch.ArgumentError, match=f"'out' overlaps {name}"):
            ops.flash_attention_out(q, k, v, out=out)


# -- huge sizes and bad values --------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: ops.full((2**30, 2**20), 1.0),
    lambda: ops.arange(2**50),
    lambda: ops.embedding(torch.zeros(1, dtype=torch.int64).expand(2**36), torch.randn(4, 2**10)),
], ids=["full", "arange", "embedding"])
def test_huge_sizes_are_refused_before_allocating_naming_the_size(make):
    with pytest.raises(dtorch.ArgumentError, match=r"of shape \(.*\) would hold \d+ elements"):
        make()


@pytest.mark.parametrize("bad", [{"end": float("nan")}, {"start": float("inf"), "end": 1.0}, {"step": float("nan")}])
def test_arange_with_a_non_finite_bound_names_it(bad):
    kw = {"start": 0.0, "end": 4.0, "step": 1.0} | bad
    name = next(iter(bad))
    with pytest.raises(dtorch.ArgumentError, match=f"'{name}' must be a finite number"):
        ops.arange(**kw)


def test_varlen_max_seqlen_past_memory_names_it():
    q, k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(dtorch.ArgumentError, match="'max_seqlen_k' 1099511627776"):
        ops.flash_attention_varlen(q, k, v, cu, cu, 3, 2**40)


# -- attention: NaN and the causal convention agree across providers -------------------------------------------

CASES = [(3, 3, False), (3, 3, True), (4, 2, True), (1, 3, True), (2, 5, True), (4, 2, False)]


@pytest.mark.parametrize("t,s,causal", CASES)
@pytest.mark.parametrize("where", ["none", "q", "k", "v", "k_inf"])
def test_attention_providers_agree_on_non_finite_input_and_causal_t_gt_s(t, s, causal, where):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, t, 4, 8), torch.randn(1, s, 2, 8), torch.randn(1, s, 2, 8)
    bad = {"q": (q, (0, t - 1, 0, 0)), "k": (k, (0, 0, 0, 3)), "v": (v, (0, s - 1, 1, 3)),
           "k_inf": (k, (0, s - 1, 0, 0))}
    if where in bad:
        x, at = bad[where]
        x[at] = float("inf") if where == "k_inf" else float("nan")
    outs = []
    for make in _both():
        with make():
            outs.append(ops.flash_attention(q, k, v, causal))
    active, reference = outs
    assert torch.equal(active.isnan(), reference.isnan())
    torch.testing.assert_close(active.nan_to_num(), reference.nan_to_num())
    if where == "q":  # the row whose q holds the NaN is NaN (it sees at least one key in every case here)
        assert reference[0, t - 1, 0].isnan().all()
    if causal and t > s:  # flash-attn's convention: a row that sees no key is 0, whatever the input
        assert (reference[:, : t - s] == 0).all()


def test_varlen_providers_agree_on_nan():
    q, k, v = torch.randn(6, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    cu_q, cu_k = torch.tensor([0, 4, 6], dtype=torch.int32), torch.tensor([0, 3, 5], dtype=torch.int32)
    v[2, 1, 3] = float("nan")  # the last key of segment 0: causal rows that do not see it stay finite
    outs = []
    for make in _both():
        with make():
            outs.append(ops.flash_attention_varlen(q, k, v, cu_q, cu_k, 4, 3, True))
    assert torch.equal(outs[0].isnan(), outs[1].isnan())
    assert not outs[0][:2].isnan().any() and outs[0][0].eq(0).all()  # row 0 of 4 queries over 3 keys sees none


def test_verify_flags_a_provider_that_hides_a_nan():
    key = dtorch.KernelKey("llm.flash_attention", "cpu", torch.float32)
    active = dtorch.dispatcher.select(key)
    reference = dtorch.dispatcher.reference(key)

    class Hiding:  # the sdpa provider as it was: NaN rows came back as zeros
        provider, name = "liar", "hides_nan"

        @staticmethod
        def fn(ctx, inputs, outputs):
            active.fn(ctx, inputs, outputs)
            outputs[0].nan_to_num_(0.0)

    q = torch.randn(1, 2, 2, 8)
    q[0, 0, 0, 0] = float("nan")
    ctx = dtorch.dispatch.KernelContext(dtorch.Device("cpu", 0), None, None,
                                        ops.attention.dense_params(8, False))
    with pytest.raises(dtorch.VerifyError, match="NaN"):
        verification.run_verified(key, Hiding, reference, ctx, (q, torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8)),
                                  (torch.empty(1, 2, 2, 8),))
