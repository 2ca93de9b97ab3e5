"""Runs the op table (tests/op_table.py + tests/op_table_llm.py) against torch, three ways per
(row, dtype, case): the functional wrapper, ``dtorch.ops.invoke``, and ``invoke`` with only the
reference provider allowed; plus completeness against the CPU registry and verify mode."""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch.core.dtypes import dtype_name
from dtorch.dispatch.key import KernelKey
from dtorch.kernels.torch.matmul import native_bf16_matmul
from tests.op_table import ROWS, Row
from tests.op_table_llm import LLM_NOT_IN_TABLE, LLM_ROWS

ALL_ROWS = ROWS + LLM_ROWS

# Ops registered on cpu that the table does not run, each with the reason and where it is tested instead.
# (The llm.* engineers list theirs in tests/op_table_llm.py as LLM_NOT_IN_TABLE.)
NOT_IN_TABLE: dict[str, str] = {
    **LLM_NOT_IN_TABLE,
}

CASES = [pytest.param(row, dt, case, id=f"{row.id}-{dtype_name(dt)}-{case}")
         for row in ALL_ROWS for dt in row.dtypes for case in row.cases]
PATHS = ("functional", "invoke", "reference")


def _assert_close(row: Row, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape, f"{row.id}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{row.id}: dtype {got.dtype} != {want.dtype}"
    if not row.values:
        return
    rtol, atol = row.tolerance(dtype)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{row.id}: {m}")


def _key(row: Row, inputs: list, out: torch.Tensor) -> KernelKey:
    first = next((t for t in inputs if isinstance(t, torch.Tensor)), out)
    return KernelKey(row.op, "cpu", first.dtype)


def _invoke(row: Row, inputs: list, params: dict, want: torch.Tensor) -> torch.Tensor:
    out = torch.empty(want.shape, dtype=want.dtype)
    dtorch.ops.invoke(row.op, inputs, [out], params)
    return out


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("row", "dtype", "case"), CASES)
def test_row(row: Row, dtype: torch.dtype, case: str, path: str) -> None:
    inputs = row.make_inputs(dtype, case)
    if case.endswith("strided"):
        assert any(isinstance(t, torch.Tensor) and not t.is_contiguous() for t in inputs), "case must be strided"
    params = row.params_for(dtype, case)
    want = row.reference(inputs, params)
    if path == "functional":
        got = row.run_functional(inputs, params)
    elif path == "invoke":
        got = _invoke(row, inputs, params, want)
    else:
        key = _key(row, inputs, want)
        others = {c.provider for c in dtorch.dispatcher.candidates(key)} - {"reference"}
        with dtorch.dispatcher.disabled(*others):
            assert dtorch.dispatcher.select(key).provider == "reference"
            got = _invoke(row, inputs, params, want)
    _assert_close(row, got, want, dtype)


def test_table_covers_every_cpu_kernel() -> None:
    covered = {(row.op, dt) for row in ALL_ROWS for dt in row.dtypes}
    registered = {(r.key.op, r.key.dtype) for r in dtorch.dispatcher.table("cpu")}
    missing = sorted(f"{op}/{dtype_name(dt)}" for op, dt in registered - covered if op not in NOT_IN_TABLE)
    assert not missing, f"registered on cpu but neither in the op table nor in NOT_IN_TABLE: {missing}"
    unregistered = sorted(f"{op}/{dtype_name(dt)}" for op, dt in covered - registered)
    assert not unregistered, f"op table rows for keys with no cpu kernel: {unregistered}"
    stale = sorted(op for op in NOT_IN_TABLE if op not in {k for k, _ in registered})
    assert not stale, f"NOT_IN_TABLE names ops that are not registered: {stale}"


def test_accelerated_overrides_are_visible() -> None:
    for op, provider in (("matmul.mm", "blas"), ("matmul.bmm", "blas"), ("matmul.linear", "blas"),
                         ("conv.conv1d", "torch"), ("conv.conv2d", "torch")):
        for dt in (torch.float32, torch.bfloat16):
            key = KernelKey(op, "cpu", dt)
            exp = dtorch.dispatcher.explain(key)
            want = "upcast" if (op, dt) == ("matmul.mm", torch.bfloat16) and not native_bf16_matmul() else provider
            assert exp.winner is not None and exp.winner.provider == want, str(exp)
            statuses = {c.provider: s for c, s in exp.rows}
            assert statuses["reference"].startswith("lower priority"), str(exp)
            assert provider in str(exp) and "reference" in str(exp)
        rows = [r for r in dtorch.dispatcher.table("cpu") if r.key == KernelKey(op, "cpu", torch.float32)]
        assert {(r.provider, r.active) for r in rows} == {(provider, True), ("reference", False)}


