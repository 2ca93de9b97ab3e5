"""The engine: paged blocks and the prefix cache, continuous batching with chunked prefill, preemption, aborts,
concurrent callers, and what each request sees (deltas, n choices, logprobs), against transformers' greedy
continuations of tiny random checkpoints."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import pytest
import torch

import dtorch
from dtorch.engine.block_manager import BlockManager
from dtorch.engine.llm import LLM
from dtorch.engine.loop import EngineLoop
from dtorch.engine.sampling import SamplingParams
from dtorch.models.kv_cache import kv_bytes_per_token
from tests.tiny_models import families, hf_greedy, save_random, tiny_config

transformers = pytest.importorskip("transformers")

VOCAB = 128
FAMILIES = families(transformers, heads=4, kv_heads=2, vocab=VOCAB, qwen3_head_dim=32)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def rand_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, checkpoint directory) of a tiny random Qwen3."""
    path = tmp_path_factory.mktemp("qwen3")
    return save_random(transformers, FAMILIES["qwen3"](), path), str(path)


def one_sequence_cache(path: str, tokens: int) -> int:
    """Bytes of KV cache that hold ``tokens`` tokens of the model at ``path``."""
    from dtorch.models.loaders import open_checkpoint

    with open_checkpoint(path, torch.float32) as ckpt:
        return kv_bytes_per_token(ckpt.config, torch.float32) * tokens


# -- the block manager ----------------------------------------------------------------------------------------------

def test_blocks_are_held_shared_and_freed():
    bm = BlockManager(6, 4)
    a = bm.allocate(3)
    assert bm.num_free == 3 and len(set(a)) == 3
    bm.hold(a[:2])  # a second sequence shares the first two
    bm.free(a)
    assert bm.num_free == 4 and [bm.holders[b] for b in a] == [1, 1, 0]
    bm.free(a[:2])
    assert bm.num_free == 6
    with pytest.raises(dtorch.ArgumentError, match="freed more often"):
        bm.free(a[:1])
    with pytest.raises(dtorch.ArgumentError, match="7 blocks asked, 6 free"):
        bm.allocate(7)


def test_the_prefix_cache_names_whole_blocks_of_the_whole_prefix():
    bm = BlockManager(8, 4)
    tokens = list(range(10, 23))  # 13 tokens: 3 full blocks
    blocks = bm.allocate(4)
    key = bm.register(blocks, tokens, 0, 13, -1)
    assert key >= 0
    assert bm.cached_prefix(tokens) == (blocks[:3], key)  # 12 cached, the 13th left to compute
    assert bm.cached_prefix(tokens[:12])[0] == blocks[:2]  # at least one token is computed
    assert bm.cached_prefix(tokens[:4] + [99] + tokens[5:])[0] == blocks[:1]  # a change ends the match
    assert bm.cached_prefix([0] + tokens)[0] == []  # the same blocks at another offset are another prefix
    bm.free(blocks)  # freed but remembered: a new sequence still finds them
    assert bm.cached_prefix(tokens)[0] == blocks[:3]
    fresh = bm.allocate(5)  # least recently freed first: the 4 never-used blocks, then the tail block of the prefix
    assert blocks[3] in fresh and not set(blocks[:3]) & set(fresh)
    assert bm.cached_prefix(tokens)[0] == blocks[:3]
    bm.allocate(3)  # the prefix's blocks are reused now: forgotten, last block first
    assert bm.cached_prefix(tokens)[0] == []


def test_free_blocks_are_reused_in_the_order_that_touches_least_memory():
    bm = BlockManager(8, 2)
    a = bm.allocate(3)
    assert a == [0, 1, 2] and bm.num_resident == 3  # never-used blocks, lowest first
    key = bm.register(a, [5, 6, 7, 8, 9], 0, 5, -1)  # blocks 0 and 1 are full: named
    assert key >= 0
    bm.free(a)
    assert bm.allocate(1) == [2]  # an unnamed block whose memory is in use comes first
    assert bm.allocate(1) == [3]  # then a never-used one
    b = bm.allocate(4)  # then the named ones, least recently freed first: the prefix's tail block before its head
    assert b == [4, 5, 6, 7] and bm.cached_prefix([5, 6, 7, 8, 9])[0] == [0, 1]
    assert bm.allocate(1) == [1] and bm.cached_prefix([5, 6, 7, 8, 9])[0] == [0]  # the head still matches


