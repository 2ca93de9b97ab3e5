"""Speculative decoding (issue #23) against references nobody here wrote: transformers' greedy continuations of tiny
random checkpoints of every family the tests build (drafts from prompt lookup, from a draft model and from an oracle
that knows transformers' answer and errs on purpose, alone and in batches of different lengths, under preemption in a
tiny cache, tensor parallel on ``DeviceMesh.cpu(2)``), the exact next-token distribution of the request's sampling
parameters (chi-square tests over a fixed set of seeds), and the default model's own plain decoding (a stop string in
the middle of an accepted run, max_tokens, min_tokens, end of sequence, structured outputs). Every test ends with every
cache block free."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dtorch
from dtorch.engine.llm import LLM
from dtorch.engine.request import GenerationStats
from dtorch.engine.sampling import SamplingParams
from dtorch.engine.speculative import ROW_COST, Adaptive, NgramIndex, SpeculativeConfig, Speculator, best_k, row_cost
from dtorch.models.kv_cache import kv_bytes_per_token
from tests.tiny_models import save_random, tiny_config

transformers = pytest.importorskip("transformers")

VOCAB = 128
NEW = 16  # tokens generated per prompt
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# every family the tests build (sliding windows shorter than the prompts; the hybrids with one layer of each kind)
FAMILIES = {"llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {}, "qwen3_moe": {}, "phi3": {},
            "gemma3": dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]),
            "qwen3_5_text": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
            "qwen3_next": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])}


def rand_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [rand_ids(5, 1) * 4, rand_ids(9, 2), rand_ids(23, 3)]  # one that repeats itself, two that do not
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def hf_continue(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` by ``n`` tokens (its KV cache, end of sequence not special)."""
    out, ids = None, [torch.tensor([prompt])]
    with torch.no_grad():
        for _ in range(n):
            out = hf(ids[-1], cache=out.cache if out is not None else None, use_cache=True)
            ids.append(out.logits[:, -1:].argmax(-1))
    return [int(t) for t in ids[1:]]


def cache_bytes(path: str, tokens: int) -> int:
    from dtorch.models.loaders import open_checkpoint

    with open_checkpoint(path, torch.float32) as ckpt:
        return kv_bytes_per_token(ckpt.config, torch.float32) * tokens


