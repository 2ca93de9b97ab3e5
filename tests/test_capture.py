"""Capture mode: the dispatcher passes over kernels that are not capture-safe for a captured call, prepared operators
and Runners bind for capture, a static Runner records its second run and replays it after, and the decode step of a
model replays with the logits of an uncaptured step.

A CUDA graph needs a GPU; here a recorder that keeps ``issue`` and calls it again on replay stands in for one. Its
replays run under ``forbid_host_sync``, as a CUDA graph's recording runs under the sync ban, so a kernel that reads a
device value on the host fails the test. The real recorder is checked by the cuda-marked test at the end.
"""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import DeviceMesh, LogicalGraph, Runner
from dtorch.core.hostsync import forbid_host_sync
from dtorch.dispatch import Call, Dispatcher, KernelKey, KernelMeta
from dtorch.ops import OperatorInitContext, RMSNorm

KEY = KernelKey("test.op", "cpu", torch.float32)
UNSAFE = KernelMeta(capture_safe=False)


def _plus_one(ctx, inputs, outputs):
    torch.add(inputs[0], 1, out=outputs[0])


def _plus_one_host(ctx, inputs, outputs):  # a kernel reading a value on the host (a sync on a GPU)
    torch.add(inputs[0], float(inputs[0].sum().item()) * 0 + 1, out=outputs[0])


class HostRecorder:
    """Stands in for ``CudaGraphRecorder``: a recording is ``issue`` itself, replayed under the host-sync ban."""

    def __init__(self) -> None:
        self.recorded = 0
        self.replays = 0

    def record(self, issue):
        self.recorded += 1
        recorder = self

        class Recording:
            def replay(self) -> None:
                recorder.replays += 1
                with forbid_host_sync():
                    issue()
        return Recording()


# -- the dispatcher and prepared operators -------------------------------------------------------------------

def test_captured_calls_pass_over_kernels_that_are_not_capture_safe():
    d = Dispatcher(backends={})
    d.define(KEY.op)
    d.register(KEY, _plus_one, provider="reference")
    d.register(KEY, _plus_one_host, provider="user", meta=UNSAFE)
    plain, captured = Call(KEY.device, KEY.dtype), Call(KEY.device, KEY.dtype, capture=True)
    assert d.choose(KEY, plain).winner.provider == "user"
    assert d.select(KEY, plain).provider == "user"  # fills the per-key cache a captured call must not use
    choice = d.choose(KEY, captured)
    assert choice.winner.provider == "reference"
    assert d.select(KEY, captured).provider == "reference"
    assert "not capture-safe" in dict((c.provider, r) for c, r in choice.passed_over)["user"]
    rows = dict((c.provider, status) for c, status in d.explain(KEY, captured).rows)
    assert rows["reference"] == "active" and "not capture-safe" in rows["user"]
    d.unregister(KEY, "reference")
    with pytest.raises(dtorch.KernelNotFound, match="not capture-safe"):
        d.choose(KEY, captured)


def test_prepared_operator_for_capture_binds_a_capture_safe_kernel():
    d = Dispatcher()
    key = KernelKey("llm.rms_norm", "cpu", torch.float32)
    d.register(key, lambda ctx, ins, outs: outs[0].copy_(ins[0]), provider="user", meta=UNSAFE)
    eager = RMSNorm(1e-6).prepare(OperatorInitContext("cpu", torch.float32), dispatcher=d)
    captured = RMSNorm(1e-6).prepare(OperatorInitContext("cpu", torch.float32, capture=True), dispatcher=d)
    assert eager.provider == "user"
    assert captured.provider != "user" and captured.kernel.meta.capture_safe
    assert "not capture-safe" in str(captured.explain())
    x, w = torch.randn(3, 8), torch.randn(8)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(captured.forward(x, w), want, rtol=1e-5, atol=1e-5)


# -- the Runner -------------------------------------------------------------------------------------------------

def _graph():
    g = LogicalGraph(DeviceMesh.cpu(1))
    w = torch.randn(16, 16) / 4
    x = g.input("x", (4, 16))
    g.output("y", (x @ g.param("w", w)).relu() + x)
    return g, w


def test_static_runner_records_its_second_run_and_replays_it():
    g, w = _graph()
    rec = HostRecorder()
    with Runner(g, static=True, capture=True, recorder=rec) as r:
        assert r.capture_off is None and not r.captured
        for step in range(4):  # run 0 uncaptured, run 1 records and replays, runs 2.. replay
            x = torch.randn(4, 16)
            torch.testing.assert_close(r.run({"x": x})["y"], torch.relu(x @ w) + x, rtol=1e-5, atol=1e-5)
            assert rec.recorded == (step >= 1) and rec.replays == max(0, step)
        assert r.captured