def test_trim_keeps_the_newest_cached_prefixes():
    bm = BlockManager(6, 2)
    first, second = bm.allocate(2), bm.allocate(3)
    bm.register(first, [1, 2, 3, 4], 0, 4, -1)
    bm.register(second, [7, 8, 9, 10, 11], 0, 5, -1)
    bm.free(first)
    bm.free(second)  # named blocks freed: first's two, then second's two; second[2] (partial) is unnamed
    assert bm.trim(keep_named=2) == sorted(first + second[2:])  # the two most recently freed stay cached
    assert bm.num_resident == 2 and bm.cached_prefix([7, 8, 9, 10, 11])[0] == second[:2]
    assert bm.cached_prefix([1, 2, 3, 4, 5])[0] == []


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="pages are released with madvise")
def test_an_idle_engine_gives_the_memory_of_free_blocks_back(tiny):
    _, path = tiny
    llm = LLM(path, block_size=4)
    try:
        llm.generate([rand_ids(40 + i, 60 + i) for i in range(8)], greedy(20))
        s = llm.engine.stats()
        assert s.kv_blocks_used == 0
        assert 0 < s.kv_blocks_resident <= s.kv_blocks_total // 4  # at most the kept cached prefixes
        # what was released reads as zeros: its pages went back to the system
        k = next(iter(llm.cache.tensors["k_cache.0"].blobs.values())).tensor
        kept = {b for b in range(s.kv_blocks_total) if b in llm.engine.blocks._named}
        written = [b for b in range(64) if b not in kept]
        assert float(k[written].abs().sum()) == 0.0 and float(k[sorted(kept)].abs().sum()) > 0
    finally:
        llm.close()


def test_no_prefix_cache_when_disabled():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    b = bm.allocate(2)
    bm.register(b, [5, 6, 7, 8], 0, 4, -1)
    assert bm.cached_prefix([5, 6, 7, 8, 9]) == ([], -1)


# -- generation on the engine ---------------------------------------------------------------------------------------

def test_preemption_under_a_tiny_cache_loses_nothing(tiny):
    hf, path = tiny
    # room for one sequence of 64 tokens; four sequences of up to 60 tokens each must take turns
    llm = LLM(path, max_num_seqs=4, max_model_len=64, kv_cache_memory_bytes=one_sequence_cache(path, 64),
              block_size=4, max_num_batched_tokens=32)
    try:
        prompts = [rand_ids(n, seed) for seed, n in enumerate((20, 11, 30, 7))]
        outs = llm.generate(prompts, greedy(30))
        s = llm.engine.stats()
        assert s.preemptions > 0 and s.kv_blocks_total == 16
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 30) for p in prompts]
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        assert s.kv_blocks_used == 0 and s.running == s.waiting == 0
    finally:
        llm.close()


def test_prefix_caching_reuses_blocks_and_gives_identical_outputs(tiny):
    hf, path = tiny
    llm = LLM(path, block_size=8)
    try:
        system = rand_ids(40, 7)
        a, b = system + rand_ids(5, 8), system + rand_ids(9, 9)
        assert llm.generate([a], greedy(12))[0].outputs[0].token_ids == hf_greedy(hf, a, 12)
        before = llm.engine.stats()
        out = llm.generate([b], greedy(12))[0]
        after = llm.engine.stats()
        assert after.prefix_hits - before.prefix_hits == 40  # 5 whole blocks of the shared 40 tokens
        assert after.prompt_tokens - before.prompt_tokens == len(b) - 40  # its prefill starts after them
        assert out.outputs[0].token_ids == hf_greedy(hf, b, 12)
        # the same prompt again: every whole block but the one holding its last token comes from the cache
        again = llm.generate([a], greedy(12))[0]
        assert again.outputs[0].token_ids == hf_greedy(hf, a, 12)
        assert llm.engine.stats().prefix_hits - after.prefix_hits == 40
    finally:
        llm.close()