class Oracle:
    """A drafter that knows each prompt's answer (``answers``: prompt -> token ids) and drafts it, except that every
    third round it gets one draft wrong (the first, second or third): so some rounds keep every draft, some a few,
    some none."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]]) -> None:
        self.answers, self.rounds = answers, 0

    def propose(self, engine, plan, ks):
        tokens = []
        for (s, _), k in zip(plan, ks, strict=True):
            ahead = self.answers[tuple(s.ids[:s.num_prompt])][len(s.output_ids):][:k]
            if ahead:
                self.rounds += 1
                wrong = self.rounds % 9
                if wrong < len(ahead) and self.rounds % 3 == 0:
                    ahead[wrong] = (ahead[wrong] + 1) % VOCAB
            tokens.append(ahead)
        return tokens, [None] * len(plan)

    def close(self) -> None:
        pass


def use_oracle(llm: LLM, answers: dict, k: int = 3) -> None:
    """Make ``llm`` draft with an ``Oracle`` (drafts at every step: a row costs nothing to the adaptive k)."""
    config = SpeculativeConfig("draft_model", k, model="oracle")
    llm.engine.speculator = Speculator(config, (0.0, 0.0), Oracle(answers))


def blocks_free(llm: LLM) -> bool:
    s = llm.engine.stats()
    return s.kv_blocks_used == 0 and s.running == s.waiting == 0


# -- the config and the drafters' parts -----------------------------------------------------------------------------

def test_the_config_is_vllms_and_bad_ones_are_refused():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    assert SpeculativeConfig.from_dict({"model": "x", "num_speculative_tokens": 2}).method == "draft_model"
    bad = {"unknown key 'num_speculative_token'; did you mean 'num_speculative_tokens'":
           {"method": "ngram", "num_speculative_token": 4},
           "give 'num_speculative_tokens'": {"method": "ngram"},
           "method must be one of ngram, draft_model": {"method": "eagle", "num_speculative_tokens": 2},
           "num_speculative_tokens must be an int >= 1": {"method": "ngram", "num_speculative_tokens": 0},
           r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)":
           {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
           "'draft_model' needs 'model'": {"method": "draft_model", "num_speculative_tokens": 2},
           "must be a dict": "ngram"}
    for message, value in bad.items():
        with pytest.raises(dtorch.ArgumentError, match=message):
            SpeculativeConfig.from_dict(value)


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    g = torch.Generator().manual_seed(5)
    for _ in range(200):
        ids = torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        index, got = NgramIndex(1, 3), []
        for end in range(1, len(ids) + 1):  # as a sequence grows, asked at every length
            got.append(index.propose(ids[:end], 3))
        for end, proposal in enumerate(got, 1):
            want = []
            for n in range(min(3, end - 1), 0, -1):  # the definition: the longest suffix, its latest earlier match
                starts = [i for i in range(end - n) if ids[i:i + n] == ids[end - n:end]]
                if starts:
                    want = ids[starts[-1] + n:starts[-1] + n + 3][:end - starts[-1] - n]
                    break
            assert proposal == want[:3], (ids[:end], proposal, want)


def test_the_adaptive_k_pauses_after_rejections_and_probes_with_one_draft():
    cpu, free = ROW_COST["cpu"], (0.0, 0.0)
    a = Adaptive()
    assert a.want(4, cpu) == 1 and Adaptive().want(4, free) == 4  # on a CPU a second row is cheap, a third is not
    for _ in range(3):
        a.observe(1, 0)
    assert [a.want(4, cpu) for _ in range(10)] == [0, 1, 0, 0, 1, 0, 0, 0, 0, 1]  # each pause twice the last
    for _ in range(4):
        a.observe(1, 1)
    assert a.want(4, cpu) == 1 and a.wait == 1  # kept drafts end the pauses
    assert best_k(0.3, 4, cpu) == 0 and best_k(0.3, 4, ROW_COST["cuda"]) == 2
    # 17 rows and more pad to a power of two (bucket_for): drafts always kept stop at 15 rather than pay for 32 rows
    assert best_k(1.0, 15, ROW_COST["cpu-avx512"]) == 15 and best_k(1.0, 24, ROW_COST["cpu-avx512"]) == 15
    assert best_k(1.0, 31, ROW_COST["cpu-avx512"]) == 31  # 32 rows: no padding left to waste


def test_the_row_costs_follow_the_native_kernels_isa():
    """Where rows cost alike (AVX-512 VNNI), drafts that are nearly always kept are taken four at a time; where a third
    row costs twice the second (AVX2), one at a time."""
    native = pytest.importorskip("dtorch.kernels.native")
    if native.unavailable_reason() is not None:
        pytest.skip(native.unavailable_reason())
    for isa in native.available_isas():
        with native.use_isa(isa):
            got = row_cost("cpu")
        assert got == ROW_COST["cpu-avx512" if isa == "avx512" else "cpu"], isa
        assert best_k(0.95, 4, got) == (4 if isa == "avx512" else 1), isa
    assert row_cost("cuda") == ROW_COST["cuda"] and row_cost("mps") == ROW_COST["cuda"]


# -- greedy: the same ids as without speculation, on every family ---------------------------------------------------

@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(family, checkpoint directory, transformers' greedy answers to PROMPTS)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random(transformers, tiny_config(transformers, request.param, **FAMILIES[request.param]), path)
    return request.param, str(path), {tuple(p): hf_continue(hf, p, NEW) for p in PROMPTS}


def test_greedy_ids_are_unchanged_on_every_family(family):
    """Prompt lookup on a batch of prompts of different lengths (and, for a dense and a hybrid family, on one prompt
    alone); then an oracle's drafts (kept whole, in part and not at all), the batch preempted in a cache of about one
    sequence; for the dense and the hybrid family, the oracle on DeviceMesh.cpu(2). Gated delta net layers roll their
    state back."""
    name, path, answers = family
    want = [answers[tuple(p)] for p in PROMPTS]
    llm = LLM(path, max_num_seqs=4, max_model_len=64, block_size=4, max_num_batched_tokens=32,
              kv_cache_memory_bytes=cache_bytes(path, 64), speculative_config=NGRAM)
    try:
        if name in ("qwen3", "qwen3_5_text"):
            assert llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids == want[0]
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        s = llm.engine.stats()
        assert s.spec_draft_tokens > 0 and blocks_free(llm)
        use_oracle(llm, answers)
        outs = llm.generate(PROMPTS, GREEDY)
        t = llm.engine.stats()
        assert [o.outputs[0].token_ids for o in outs] == want
        drafted, accepted = t.spec_draft_tokens, t.spec_accepted_tokens
        assert 0 < accepted < drafted and blocks_free(llm)
        if llm.config.kv_window is None:  # (sliding layers hold about a window of blocks each: nothing to preempt)
            assert t.preemptions > s.preemptions
    finally:
        llm.close()
    if name in ("qwen3", "qwen3_5_text"):  # tensor parallel: the verify step is an ordinary step of the graph
        llm = LLM(path, max_num_seqs=4, tensor_parallel_size=2, speculative_config=NGRAM)
        try:
            use_oracle(llm, answers)
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
            s = llm.engine.stats()
            assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens and blocks_free(llm)
        finally:
            llm.close()


# -- a draft model: a tiny target, a tinier draft with its vocabulary -------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target directory, draft directories, transformers' greedy answers to PROMPTS): the draft "first" is the target's
    first layer alone (it agrees with the target often), "small" a random model of half the width and one layer."""
    root = tmp_path_factory.mktemp("pair")
    hf = save_random(transformers, tiny_config(transformers, "qwen3"), root / "target")
    first = transformers.AutoModelForCausalLM.from_config(tiny_config(transformers, "qwen3", num_hidden_layers=1))
    first.load_state_dict(hf.state_dict(), strict=False)  # the second layer's weights are left out
    first.save_pretrained(root / "first")
    save_random(transformers, tiny_config(transformers, "qwen3", hidden_size=32, intermediate_size=48, head_dim=16,
                                          num_hidden_layers=1), root / "small")
    return str(root / "target"), {d: str(root / d) for d in ("first", "small")}, \
        {tuple(p): hf_continue(hf, p, NEW) for p in PROMPTS}


