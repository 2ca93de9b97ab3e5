"""Prepared ``MatMul`` and ``Linear``: same results as the functional ops, provider changes, bad calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch.ops import Linear, MatMul, OperatorInitContext, RuntimeContext

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64)


def _rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-3, 4, shape, dtype=dtype)


def _prep(op, dtype=torch.float32, device="cpu"):
    return op.prepare(OperatorInitContext(device=device, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batched", [False, True])
def test_matmul_equals_functional(dtype: torch.dtype, batched: bool) -> None:
    mm = _prep(MatMul(batched=batched), dtype)
    a, b = (_rand(2, 3, 4, dtype=dtype), _rand(2, 4, 5, dtype=dtype)) if batched else \
        (_rand(3, 4, dtype=dtype), _rand(4, 5, dtype=dtype))
    functional = dtorch.ops.bmm(a, b) if batched else dtorch.ops.mm(a, b)
    assert torch.equal(mm.forward(a, b), functional)
    out = torch.empty_like(functional)
    assert mm.forward_out(a, b, out=out, ctx=RuntimeContext("cpu")) is out
    assert torch.equal(out, functional)
    if dtype is torch.float64:
        torch.testing.assert_close(out, a @ b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("x_shape", [(4,), (3, 4), (2, 3, 4)], ids=str)
def test_linear_equals_functional(dtype: torch.dtype, has_bias: bool, x_shape: tuple[int, ...]) -> None:
    lin = _prep(Linear(has_bias), dtype)
    x, w = _rand(*x_shape, dtype=dtype), _rand(5, 4, dtype=dtype)
    bias = _rand(5, dtype=dtype) if has_bias else None
    functional = dtorch.ops.linear(x, w, bias)
    assert torch.equal(lin.forward(x, w, bias), functional)
    out = torch.empty_like(functional)
    assert lin.forward_out(x, w, bias, out=out) is out
    assert torch.equal(out, functional)
    if dtype is torch.float64:
        torch.testing.assert_close(out, F.linear(x, w, bias))


def test_prepared_follows_disabled_providers() -> None:
    lin = _prep(Linear(True), torch.float64)
    x, w, b = _rand(3, 8, dtype=torch.float64), _rand(6, 8, dtype=torch.float64), _rand(6, dtype=torch.float64)
    assert lin.provider == "blas"
    assert "blas" in str(lin.explain()) and "reference" in str(lin.explain())
    fast = lin.forward(x, w, b)
    with dtorch.dispatcher.disabled("blas"):
        slow = lin.forward(x, w, b)
        assert lin.provider == "reference"
    assert lin.forward(x, w, b) is not None and lin.provider == "blas"
    torch.testing.assert_close(slow, fast)
    torch.testing.assert_close(fast, F.linear(x, w, b))


def test_prepared_under_verify_mode() -> None:
    mm = _prep(MatMul(batched=True), torch.bfloat16)
    a, b = _rand(2, 3, 16, dtype=torch.bfloat16), _rand(2, 16, 4, dtype=torch.bfloat16)
    with dtorch.verify():
        got = mm.forward(a, b)
    torch.testing.assert_close(got.float(), torch.bmm(a.float(), b.float()), rtol=3e-2, atol=5e-2)


def test_prepared_on_meta_infers_shapes() -> None:
    lin = _prep(Linear(False), torch.float32, "meta")
    x, w = torch.empty(2, 3, 4, device="meta"), torch.empty(5, 4, device="meta")
    y = lin.forward(x, w)
    assert y.device.type == "meta" and y.shape == (2, 3, 5)


def test_not_prepared() -> None:
    with pytest.raises(dtorch.ArgumentError, match="not prepared"):
        Linear(False).forward_out(torch.randn(2, 4), torch.randn(3, 4), out=torch.empty(2, 3))
    with pytest.raises(dtorch.ArgumentError, match="not prepared"):
        MatMul().forward(torch.randn(2, 4), torch.randn(4, 3))


def test_constructor_arguments() -> None:
    with pytest.raises(dtorch.ArgumentError, match="has_bias"):
        Linear(1)
    with pytest.raises(dtorch.ArgumentError, match="batched"):
        MatMul(batched="yes")


def test_linear_bad_calls() -> None:
    lin = _prep(Linear(False))
    x, w, out = torch.randn(3, 4), torch.randn(5, 4), torch.empty(3, 5)
    with pytest.raises(dtorch.DTypeError, match="'x'.*float64"):
        lin.forward_out(x.double(), w, out=out)
    with pytest.raises(dtorch.ArgumentError, match="has_bias=False"):
        lin.forward_out(x, w, torch.randn(5), out=out)
    with pytest.raises(dtorch.ShapeError, match="K must match"):
        lin.forward_out(torch.randn(3, 7), w, out=out)  # the kernel fails; the slow path names the problem
    with pytest.raises(dtorch.DTypeError, match="'w'"):
        lin.forward_out(x, w.double(), out=out)
    with pytest.raises(dtorch.DTypeError, match="'out'"):
        lin.forward_out(x, w, out=out.double())
    with pytest.raises(dtorch.ArgumentError, match="has_bias=True"):
        _prep(Linear(True)).forward(x, w)
    with pytest.raises(dtorch.DeviceError):
        lin.forward(torch.empty(3, 4, device="meta"), torch.empty(5, 4, device="meta"))


def test_matmul_bad_calls() -> None:
    mm = _prep(MatMul())
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with pytest.raises(dtorch.ShapeError, match="inner dims"):
        mm.forward_out(a, torch.randn(6, 5), out=torch.empty(3, 5))
    with pytest.raises(dtorch.ShapeError, match="rank 2"):
        mm.forward(a[None], b)
    with pytest.raises(dtorch.DTypeError, match="'a'"):
        mm.forward(a.half(), b.half())
    with pytest.raises(dtorch.ShapeError, match="batch sizes"):
        _prep(MatMul(batched=True)).forward(torch.randn(2, 3, 4), torch.randn(3, 4, 5))


def test_bf16_mm_upcast_provider() -> None:
    """Without native bf16 matmul, prepared bf16 MatMul binds "upcast": many rows multiply in float32 and round
    once (the float32 product's bf16 rounding exactly), few rows run torch's bf16 mm unchanged."""
    from dtorch.kernels.torch.matmul import UPCAST_MIN_ROWS, native_bf16_matmul

    mm = _prep(MatMul(), torch.bfloat16)
    assert mm.provider == ("blas" if native_bf16_matmul() else "upcast"), str(mm.explain())
    b = _rand(24, 7, dtype=torch.bfloat16)
    tall, short = _rand(UPCAST_MIN_ROWS + 3, 24, dtype=torch.bfloat16), _rand(2, 24, dtype=torch.bfloat16)
    got = mm.forward(tall, b)
    assert torch.equal(got, (tall.float() @ b.float()).bfloat16())
    torch.testing.assert_close(got.double(), tall.double() @ b.double(), rtol=1.6e-2, atol=1e-2)
    assert torch.equal(mm.forward(short, b), torch.mm(short, b))
    assert torch.equal(dtorch.ops.mm(tall, b), got)  # the functional path picks the same kernel
    with dtorch.verify():
        mm.forward(tall, b)  # against the reference kernel, within bf16 tolerance
    with pytest.raises(dtorch.DTypeError, match="'b'"):
        mm.forward_out(tall, b.float(), out=torch.empty(tall.shape[0], 7, dtype=torch.bfloat16))
    if not native_bf16_matmul():
        key = dtorch.dispatch.KernelKey("matmul.mm", "cpu", torch.bfloat16)
        call = dtorch.dispatch.Call(dtorch.Device("cpu"), torch.bfloat16, inputs=(short, b))
        exp = str(dtorch.dispatcher.explain(key, call))
        assert "too few rows" in exp and "blas" in exp