def test_runner_says_why_it_cannot_capture():
    g, w = _graph()
    with Runner(g, static=True, capture=True) as r:  # nothing records on a CPU
        assert "cpu" in r.capture_off
        r.run({"x": torch.randn(4, 16)})
        r.run({"x": torch.randn(4, 16)})
        assert not r.captured
    with Runner(g, capture=True, recorder=HostRecorder()) as r:
        assert "static" in r.capture_off
    with Runner(g, static=True) as r:
        assert r.capture_off == "capture was not asked for"
    with pytest.raises(dtorch.ArgumentError, match="'capture' must be a bool or a Capture"):
        Runner(g, static=True, capture="yes")

    p = LogicalGraph(DeviceMesh.cpu(1))
    p.output("y", p.python(lambda t: t * 2, p.input("x", (4, 16))))
    with Runner(p, static=True, capture=True, recorder=HostRecorder()) as r:
        assert "PythonKernel" in r.capture_off

    d = Dispatcher()  # relu served only by a kernel that is not capture-safe: bound for an uncaptured run
    key = KernelKey("unary.relu", "cpu", torch.float32)
    for cand in d.candidates(key):
        d.unregister(key, cand.provider)
    d.register(key, lambda ctx, ins, outs: torch.clamp(ins[0], min=0, out=outs[0]), provider="user", meta=UNSAFE)
    rec = HostRecorder()
    with Runner(g, static=True, capture=True, recorder=rec, dispatcher=d) as r:
        assert r.capture_off == "no capture-safe kernel for unary.relu/cpu/float32 (1 operator: unary.relu#1)"
        x = torch.randn(4, 16)
        for _ in range(3):
            torch.testing.assert_close(r.run({"x": x})["y"], torch.relu(x @ w) + x, rtol=1e-5, atol=1e-5)
        assert rec.recorded == 0 and not r.captured


def test_runners_sharing_a_capture_record_into_its_one_recorder():
    from dtorch.runtime.capture import Capture

    g, w = _graph()
    rec = HostRecorder()
    shared = Capture(recorder=rec)
    with Runner(g, static=True, capture=shared) as a, Runner(g, static=True, capture=shared) as b:
        for _ in range(3):
            for r in (a, b):
                x = torch.randn(4, 16)
                torch.testing.assert_close(r.run({"x": x})["y"], torch.relu(x @ w) + x, rtol=1e-5, atol=1e-5)
        assert a.captured and b.captured and rec.recorded == 2 and rec.replays == 4
        assert a.capture.status() == "captured"
    device = dtorch.Device("cpu")
    assert "mesh of 2 devices" in Capture.for_steps(device, 2, recorder=rec).off
    assert Capture.for_steps(device, 1, asked=False, recorder=rec).off == "capture was not asked for"
    assert Capture.for_steps(device, 1, recorder=rec).off is None and "cpu" in Capture(device).off


def test_a_recording_that_fails_leaves_the_runner_uncaptured():
    class Failing:
        def record(self, issue):
            raise RuntimeError("operation not permitted when stream is capturing")

    g, w = _graph()
    with Runner(g, static=True, capture=True, recorder=Failing()) as r:
        for _ in range(3):
            x = torch.randn(4, 16)
            torch.testing.assert_close(r.run({"x": x})["y"], torch.relu(x @ w) + x, rtol=1e-5, atol=1e-5)
        assert not r.captured and "recording failed" in r.capture_off and "not permitted" in r.capture_off


# -- a model's decode step ----------------------------------------------------------------------------------------