@pytest.mark.parametrize("draft, tp", [("first", 1), ("small", 1), ("first", 2)])
def test_a_draft_model_keeps_the_targets_greedy_ids(pair, draft, tp):
    target, drafts, answers = pair
    config = {"method": "draft_model", "model": drafts[draft], "num_speculative_tokens": 3}
    llm = LLM(target, max_num_seqs=4, tensor_parallel_size=tp, speculative_config=config)
    agreed = []
    if draft == "small":  # every rank takes rank 0's drafts and tokens (torchrun): here one rank, through the same path
        llm.engine.agree = lambda tokens: agreed.append(len(tokens)) or list(tokens)
    try:
        if tp == 1 and draft == "first":
            assert llm.generate([PROMPTS[1]], GREEDY)[0].outputs[0].token_ids == answers[tuple(PROMPTS[1])]
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == [answers[tuple(p)] for p in PROMPTS]
        s = llm.engine.stats()
        assert s.spec_draft_tokens > 0 and blocks_free(llm)
        if draft == "first":  # (one layer of two agrees with the whole about a fifth of the time)
            assert s.spec_accepted_tokens > 0
        assert bool(agreed) == (draft == "small")
    finally:
        llm.close()


def test_blocks_of_kept_drafts_are_named_for_the_prefix_cache(pair):
    """A prompt that goes on from an answer whose tokens were mostly kept drafts finds all its whole blocks in the
    prefix cache, and continues as transformers does."""
    target, _, answers = pair
    llm = LLM(target, max_num_seqs=4, block_size=4)
    try:
        use_oracle(llm, answers)
        prompt = PROMPTS[2]
        assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == answers[tuple(prompt)]
        assert llm.engine.stats().spec_accepted_tokens > NEW // 2
        longer = prompt + answers[tuple(prompt)]
        before = llm.engine.stats().prefix_hits
        llm.engine.speculator = None
        out = llm.generate([longer], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
        assert llm.engine.stats().prefix_hits - before == 4 * ((len(longer) - 1) // 4)
        hf = transformers.AutoModelForCausalLM.from_pretrained(target).eval()
        assert out.outputs[0].token_ids == hf_continue(hf, longer, 6) and blocks_free(llm)
    finally:
        llm.close()


def test_a_draft_model_must_share_the_vocabulary_and_attend(pair, tmp_path):
    target, _, _ = pair
    save_random(transformers, tiny_config(transformers, "qwen3", vocab_size=130), tmp_path / "vocab")
    save_random(transformers, tiny_config(transformers, "qwen3_5_text", num_hidden_layers=2,
                                          layer_types=["linear_attention", "full_attention"]), tmp_path / "hybrid")
    for where, message in (("vocab", "has a vocabulary of 130 tokens, the target 128"),
                           ("hybrid", "gated delta net layers: their recurrent state cannot step back")):
        with pytest.raises(dtorch.ModelError, match=message):
            LLM(target, speculative_config={"model": str(tmp_path / where), "num_speculative_tokens": 2})


# -- sampling: the distribution is kept -----------------------------------------------------------------------------

SEEDS = range(9000, 9320)  # the recorded seeds: the tests below are deterministic
# chi-square's 0.999 quantiles by degrees of freedom (a fixed table: scipy is not a dependency)
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124, 9: 27.877,
            10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123, 15: 37.697}


def chi2(observed: list[list[int]], expected: list[list[float]] | None = None) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom: goodness of fit of ``observed[0]`` to the counts ``expected[0]``,
    or (``expected`` None) homogeneity of the rows of ``observed``; cells whose expected count is under 5 are pooled."""
    obs = torch.tensor(observed, dtype=torch.float64)
    exp = torch.tensor(expected, dtype=torch.float64) if expected is not None else \
        obs.sum(1, keepdim=True) * obs.sum(0, keepdim=True) / obs.sum()
    seen = exp.sum(0) > 0  # cells nobody can land in
    obs, exp = obs[:, seen], exp[:, seen]
    small = exp.min(0).values < 5
    if small.any():
        obs = torch.cat([obs[:, ~small], obs[:, small].sum(1, keepdim=True)], 1)
        exp = torch.cat([exp[:, ~small], exp[:, small].sum(1, keepdim=True)], 1)
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat, (obs.shape[1] - 1) * (1 if expected is not None else obs.shape[0] - 1)


def exact_first(hf, prompt: list[int], p: SamplingParams) -> torch.Tensor:
    """The distribution of the first token under ``p`` from transformers' logits: the repetition penalty over the
    prompt, the temperature, then top-k (the math of each, written out)."""
    with torch.no_grad():
        x = hf(torch.tensor([prompt])).logits[0, -1].double()
    seen = torch.tensor(sorted(set(prompt)))
    x[seen] = torch.where(x[seen] > 0, x[seen] / p.repetition_penalty, x[seen] * p.repetition_penalty)
    x = x / p.temperature
    x[x < torch.topk(x, p.top_k).values[-1]] = -float("inf")
    return torch.softmax(x, -1)


def drafted_prompt(hf, p: SamplingParams) -> tuple[list[int], torch.Tensor]:
    """A prompt whose lookup drafts a first token that ``p`` draws with probability in [0.15, 0.85] (so drafts are
    kept and refused), and that distribution: [b_-1, t] + b for a random b, t the likeliest first token after it."""
    for seed in range(60, 90):
        base, t = rand_ids(8, seed), 3
        for _ in range(4):
            prompt = [base[-1], t] + base  # the lookup of base's last token drafts t
            exact = exact_first(hf, prompt, p)
            if 0.15 <= exact[t] <= 0.85:
                return prompt, exact
            t = int(exact.argmax())
    raise AssertionError("no prompt drafts a likely first token")


def test_sampling_keeps_the_distribution(pair):
    """Over a fixed set of seeds, the first two tokens' frequencies with prompt lookup and with a draft model (whose
    drafts are drawn from its own distribution) agree with those without speculation, and the first token's with
    transformers' distribution (chi-square at 0.999); a seeded request repeats itself."""
    target, drafts, _ = pair
    p = SamplingParams(temperature=0.8, top_k=4, repetition_penalty=1.2, max_tokens=2, ignore_eos=True)
    prompt, exact = drafted_prompt(transformers.AutoModelForCausalLM.from_pretrained(target).eval(), p)
    llm = LLM(target, max_num_seqs=16, speculative_config={"model": drafts["first"], "num_speculative_tokens": 1})
    try:
        speculators = {"plain": None, "draft model": llm.engine.speculator,
                       "ngram": Speculator(SpeculativeConfig.from_dict(NGRAM), (0.35, 0.7))}
        runs, made = {}, {}
        for name, spec in speculators.items():
            llm.engine.speculator = spec
            before = llm.engine.stats()
            outs = llm.generate([prompt] * len(SEEDS), [dataclasses.replace(p, seed=s) for s in SEEDS])
            runs[name] = [o.outputs[0].token_ids for o in outs]
            made[name] = GenerationStats.between(before, llm.engine.stats())
        for name in ("ngram", "draft model"):
            assert made[name].draft_tokens >= len(SEEDS) and 0 < made[name].accepted_tokens < made[name].draft_tokens
        seeded = [dataclasses.replace(p, seed=s, max_tokens=8) for s in SEEDS[:16]]
        again, once = (llm.generate([prompt] * 16, seeded) for _ in range(2))
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in once]
        assert blocks_free(llm)
    finally:
        llm.close()
    for name in ("ngram", "draft model"):
        for position in (0, 1):
            stat, df = chi2([counts_of(runs[n], position) for n in (name, "plain")])
            assert stat < CHI2_999[df], (name, position, stat, df)
        first = counts_of(runs[name], 0)
        assert sum(first[t] for t in range(VOCAB) if exact[t] == 0) == 0  # nothing outside the top-k
        stat, df = chi2([first], [(exact * len(SEEDS)).tolist()])
        assert stat < CHI2_999[df], (name, stat, df)


