"""Runs the op table (tests/op_table.py + tests/op_table_llm.py) against torch, per (row, dtype, case):

- "functional": the functional wrapper;
- "invoke": ``dtorch.ops.invoke`` on the kernel key (the winner, chosen with the call's facts);
- "provider=<name>": ``invoke`` with every other candidate of the key disabled, once per candidate, so every
  registered kernel runs, not only the winner and the reference (a candidate whose capability check declines
  the call is skipped with the check's reason);
- "prepared": the op's prepared operator (``prepare`` then ``forward_out``), for ops that have one
  (``PREPARED``; ``NO_PREPARED`` lists the others with the reason);

plus completeness against the CPU registry and verify mode."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import dtorch
from dtorch.core.device import Device
from dtorch.core.dtypes import dtype_name
from dtorch.dispatch.context import KernelParams
from dtorch.dispatch.key import KernelKey
from dtorch.dispatch.meta import Call
from dtorch.kernels.torch.matmul import native_bf16_matmul, onednn_linear_op
from dtorch.ops import (
    Attention,
    AttentionVarlen,
    Binary,
    Embedding,
    GeluTanhAndMul,
    Linear,
    MatMul,
    PreparedOperator,
    RMSNorm,
    RoPE,
    SiluAndMul,
)
from tests.op_table import ROWS, Row
from tests.op_table_llm import LLM_NOT_IN_TABLE, LLM_ROWS

ALL_ROWS = ROWS + LLM_ROWS

# Ops registered on cpu that the table does not run, each with the reason and where it is tested instead.
# (The llm.* engineers list theirs in tests/op_table_llm.py as LLM_NOT_IN_TABLE.)
NOT_IN_TABLE: dict[str, str] = {
    **LLM_NOT_IN_TABLE,
}

# -- prepared operators --------------------------------------------------------------------------
# op -> build(inputs, params) -> (the unprepared operator, run(op, inputs, out) calling its forward_out).
# Inputs are in kernel order, as the table makes them.
Build = Callable[[list, dict], tuple[PreparedOperator, Callable[[PreparedOperator, list, torch.Tensor], object]]]


def _binary(name: str) -> Build:
    return lambda inputs, p: (Binary(name), lambda op, i, out: op.forward_out(i[0], i[1], out=out))


def _attention(inputs: list, p: dict):
    q, k = inputs[0], inputs[1]
    op = Attention(p["causal"], p["scale"], q.shape[-2], k.shape[-2], q.shape[-1])
    return op, lambda op, i, out: op.forward_out(*i, out=out)


def _attention_varlen(inputs: list, p: dict):
    q, k = inputs[0], inputs[1]
    op = AttentionVarlen(p["causal"], p["scale"], q.shape[-2], k.shape[-2], q.shape[-1])
    return op, lambda op, i, out: op.forward_out(*i, p["max_seqlen_q"], p["max_seqlen_k"], out=out)


def _rope(inputs: list, p: dict):
    op = RoPE(inputs[0].shape[-1], p["rotary_dim"], interleaved=p["interleaved"])
    positions = torch.tensor(p["positions"], dtype=torch.long)
    return op, lambda op, i, out: op.forward_out(i[0], positions, out=out)


PREPARED: dict[str, Build] = {
    **{f"binary.{n}": _binary(n) for n in ("add", "sub", "mul", "div", "maximum", "minimum", "pow")},
    "matmul.mm": lambda inputs, p: (MatMul(), lambda op, i, out: op.forward_out(*i, out=out)),
    "matmul.bmm": lambda inputs, p: (MatMul(batched=True), lambda op, i, out: op.forward_out(*i, out=out)),
    "matmul.linear": lambda inputs, p: (Linear(has_bias=inputs[2] is not None),
                                        lambda op, i, out: op.forward_out(*i, out=out)),
    "llm.rms_norm": lambda inputs, p: (RMSNorm(p["eps"]), lambda op, i, out: op.forward_out(*i, out=out)),
    "llm.silu_and_mul": lambda inputs, p: (SiluAndMul(), lambda op, i, out: op.forward_out(*i, out=out)),
    "llm.gelu_tanh_and_mul": lambda inputs, p: (GeluTanhAndMul(), lambda op, i, out: op.forward_out(*i, out=out)),
    "llm.embedding": lambda inputs, p: (Embedding(), lambda op, i, out: op.forward_out(i[1], i[0], out=out)),
    "llm.rope": _rope,
    "llm.flash_attention": _attention,
    "llm.flash_attention_varlen": _attention_varlen,
}

# Table ops with no prepared operator class: their functional and *_out forms are the whole API.
_NO_CLASS = "no PreparedOperator class: elementwise/reduction/creation ops are called through their *_out forms"
NO_PREPARED: dict[str, str] = {
    **{row.op: _NO_CLASS for row in ALL_ROWS if row.op.split(".")[0] in ("unary", "reduce", "creation", "copy")},
    **{row.op: "Binary prepares tensor-tensor ops; a scalar operand is a per-call value, not a prepared one"
       for row in ALL_ROWS if row.op.endswith("_scalar")},
    "conv.conv1d": "no PreparedOperator class yet (no model calls a convolution per step; conv1d_out serves)",
    "conv.conv2d": "no PreparedOperator class yet (no model calls a convolution per step; conv2d_out serves)",
    "llm.moe_experts": "no PreparedOperator class yet: a MoE layer calls moe_experts_out, whose checks are shapes "
                       "and dtypes only (the ids' values are read on cpu alone)",
    "llm.softmax_last_dim": "no PreparedOperator class: attention kernels fuse their softmax; softmax_last_dim_out "
                            "serves the rest",
}


def _providers(row: Row, dtype: torch.dtype) -> list[str]:
    """Every provider registered for the row's cpu key (the backends load here, at collection)."""
    return [c.provider for c in dtorch.dispatcher.candidates(KernelKey(row.op, "cpu", dtype))]


