"""A decode step's frames each do work: on one CPU device, the frames between ``Engine.step`` and a kernel are the
engine's step, the executor's step and the Runner's run and loop, nothing that only passes the call on; a traced run
and one under ``forbid_host_sync`` take the stream path (each kernel traced, or checked) and compute the same; a
failing kernel on the bare path is reported as on a stream. Multi-stream and multi-device runs keep their path
(``test_runtime``, ``test_runtime_static``, ``test_trace`` and the tensor-parallel tests cover them)."""

from __future__ import annotations

import sys

import pytest
import torch

import dtorch
from dtorch import DeviceMesh, LogicalGraph, Runner
from dtorch.core import hostsync
from dtorch.dispatch.key import KernelKey
from dtorch.kernels.torch import llm as torch_llm

transformers = pytest.importorskip("transformers")

# the frames that may stand between Engine.step (excluded) and a kernel (excluded) on the one-device path, each doing
# work (torch.no_grad's wrapper of Engine.step sits above it). Where the engine keeps pipeline micro-batches in flight,
# a step is launched (drafts, the step's plan) and submitted (bucket, feeds) before the Runner runs it.
ALLOWED = {
    "Engine._launch": "drafts and makes the step's plan, starts it on the executor",
    "Executor.step": "pads the step to its bucket and builds its feeds (or waits for a submitted step)",
    "Executor.submit": "pads the step to its bucket, builds its feeds, runs it",
    "Runner.run": "places the feeds, runs the program, collects the outputs",
    "Runner._call_kernels": "the loop over the bound kernels",
}
RMS = KernelKey("llm.rms_norm", "cpu", torch.float32)  # the final norm of a step: one kernel


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(transformers model, LLM) of a tiny random Llama."""
    from dtorch.engine.llm import LLM
    from tests.tiny_models import families, save_random

    config = families(transformers, heads=4, kv_heads=2, vocab=128, qwen3_head_dim=32)["llama"]()
    hf = save_random(transformers, config, path := tmp_path_factory.mktemp("llama"))
    llm = LLM(str(path), max_num_seqs=2)
    yield hf, llm
    llm.close()


def _frames_below_step() -> list[str]:
    """The qualified names of the frames between ``Engine.step`` and the caller of this function's caller."""
    names = []
    f = sys._getframe(2)
    while f is not None and f.f_code.co_qualname != "Engine.step":
        names.append(f.f_code.co_qualname)
        f = f.f_back
    assert f is not None, "the kernel ran outside Engine.step"
    return names[::-1]


def _decode(llm, seen: list[list[str]], prompt: list[int], n: int) -> list[int]:
    """Greedy ids of ``n`` tokens after ``prompt`` with a plugged rms_norm that records its frames in ``seen``."""
    def plugged(ctx, inputs, outputs):
        seen.append(_frames_below_step())
        torch_llm.rms_norm_torch(ctx, inputs, outputs)

    dtorch.dispatcher.register(RMS, plugged, provider="user", meta=torch_llm.INPLACE)
    try:
        params = dtorch.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return llm.generate([prompt], params)[0].outputs[0].token_ids
    finally:
        dtorch.dispatcher.unregister(RMS, "user")


def test_a_decode_step_calls_its_kernels_from_the_runner_loop(llama):
    from tests.tiny_models import hf_greedy

    hf, llm = llama
    seen: list[list[str]] = []
    ids = _decode(llm, seen, [5, 9, 17, 3], 4)
    assert ids == hf_greedy(hf, [5, 9, 17, 3], 4)  # the plugged kernel's steps compute as transformers
    assert len(seen) == 4  # one prefill step and three decode steps, each its final norm
    # the first call of each bucket's binding (the prefill's, the first decode's) checks the kernel ABI once in
    # PreparedKernel._first_call; the decode steps after it call the kernel itself
    for frames in seen[2:]:
        passing = [name for name in frames if name not in ALLOWED]
        assert not passing, f"frames between Engine.step and the kernel that are not in ALLOWED: {passing} ({frames})"
        assert frames[-2:] == ["Runner.run", "Runner._call_kernels"], frames  # the kernel called from the loop
        assert len(frames) == len(set(frames)), frames


