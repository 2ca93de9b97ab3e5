"""The checks every op makes before a kernel runs: layouts (only strided tensors have kernels) and full
devices (type and index), on every path: functional, ``*_out``, ``invoke`` and prepared ``forward_out``.

Without a GPU, a tensor "on cuda:1" is a CPU tensor of a subclass whose ``device`` says so: the checks read
``device`` and nothing else about where a tensor lives, and a subclass takes the full (slow) validation. The
hot paths' device comparison is exercised with real tensors on ``meta`` against operators prepared for cpu.
"""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import DeviceError, LayoutError
from dtorch.core.device import Device
from dtorch.ops import Binary, Linear, MatMul, OperatorInitContext, RMSNorm, RuntimeContext, SiluAndMul, _checks


class OnCuda1(torch.Tensor):
    """A CPU tensor that reports ``cuda:1`` as its device."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 1)


class OnCuda0(torch.Tensor):
    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


def cuda1(*shape: int) -> torch.Tensor:
    return torch.randn(shape).as_subclass(OnCuda1)


def cuda0(*shape: int) -> torch.Tensor:
    return torch.randn(shape).as_subclass(OnCuda0)


def sparse(*shape: int) -> torch.Tensor:
    return torch.randn(shape).to_sparse()


def prep(op, device: str = "cpu", dtype: torch.dtype = torch.float32):
    return op.prepare(OperatorInitContext(device, dtype))


# -- layouts -------------------------------------------------------------------------------------

def _dense(*shape: int) -> torch.Tensor:
    return torch.randn(shape)


LAYOUT_CALLS = {  # name -> (call with one sparse COO argument, the argument's name)
    "mm_a": (lambda: dtorch.ops.mm(sparse(3, 3), _dense(3, 3)), "a"),
    "mm_b": (lambda: dtorch.ops.mm(_dense(3, 3), sparse(3, 3)), "b"),
    "mm_out": (lambda: dtorch.ops.mm_out(_dense(3, 3), _dense(3, 3), out=sparse(3, 3)), "out"),
    "bmm": (lambda: dtorch.ops.bmm(sparse(2, 3, 3), _dense(2, 3, 3)), "a"),
    "linear_x": (lambda: dtorch.ops.linear(sparse(2, 3), _dense(4, 3)), "x"),
    "linear_w": (lambda: dtorch.ops.linear(_dense(2, 3), sparse(4, 3)), "w"),
    "linear_bias": (lambda: dtorch.ops.linear(_dense(2, 3), _dense(4, 3), sparse(4)), "bias"),
    "linear_out": (lambda: dtorch.ops.linear_out(_dense(2, 3), sparse(4, 3), out=torch.empty(2, 4)), "w"),
    "add_a": (lambda: dtorch.ops.add(sparse(3, 3), _dense(3, 3)), "a"),
    "add_b": (lambda: dtorch.ops.add(_dense(3, 3), sparse(3, 3)), "b"),  # torch itself accepts dense + sparse
    "add_out": (lambda: dtorch.ops.add_out(_dense(3, 3), sparse(3, 3), out=torch.empty(3, 3)), "b"),
    "add_scalar": (lambda: dtorch.ops.add(sparse(3, 3), 2.0), "a"),
    "exp": (lambda: dtorch.ops.exp(sparse(3, 3)), "x"),
    "exp_out": (lambda: dtorch.ops.exp_out(_dense(3, 3), out=sparse(3, 3)), "out"),
    "sum": (lambda: dtorch.ops.sum(sparse(3, 3), 0), "x"),
    "rms_norm": (lambda: dtorch.ops.rms_norm(sparse(2, 8), _dense(8)), "x"),
    "conv1d": (lambda: dtorch.ops.conv1d(_dense(1, 2, 5), sparse(3, 2, 2)), "w"),
    "copy": (lambda: dtorch.ops.copy(sparse(3, 3)), "x"),
    "invoke_input": (lambda: dtorch.ops.invoke("matmul.mm", [_dense(3, 3), sparse(3, 3)], [torch.empty(3, 3)]),
                     "inputs[1]"),
    "invoke_output": (lambda: dtorch.ops.invoke("unary.neg", [_dense(3, 3)], [sparse(3, 3)]), "outputs[0]"),
    "prepared_add": (lambda: prep(Binary("add")).forward_out(_dense(3, 3), sparse(3, 3), out=torch.empty(3, 3)),
                     "b"),
    "prepared_mm": (lambda: prep(MatMul()).forward_out(sparse(3, 3), _dense(3, 3), out=torch.empty(3, 3)), "a"),
    "prepared_linear": (lambda: prep(Linear(False)).forward_out(_dense(2, 3), sparse(4, 3), out=torch.empty(2, 4)),
                        "w"),
    "prepared_linear_out": (lambda: prep(Linear(False)).forward_out(_dense(2, 3), _dense(4, 3), out=sparse(2, 4)),
                            "out"),
    "prepared_rms_norm": (lambda: prep(RMSNorm()).forward_out(_dense(2, 8), sparse(8), out=torch.empty(2, 8)),
                          "weight"),
    "prepared_silu_and_mul": (lambda: prep(SiluAndMul()).forward_out(sparse(2, 8), out=torch.empty(2, 4)), "x"),
}


@pytest.mark.parametrize("name", LAYOUT_CALLS)
def test_sparse_tensor_is_refused_with_its_name_and_layout(name: str) -> None:
    run, arg = LAYOUT_CALLS[name]
    with pytest.raises(LayoutError) as err:
        run()
    msg = str(err.value)
    assert f"'{arg}'" in msg and "sparse_coo" in msg and "no kernel" in msg, msg


def test_strided_views_still_pass() -> None:
    """The layout check is about sparse and other layouts, not about strides: views run and are right."""
    a, b = torch.randn(4, 6)[:, ::2], torch.randn(3, 5)
    torch.testing.assert_close(dtorch.ops.mm(a, b), a @ b)
    out = torch.empty(4, 5)
    prep(MatMul()).forward_out(a, b, out=out)
    torch.testing.assert_close(out, a @ b)


# -- devices: the helpers, with a device index that differs --------------------------------------

def test_on_device_compares_the_index() -> None:
    t = cuda1(2, 3)
    with pytest.raises(DeviceError) as err:
        _checks.on_device("binary.add", "a", t, Device("cuda", 0))
    msg = str(err.value)
    assert "'a'" in msg and "cuda:1" in msg and "cuda:0" in msg, msg
    assert _checks.on_device("binary.add", "a", t, Device("cuda", 1)) == Device("cuda", 1)


def test_same_device_compares_the_index() -> None:
    with pytest.raises(DeviceError, match=r"'x' is on cuda:1, but the context device is cuda:0"):
        _checks.same_device("matmul.linear", {"x": cuda1(2, 3), "w": cuda1(4, 3)}, Device("cuda", 0))
    assert _checks.same_device("matmul.linear", {"x": cuda1(2, 3), "w": cuda1(4, 3)}, Device("cuda", 1)) == \
        Device("cuda", 1)


def test_every_cpu_device_holds_cpu_tensors() -> None:
    """cpu:N devices of one process all hold torch's cpu tensors, so a cpu tensor is on any of them."""
    assert _checks.on_device("unary.neg", "x", torch.ones(2), Device("cpu", 3)) == Device("cpu", 3)
    op = prep(Binary("add"), "cpu:2")
    a = torch.ones(3)
    torch.testing.assert_close(op.forward_out(a, a, out=torch.empty(3), ctx=RuntimeContext("cpu:2")), a + a)
    with pytest.raises(DeviceError, match="'a' is on meta"):
        _checks.on_device("unary.neg", "a", torch.empty(2, device="meta"), Device("cpu", 2))