def _paths(row: Row, dtype: torch.dtype) -> list[str]:
    prepared = ["prepared"] if row.op in PREPARED else []
    return ["functional", "invoke", *prepared, *(f"provider={p}" for p in _providers(row, dtype))]


CASES = [pytest.param(row, dt, case, path, id=f"{row.id}-{dtype_name(dt)}-{case}-{path}")
         for row in ALL_ROWS for dt in row.dtypes for case in row.cases for path in _paths(row, dt)]


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


def _alone(row: Row, inputs: list, params: dict, want: torch.Tensor, provider: str) -> torch.Tensor:
    """``invoke`` with ``provider`` the only candidate left; skips when its capability check declines."""
    key = _key(row, inputs, want)
    cands = dtorch.dispatcher.candidates(key)
    cand = next(c for c in cands if c.provider == provider)
    call = Call(Device("cpu"), key.dtype, KernelParams(**params), inputs)
    if cand.check is not None and (reason := cand.check(call)) is not None:
        pytest.skip(f"{key}: provider {provider!r} declines this call: {reason}")
    with dtorch.dispatcher.disabled(*{c.provider for c in cands} - {provider}):
        assert dtorch.dispatcher.select(key, call).provider == provider
        return _invoke(row, inputs, params, want)


def _prepared(row: Row, inputs: list, params: dict, want: torch.Tensor) -> torch.Tensor:
    op, run = PREPARED[row.op](inputs, params)
    op.prepare(dtorch.OperatorInitContext("cpu", _key(row, inputs, want).dtype))
    out = torch.empty(want.shape, dtype=want.dtype)
    assert run(op, inputs, out) is out
    return out


@pytest.mark.parametrize(("row", "dtype", "case", "path"), CASES)
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
    elif path == "prepared":
        got = _prepared(row, inputs, params, want)
    else:
        got = _alone(row, inputs, params, want, path.removeprefix("provider="))
    _assert_close(row, got, want, dtype)


def test_prepared_paths_are_declared() -> None:
    """Every table op either has a prepared builder or is listed in NO_PREPARED with its reason."""
    ops = {row.op for row in ALL_ROWS}
    undeclared = sorted(ops - PREPARED.keys() - NO_PREPARED.keys())
    assert not undeclared, f"table ops with neither a PREPARED builder nor a NO_PREPARED reason: {undeclared}"
    both = sorted(PREPARED.keys() & NO_PREPARED.keys())
    assert not both and PREPARED.keys() <= ops, f"declared twice: {both}; not in the table: {PREPARED.keys() - ops}"


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
            want = provider
            if dt == torch.bfloat16 and op in ("matmul.mm", "matmul.linear") and not native_bf16_matmul():
                want = "upcast"  # torch's bf16 products, upcast when rows make it pay
            if (op, dt) == ("matmul.linear", torch.bfloat16) and "native" not in dtorch.dispatcher.unavailable("cpu"):
                want = "native"  # our one-row GEMV, the rest handed to torch's kernels
            if op in ("matmul.linear", "matmul.mm") and dt == torch.float32 and onednn_linear_op() is not None:
                want = "onednn"  # oneDNN's GEMM, over torch's linear
            assert exp.winner is not None and exp.winner.provider == want, str(exp)
            statuses = {c.provider: s for c, s in exp.rows}
            assert statuses["reference"].startswith("lower priority"), str(exp)
            assert provider in str(exp) and "reference" in str(exp)
        rows = [r for r in dtorch.dispatcher.table("cpu") if r.key == KernelKey(op, "cpu", torch.float32)]
        if op in ("matmul.linear", "matmul.mm") and onednn_linear_op() is not None:  # blas behind oneDNN's GEMM
            assert {(r.provider, r.active) for r in rows} == {("onednn", True), (provider, False),
                                                               ("reference", False)}
        else:
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


def test_what_torch_cannot_run_is_not_registered() -> None:
    """torch has no integer matmul on CUDA (addmm/bmm "not implemented for 'Int'"), so those keys have no
    candidate there, while cpu keeps them and cuda keeps the float ones."""
    for op in ("matmul.mm", "matmul.bmm", "matmul.linear"):
        for dt in (torch.int32, torch.int64):
            assert not dtorch.dispatcher.candidates(KernelKey(op, "cuda", dt)), f"{op}/cuda/{dtype_name(dt)}"
            assert dtorch.dispatcher.candidates(KernelKey(op, "cpu", dt)), f"{op}/cpu/{dtype_name(dt)}"
        assert dtorch.dispatcher.candidates(KernelKey(op, "cuda", torch.float32)), f"{op}/cuda/float32"