def counts_of(runs: list[list[int]], position: int) -> list[int]:
    return torch.bincount(torch.tensor([r[position] for r in runs]), minlength=VOCAB).tolist()


# -- the default model: what ends an answer ends it inside an accepted run ------------------------------------------

PARAGRAPH = ("The lighthouse stood on a rock at the mouth of the harbour, and for two hundred years its keepers kept "
             "the lamp burning through every storm.")


@pytest.fixture(scope="module")
def default():
    """The default model with prompt lookup of up to 4 tokens a step (rows priced at nothing, so the adaptive k drafts
    all 4 where they are kept), and a chat prompt asking it to repeat a paragraph."""
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    llm = LLM(max_model_len=512, speculative_config=config)
    llm.engine.speculator = Speculator(SpeculativeConfig.from_dict(config), (0.0, 0.0))
    yield llm, llm.chat_prompt([{"role": "user", "content": "Repeat this sentence exactly:\n\n" + PARAGRAPH}])
    llm.close()


def both(llm: LLM, prompt, params: SamplingParams, plain: bool = True):
    """(the plain answer (None unless ``plain``), the answer with speculation, the rounds of the latter: (tokens before
    the step, tokens the step verified, tokens after it))."""
    spec, rounds = llm.engine.speculator, []
    verify, settle = spec.verify, spec.settle
    before = {}

    def watch_verify(engine, seqs, *rest):
        before.update({id(s): len(s.output_ids) for s in seqs})
        return verify(engine, seqs, *rest)

    def watch_settle(engine, seq, draft, tokens, taken, rollback):
        rounds.append((before[id(seq)], list(tokens), len(seq.output_ids)))
        return settle(engine, seq, draft, tokens, taken, rollback)

    llm.engine.speculator = None
    plain = llm.generate([prompt], params)[0].outputs[0] if plain else None
    llm.engine.speculator = spec
    spec.verify, spec.settle = watch_verify, watch_settle
    try:
        fast = llm.generate([prompt], params)[0].outputs[0]
    finally:
        del spec.verify, spec.settle
    return plain, fast, rounds