def test_a_request_joins_the_running_batch_and_prefills_in_chunks_beside_decodes(tiny):
    hf, path = tiny
    llm = LLM(path, max_num_batched_tokens=16)
    steps: list[list[int]] = []
    real = llm.executor.step

    def recording(plan, **kw):
        steps.append(list(plan.counts))
        return real(plan, **kw)

    llm.executor.step = recording
    try:
        e, got, reasons = llm.engine, defaultdict(list), {}

        def sink(d):
            got[d.request_id] += d.token_ids
            if d.finish_reason:
                reasons[d.request_id] = d.finish_reason

        pa, pb = rand_ids(6, 1), rand_ids(40, 2)
        e.add_request("a", pa, greedy(20), sink)
        for _ in range(3):
            e.step()
        assert len(got["a"]) == 3
        e.add_request("b", pb, greedy(20), sink)
        e.step()
        assert steps[-1] == [1, 15]  # a decodes while b's first chunk fills the step's 16 tokens
        e.run_until(lambda: len(reasons) == 2, timeout=60)
        assert got["a"] == hf_greedy(hf, pa, 20) and got["b"] == hf_greedy(hf, pb, 20)
        assert max(sum(c) for c in steps) <= 16
        assert [1, 15] in steps and [1, 15] in steps[steps.index([1, 15]) + 1:]  # b needed three chunks
        assert reasons == {"a": "length", "b": "length"} and e.stats().kv_blocks_used == 0
    finally:
        llm.close()


def test_first_come_first_served_within_max_num_seqs(tiny):
    _, path = tiny
    llm = LLM(path, max_num_seqs=2)
    try:
        e, order = llm.engine, []
        for name in "abc":
            e.add_request(name, rand_ids(5, ord(name)), greedy(3),
                          lambda d: order.append(d.request_id) if d.finished else None)
        e.step()
        assert [s.request_id for s in e.scheduler.running] == ["a", "b"]
        assert [s.request_id for s in e.scheduler.waiting] == ["c"]
        e.run_until(lambda: len(order) == 3, timeout=60)
        assert order[2] == "c"
    finally:
        llm.close()


def test_an_aborted_request_ends_and_frees_its_blocks(tiny):
    _, path = tiny
    llm = LLM(path)
    try:
        e, deltas = llm.engine, []
        e.add_request("x", rand_ids(30, 3), greedy(50), deltas.append)
        e.add_request("y", rand_ids(5, 4), greedy(50), deltas.append)
        e.step()
        e.step()
        assert e.stats().kv_blocks_used > 0
        e.abort("x")
        e.abort("nobody")  # unknown ids are ignored
        e.step()
        last = [d for d in deltas if d.request_id == "x"][-1]
        assert last.finish_reason == "abort" and last.token_ids == ()
        assert [s.request_id for s in e.scheduler.running] == ["y"]
        e.abort("y")
        e.step()
        assert e.stats().kv_blocks_used == 0 and not e.has_unfinished()
        assert sum(d.finish_reason is not None for d in deltas) == 2  # each ended once
    finally:
        llm.close()


def test_a_failing_sink_ends_only_its_own_request(tiny):
    hf, path = tiny
    llm = LLM(path)
    try:
        e, good, calls = llm.engine, [], []

        def bad(d):
            calls.append(d)
            raise RuntimeError("client gone")

        prompt = rand_ids(8, 12)
        e.add_request("bad", rand_ids(8, 13), greedy(20), bad)
        e.add_request("good", prompt, greedy(12), lambda d: good.extend(d.token_ids))
        e.run_until(lambda: not e.has_unfinished(), timeout=60)
        assert good == hf_greedy(hf, prompt, 12)
        assert calls[-1].finish_reason == "abort" and len(calls) <= 3  # aborted at the next step
        assert e.stats().kv_blocks_used == 0
    finally:
        llm.close()


def test_bad_requests_and_a_full_queue_are_refused_clearly(tiny):
    _, path = tiny
    llm = LLM(path, max_waiting=1, max_model_len=64)
    try:
        e = llm.engine
        with pytest.raises(dtorch.ArgumentError, match="empty"):
            e.add_request("a", [], greedy(2), print)
        with pytest.raises(dtorch.ArgumentError, match=r"token id 500.*\[0, 128\)"):
            e.add_request("a", [3, 500], greedy(2), print)
        with pytest.raises(dtorch.ModelError, match="64 tokens.*max_model_len"):
            e.add_request("a", [3] * 64, greedy(2), print)
        with pytest.raises(dtorch.ArgumentError, match="SamplingParams"):
            e.add_request("a", [3], {"temperature": 0}, print)
        e.add_request("a", [3, 4], greedy(2), lambda d: None)
        with pytest.raises(dtorch.ArgumentError, match="'a' is already in use"):
            e.add_request("a", [3, 4], greedy(2), lambda d: None, force=True)
        with pytest.raises(dtorch.EngineBusy, match="queue is full"):
            e.add_request("b", [3, 4], greedy(2), lambda d: None)
        e.accepting = False
        with pytest.raises(dtorch.EngineBusy, match="shutting down"):
            e.add_request("c", [3, 4], greedy(2), lambda d: None, force=True)
    finally:
        llm.close()
    with pytest.raises(dtorch.ArgumentError, match="kv_cache_memory_bytes 2048 holds 2 tokens"):
        LLM(path, kv_cache_memory_bytes=2048)
    with pytest.raises(dtorch.ArgumentError, match="more than the .* bytes this machine has available; lower it"):
        LLM(path, kv_cache_memory_bytes=10**18)
    with pytest.raises(dtorch.ArgumentError, match="max_model_len 4096 is more than the model's 128"):
        LLM(path, max_model_len=4096)