def _families(transformers):
    from tests.tiny_models import families, tiny_config

    common = dict(vocab_size=96, max_position_embeddings=256, initializer_range=0.02)  # transformers' default init
    return {
        "qwen3": families(transformers, 4, 2, 96, 16)["qwen3"],
        "qwen3_5_text": lambda: tiny_config(transformers, "qwen3_5_text", **common),  # gated delta net + attention
        "qwen3_next": lambda: tiny_config(transformers, "qwen3_next", **common, num_experts=4),
    }


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5_text", "qwen3_next"])
def checkpoint(request, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from tests.tiny_models import save_random

    path = tmp_path_factory.mktemp(request.param)
    save_random(transformers, _families(transformers)[request.param](), path)
    return request.param, path


def _executor(path, recorder):
    from dtorch.models.executor import Executor
    from dtorch.models.kv_cache import KVCache
    from dtorch.models.loaders import open_checkpoint
    from dtorch.models.model import Transformer
    from dtorch.runtime.comm import default_communicator

    mesh = DeviceMesh.cpu(1)
    with open_checkpoint(path, torch.float32) as ckpt:
        model = Transformer.load(ckpt.config, ckpt.get, mesh, (0,), torch.float32)
    ex = Executor(model, default_communicator(mesh.ids, 30.0), (0,), 30.0, capture=recorder is not None,
                  recorder=recorder)
    cache = KVCache(model.layout, mesh, (0,), 16, 4, 64, 4, torch.float32)
    if cache.has_state:
        for slot in range(cache.num_state_slots):
            cache.reset_state(slot)
    ex.use_cache(cache)
    return ex


@pytest.mark.parametrize("disabled", [(), ("native",)], ids=["default", "torch-kernels"])
def test_decode_steps_replay_with_the_logits_of_uncaptured_steps(checkpoint, disabled):
    """Prefill, then the decode bucket recorded ahead on padding rows alone (as Engine.warmup does: the cache and
    the states must come out of it unchanged), then decode steps: the replays give the uncaptured logits. With the
    native kernels disabled the torch kernels serve every op, as on a GPU without triton. A MoE model's experts run
    on the gathered kernel there (the others read the routing on the host); with a cap on the gathered weights
    below one step's, its decode bucket runs uncaptured and says why."""
    from dtorch.models.bucket import bucket_for
    from dtorch.models.executor import StepPlan

    family, path = checkpoint
    rec = HostRecorder()
    with dtorch.dispatcher.disabled(*disabled):
        eager, captured = _executor(path, None), _executor(path, rec)
        try:
            prompts, blocks = [[5, 9, 3, 7, 11], [4, 8, 15]], [[0, 1, 2], [3, 4, 5]]
            slots = [0, 1] if captured.cache.has_state else ()
            for ex in (eager, captured):
                ex.step(StepPlan([t for p in prompts for t in p], [5, 3], [0, 0], blocks, slots))
            assert captured.capture_now(bucket_for(2, 2)) and not eager.capture_now(bucket_for(2, 2))
            lens = [5, 3]
            for step in range(4):
                plan = StepPlan([10 + step, 20 + step], [1, 1], lens, blocks, slots)
                torch.testing.assert_close(captured.step(plan), eager.step(plan), rtol=1e-5, atol=1e-5)
                lens = [n + 1 for n in lens]
            (decode,) = [status for b, status in captured.capture_report().items() if b.decode]
            assert decode == "captured" and rec.recorded == 1 and rec.replays == 5
            assert all(status == "capture was not asked for" for b, status in captured.capture_report().items()
                       if not b.decode)
            assert all(status == "capture was not asked for" for status in eager.capture_report().values())
        finally:
            eager.close()
            captured.close()


def test_moe_experts_past_the_gather_limit_run_uncaptured(checkpoint, monkeypatch):
    from dtorch.kernels.torch import moe
    from dtorch.models.bucket import bucket_for

    family, path = checkpoint
    if family != "qwen3_next":
        pytest.skip("a MoE model's case")
    monkeypatch.setattr(moe, "GATHER_LIMIT", 1)
    rec = HostRecorder()
    captured = _executor(path, rec)
    try:
        assert not captured.capture_now(bucket_for(1, 1)) and rec.recorded == 0
        (decode,) = captured.capture_report().values()
        assert decode.startswith("no capture-safe kernel for llm.moe_experts/cpu/float32 (4 operators:"), decode
    finally:
        captured.close()


def test_llm_enforce_eager_is_a_bool_and_a_cpu_says_why_it_does_not_capture():
    from dtorch import LLM, SamplingParams

    with pytest.raises(dtorch.ArgumentError, match="enforce_eager"):
        LLM(enforce_eager="no")
    llm = LLM(threads=1, max_num_seqs=2)
    try:
        llm.generate(["Hi"], SamplingParams(max_tokens=3, temperature=0))
        report = llm.capture_report()
        assert report and all("cpu" in status for status in report.values())
    finally:
        llm.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_recorder_replays_a_runner():
    from dtorch.runtime.capture import CudaGraphRecorder

    g = LogicalGraph(DeviceMesh.cuda(1))
    w = torch.randn(16, 16, device="cuda") / 4
    x = g.input("x", (4, 16))
    g.output("y", (x @ g.param("w", w)).relu() + x)
    with Runner(g, static=True, capture=True, recorder=CudaGraphRecorder(g.mesh.device(0))) as r:
        for _ in range(4):
            xs = torch.randn(4, 16)
            torch.testing.assert_close(r.run({"x": xs})["y"].cpu(), torch.relu(xs @ w.cpu()) + xs, rtol=1e-4,
                                       atol=1e-4)
        assert r.captured, r.capture_off
