"""Pipeline parallelism across processes: ``torchrun`` with gloo, one device per rank, each rank one stage's tp group
member. The same greedy ids as one process at tp=1 (a batch, twice: the second time from the prefix cache) at pp=2
on 2 ranks and pp=2 x tp=2 on 4 ranks, with micro-batches in flight, preemption (a small cache) and n-gram drafts;
each rank holds only its stage's weights and KV cache. Served across ranks (rank 0 leads, the other ranks follow its
told calls, as ``dtorch serve`` runs), pp=2 keeps two micro-batches in flight and a draft model drafts on the
pipeline: the same greedy ids.

This file is also the script each rank runs (``python -m torch.distributed.run ... test_pp_torchrun.py PP TP PATH``).
"""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.test_tp_torchrun import BATCH, _run, _torchrun, one_process_greedy_ids, tiny_llama  # noqa: F401 - tiny_llama is a fixture


def _worker(pp: int, tp: int, model: str) -> int:
    from dtorch.engine.llm import LLM
    from dtorch.engine.sampling import SamplingParams
    from tests.test_engine import one_sequence_cache

    # micro-batches in flight, six blocks of 4 tokens (the longest sequence, 21 tokens, fits alone: preemption),
    # n-gram drafts
    llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, max_num_seqs=4, block_size=4,
              max_model_len=24, kv_cache_memory_bytes=one_sequence_cache(model, 24), max_num_batched_tokens=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        runs = [[o.outputs[0].token_ids for o in llm.generate(BATCH, params)] for _ in range(2)]
        rank, s = llm.rank, llm.engine.stats()
        print(f"rank {rank} stage {llm.mesh.stage_of(rank)} weights {llm.model.weight_bytes()} "
              f"kv {llm.cache.nbytes}", file=sys.stderr, flush=True)
        if rank == 0:
            print(json.dumps(runs), flush=True)
            print(f"preemptions {s.preemptions} drafted {s.spec_draft_tokens} steps {s.steps}", flush=True)
        return 0
    finally:
        llm.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _served(model: str) -> int:
    """pp=2 served across 2 ranks (``dtorch.engine.ranks``: rank 0 leads and generates, rank 1 follows) with the
    model as its own draft model: rank 0 prints the batch's greedy ids with and without drafts and the most steps it
    had in flight."""
    import torch.distributed as dist

    from dtorch.engine.engine import Engine
    from dtorch.engine.llm import LLM
    from dtorch.engine.ranks import Leader, Ranks, follow
    from dtorch.engine.sampling import SamplingParams

    most = [0]
    launch = Engine._launch

    def counted(self, plan):  # the steps in flight once this one is launched
        launch(self, plan)
        most[0] = max(most[0], len(self._flights))

    Engine._launch = counted
    lms = [LLM(model, pipeline_parallel_size=2, max_num_seqs=4, block_size=4, max_model_len=24,
               speculative_config=spec) for spec in
           (None, {"method": "draft_model", "model": model, "num_speculative_tokens": 2})]
    try:
        for llm in lms:  # one at a time: the plan channel and the watchdog of each are collective
            ranks = Ranks(llm, 30.0)
            if llm.rank != 0:
                follow(ranks)
                continue
            ranks.leader = Leader(ranks)
            params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
            ids = [o.outputs[0].token_ids for o in llm.generate(BATCH, params)]
            s = llm.engine.stats()
            print(json.dumps({"ids": ids, "most": most[0], "accepted": s.spec_accepted_tokens}), flush=True)
            ranks.leader.stop()
        return 0
    finally:
        for llm in lms:
            llm.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_served_across_ranks_micro_batches_stay_in_flight_and_a_draft_model_drafts(tiny_llama):  # noqa: F811
    want = one_process_greedy_ids(tiny_llama)
    proc, _ = _run(_torchrun(2, __file__, "served", str(tiny_llama)), timeout=300)
    assert proc.returncode == 0, proc.stderr
    plain, drafted = (json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{"))
    assert plain["ids"] == want and drafted["ids"] == want
    assert plain["most"] == 2  # two micro-batches in flight, as in one process
    assert drafted["accepted"] > 0  # the model agrees with itself: its drafts were taken


@pytest.mark.parametrize(("pp", "tp"), [(2, 1), (2, 2)])
def test_stages_on_ranks_give_one_processs_greedy_ids(tiny_llama, pp, tp):  # noqa: F811 - the fixture
    from dtorch.engine.llm import LLM
    from dtorch.engine.sampling import SamplingParams
    from tests.test_engine import one_sequence_cache

    llm = LLM(str(tiny_llama), max_num_seqs=4)
    try:
        want = [o.outputs[0].token_ids for o in llm.generate(BATCH, SamplingParams(temperature=0.0, max_tokens=10,
                                                                                   ignore_eos=True))]
        weights, kv = llm.model.weight_bytes(), one_sequence_cache(str(tiny_llama), 24)  # the ranks' cache, whole
    finally:
        llm.close()
    proc, _ = _run(_torchrun(pp * tp, __file__, str(pp), str(tp), str(tiny_llama)), timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    assert len(lines) == 1, proc.stdout  # rank 0 only
    assert json.loads(lines[0]) == [want, want]
    stats = next(ln.split() for ln in proc.stdout.splitlines() if ln.startswith("preemptions"))
    assert int(stats[1]) > 0 and int(stats[3]) > 0, stats
    # the ranks write to one stderr, so their lines may run together: each rank's report found wherever it is
    held = re.findall(r"rank (\d+) stage (\d+) weights (\d+) kv (\d+)", proc.stderr)
    assert sorted(int(h[0]) for h in held) == list(range(pp * tp)), proc.stderr
    for _rank, _stage, held_weights, held_kv in held:  # each: ~1/(pp tp) of the weights (norms, the small head aside)
        assert int(held_weights) < 0.75 * weights / (pp * tp) * 2
        assert int(held_kv) == kv // (pp * tp)  # its stage's layers' KV, its tp share of the heads


if __name__ == "__main__":
    sys.exit(_served(sys.argv[2]) if sys.argv[1] == "served" else _worker(int(sys.argv[1]), int(sys.argv[2]),
                                                                           sys.argv[3]))