def test_concurrent_callers_each_get_their_own_tokens(tiny):
    hf, path = tiny
    llm = LLM(path, max_num_seqs=4)
    try:
        prompts = [rand_ids(4 + 3 * i, 20 + i) for i in range(8)]
        alone = [llm.generate([p], greedy(10))[0].outputs[0].token_ids for p in prompts]
        got: dict[int, list[int]] = {}
        threads_before = threading.active_count()

        def call(i: int) -> None:
            got[i] = llm.generate([prompts[i]], greedy(10))[0].outputs[0].token_ids

        threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert [got[i] for i in range(8)] == alone
        assert alone[0] == hf_greedy(hf, prompts[0], 10)
        assert threading.active_count() == threads_before
    finally:
        llm.close()


def test_the_engine_loop_serves_and_stops_within_its_grace(tiny):
    hf, path = tiny
    llm = LLM(path)
    loop = EngineLoop(llm.engine).start()
    try:
        done, ids = threading.Event(), []

        def sink(d):
            ids.extend(d.token_ids)
            if d.finished:
                done.set()

        prompt = rand_ids(9, 5)
        llm.engine.add_request("r", prompt, greedy(8), sink)
        assert done.wait(60) and ids == hf_greedy(hf, prompt, 8)
        ended = []
        llm.engine.add_request("long", prompt, greedy(100), lambda d: ended.append(d.finish_reason))
        t0 = time.monotonic()
        loop.stop(grace=0.0)
        assert time.monotonic() - t0 < 30
        assert ended[-1] in ("abort", "length") and not loop._thread.is_alive()
        with pytest.raises(dtorch.EngineBusy):
            llm.engine.add_request("late", prompt, greedy(2), print)
    finally:
        loop.stop()
        llm.close()


def test_n_choices_logprobs_and_seeds(tiny):
    _, path = tiny
    llm = LLM(path)
    try:
        e, prompt, deltas = llm.engine, rand_ids(7, 11), defaultdict(list)
        e.add_request("n", prompt, SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=6, ignore_eos=True,
                                                  logprobs=3), lambda d: deltas[d.index].append(d))
        e.run_until(lambda: all(ds and ds[-1].finished for ds in deltas.values()) and len(deltas) == 2, timeout=60)
        choices = {i: [t for d in ds for t in d.token_ids] for i, ds in deltas.items()}
        for i in (0, 1):  # choice i draws as a request of its own seeded with seed + i
            alone = llm.generate([prompt], SamplingParams(temperature=1.0, seed=5 + i, max_tokens=6,
                                                          ignore_eos=True))[0].outputs[0].token_ids
            assert choices[i] == alone
        # each token's logprob is the model's log_softmax at its position
        ids = prompt + choices[0]
        want = torch.log_softmax(llm.logits(ids), -1)
        for k, d in enumerate(deltas[0]):
            (lp,) = d.logprobs
            pos = len(prompt) - 1 + k
            assert lp.token_id == ids[pos + 1]
            assert lp.logprob == pytest.approx(float(want[pos, lp.token_id]), abs=1e-4)
            assert [t for t, _ in lp.top] == want[pos].topk(3).indices.tolist()
        assert deltas[0][-1].completion_tokens == 6 and deltas[0][-1].prompt_tokens == 7
        # n choices share the prompt's prefill: choice 1 takes choice 0's whole blocks of the prompt
        long_prompt = rand_ids(40, 14)
        before = e.stats()
        done = []
        e.add_request("shared", long_prompt, SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=2),
                      lambda d: done.append(d) if d.finished else None)
        e.run_until(lambda: len(done) == 3, timeout=60)
        after = e.stats()
        assert after.prompt_tokens - before.prompt_tokens == 40 + 2 * (40 - 32)  # blocks of 16: 32 tokens shared
        assert after.prefix_hits - before.prefix_hits == 2 * 32
    finally:
        llm.close()