def spec_only(llm: LLM, prompt, params: SamplingParams):
    """(the answer with speculation, its rounds as ``both``'s)."""
    _, fast, rounds = both(llm, prompt, params, plain=False)
    return fast, rounds


def same(a, b) -> bool:
    def key(c):
        return c.token_ids, c.text, c.finish_reason, c.stop_reason
    return key(a) == key(b)


def test_stops_inside_an_accepted_run_end_where_plain_decoding_ends(default):
    llm, prompt = default
    plain, fast, rounds = both(llm, prompt, SamplingParams(temperature=0.0, max_tokens=64))
    assert same(plain, fast) and plain.finish_reason == "stop" and plain.stop_reason is None  # end of sequence
    assert PARAGRAPH[:40] in plain.text
    assert sum(len(t) - 1 for _, t, _ in rounds) > len(plain.token_ids) // 2  # most tokens came from drafts
    ids, n, tok = plain.token_ids, len(plain.token_ids), llm.tokenizer
    # a stop string that ends on the second token of a run of three or more: the answer is plain decoding's up to it
    for start, tokens, _ in rounds:
        at = len(tok.decode(ids[:start]))
        stop = tok.decode(ids[:start + 2])[at:]
        if len(tokens) >= 3 and stop.strip() and plain.text.find(stop) == at:
            break
    else:
        raise AssertionError("no run of three tokens to stop in")
    fast, rounds = spec_only(llm, prompt, SamplingParams(temperature=0.0, max_tokens=64, stop=[stop]))
    assert (fast.token_ids, fast.text, fast.finish_reason, fast.stop_reason) == \
        (ids[:start + 2], plain.text[:at], "stop", stop)
    last_start, last_tokens, last_end = rounds[-1]
    assert last_end - last_start < len(last_tokens)  # the step verified more tokens than the answer kept
    # max_tokens inside a run: plain decoding's first tokens
    fast, rounds = spec_only(llm, prompt, SamplingParams(temperature=0.0, max_tokens=n - 3))
    assert (fast.token_ids, fast.finish_reason) == (ids[:n - 3], "length") and rounds
    # min_tokens past the end of sequence: as plain decoding goes on
    plain, fast, rounds = both(llm, prompt, SamplingParams(temperature=0.0, max_tokens=n + 8, min_tokens=n + 6))
    assert same(plain, fast) and len(fast.token_ids) >= n + 6 and fast.token_ids[:n - 1] == ids[:n - 1]
    assert blocks_free(llm)


