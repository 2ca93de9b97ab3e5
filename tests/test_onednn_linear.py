"""oneDNN's float32 GEMM (provider "onednn": ``matmul.linear`` and ``matmul.mm`` in ``dtorch.kernels.torch.matmul``)
and the 16-bit weight panels it multiplies: against float64 products, and against torch's (provider "blas") through
the dispatcher, down to a float32 model's logits."""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch.core.device import Device
from dtorch.dispatch.context import KernelContext
from dtorch.dispatch.key import KernelKey
from dtorch.kernels.torch import half as torch_half
from dtorch.kernels.torch.matmul import linear_blas, linear_onednn, mm_blas, mm_onednn, onednn_linear_op

pytestmark = pytest.mark.skipif(onednn_linear_op() is None, reason="torch is built without oneDNN")

KEY = KernelKey("matmul.linear", "cpu", torch.float32, "strided")


def _ctx() -> KernelContext:
    return KernelContext(Device("cpu"))


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_shape", [(64,), (1, 64), (7, 64), (3, 5, 64), (200, 64)])
def test_linear_onednn_matches_float64(x_shape, bias):
    torch.manual_seed(0)
    x, w = torch.randn(x_shape), torch.randn(48, 64)
    b = torch.randn(48) if bias else None
    out = torch.full((*x_shape[:-1], 48), float("nan"))
    linear_onednn(_ctx(), (x, w, b), (out,))
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert out.shape == ref.shape and _rel(out, ref) < 1e-5


def test_other_weights_go_to_torch_linear():
    # a strided weight (a transposed view) or a bias of another dtype: torch's linear, bit for bit
    torch.manual_seed(1)
    x, w = torch.randn(9, 32), torch.randn(32, 24).T
    for b in (None, torch.randn(24, dtype=torch.float64)):
        got, want = torch.empty(9, 24), torch.empty(9, 24)
        if b is not None:  # torch's linear refuses mixed dtypes: so does the fallback
            with pytest.raises(RuntimeError):
                linear_onednn(_ctx(), (x, w.contiguous(), b), (got,))
            continue
        linear_onednn(_ctx(), (x, w, b), (got,))
        linear_blas(_ctx(), (x, w, b), (want,))
        assert torch.equal(got, want)


@pytest.mark.parametrize("m", [1, 5, 64, 130])
def test_mm_onednn_matches_float64(m):
    torch.manual_seed(m)
    a, b = torch.randn(m, 96), torch.randn(96, 40)  # b as a model holds a weight: [K, N]
    out = torch.full((m, 40), float("nan"))
    mm_onednn(_ctx(), (a, b), (out,))
    assert _rel(out, a.double() @ b.double()) < 1e-5
    strided, want = torch.empty(m, 40), torch.empty(m, 40)  # a transposed b: torch's mm, bit for bit
    bt = torch.randn(40, 96).T
    mm_onednn(_ctx(), (a, bt), (strided,))
    mm_blas(_ctx(), (a, bt), (want,))
    assert torch.equal(strided, want)


@pytest.mark.parametrize("rows", [1, 2, 16])
def test_mm_provider_follows_the_row_rule(rows, monkeypatch):
    """matmul.mm against a [K, N] weight: torch's BLAS below ``ONEDNN_MM_MIN_ROWS`` rows (its gemv reads b as
    stored), oneDNN from there; chosen by the dispatcher where the shapes are known (a step graph binds that kernel,
    ``explain`` gives the reason) and by oneDNN's kernel itself where they are not (a prepared MatMul)."""
    from dtorch.dispatch.meta import Call
    from dtorch.kernels.torch import matmul

    a, b = torch.randn(rows, 96), torch.randn(96, 40)
    key = KernelKey("matmul.mm", "cpu", torch.float32)
    choice = dtorch.dispatcher.choose(key, Call(Device("cpu"), torch.float32, inputs=(a.to("meta"), b.to("meta"))))
    want = "onednn" if rows >= matmul.ONEDNN_MM_MIN_ROWS else "blas"
    assert choice.winner.provider == want
    if want == "blas":
        assert any(c.provider == "onednn" and "row(s)" in reason for c, reason in choice.passed_over)
    calls = []
    monkeypatch.setattr(matmul, "onednn_linear", lambda *args: calls.append(1) or torch.mm(args[0], args[1].t()))
    out = torch.empty(rows, 40)
    mm_onednn(_ctx(), (a, b), (out,))
    assert bool(calls) == (want == "onednn")
    assert _rel(out, a.double() @ b.double()) < 1e-5


def test_the_dispatcher_prefers_onednn_and_can_do_without():
    assert dtorch.dispatcher.select(KernelKey("matmul.mm", "cpu", torch.float32)).provider == "onednn"
    assert dtorch.dispatcher.select(KEY).provider == "onednn"
    torch.manual_seed(2)
    x, w, b = torch.randn(33, 128), torch.randn(96, 128), torch.randn(96)
    ref = x.double() @ w.double().T + b.double()
    got = {}
    for name in ("onednn", "blas"):
        with dtorch.dispatcher.disabled(*(["onednn"] if name == "blas" else [])):
            kernel = dtorch.dispatcher.select(KEY)
            assert kernel.provider == name
            out = torch.empty(33, 96)
            kernel.fn(_ctx(), (x, w, b), (out,))
            got[name] = out
            assert _rel(out, ref) < 1e-5
    assert _rel(got["onednn"], got["blas"].double()) < 1e-5


@pytest.mark.parametrize("wdtype", [torch.float16, torch.bfloat16])
def test_16_bit_weight_panels_in_onednn(wdtype, monkeypatch):
    # more rows than one panel holds: every panel's product lands in its own columns
    monkeypatch.setattr(torch_half, "PANEL_BYTES", 16 * 64 * 4)
    torch.manual_seed(3)
    x, w, b = torch.randn(40, 64), torch.randn(50, 64).to(wdtype), torch.randn(50)
    out = torch.empty(40, 50)
    torch_half.linear_half(_ctx(), (x, w, b), (out,))
    ref = x.double() @ w.double().T + b.double()
    assert _rel(out, ref) < 1e-5


def test_a_float32_model_reads_the_same_with_or_without_onednn():
    # the default model dequantized to float32 (its weights [K, N]: matmul.mm) over a 40-token prompt: the logits of
    # oneDNN's products and torch's agree to float32 rounding, and so does every position's top-1
    from dtorch import LLM

    llm = LLM(max_model_len=256, dequantize=True)
    try:
        ids = llm.tokenizer.encode("The lighthouse stood on a rock at the mouth of the harbour, and for two hundred "
                                   "years its keepers kept the lamp burning through every storm.")
        fast = llm.logits(ids)
        with dtorch.dispatcher.disabled("onednn"):
            plain = llm.logits(ids)
    finally:
        llm.close()
    assert _rel(fast, plain.double()) < 1e-4
    assert torch.equal(fast.argmax(-1), plain.argmax(-1))