def test_a_hybrid_model_is_preempted_and_resumed_exactly(tmp_path):
    """Gated delta net layers keep a state per sequence: a preempted sequence gives its state slot back and recomputes
    its state from its first token."""
    config = tiny_config(transformers, "qwen3_5_text", vocab_size=VOCAB, num_hidden_layers=2,
                         layer_types=["linear_attention", "full_attention"], max_position_embeddings=128)
    hf = save_random(transformers, config, tmp_path)
    llm = LLM(str(tmp_path), max_num_seqs=3, max_model_len=48, block_size=4, max_num_batched_tokens=16,
              kv_cache_memory_bytes=one_sequence_cache(str(tmp_path), 48))
    try:
        prompts = [rand_ids(n, 30 + n) for n in (14, 9, 20)]
        outs = llm.generate(prompts, greedy(20))
        assert llm.engine.stats().preemptions > 0
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 20) for p in prompts]
    finally:
        llm.close()


def test_streamed_text_joins_to_the_answer_and_stop_strings_are_held_back():
    llm = LLM(max_model_len=512)
    try:
        prompt = llm.chat_prompt([{"role": "user", "content": "Name three colours."}])
        full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0].text
        pieces = []
        streamed = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24),
                                on_text=lambda i, p: pieces.append(p))[0].outputs[0]
        assert "".join(pieces) == streamed.text == full and full
        cut = full[len(full) // 2:][:3]  # a stop string from the middle of the answer
        for include in (False, True):
            got: list[str] = []
            params = SamplingParams(temperature=0.0, max_tokens=24, stop=[cut], include_stop_str_in_output=include)
            stopped = llm.generate([prompt], params, on_text=lambda i, p, got=got: got.append(p))[0].outputs[0]
            end = full.index(cut) + (len(cut) if include else 0)
            assert (stopped.finish_reason, stopped.stop_reason, stopped.text) == ("stop", cut, full[:end])
            assert "".join(got) == stopped.text
        # min_tokens: no stop string, stop id or end of sequence before it
        ended = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=200))[0].outputs[0]
        assert ended.finish_reason == "stop" and ended.stop_reason is None  # the end-of-sequence token
        longer = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=200,
                                                       min_tokens=len(ended.token_ids) + 5))[0].outputs[0]
        assert len(longer.token_ids) > len(ended.token_ids) + 4
        assert not set(longer.token_ids[:len(ended.token_ids) + 5]) & llm.eos_token_ids
        assert longer.token_ids[:len(ended.token_ids) - 1] == ended.token_ids[:-1]  # the same until the end was due
        # a stop token id ends with its id as stop_reason and stays in token_ids
        stop_id = ended.token_ids[3]
        by_id = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id]))
        c = by_id[0].outputs[0]
        assert (c.finish_reason, c.stop_reason, c.token_ids) == ("stop", stop_id, ended.token_ids[:4])
    finally:
        llm.close()


def test_vllm_shaped_outputs_with_n_and_logprobs(tiny):
    """``RequestOutput.outputs`` holds the n choices; each choice's logprobs are {token id: Logprob} per token, the
    same as generating that choice alone (choice i is seeded with seed + i), and cumulative_logprob is their sum."""
    _, path = tiny
    llm = LLM(path)
    try:
        prompt = rand_ids(9, 40)
        params = SamplingParams(temperature=0.9, seed=3, n=3, max_tokens=5, ignore_eos=True, logprobs=2)
        (out,) = llm.generate([prompt], params)
        assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished and out.prompt_token_ids == prompt
        for c in out.outputs:
            alone = llm.generate([prompt], SamplingParams(temperature=0.9, seed=3 + c.index, max_tokens=5,
                                                          ignore_eos=True, logprobs=2))[0].outputs[0]
            assert c.token_ids == alone.token_ids and c.finish_reason == "length"
            assert len(c.logprobs) == 5
            for tok, entry, other in zip(c.token_ids, c.logprobs, alone.logprobs, strict=True):
                assert tok in entry and len(entry) in (2, 3)  # the chosen token, and the top 2 (it may be one)
                assert entry[tok].logprob == pytest.approx(other[tok].logprob, abs=1e-5)
                top = sorted(((lp.rank, t) for t, lp in entry.items() if t != tok or lp.rank <= 2))
                assert [r for r, _ in top][:2] == [1, 2]
            assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs,
                                                                                         strict=True)))
        assert SamplingParams().logprobs is None and llm.generate([prompt], greedy(2))[0].outputs[0].logprobs is None
    finally:
        llm.close()