def test_host_sync_checks_and_traces_take_the_stream_path(llama, monkeypatch):
    """With host reads forbidden (``DTORCH_FORBID_SYNC``'s flag: the streams enter the mode for each item) each kernel
    runs inside the stream's check (the frames show it) and computes the same; a traced static one-device Runner
    records every kernel and returns what the untraced one does."""
    hf, llm = llama
    seen: list[list[str]] = []
    want = _decode(llm, seen, [7, 8], 3)
    seen.clear()
    monkeypatch.setattr(hostsync, "_FLAG", True)  # what DTORCH_FORBID_SYNC=1 sets at import
    monkeypatch.setattr(hostsync, "ON", True)
    assert _decode(llm, seen, [7, 8], 3) == want
    assert seen and all("KernelStream.execute" in frames for frames in seen)
    monkeypatch.undo()

    g = LogicalGraph(DeviceMesh.cpu(1))
    x = g.input("x", (4, 8))
    g.output("y", (x.exp() * x).relu())
    feeds = {"x": torch.randn(4, 8)}
    with Runner(g, static=True, trace=True) as traced, Runner(g, static=True) as plain:
        assert traced.program.calls is not None  # the one-device static plan has bare calls, yet traces
        got = traced.run(feeds)["y"]
        torch.testing.assert_close(got, plain.run(feeds)["y"], rtol=0, atol=0)
        torch.testing.assert_close(got, (feeds["x"].exp() * feeds["x"]).relu())
        assert [e[-3] for e in traced.tracer.events] == [k.label for k in traced.kernels]


def test_a_failing_kernel_on_the_bare_path_is_reported_and_the_runner_recovers():
    fail = {"on": True}

    def maybe_fail(t: torch.Tensor) -> torch.Tensor:
        if fail["on"] and not t.is_meta:
            raise ValueError("boom")
        return t + 1

    g = LogicalGraph(DeviceMesh.cpu(1))
    g.output("y", g.python(maybe_fail, g.input("x", (2, 3)).exp(), name="maybe_fail").relu())
    x = torch.randn(2, 3)
    with Runner(g, static=True) as r:
        assert r.program.calls is not None
        with pytest.raises(dtorch.KernelFailure, match=r"python.maybe_fail.*cpu:0.*compute.*boom"):
            r.run({"x": x})
        fail["on"] = False
        torch.testing.assert_close(r.run({"x": x})["y"], (x.exp() + 1).relu())


def test_the_bound_calls_are_the_kernels_own_and_follow_a_rebind():
    """After a whole run the loop binds each call once (the kernel's own ``bind`` where it has one); later runs call
    what it bound, and a registration re-binds: the next run calls the kernel now chosen, then binds again."""
    key = KernelKey("unary.exp", "cpu", torch.float32)
    runs = {"bind": 0, "bound": 0}

    def plus_one(ctx, inputs, outputs):  # exp(x) + 1, so which kernel ran shows in the output
        torch.add(inputs[0].exp(), 1, out=outputs[0])

    def bind(ctx, inputs, outputs):
        runs["bind"] += 1

        def bound():
            runs["bound"] += 1
            plus_one(ctx, inputs, outputs)
        return bound

    plus_one.bind = bind
    g = LogicalGraph(DeviceMesh.cpu(1))
    g.output("y", g.input("x", (4, 8)).exp())
    x = torch.randn(4, 8)
    with Runner(g, static=True) as r:
        torch.testing.assert_close(r.run({"x": x})["y"], x.exp(), rtol=0, atol=0)  # then bound: the torch kernel
        dtorch.dispatcher.register(key, plus_one, provider="user")
        try:
            for _ in range(3):  # the first run re-binds (and checks the ABI), the later ones call the bound call
                torch.testing.assert_close(r.run({"x": x})["y"], x.exp() + 1)
            assert runs == {"bind": 1, "bound": 2}
        finally:
            dtorch.dispatcher.unregister(key, "user")
        torch.testing.assert_close(r.run({"x": x})["y"], x.exp(), rtol=0, atol=0)
        assert runs["bound"] == 2


