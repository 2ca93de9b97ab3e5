"""Pipeline parallelism in one process: the layers split into contiguous stages over a (pp, tp) ``DeviceMesh``, each
stage a placement of the one step graph on its tp group, the residual stream sent stage to stage on the communicate
streams, up to P micro-batches in flight. On every family: greedy ids equal tp=1's (and the logits transformers') at
pp=2, pp=3 with an uneven split and pp=2 x tp=2 (four CPU devices), with prefix caching, preemption (a small cache)
and speculative decoding (n-gram drafts; a draft model) on; each stage holds only its layers' weights and caches; a
traced pipelined generation shows the stages computing at the same time."""

from __future__ import annotations

import threading

import pytest
import torch

import dtorch
from dtorch.distributed.inprocess import InProcessCommunicator
from dtorch.engine.llm import LLM
from dtorch.engine.sampling import SamplingParams
from dtorch.graph import DeviceMesh, LogicalGraph, Replicate, Shard
from dtorch.models import families
from dtorch.models.tiny import tiny_config
from dtorch.runtime.runner import Runner
from tests.test_engine import one_sequence_cache
from tests.tiny_models import save_random

transformers = pytest.importorskip("transformers")

# the second shares a prefix of eight blocks with the first (block_size 4: prefix caching hits it); the first repeats
# itself, so n-gram drafts find something to propose
PROMPTS = [[5, 17, 99, 3, 64, 120, 7] * 5, [5, 17, 99, 3, 64, 120, 7] * 5 + [42], [9] * 12 + [11, 12], [77, 78, 79]]
SPLITS = [dict(pipeline_parallel_size=2), dict(pipeline_parallel_size=3, pp_layers="uneven"),
          dict(pipeline_parallel_size=2, tensor_parallel_size=2)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _config(name: str):
    """The family's tiny config, with 4 layers where it has fewer than 3 (pp=3 needs a layer per stage)."""
    c = tiny_config(transformers, name)
    return c if c.num_hidden_layers >= 3 else tiny_config(transformers, name, num_hidden_layers=4)


def _reference(name: str, tmp_path_factory) -> tuple:
    """(transformers model, checkpoint directory, greedy ids of PROMPTS at tp=1, one stage, nothing else on)."""
    hf = save_random(transformers, _config(name), path := tmp_path_factory.mktemp(name))
    llm = LLM(str(path), max_num_seqs=4, block_size=4, max_model_len=64)
    greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _greedy())]
    llm.close()
    return hf, str(path), greedy