# -- verify mode ---------------------------------------------------------------------------------

@pytest.mark.parametrize("run", [
    lambda: dtorch.ops.linear(torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)),
    lambda: dtorch.ops.bmm(torch.randn(2, 3, 4), torch.randn(2, 4, 5)),
    lambda: dtorch.ops.conv2d(torch.randn(1, 2, 5, 5), torch.randn(4, 2, 3, 3), padding=1),
    lambda: dtorch.ops.conv1d(torch.randn(1, 4, 9).bfloat16(), torch.randn(4, 2, 3).bfloat16(), groups=2),
    lambda: dtorch.ops.mm(torch.randn(4, 6).half(), torch.randn(6, 3).half()),
], ids=["linear", "bmm", "conv2d", "conv1d_bf16", "mm_fp16"])
def test_verify_mode_accepts_correct_kernels(run) -> None:
    with dtorch.verify():
        run()


def test_verify_mode_catches_a_wrong_kernel() -> None:
    key = KernelKey(dtorch.dispatcher.define("test_table.neg"), "cpu", torch.float32)

    def reference(ctx, inputs, outputs):
        torch.neg(inputs[0], out=outputs[0])

    def wrong(ctx, inputs, outputs):
        torch.neg(inputs[0], out=outputs[0])
        outputs[0].view(-1)[0] += 1.0

    dtorch.dispatcher.register(key, reference, provider="reference")
    dtorch.dispatcher.register(key, wrong, provider="user")
    try:
        x = torch.randn(4, 3)
        out = torch.empty_like(x)
        dtorch.ops.invoke(key.op, [x], [out])  # without verify the wrong kernel runs silently
        assert not torch.equal(out, -x)
        with dtorch.verify(), pytest.raises(dtorch.VerifyError, match="test_table.neg"):
            dtorch.ops.invoke(key.op, [x], [out])
        dtorch.dispatcher.unregister(key, "user")
        with dtorch.verify():
            dtorch.ops.invoke(key.op, [x], [out])
        assert torch.equal(out, -x)
    finally:
        for provider in ("user", "reference"):
            if any(c.provider == provider for c in dtorch.dispatcher.candidates(key)):
                dtorch.dispatcher.unregister(key, provider)


META_CASES = [pytest.param(row, row.dtypes[0], row.cases[0], id=f"{row.id}-{dtype_name(row.dtypes[0])}-{row.cases[0]}")
              for row in ROWS if not row.op.startswith("creation.")]
# The generic rows (an llm row's call may build tensors of its own on cpu); creation ops take a device argument
# instead of tensors and are checked on meta in test_creation_on_meta.


@pytest.mark.parametrize(("row", "dtype", "case"), META_CASES)
def test_row_infers_shapes_on_meta(row: Row, dtype: torch.dtype, case: str) -> None:
    """The functional wrapper on meta copies of the inputs gives the reference's shape and dtype (graphs rely on it)."""
    inputs = row.make_inputs(dtype, case)
    params = row.params_for(dtype, case)
    want = row.reference(inputs, params)
    got = row.run_functional([t.to("meta") if isinstance(t, torch.Tensor) else t for t in inputs], params)
    assert got.device.type == "meta"
    assert (got.shape, got.dtype) == (want.shape, want.dtype)


@pytest.mark.parametrize("make", [
    lambda d: (dtorch.ops.zeros((2, 3), device=d), torch.zeros(2, 3)),
    lambda d: (dtorch.ops.ones(4, dtype=torch.int32, device=d), torch.ones(4, dtype=torch.int32)),
    lambda d: (dtorch.ops.full((2, 0), 1.5, dtype=torch.bfloat16, device=d), torch.full((2, 0), 1.5,
                                                                                        dtype=torch.bfloat16)),
    lambda d: (dtorch.ops.empty((), device=d), torch.empty(())),
    lambda d: (dtorch.ops.arange(1, 2, 0.3, device=d), torch.arange(1, 2, 0.3)),
], ids=["zeros", "ones", "full", "empty", "arange"])
def test_creation_on_meta(make) -> None:
    got, want = make("meta")
    assert got.device.type == "meta" and (got.shape, got.dtype) == (want.shape, want.dtype)