def test_step_feeds_match_the_plan_and_refuse_too_many_blocks(llama):
    """A step of two sequences (a decode past a block freed behind a window, -1, and a prompt chunk) padded to its
    bucket: its feeds, built from two host tensors and views of the RoPE table, are the plan's rows computed here with
    torch (ids, cache slots, cu_seqlens, lengths, block table with -1 read as 0, cos / sin gathered from the table);
    a sequence with more blocks than a table row holds is refused."""
    from dtorch.core.errors import ModelError
    from dtorch.models.bucket import bucket_for
    from dtorch.models.executor import StepPlan

    _, llm = llama
    ex = llm.executor
    bs, m = ex.cache.block_size, ex.cache.max_blocks_per_seq
    a, b = [-1, 3], [5]
    plan = StepPlan([7, 1, 2, 3], [1, 3], [bs + 2, 0], [a, b])
    bucket = bucket_for(4, 2)
    feeds = ex.feeds(plan, bucket)
    T, N = bucket.tokens, bucket.seqs
    pos = torch.tensor([bs + 2, 0, 1, 2] + [0] * (T - 4))
    assert torch.equal(feeds["ids"], torch.tensor([7, 1, 2, 3] + [0] * (T - 4)))
    slots = [3 * bs + 2, 5 * bs, 5 * bs + 1, 5 * bs + 2] + [-1] * (T - 4)  # padding rows write no slot
    assert torch.equal(feeds["slot_mapping"], torch.tensor(slots))
    assert torch.equal(feeds["cu_seqlens_q"], torch.tensor([0, 1, 4, T] + [T] * (N - 3), dtype=torch.int32))
    assert torch.equal(feeds["seqlens_k"], torch.tensor([bs + 3, 3] + [0] * (N - 2), dtype=torch.int32))
    table = torch.zeros(N, m, dtype=torch.int32)
    table[0, :2], table[1, :1] = torch.tensor([0, 3]), torch.tensor([5])
    assert torch.equal(feeds["block_table"], table)
    assert torch.equal(feeds["cos"], ex.model.rope_table[pos, 0])
    assert torch.equal(feeds["sin"], ex.model.rope_table[pos, 1])
    one = ex.feeds(StepPlan([7], [1], [bs + 2], [a]), bucket_for(1, 1))
    assert torch.equal(one["cos"], ex.model.rope_table[bs + 2:bs + 3, 0])
    with pytest.raises(ModelError, match="more than the cache's"):
        ex.feeds(StepPlan([7], [1], [0], [[0] * (m + 1)]), bucket_for(1, 1))


@pytest.mark.parametrize("case", ["padded", "decode", "two decodes", "speculative rows"])
def test_feeds_written_into_the_runner_buffers_are_the_built_ones(llama, case):
    """A one-CPU Runner's feed buffers, written with numpy (``Executor.feeds(into=...)``, what ``submit`` does once a
    bucket's Runner is built), hold exactly the feeds built with torch, and are the feeds (the run copies nothing)."""
    from dtorch.models.bucket import bucket_for
    from dtorch.models.executor import StepPlan

    _, llm = llama
    ex = llm.executor
    bs = ex.cache.block_size
    plan, bucket = {
        "padded": (StepPlan([7, 1, 2, 3], [1, 3], [bs + 2, 0], [[-1, 3], [5]]), bucket_for(4, 2)),
        "decode": (StepPlan([7], [1], [bs + 2], [[2, 4]]), bucket_for(1, 1)),
        "two decodes": (StepPlan([7, 9], [1, 1], [bs + 2, 5], [[2, 4], [6]]), bucket_for(2, 2)),
        "speculative rows": (StepPlan([7, 8, 9, 4], [3, 1], [bs - 1, 2], [[2, 4], [6]], logits=[3, 1]),
                             bucket_for(4, 2, rows=4)),
    }[case]
    built = ex.feeds(plan, bucket)
    into = ex.runner(bucket).feed_buffers()
    assert into is not None and set(into) == set(built)
    for t, _ in into.values():
        t.fill_(-7)  # every value must be written
    written = ex.feeds(plan, bucket, into)
    assert set(written) == set(built)
    for name, t in written.items():
        assert t is into[name][0] and torch.equal(t, built[name]), name
