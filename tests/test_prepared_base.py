"""The PreparedOperator base: binding once, explaining, checking what it runs on."""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch.dispatch import KernelParams
from dtorch.ops import OperatorInitContext, PreparedOperator, RuntimeContext
from dtorch.ops._invoke import run


class Exp(PreparedOperator):
    op = "unary.exp"

    def forward_out(self, x, *, out, ctx=None):
        self._check_like("x", x)
        self._run((x,), (out,), ctx)
        return out


class Gelu(PreparedOperator):
    op = "unary.gelu"

    def __init__(self, approximate: str):
        super().__init__(KernelParams(approximate=approximate))

    def forward_out(self, x, *, out, ctx=None):
        self._check_like("x", x)
        self._run((x,), (out,), ctx)
        return out


def test_prepared_matches_functional_and_reports_its_provider():
    x = torch.randn(5, 7)
    op = Gelu("tanh").prepare(OperatorInitContext("cpu", torch.float32))
    out = op.forward_out(x, out=torch.empty_like(x), ctx=RuntimeContext("cpu"))
    torch.testing.assert_close(out, dtorch.ops.gelu(x, "tanh"))
    torch.testing.assert_close(out, torch.nn.functional.gelu(x, approximate="tanh"))
    assert op.provider == "torch"
    assert "lower priority than torch" in str(op.explain())


def test_prepared_follows_a_disabled_provider():
    x = torch.randn(64)
    op = Gelu("none").prepare(OperatorInitContext("cpu", torch.float64))
    with dtorch.dispatcher.disabled("torch"):
        op.forward_out(x.double(), out=torch.empty(64, dtype=torch.float64))
        assert op.provider == "reference"
    op.forward_out(x.double(), out=torch.empty(64, dtype=torch.float64))
    assert op.provider == "torch"


def test_unprepared_and_mismatched_calls_are_errors():
    x = torch.randn(3)
    with pytest.raises(dtorch.ArgumentError, match="not prepared"):
        Exp().forward_out(x, out=torch.empty(3))
    op = Exp().prepare(OperatorInitContext("cpu", torch.bfloat16))
    with pytest.raises(dtorch.DTypeError, match="prepared for bfloat16"):
        op.forward_out(x, out=torch.empty(3))
    with pytest.raises(dtorch.DeviceError):
        op.forward_out(torch.empty(3, dtype=torch.bfloat16, device="meta"), out=torch.empty(3))
    with pytest.raises(dtorch.ArgumentError):
        Exp().prepare("cpu")
    with pytest.raises(dtorch.KernelNotFound, match="unary.exp on cpu/int32"):
        Exp().prepare(OperatorInitContext("cpu", torch.int32))


def test_contexts_validate():
    with pytest.raises(dtorch.DTypeError):
        OperatorInitContext("cpu", "float7")
    with pytest.raises(dtorch.DeviceError):
        RuntimeContext("npu:0")
    with pytest.raises(dtorch.ArgumentError):
        OperatorInitContext("cpu", torch.float32, layout="sparse")


def test_a_failing_kernel_is_reported_as_a_kernel_failure():
    key = dtorch.KernelKey("unary.sin", "cpu", torch.float64)

    def broken(ctx, inputs, outputs):
        raise RuntimeError("boom")

    dtorch.dispatcher.register(key, broken, provider="user")
    try:
        with pytest.raises(dtorch.KernelFailure, match=r"unary.sin.*boom"):
            run("unary.sin", dtorch.Device("cpu"), torch.float64, (torch.ones(2, dtype=torch.float64),),
                (torch.empty(2, dtype=torch.float64),))
    finally:
        dtorch.dispatcher.unregister(key, "user")


def test_invoke_runs_any_op_by_name():
    a, b = torch.randn(3, 4), torch.randn(4)
    out = torch.empty(3, 4)
    dtorch.ops.invoke("binary.mul", [a, b], [out])
    torch.testing.assert_close(out, a * b)
    dtorch.ops.invoke("binary.add_scalar", [a], [out], params={"value": 2.5})
    torch.testing.assert_close(out, a + 2.5)
    with pytest.raises(dtorch.ArgumentError):
        dtorch.ops.invoke("binaryadd", [a, b], [out])
    with pytest.raises(dtorch.KernelNotFound):
        dtorch.ops.invoke("binary.nope", [a, b], [out])