# -- devices: the wrappers -----------------------------------------------------------------------

@pytest.mark.parametrize("run", [
    lambda ctx: dtorch.ops.add_out(cuda1(2, 3), cuda1(2, 3), out=cuda1(2, 3), ctx=ctx),
    lambda ctx: dtorch.ops.mm_out(cuda1(2, 3), cuda1(3, 4), out=cuda1(2, 4), ctx=ctx),
    lambda ctx: dtorch.ops.linear_out(cuda1(2, 3), cuda1(4, 3), out=cuda1(2, 4), ctx=ctx),
    lambda ctx: dtorch.ops.exp_out(cuda1(2, 3), out=cuda1(2, 3), ctx=ctx),
    lambda ctx: dtorch.ops.rms_norm_out(cuda1(2, 8), cuda1(8), out=cuda1(2, 8), ctx=ctx),
    lambda ctx: dtorch.ops.sum_out(cuda1(2, 3), 0, out=cuda1(3), ctx=ctx),
    lambda ctx: dtorch.ops.invoke("unary.neg", [cuda1(2, 3)], [cuda1(2, 3)], ctx=ctx),
], ids=["add_out", "mm_out", "linear_out", "exp_out", "rms_norm_out", "sum_out", "invoke"])
def test_out_forms_refuse_another_index_of_the_context_type(run) -> None:
    with pytest.raises(DeviceError) as err:
        run(RuntimeContext("cuda:0"))
    assert "cuda:1" in str(err.value) and "cuda:0" in str(err.value), str(err.value)