def test_structured_outputs_are_kept_token_by_token(default):
    pytest.importorskip("llguidance")
    llm, _ = default
    prompt = llm.chat_prompt([{"role": "user", "content": 'Repeat this JSON exactly: {"place": "lighthouse", '
                                                          '"keepers": 12, "lamp": "oil"}'}])
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=dtorch.StructuredOutputsParams(
        json={"type": "object", "properties": {"place": {"type": "string"}, "keepers": {"type": "integer"},
                                               "lamp": {"type": "string"}}, "required": ["place", "keepers"]}))
    plain, fast, rounds = both(llm, prompt, params)
    assert same(plain, fast) and fast.finish_reason == "stop"
    assert any(len(t) > 1 for _, t, _ in rounds)  # drafts were kept under the grammar's mask
    import json
    assert json.loads(fast.text)["place"] == "lighthouse"
    assert blocks_free(llm)


def test_the_speed_line_and_metrics_report_drafts(default, capsys):
    from dtorch.engine.options import print_speed
    from dtorch.serve.metrics import ServerMetrics

    llm, prompt = default
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))
    g, s = llm.stats, llm.engine.stats()
    assert 0 < g.accepted_tokens <= g.draft_tokens and g.acceptance_rate == g.accepted_tokens / g.draft_tokens
    print_speed(g)
    assert f"speculative: {g.draft_tokens} drafted, {g.accepted_tokens} accepted ({g.acceptance_rate:.0%})" \
        in capsys.readouterr().err
    text = ServerMetrics(llm.engine).render().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("dtorch:spec")}
    assert values["dtorch:spec_decode_num_draft_tokens_total"] == s.spec_draft_tokens
    assert values["dtorch:spec_decode_num_accepted_tokens_total"] == s.spec_accepted_tokens
    assert values["dtorch:spec_decode_acceptance_rate"] == pytest.approx(s.spec_accepted_tokens / s.spec_draft_tokens)


@pytest.mark.parametrize("flag, message", [
    ("{method", "--speculative-config: not JSON"),
    ('{"method": "ngram"}', "--speculative-config: give 'num_speculative_tokens'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookup_max": 3}', "unknown key 'lookup_max'"),
])
def test_a_bad_speculative_config_flag_is_a_clean_error(flag, message, capsys):
    from dtorch.cli import main

    assert main(["generate", "hi", "--speculative-config", flag]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