def test_four_threads_with_prompts_of_one_length(tiny):
    """The case that returned garbage before the engine: four threads, prompts of the same length."""
    hf, path = tiny
    llm = LLM(path)
    try:
        prompts = [rand_ids(12, 50 + i) for i in range(4)]
        got: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(
            i, llm.generate([prompts[i]], greedy(10))[0].outputs[0].token_ids)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [got[i] for i in range(4)] == [hf_greedy(hf, p, 10) for p in prompts]
    finally:
        llm.close()


NEAR_TIE = 0.01  # nats: greedy choices this close may flip between batch shapes (see _same_greedy)


def _same_greedy(got: list[int], ref) -> bool:
    """Whether token ids ``got`` are ``ref``'s (a CompletionOutput with logprobs) up to a near tie. A decode row
    batched beside another request's prefill runs the products' float path (32 rows and more) rather than the integer
    one, so where the reference's best two tokens are within NEAR_TIE the greedy choice may flip, and the texts part
    there; a mixed-up stream differs where the model is sure."""
    for i, (g, r) in enumerate(zip(got, ref.token_ids, strict=False)):
        if g != r:
            top = ref.logprobs[i]
            return g in top and top[r].logprob - top[g].logprob < NEAR_TIE
    return len(got) == len(ref.token_ids)


def _same_greedy_text(text: str, ref, tokenizer) -> bool:
    """_same_greedy for a streamed text: it follows ``ref``'s tokens, and where it leaves them that was a near tie."""
    for i in range(len(ref.token_ids)):
        if not text.startswith(tokenizer.decode(ref.token_ids[:i + 1])):
            best = sorted((lp.logprob for lp in ref.logprobs[i].values()), reverse=True)
            return len(best) > 1 and best[0] - best[1] < NEAR_TIE
    return text == ref.text


def test_callbacks_and_streams_of_one_llm_do_not_mix():
    llm = LLM(max_model_len=256)
    try:
        chat = [{"role": "user", "content": "Say hello."}]
        a_ids, b_ids = llm.chat_prompt(chat), llm.chat_prompt([{"role": "user", "content": "Count to five."}])
        p = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
        ref_a, ref_b = (llm.generate([x], p)[0].outputs[0] for x in (a_ids, b_ids))
        want_a, want_b = ref_a.text, ref_b.text
        nested: list = []

        def on_text(_i, _piece):  # a streaming callback that calls generate again
            if not nested:
                nested.append(llm.generate([b_ids], p)[0].outputs[0])

        outer = llm.generate([a_ids], p, on_text=on_text)[0].outputs[0]
        assert len(nested) == 1
        assert _same_greedy(outer.token_ids, ref_a), (outer.text, want_a)
        assert _same_greedy(nested[0].token_ids, ref_b), (nested[0].text, want_b)
        sa, sb = llm.stream(a_ids, p), llm.stream(b_ids, p)  # two iterators, advanced in turn
        pa, pb, done = [], [], [False, False]
        while not all(done):
            for k, (it, out) in enumerate(((sa, pa), (sb, pb))):
                if not done[k]:
                    try:
                        out.append(next(it))
                    except StopIteration:
                        done[k] = True
        assert _same_greedy_text("".join(pa), ref_a, llm.tokenizer), ("".join(pa), want_a)
        assert _same_greedy_text("".join(pb), ref_b, llm.tokenizer), ("".join(pb), want_b)
        assert llm.engine.stats().kv_blocks_used == 0
    finally:
        llm.close()


def test_non_finite_weights_are_refused_unless_asked_not_to(tmp_path):
    hf = save_random(transformers, FAMILIES["llama"](), tmp_path)
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(dtorch.ModelError, match="model.layers.1.mlp.down_proj.weight"):
        LLM(str(tmp_path))
    llm = LLM(str(tmp_path), check_weights=False)  # the caller's choice: it loads, and the NaN shows in the logits
    try:
        assert torch.isnan(llm.logits([3, 4, 5])).any() and hf is not None
    finally:
        llm.close()