def test_invoke_refuses_a_tensor_off_the_context_device() -> None:
    x = torch.randn(2, 3)
    with pytest.raises(DeviceError, match=r"'outputs\[0\]' is on meta"):
        dtorch.ops.invoke("unary.neg", [x], [torch.empty(2, 3, device="meta")], ctx=RuntimeContext("cpu"))


# -- devices: prepared operators -----------------------------------------------------------------

PREPARED_CALLS = {  # name -> (operator, forward_out given a maker of tensors [shape] on the wrong device)
    "add": (Binary("add"), lambda t: ("a", lambda op: op.forward_out(t(2, 3), t(2, 3), out=t(2, 3)))),
    "mm": (MatMul(), lambda t: ("a", lambda op: op.forward_out(t(2, 3), t(3, 4), out=t(2, 4)))),
    "linear": (Linear(True), lambda t: ("x", lambda op: op.forward_out(t(2, 3), t(4, 3), t(4), out=t(2, 4)))),
    "rms_norm": (RMSNorm(), lambda t: ("x", lambda op: op.forward_out(t(2, 8), t(8), out=t(2, 8)))),
    "silu_and_mul": (SiluAndMul(), lambda t: ("x", lambda op: op.forward_out(t(2, 8), out=t(2, 4)))),
}


@pytest.mark.parametrize("name", PREPARED_CALLS)
def test_prepared_for_cuda0_refuses_cuda1(name: str) -> None:
    op, make = PREPARED_CALLS[name]
    arg, run = make(cuda1)
    prep(op, "cuda:0")
    with pytest.raises(DeviceError) as err:
        run(op)
    msg = str(err.value)
    assert f"'{arg}'" in msg and "cuda:1" in msg and "prepared for cuda:0" in msg, msg


@pytest.mark.parametrize("name", PREPARED_CALLS)
def test_prepared_hot_path_refuses_another_device(name: str) -> None:
    """Plain tensors on meta against an operator prepared for cpu: the hot path's own comparison refuses them."""
    op, make = PREPARED_CALLS[name]
    arg, run = make(lambda *shape: torch.empty(shape, device="meta"))
    prep(op, "cpu")
    with pytest.raises(DeviceError, match=f"'{arg}' is on meta, but the operator was prepared for cpu:0"):
        run(op)


@pytest.mark.parametrize("bad", ["b", "out"])
def test_prepared_hot_path_checks_every_tensor(bad: str) -> None:
    """One tensor off the prepared device among good ones is named (torch would not always refuse it)."""
    t = {"a": torch.randn(2, 3), "b": torch.randn(2, 3), "out": torch.empty(2, 3)}
    t[bad] = torch.empty(2, 3, device="meta")
    with pytest.raises(DeviceError, match=f"'{bad}'.* meta"):
        prep(Binary("add")).forward_out(t["a"], t["b"], out=t["out"])


def test_prepared_refuses_a_context_on_another_device() -> None:
    op = prep(Linear(False), "cuda:0")
    with pytest.raises(DeviceError, match="runtime context is on cuda:1"):
        op.forward_out(cuda0(2, 3), cuda0(4, 3), out=cuda0(2, 4), ctx=RuntimeContext("cuda:1"))


def test_checks_do_not_refuse_valid_calls() -> None:
    """The same ops, on the right device and layout, give torch's results on every path."""
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    want = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(dtorch.ops.linear(x, w, b), want)
    out = torch.empty(3, 5)
    torch.testing.assert_close(prep(Linear(True)).forward_out(x, w, b, out=out, ctx=RuntimeContext("cpu")), want)
    torch.testing.assert_close(dtorch.ops.add_out(x, x, out=torch.empty(3, 8), ctx=RuntimeContext("cpu:1")), x + x)
