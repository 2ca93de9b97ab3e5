"""Bad inputs to the generic ops (matmul, conv, reduce, creation, copy, and unary/binary dtypes) raise
the right ``DtorchError`` subclass with a message naming the problem; no torch error leaks out."""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import ops
from dtorch.ops import RuntimeContext

x34, x45 = torch.randn(3, 4), torch.randn(4, 5)
meta45 = torch.empty(4, 5, device="meta")
img = torch.randn(1, 4, 5, 5)
seq = torch.randn(1, 4, 9)

CASES = [
    # (id, call, error, message pattern)
    ("mm_rank", lambda: ops.mm(x34[None], x45), dtorch.ShapeError, "'a' must have rank 2"),
    ("mm_inner", lambda: ops.mm(x34, torch.randn(5, 4)), dtorch.ShapeError, "inner dims must match"),
    ("mm_dtypes", lambda: ops.mm(x34, x45.double()), dtorch.DTypeError, "dtypes disagree"),
    ("mm_devices", lambda: ops.mm(x34, meta45), dtorch.DeviceError, "devices disagree"),
    ("mm_ctx_device", lambda: ops.mm_out(x34, x45, out=torch.empty(3, 5), ctx=RuntimeContext("meta")),
     dtorch.DeviceError, "context device"),
    ("mm_not_tensor", lambda: ops.mm(x34, [[1.0]]), dtorch.DTypeError, "'b' must be a torch.Tensor"),
    ("mm_out_shape", lambda: ops.mm_out(x34, x45, out=torch.empty(5, 3)), dtorch.ShapeError, "'out' must have shape"),
    ("mm_out_dtype", lambda: ops.mm_out(x34, x45, out=torch.empty(3, 5, dtype=torch.float64)), dtorch.DTypeError,
     "'out' must have dtype"),
    ("mm_bool", lambda: ops.mm(x34.bool(), x45.bool()), dtorch.KernelNotFound, "registered: .*float32"),
    ("bmm_batch", lambda: ops.bmm(torch.randn(2, 3, 4), torch.randn(3, 4, 5)), dtorch.ShapeError, "batch sizes"),
    ("bmm_inner", lambda: ops.bmm(torch.randn(2, 3, 4), torch.randn(2, 3, 5)), dtorch.ShapeError, "inner dims"),
    ("linear_k", lambda: ops.linear(x34, torch.randn(6, 5)), dtorch.ShapeError, "K must match"),
    ("linear_bias", lambda: ops.linear(x34, torch.randn(6, 4), torch.randn(4)), dtorch.ShapeError, "'bias'"),
    ("linear_0d", lambda: ops.linear(torch.tensor(1.0), torch.randn(6, 4)), dtorch.ShapeError, "rank >= 1"),
    ("linear_w_rank", lambda: ops.linear(x34, torch.randn(4)), dtorch.ShapeError, "'w' must have rank 2"),
    ("conv_stride", lambda: ops.conv2d(img, torch.randn(2, 4, 3, 3), stride=0), dtorch.ArgumentError, "'stride'"),
    ("conv_padding", lambda: ops.conv1d(seq, torch.randn(2, 4, 3), padding=-1), dtorch.ArgumentError, "'padding'"),
    ("conv_dilation", lambda: ops.conv2d(img, torch.randn(2, 4, 3, 3), dilation=(1, 2, 3)), dtorch.ArgumentError,
     "'dilation'"),
    ("conv_groups", lambda: ops.conv1d(seq, torch.randn(2, 4, 3), groups=0), dtorch.ArgumentError, "'groups'"),
    ("conv_groups_divide", lambda: ops.conv1d(seq, torch.randn(2, 4, 3), groups=3), dtorch.ShapeError,
     "must divide"),
    ("conv_channels", lambda: ops.conv2d(img, torch.randn(2, 3, 3, 3)), dtorch.ShapeError, "input channels"),
    ("conv_kernel_too_big", lambda: ops.conv1d(seq, torch.randn(2, 4, 10)), dtorch.ShapeError,
     "smaller than the dilated kernel"),
    ("conv_rank", lambda: ops.conv2d(seq, torch.randn(2, 4, 3)), dtorch.ShapeError, "rank 4"),
    ("conv_bias", lambda: ops.conv1d(seq, torch.randn(2, 4, 3), torch.randn(3)), dtorch.ShapeError, "'bias'"),
    ("conv_int", lambda: ops.conv1d(seq.long(), torch.ones(2, 4, 3, dtype=torch.long)), dtorch.KernelNotFound,
     "conv.conv1d on cpu/int64"),
    ("conv_devices", lambda: ops.conv1d(seq, torch.empty(2, 4, 3, device="meta")), dtorch.DeviceError, "disagree"),
    ("reduce_dim", lambda: ops.sum(x34, 2), dtorch.ArgumentError, "out of range"),
    ("reduce_dim_type", lambda: ops.max(x34, 0.5), dtorch.ArgumentError, "'dim' must be an int"),
    ("reduce_keepdim", lambda: ops.min(x34, 0, keepdim=1), dtorch.ArgumentError, "'keepdim'"),
    ("reduce_empty_max", lambda: ops.max(torch.randn(0, 3), 0), dtorch.ShapeError, "size 0"),
    ("reduce_mean_int", lambda: ops.mean(x34.long(), 0), dtorch.KernelNotFound, "reduce.mean on cpu/int64"),
    ("argmax_out_dtype", lambda: ops.argmax_out(x34, 1, out=torch.empty(3)), dtorch.DTypeError, "int64"),
    ("reduce_not_tensor", lambda: ops.sum([1, 2], 0), dtorch.DTypeError, "'x' must be a torch.Tensor"),
    ("zeros_shape", lambda: ops.zeros((2, -1)), dtorch.ArgumentError, "'shape'"),
    ("zeros_dtype", lambda: ops.zeros(3, dtype=torch.bool), dtorch.DTypeError, "bool"),
    ("ones_unknown_dtype", lambda: ops.ones(3, dtype="float8"), dtorch.DTypeError, "unknown dtype"),
    ("full_int_value", lambda: ops.full(3, 1.5, dtype=torch.int32), dtorch.ArgumentError, "'value' must be an int"),
    ("full_value_type", lambda: ops.full(3, "1"), dtorch.ArgumentError, "'value'"),
    ("arange_step", lambda: ops.arange(0, 5, 0), dtorch.ArgumentError, "'step' must be non-zero"),
    ("arange_out_size", lambda: ops.arange_out(0, 5, out=torch.empty(4, dtype=torch.int64)), dtorch.ShapeError,
     r"shape \(5,\)"),
    ("creation_device", lambda: ops.zeros(3, device="tpu"), dtorch.DeviceError, "device type"),
    ("copy_target", lambda: ops.copy(x34, dtype=torch.bool), dtorch.DTypeError, "cannot copy to bool"),
    ("copy_out_shape", lambda: ops.copy_out(x34, out=torch.empty(4, 3)), dtorch.ShapeError, "'out' must have shape"),
    ("copy_out_device", lambda: ops.copy_out(x34, out=torch.empty(3, 4, device="meta")), dtorch.DeviceError,
     "'out' must be on cpu"),
    ("copy_bool_source", lambda: ops.copy(x34.bool()), dtorch.KernelNotFound, "copy.copy on cpu/bool"),
    ("contiguous_out_layout", lambda: ops.contiguous_out(x34, out=torch.empty(4, 3).t()), dtorch.LayoutError,
     "contiguous"),
    ("exp_int", lambda: ops.exp(torch.arange(3)), dtorch.KernelNotFound, r"unary.exp on cpu/int64; registered"),
    ("add_mixed_dtypes", lambda: ops.add(x34, x34.long()), dtorch.DTypeError, "dtypes disagree"),
    ("div_int", lambda: ops.div(torch.arange(3), torch.arange(3)), dtorch.KernelNotFound, "binary.div"),
]


@pytest.mark.parametrize(("call", "error", "pattern"), [pytest.param(c, e, p, id=i) for i, c, e, p in CASES])
def test_bad_input(call, error, pattern) -> None:
    with pytest.raises(error, match=pattern) as info:
        call()
    assert isinstance(info.value, dtorch.DtorchError)
    op_named = any(part in str(info.value) for part in ("matmul.", "conv.", "reduce.", "creation.", "copy.", "unary.",
                                                        "binary.", "device type", "dtype"))
    assert op_named, f"message does not name the op: {info.value}"


def test_int_sum_keeps_dtype_and_wraps() -> None:
    big = torch.tensor([[2**30, 2**30, 5]], dtype=torch.int32)
    got = ops.sum(big, 1)
    assert got.dtype == torch.int32
    assert got.item() == torch.tensor(2**31 + 5, dtype=torch.int64).to(torch.int32).item()  # two's-complement wrap
    assert ops.sum(big.long(), 1).item() == 2**31 + 5


def test_contiguous_returns_the_same_tensor_when_dense() -> None:
    assert ops.contiguous(x34) is x34
    strided = x34.t()
    dense = ops.contiguous(strided)
    assert dense is not strided and dense.is_contiguous() and torch.equal(dense, strided)
