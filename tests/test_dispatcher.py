"""The Dispatcher: registration semantics, choice and explanation, lazy registration, concurrency."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import dtorch
from dtorch.dispatch import Call, Dispatcher, KernelKey, KernelMeta, KernelParams, PreparedKernel
from dtorch.dispatch.registration import KernelSet

KEY = KernelKey("test.op", "cpu", torch.float32)


def ref_kernel(ctx, inputs, outputs):
    torch.add(inputs[0], 1, out=outputs[0])


def fast_kernel(ctx, inputs, outputs):
    torch.add(inputs[0], 1, out=outputs[0])


def other_kernel(ctx, inputs, outputs):
    torch.add(inputs[0], 2, out=outputs[0])


def small_head_dim_only(call: Call) -> str | None:
    d = call.params.get("head_dim")
    return None if d is None or d <= 128 else f"head_dim {d} > 128"


@pytest.fixture
def d() -> Dispatcher:
    disp = Dispatcher(backends={})
    disp.define(KEY.op)
    return disp


def test_higher_priority_wins_and_explain_says_why(d):
    d.register(KEY, ref_kernel, provider="reference")
    d.register(KEY, fast_kernel, provider="blas")
    assert d.lookup(KEY) is fast_kernel
    exp = d.explain(KEY)
    assert exp.winner.provider == "blas"
    statuses = {c.provider: s for c, s in exp.rows}
    assert statuses["blas"] == "active"
    assert "lower priority than blas" in statuses["reference"]
    assert "blas" in str(exp) and "reference" in str(exp)


def test_registration_order_does_not_matter_for_priority(d):
    d.register(KEY, fast_kernel, provider="blas")
    d.register(KEY, ref_kernel, provider="reference")
    assert d.lookup(KEY) is fast_kernel


def test_same_function_again_is_a_noop_and_keeps_generation(d):
    d.register(KEY, ref_kernel, provider="reference")
    gen = d.generation
    d.register(KEY, ref_kernel, provider="reference")
    assert d.generation == gen
    assert len(d.candidates(KEY)) == 1


def test_different_function_same_provider_is_an_error_unless_override(d):
    d.register(KEY, ref_kernel, provider="reference")
    with pytest.raises(dtorch.RegistrationError, match="override=True"):
        d.register(KEY, other_kernel, provider="reference")
    gen = d.generation
    d.register(KEY, other_kernel, provider="reference", override=True)
    assert d.generation > gen
    assert d.lookup(KEY) is other_kernel
    assert len(d.candidates(KEY)) == 1


def test_every_registration_changes_the_generation(d):
    gens = [d.generation]
    for provider in ("reference", "blas", "triton"):
        d.register(KEY, ref_kernel, provider=provider)
        gens.append(d.generation)
    assert len(set(gens)) == len(gens)


def test_capability_check_declines_with_a_reason(d):
    d.register(KEY, ref_kernel, provider="reference")
    d.register(KEY, fast_kernel, provider="sdpa", check=small_head_dim_only)
    small = Call(dtorch.Device("cpu"), torch.float32, KernelParams(head_dim=64))
    big = Call(dtorch.Device("cpu"), torch.float32, KernelParams(head_dim=256))
    assert d.select(KEY, small).fn is fast_kernel
    assert d.select(KEY, big).fn is ref_kernel
    choice = d.choose(KEY, big)
    assert choice.passed_over[0][0].provider == "sdpa"
    assert choice.passed_over[0][1] == "head_dim 256 > 128"
    assert "head_dim 256 > 128" in str(d.explain(KEY, big))


def test_all_declining_raises_with_reasons(d):
    d.register(KEY, fast_kernel, provider="sdpa", check=small_head_dim_only)
    big = Call(dtorch.Device("cpu"), torch.float32, KernelParams(head_dim=256))
    with pytest.raises(dtorch.KernelNotFound, match="sdpa declined: head_dim 256 > 128"):
        d.select(KEY, big)


def test_disabled_block_switches_provider_and_restores(d):
    d.register(KEY, ref_kernel, provider="reference")
    d.register(KEY, fast_kernel, provider="blas")
    with d.disabled("blas"):
        assert d.lookup(KEY) is ref_kernel
        assert "disabled" in dict((c.provider, s) for c, s in d.explain(KEY).rows)["blas"]
    assert d.lookup(KEY) is fast_kernel


def test_prepared_kernel_follows_a_disabled_block(d):
    d.register(KEY, ref_kernel, provider="reference")
    d.register(KEY, other_kernel, provider="blas")
    pk = PreparedKernel(d, KEY)
    x = torch.zeros(3)
    out = torch.empty(3)
    pk(dtorch.KernelContext(dtorch.Device("cpu")), (x,), (out,))
    assert torch.equal(out, x + 2)
    with d.disabled("blas"):
        pk(dtorch.KernelContext(dtorch.Device("cpu")), (x,), (out,))
        assert torch.equal(out, x + 1)
        assert pk.provider == "reference"


def test_missing_kernel_lists_what_is_registered(d):
    d.define("llm.rms_norm")
    d.register(KernelKey("llm.rms_norm", "cpu", torch.float32), ref_kernel, provider="reference")
    d.register(KernelKey("llm.rms_norm", "cpu", torch.bfloat16), ref_kernel, provider="reference")
    d.register(KernelKey("llm.rms_norm", "cuda", torch.float16), ref_kernel, provider="reference")
    with pytest.raises(dtorch.KernelNotFound) as info:
        d.lookup(KernelKey("llm.rms_norm", "cuda", torch.float8_e4m3fn))
    msg = str(info.value)
    assert "llm.rms_norm on cuda/float8_e4m3fn" in msg
    assert "cpu/{bfloat16,float32}" in msg and "cuda/{float16}" in msg
    assert not d.has_kernel(KernelKey("llm.rms_norm", "cuda", torch.float8_e4m3fn))


def test_unknown_op_is_named(d):
    with pytest.raises(dtorch.KernelNotFound, match="'nope.op' is not registered"):
        d.lookup(KernelKey("nope.op", "cpu", torch.float32))


def test_table_marks_one_active_row_per_key(d):
    d.register(KEY, ref_kernel, provider="reference")
    d.register(KEY, fast_kernel, provider="blas", meta=KernelMeta(requires_dense=True))
    rows = d.table()
    assert [(r.provider, r.active) for r in rows] == [("blas", True), ("reference", False)]
    assert rows[0].meta.requires_dense
    assert d.lookup_meta(KEY).requires_dense


def test_global_table_shows_accelerated_overrides():
    rows = [r for r in dtorch.dispatcher.table("cpu") if r.key.op == "unary.silu" and r.key.dtype == torch.float32]
    assert {r.provider: r.active for r in rows} == {"torch": True, "reference": False}


def test_bad_registrations_are_errors(d):
    with pytest.raises(dtorch.RegistrationError):
        d.register(("test.op", "cpu", torch.float32), ref_kernel, provider="user")  # a plain tuple is not a KernelKey
    with pytest.raises(dtorch.RegistrationError):
        d.register(KEY, "not callable", provider="user")
    with pytest.raises(dtorch.ArgumentError):
        KernelKey.of("noseparator", "cpu", torch.float32)
    with pytest.raises(dtorch.ArgumentError):
        KernelKey.of("a.b", "tpu", torch.float32)


def test_lazy_backend_registers_once_under_contention():
    calls = []
    kernels = KernelSet(devices=("cpu",))
    kernels.add("lazy.op", ref_kernel, (torch.float32, torch.float64))

    def loader(disp: Dispatcher, device_type: str) -> None:
        calls.append(threading.get_ident())
        time.sleep(0.05)  # widen the window in which other threads miss
        kernels.install(disp, "cpu")

    d = Dispatcher(backends={"cpu": loader})
    barrier = threading.Barrier(16)
    found, errors = [], []

    def worker():
        barrier.wait()
        try:
            found.append(d.lookup(KernelKey("lazy.op", "cpu", torch.float64)))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    assert len(calls) == 1 and d.backend_loads["cpu"] == 1
    assert found == [ref_kernel] * 16
    # a later miss on the loaded backend does not register again
    assert not d.has_kernel(KernelKey("lazy.op", "cpu", torch.int32))
    assert len(calls) == 1


def test_lookups_stay_consistent_while_another_thread_registers(d):
    keys = [KernelKey(d.define(f"conc.op{i}"), "cpu", torch.float32) for i in range(50)]
    d.register(KEY, ref_kernel, provider="reference")
    stop = threading.Event()
    seen, errors = set(), []

    def reader():
        while not stop.is_set():
            try:
                seen.add(d.lookup(KEY))
                d.table()
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

    def writer():
        for i, k in enumerate(keys):
            d.register(k, ref_kernel, provider="reference")
            if i == 25:
                d.register(KEY, fast_kernel, provider="blas")

    readers = [threading.Thread(target=reader) for _ in range(8)]
    for t in readers:
        t.start()
    w = threading.Thread(target=writer)
    w.start()
    w.join(10)
    stop.set()
    for t in readers:
        t.join(10)
    assert not errors
    assert seen <= {ref_kernel, fast_kernel}
    assert d.lookup(KEY) is fast_kernel
    assert all(d.has_kernel(k) for k in keys)


def test_kernel_params_are_owned_and_immutable():
    dims = [1, 2]
    p = KernelParams(dims=dims, eps=1e-6)
    dims.append(3)
    assert p.dims == (1, 2)  # a copy, frozen at construction
    with pytest.raises(dtorch.ArgumentError):
        p.eps = 1.0
    with pytest.raises(dtorch.ArgumentError, match="tensor"):
        KernelParams(x=torch.ones(1))
    with pytest.raises(dtorch.ArgumentError, match="not given"):
        _ = p.missing
    assert p.replace(eps=1e-5).eps == 1e-5 and p.eps == 1e-6


def test_params_survive_the_caller_for_a_deferred_kernel():
    # A kernel queued now and run later sees the params as they were when it was queued.
    seen = []
    d = Dispatcher(backends={})
    d.define(KEY.op)
    d.register(KEY, lambda ctx, i, o: seen.append(ctx.params.scale), provider="reference")
    pk = PreparedKernel(d, KEY)
    scale = [0.5]
    queued = [dtorch.KernelContext(dtorch.Device("cpu"), params=KernelParams(scale=scale))]
    deferred = threading.Thread(target=lambda: (time.sleep(0.02), pk(queued.pop(), (), ())))
    deferred.start()
    scale[0] = 2.0  # the caller changes its list after queueing
    deferred.join(5)
    assert seen == [(0.5,)]


def test_verify_mode_catches_a_wrong_accelerated_kernel():
    key = KernelKey("unary.exp", "cpu", torch.float32)
    x = torch.randn(8)

    def wrong_exp(ctx, inputs, outputs):
        torch.exp(inputs[0] * 1.01, out=outputs[0])

    dtorch.dispatcher.register(key, wrong_exp, provider="user")
    try:
        assert not torch.allclose(dtorch.ops.exp(x), torch.exp(x))  # the wrong kernel is active
        with dtorch.verify(), pytest.raises(dtorch.VerifyError, match="unary.exp/cpu/float32"):
            dtorch.ops.exp(x)
    finally:
        dtorch.dispatcher.unregister(key, "user")
    with dtorch.verify():
        torch.testing.assert_close(dtorch.ops.exp(x), torch.exp(x))