@pytest.fixture(scope="module", params=families.names())
def family(request, tmp_path_factory):
    """Every registered family's tiny model (``_reference``)."""
    return _reference(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny Llama (``_reference``), for what does not depend on the family."""
    return _reference("llama", tmp_path_factory)


def _split(split: dict, layers: int) -> dict:
    """``split`` with its uneven ``pp_layers`` for a model of ``layers`` layers: all but two in the first stage."""
    return split | {"pp_layers": [layers - 2, 1, 1]} if "pp_layers" in split else split


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("split", SPLITS, ids=["pp2", "pp3-uneven", "pp2xtp2"])
def test_greedy_ids_and_logits_match(family, split):
    """Micro-batches in flight, a cache of about one sequence (preemption), n-gram drafts, prefix caching: the same
    greedy ids as one device with none of that."""
    hf, path, greedy = family
    # eleven blocks: the longest sequence (44 tokens) fits alone, the four together do not
    llm = LLM(path, max_num_seqs=4, block_size=4, max_model_len=44, max_num_batched_tokens=16,
              kv_cache_memory_bytes=one_sequence_cache(path, 44), speculative_config=NGRAM,
              **_split(split, hf.config.num_hidden_layers))
    try:
        pp, tp = split["pipeline_parallel_size"], split.get("tensor_parallel_size", 1)
        assert (llm.pipeline_parallel_size, llm.tensor_parallel_size, llm.mesh.size) == (pp, tp, pp * tp)
        assert llm.executor.depth == pp
        ids = PROMPTS[2]
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(llm.logits(ids), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        for _ in range(2):  # the second time the shared prefixes come from the prefix cache
            outs = llm.generate(PROMPTS, _greedy())
            assert [o.outputs[0].token_ids for o in outs] == greedy
        s = llm.engine.stats()
        assert s.preemptions > 0 and s.spec_draft_tokens > 0
        if not llm.cache.has_state:  # (a recurrent state cannot start mid-prompt: no prefix caching on the hybrids)
            assert s.prefix_hits >= 4  # a block of the first prompt at least (a sliding window frees the others)
    finally:
        llm.close()


def test_each_stage_holds_only_its_layers(family):
    hf, path, _ = family
    layers = hf.config.num_hidden_layers
    llm = LLM(path, max_num_seqs=4, block_size=16, pipeline_parallel_size=3, pp_layers=[layers - 2, 1, 1])
    try:
        for st in llm.model.stages:
            for d in st.mesh.ids:
                held = {n for n, w in llm.model.weights.items() if d in w.blobs}
                assert held and all(st.holds(n.split("[")[0]) for n in held), (st, held)
                caches = {int(n.rsplit(".", 1)[1]) for n, t in llm.cache.tensors.items() if d in t.blobs}
                assert caches <= set(st.layers)
        assert [list(st.layers) for st in llm.model.stages] == [list(range(layers - 2)), [layers - 2], [layers - 1]]
        total = llm.model.weight_bytes()
        assert sum(llm.model.weight_bytes(d) for d in llm.mesh.ids) == total
        # the last stages' one layer each (and the final norm and the head, the vocabulary being small): under 1/2 of
        # the whole
        assert max(llm.model.weight_bytes(d) for d in llm.mesh.ids[1:]) < total / 2
        kv = [llm.cache.device_bytes(d) for d in llm.mesh.ids]
        assert sum(kv) == llm.cache.nbytes
        if not llm.cache.has_state:  # attention layers only: the cache splits as the layers do, L - 2 : 1 : 1
            assert kv == [kv[1] * (layers - 2), kv[1], kv[1]] and kv[1] * layers == llm.cache.nbytes
    finally:
        llm.close()


def test_stages_send_and_receive_on_the_communicate_streams(llama):
    _, path, _ = llama
    llm = LLM(path, max_num_seqs=2, pipeline_parallel_size=2, tensor_parallel_size=2)
    try:
        llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        first, last = next(iter(llm.executor.runners.values())).runners
        assert first.mesh.ids == (0, 1) and last.mesh.ids == (2, 3)
        ops0, ops1 = [n.op for n in first.graph.operators], [n.op for n in last.graph.operators]
        assert ops0[-1] == "send" and "recv" not in ops0 and "ids" in first.graph.inputs
        assert ops1[0] == "recv" and "send" not in ops1 and "ids" not in last.graph.inputs
        assert "all_reduce" in ops0 and "all_reduce" in ops1  # tensor parallel within each stage's group
        for r in (first, last):
            for k in r.kernels:
                if k.operator.op in ("send", "recv", "all_reduce"):
                    # the all-reduces have nothing to overlap: on a CPU they run on the compute streams
                    want = "compute" if k.operator.op == "all_reduce" else "communicate"
                    assert k.stream.type.value == want
                    assert k.device_id in r.mesh.ids
    finally:
        llm.close()


@pytest.mark.parametrize("split", [SPLITS[0], SPLITS[2]], ids=["pp2", "pp2xtp2"])
def test_a_draft_model_drafts_beside_the_micro_batches_in_flight(llama, split):
    """The model as its own draft model on the pipeline (split into stages as the target is, on a communicator and
    stream threads of its own): the same greedy ids as one device, and its drafts accepted."""
    _, path, greedy = llama
    llm = LLM(path, max_num_seqs=4, block_size=4, max_model_len=64, **split,
              speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    try:
        drafter = llm.engine.speculator.drafter
        assert len(drafter.executor.model.stages) == 2 and drafter.executor.comm is not llm.executor.comm
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _greedy())] == greedy
        s = llm.engine.stats()
        assert s.spec_draft_tokens > 0 and s.spec_accepted_tokens > 0  # it agrees with itself
    finally:
        llm.close()


def test_bad_pipeline_sizes_are_clear_errors(llama):
    _, path, _ = llama
    with pytest.raises(dtorch.ArgumentError, match="pp_layers must be 2 ints >= 1"):
        LLM(path, pipeline_parallel_size=2, pp_layers=[3, 3])
    with pytest.raises(dtorch.ArgumentError, match="pipeline_parallel_size 5 is more than the model's"):
        LLM(path, pipeline_parallel_size=5)
    with pytest.raises(dtorch.ArgumentError, match="pipeline_parallel_size must be an int >= 1"):
        LLM(path, pipeline_parallel_size=0)


def test_a_two_dimensional_mesh_and_a_graph_per_stage():
    """Stage 0 multiplies by a column-split weight (all-gather in its tp group), sends; stage 1 receives, multiplies by
    a row-split weight (all-reduce in its group): the product of both, as torch computes it."""
    mesh = DeviceMesh.cpu(4, (2, 2), ("pp", "tp"))
    assert (mesh.pp_size, mesh.tp_size) == (2, 2)
    assert mesh.stage(0).ids == (0, 1) and mesh.stage(1).ids == (2, 3) and mesh.stage(1).axis_names == ("tp",)
    assert [mesh.stage_of(i) for i in mesh.ids] == [0, 0, 1, 1]
    assert DeviceMesh.cpu(2).stage(0) == DeviceMesh.cpu(2) and DeviceMesh.cpu(2).pp_size == 1
    with pytest.raises(dtorch.ArgumentError, match="stage must be an int in"):
        mesh.stage(2)
    torch.manual_seed(0)
    w1, w2 = torch.randn(8, 6), torch.randn(6, 5)
    g0 = LogicalGraph(mesh.stage(0))
    y = g0.redistribute(g0.input("x", (3, 8)) @ g0.param("w1", w1, Shard(1)), Replicate())
    g0.send(y, mesh.stage(1).ids)
    g1 = LogicalGraph(mesh.stage(1))
    h = g1.recv("h", (3, 6), torch.float32, mesh.stage(0).ids)
    g1.output("z", g1.redistribute(h @ g1.param("w2", w2, Shard(0)), Replicate()))
    comm = InProcessCommunicator(mesh.ids)
    r0, r1 = Runner(g0, comm.group(mesh.stage(0).ids)), Runner(g1, comm.group(mesh.stage(1).ids))
    try:
        for _ in range(2):
            x = torch.randn(3, 8)
            r0.run({"x": x})
            torch.testing.assert_close(r1.run({})["z"], x @ w1 @ w2)
    finally:
        r0.shutdown()
        r1.shutdown()
    g = LogicalGraph(mesh.stage(0))
    with pytest.raises(dtorch.GraphError, match="peers must be 2 devices outside the graph's mesh"):
        g.send(g.input("x", (2,)), (0, 1))


def test_cli_pipeline_flags(llama, capsys):
    from dtorch.cli import main

    _, path, greedy = llama
    assert main(["generate", "--model", path, "-pp", "2", "--max-tokens", "8", "--ignore-eos", "--temperature", "0",
                 "--prompt-ids", ",".join(map(str, PROMPTS[3]))]) == 0
    out = capsys.readouterr()
    assert "2 pipeline stages (layers" in out.err
    assert [int(t) for t in out.out.replace(",", " ").split()] == greedy[3]  # the answer's ids
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", path, "-pp", "2", "--pp-layers", "1,x", "hi"])
    assert info.value.code == 2 and "--pp-layers: expected layer counts >= 1" in capsys.readouterr().err


def _send_then_add():
    """Two stages of one device each: stage 0 sends its input x [2, 3], stage 1 outputs y = x + b."""
    mesh = DeviceMesh.cpu(2, (2, 1), ("pp", "tp"))
    g0 = LogicalGraph(mesh.stage(0))
    g0.send(g0.input("x", (2, 3)), mesh.stage(1).ids)
    g1 = LogicalGraph(mesh.stage(1))
    h = g1.recv("h", (2, 3), torch.float32, mesh.stage(0).ids)
    g1.output("y", g1.call("binary.add", h, g1.input("b", (2, 3))))
    return mesh, g0, g1


def test_a_stage_that_fails_leaves_nothing_for_the_next_step():
    """Stage 1 fails (a bad feed) after stage 0 sent: the step raises, and the next step reads its own activations,
    not the failed step's."""
    from dtorch.models.executor import StageRunners

    mesh, g0, g1 = _send_then_add()
    comm = InProcessCommunicator(mesh.ids)
    stages = StageRunners([Runner(g0, comm.group((0,))), Runner(g1, comm.group((1,)))])
    try:
        with pytest.raises(dtorch.ShapeError, match="feed 'b' must have shape"):
            stages.run({"x": torch.ones(2, 3), "b": torch.zeros(3)})
        x = torch.arange(6.0).view(2, 3)
        torch.testing.assert_close(stages.run({"x": x, "b": torch.zeros(2, 3)})["y"], x)
    finally:
        for r in stages.runners:
            r.shutdown()


def test_the_trace_shows_micro_batches_in_flight(llama):
    """pp=2 on cpu(2), four sequences: two micro-batches take turns, so stage 1 runs step m while stage 0 runs step
    m + 1 (the stages' "pipeline" rows; stage 1 gets a step only once stage 0 has run it, so the overlap is two steps
    in flight); the residual stream goes out on stage 0's communicate stream and comes in on stage 1's. (The tiny
    model's kernels are too short to overlap on the compute streams themselves: Python's lock serializes them; the
    bench's real-shape model shows that.)"""
    _, path, greedy = llama
    llm = LLM(path, max_num_seqs=4, block_size=4, max_model_len=64, pipeline_parallel_size=2)
    try:
        llm.generate(PROMPTS, _greedy())  # the step shapes built, untraced
        llm.executor.set_trace(True)
        outs = llm.generate(PROMPTS, _greedy())
        rows = llm.executor.tracer.intervals()
        llm.executor.set_trace(False)
        assert [o.outputs[0].token_ids for o in outs] == greedy
        steps = {d: {int(label.split()[3]): (a, b) for label, a, b in rows[(d, "pipeline")]}
                 for d in ("cpu:0", "cpu:1")}
        assert all(label.startswith("stage 0 ") for label, _, _ in rows[("cpu:0", "pipeline")])
        # each step of stage 1 that overlaps stage 0's next step: micro-batches in flight together
        both = [m for m, (a, b) in steps["cpu:1"].items()
                if m + 1 in steps["cpu:0"] and min(b, steps["cpu:0"][m + 1][1]) > max(a, steps["cpu:0"][m + 1][0])]
        assert len(both) >= len(steps["cpu:1"]) // 2, steps
        assert {label.split("#")[0] for label, _, _ in rows[("cpu:0", "communicate")]} == {"send"}
        assert {label.split("#")[0].split(".")[0] for label, _, _ in rows[("cpu:1", "communicate")]} == {"recv"}
        assert llm.engine.stats().steps >= 2 * 8  # each micro-batch its own steps
    finally:
        llm.close()


def test_a_step_that_fails_in_flight_fails_the_steps_behind_it_and_no_more():
    """Three steps in flight through two stage threads; the first fails at stage 1 (a bad feed) after stage 0 sent:
    it raises its own error, the two behind it a DtorchError saying an earlier step failed, and the next step reads
    its own activations."""
    from dtorch.models.pipeline import StageWorkers

    mesh, g0, g1 = _send_then_add()
    comm = InProcessCommunicator(mesh.ids, timeout=10)
    gate = threading.Event()

    class Gated:  # stage 0's Runner, whose runs wait for the gate: every step is in flight before the first fails
        def __init__(self, runner: Runner) -> None:
            self.runner = runner

        def __getattr__(self, name: str):
            return getattr(self.runner, name)

        def run(self, feeds):
            gate.wait(10)
            return self.runner.run(feeds)

    runners = [Runner(g0, comm.group((0,))), Runner(g1, comm.group((1,)))]
    workers = StageWorkers(2, timeout=10)
    try:
        bad = workers.submit([Gated(runners[0]), runners[1]], {"x": torch.ones(2, 3), "b": torch.zeros(3)})
        behind = [workers.submit([Gated(runners[0]), runners[1]],
                                 {"x": torch.full((2, 3), float(i)), "b": torch.zeros(2, 3)}) for i in (2, 3)]
        gate.set()
        with pytest.raises(dtorch.ShapeError, match="feed 'b' must have shape"):
            bad.wait(10)
        for f in behind:
            with pytest.raises(dtorch.DtorchError, match="a step before it failed"):
                f.wait(10)
        x, b = torch.arange(6.0).view(2, 3), torch.ones(2, 3)
        good = [workers.submit(runners, {"x": x + i, "b": b}) for i in range(2)]
        for i, f in enumerate(good):
            torch.testing.assert_close(f.wait(10)["y"], x + i + b)
    finally:
        workers.close()
        for r in runners:
            r.shutdown()


@pytest.mark.parametrize(("layers", "p", "head"), [(30, 2, 8.0), (30, 3, 8.0), (30, 4, 8.0), (24, 2, 0.3), (4, 3, 9.0)])
def test_the_default_split_evens_the_work(layers, p, head):
    """The stages' work (each one's layers, the head's worth of layers on the last) differs by about a layer at most
    where a split allows it (every stage keeps one layer at least), and the layers are all there, in order."""
    from dtorch.models.parallel import pipeline_stages

    stages = pipeline_stages(DeviceMesh.cpu(p, (p, 1), ("pp", "tp")), layers, head_layers=head)
    counts = [len(st.layers) for st in stages]
    assert [i for st in stages for i in st.layers] == list(range(layers)) and min(counts) >= 1
    work = counts[:-1] + [counts[-1] + head]
    if counts[-1] > 1:
        assert max(work) - min(work) <= 1.5, counts
    else:  # the head alone outweighs a stage's share: the last stage has its one layer, the others share the rest
        assert max(counts[:-1]) - min(counts[:-1]) <= 1, counts


def test_packed_weights_cached_for_one_split_are_not_taken_for_another(tmp_path, monkeypatch):
    """The default GGUF model at pp=2 split 15 + 15, then 20 + 10, on one pack cache: each load holds its own
    stages' weights (the cache entry names the split), and both give one device's greedy ids."""
    monkeypatch.setenv("DTORCH_PACK_CACHE_DIR", str(tmp_path))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    got = []
    for split in (None, [15, 15], [20, 10]):
        llm = LLM(**({} if split is None else dict(pipeline_parallel_size=2, pp_layers=split)))
        try:
            got.append(llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids)
            llm.pack_cache.wait()  # the entry is written on a thread of its own after the load
        finally:
            llm.close()
    assert got[1] == got[0] and got[2] == got[0]
    assert len(list(tmp_path.glob("*.dtpk"))) == 3  # one entry per split
