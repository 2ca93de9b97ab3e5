"""Sampling: seeded draws are reproducible, filters never let a token outside their set through, bad values raise.

References nobody here wrote: transformers' logits processors (repetition penalty, temperature, top-k, top-p,
min-p), OpenAI's published presence/frequency formula (as plain loops), torch.log_softmax / torch.topk.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import dtorch
from dtorch.engine.sampling import (
    SamplingParams,
    apply_penalties,
    argmax_rows,
    filter_logits,
    sample,
    sample_step,
)


def _draw(logits: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    g = params.generator()
    return [sample(logits[None], [params], [g])[0] for _ in range(n)]


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    assert sample(logits, [SamplingParams(temperature=0.0)] * 4, [None] * 4) == logits.argmax(-1).tolist()


def test_seed_reproducible_and_seeds_differ():
    logits = torch.randn(200)
    a = _draw(logits, SamplingParams(temperature=1.0, seed=7), 40)
    b = _draw(logits, SamplingParams(temperature=1.0, seed=7), 40)
    c = _draw(logits, SamplingParams(temperature=1.0, seed=8), 40)
    assert a == b
    assert a != c


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_stays_in_the_k_most_likely(k):
    logits = torch.randn(100)
    allowed = set(torch.topk(logits, k).indices.tolist())
    drawn = _draw(logits, SamplingParams(temperature=5.0, top_k=k, seed=1), 300)
    assert set(drawn) <= allowed
    if k > 1:
        assert len(set(drawn)) > 1  # a hot temperature over several allowed tokens does vary


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_top_p_stays_in_the_nucleus(p):
    logits = torch.randn(60) * 2
    probs = torch.softmax(logits, -1)
    order = torch.argsort(probs, descending=True)
    cum = torch.cumsum(probs[order], 0)
    n = int((cum < p).sum()) + 1  # the smallest prefix whose mass reaches p
    nucleus = set(order[:n].tolist())
    drawn = _draw(logits, SamplingParams(temperature=1.0, top_p=p, seed=2), 300)
    assert set(drawn) <= nucleus


def test_min_p_drops_unlikely_tokens():
    logits = torch.randn(80) * 3
    probs = torch.softmax(logits, -1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    drawn = _draw(logits, SamplingParams(temperature=1.0, min_p=0.2, seed=3), 300)
    assert set(drawn) <= allowed


def test_filters_keep_temperature_scaling():
    logits = torch.randn(30)
    out = filter_logits(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(out, logits / 0.5)


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2},
    {"top_k": 2.5}, {"min_p": -0.1}, {"min_p": 2.0}, {"max_tokens": 0}, {"seed": "x"}, {"stop": [""]},
    {"stop": 3}, {"ignore_eos": "yes"}, {"stop_token_ids": ["a"]},
    {"presence_penalty": 2.5}, {"presence_penalty": -2.01}, {"presence_penalty": "0.5"}, {"presence_penalty": None},
    {"frequency_penalty": -3.0}, {"frequency_penalty": float("inf")}, {"frequency_penalty": True},
    {"repetition_penalty": 0.0}, {"repetition_penalty": -1.2}, {"repetition_penalty": float("nan")},
    {"repetition_penalty": "1.1"}, {"logprobs": -1}, {"logprobs": 21}, {"logprobs": 1.5}, {"logprobs": True},
    {"n": 0}, {"n": 17}, {"n": 2.0}, {"n": None}, {"n": True},
])
def test_bad_values_raise_sampling_error(kwargs):
    with pytest.raises(dtorch.SamplingError) as info:
        SamplingParams(**kwargs)
    assert next(iter(kwargs)).split("_")[0] in str(info.value)


@pytest.mark.parametrize("kwargs", [
    {"presence_penalty": 2.0}, {"presence_penalty": -2.0}, {"frequency_penalty": 2}, {"frequency_penalty": -2.0},
    {"repetition_penalty": 1e-3}, {"repetition_penalty": 5}, {"logprobs": 0}, {"logprobs": 20}, {"n": 1}, {"n": 16},
])
def test_boundary_values_accepted(kwargs):
    SamplingParams(**kwargs)


def test_stop_string_normalized_to_tuple():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


# --- penalties ---------------------------------------------------------------------------------------------------

V = 12
PROMPT = [1, 2, 2, 7, 11]
OUTPUT = [2, 3, 3, 3, 9, 1]


def _openai_penalties(logits: torch.Tensor, output: list[int], frequency: float, presence: float) -> torch.Tensor:
    """OpenAI's formula, token by token: logit[j] -= frequency * count[j] + presence * (count[j] > 0)."""
    out = logits.clone()
    for j in range(out.shape[-1]):
        count = output.count(j)
        out[j] = out[j] - (frequency * count + presence * (1.0 if count > 0 else 0.0))
    return out


def _hf_repetition(logits: torch.Tensor, ids: list[int], penalty: float) -> torch.Tensor:
    return RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits[None].clone())[0]


def _penalize(logits: torch.Tensor, params: SamplingParams, output=OUTPUT, prompt=PROMPT) -> torch.Tensor:
    return apply_penalties(logits[None], [params], [output], [prompt])[0]


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_hf(penalty):
    logits = torch.randn(V) * 3  # both signs
    got = _penalize(logits, SamplingParams(repetition_penalty=penalty))
    torch.testing.assert_close(got, _hf_repetition(logits, PROMPT + OUTPUT, penalty))
    assert not torch.equal(got, logits)


@pytest.mark.parametrize(("frequency", "presence"), [(0.7, 0.0), (0.0, 1.1), (-0.5, 0.0), (0.0, -2.0), (0.4, 0.9)])
def test_frequency_presence_match_openai_formula(frequency, presence):
    logits = torch.randn(V)
    got = _penalize(logits, SamplingParams(frequency_penalty=frequency, presence_penalty=presence))
    torch.testing.assert_close(got, _openai_penalties(logits, OUTPUT, frequency, presence))
    for j in set(PROMPT) - set(OUTPUT):  # the prompt is not counted
        assert got[j] == logits[j]


def test_combined_penalties_are_repetition_then_openai():
    logits = torch.randn(V) * 2
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.6)
    ref = _openai_penalties(_hf_repetition(logits, PROMPT + OUTPUT, 1.5), OUTPUT, 0.3, 0.6)
    torch.testing.assert_close(_penalize(logits, params), ref)


def test_penalties_batched_rows_independent():
    logits = torch.randn(4, V)
    params = [SamplingParams(), SamplingParams(frequency_penalty=1.0), SamplingParams(),
              SamplingParams(repetition_penalty=1.7, presence_penalty=0.2)]
    outputs, prompts = [OUTPUT, [4, 4, 5], [0, 0], [10, 11, 999]], [PROMPT, [], [0], [6]]  # 999: past the vocab
    got = apply_penalties(logits, params, outputs, prompts)
    torch.testing.assert_close(got[0], logits[0])
    torch.testing.assert_close(got[1], _openai_penalties(logits[1], [4, 4, 5], 1.0, 0.0))
    torch.testing.assert_close(got[2], logits[2])
    ref3 = _openai_penalties(_hf_repetition(logits[3], [6, 10, 11], 1.7), [10, 11], 0.0, 0.2)
    torch.testing.assert_close(got[3], ref3)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, frequency_penalty=0.3),  # 2.0 - 3 * 0.3 = 1.1 < 1.5
    SamplingParams(temperature=0.0, presence_penalty=0.6),  # 2.0 - 0.6 = 1.4 < 1.5
    SamplingParams(temperature=0.0, repetition_penalty=1.5),  # 2.0 / 1.5 = 1.33 < 1.5
])
def test_penalties_change_the_greedy_choice(params):
    logits = torch.zeros(V)
    logits[3], logits[5] = 2.0, 1.5
    assert sample(logits[None], [params], [None]) == [3]  # no history, no penalty
    tokens, _ = sample_step(logits[None], [params], [None], [[3, 3, 3]], [[0]])
    freq, pres, rep = params.frequency_penalty, params.presence_penalty, params.repetition_penalty
    ref = _openai_penalties(_hf_repetition(logits, [0, 3, 3, 3], rep), [3, 3, 3], freq, pres)
    assert tokens == [int(ref.argmax())] == [5]


def test_small_penalty_keeps_the_greedy_choice():
    logits = torch.zeros(V)
    logits[3], logits[5] = 2.0, 1.5
    tokens, _ = sample_step(logits[None], [SamplingParams(temperature=0.0, frequency_penalty=0.1)], [None],
                            [[3, 3, 3]], [[]])
    assert tokens == [3]  # 2.0 - 0.3 = 1.7 > 1.5


# --- filters and draws against transformers ------------------------------------------------------------------------

FILTERS = [
    {"temperature": 0.7}, {"temperature": 1.3, "top_k": 5}, {"temperature": 1.0, "top_p": 0.6},
    {"temperature": 0.9, "min_p": 0.1}, {"temperature": 1.5, "top_k": 20, "top_p": 0.8, "min_p": 0.05},
]


def _hf_filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' warpers in generate()'s order: temperature, top-k, top-p, min-p. logits: [V] -> [V]."""
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        warpers.append(MinPLogitsWarper(params.min_p))
    x, ids = logits[None].clone(), torch.zeros(1, 1, dtype=torch.long)
    for w in warpers:
        x = w(ids, x)
    return x[0]


@pytest.mark.parametrize("kwargs", FILTERS)
def test_filter_logits_matches_hf_warpers(kwargs):
    logits = torch.randn(64) * 2
    params = SamplingParams(**kwargs)
    torch.testing.assert_close(filter_logits(logits, params), _hf_filter(logits, params))


def _inverse_cdf(probs: torch.Tensor, g: torch.Generator) -> int:
    """The draw the sampler promises: u, one float64 uniform of ``g``; the first token id whose cumulative
    probability (in id order) exceeds u times the total."""
    u = float(torch.rand((), dtype=torch.float64, generator=g))
    cum = torch.cumsum(probs.double(), 0)
    return int(torch.searchsorted(cum, torch.tensor([u * float(cum[-1])], dtype=torch.float64), right=True))


@pytest.mark.parametrize("kwargs", FILTERS)
def test_sample_step_draw_matches_reference_pipeline(kwargs):
    logits = torch.randn(64) * 2
    output, prompt = [5, 5, 9, 40], [1, 5, 63]
    params = SamplingParams(seed=11, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3, **kwargs)
    ref = _hf_filter(_openai_penalties(_hf_repetition(logits, prompt + output, 1.2), output, 0.5, 0.3), params)
    ref_g, g = params.generator(), params.generator()
    for _ in range(30):  # the same generator stream gives the same draws
        want = _inverse_cdf(torch.softmax(ref, -1), ref_g)
        assert sample_step(logits[None], [params], [g], [output], [prompt])[0] == [want]
    assert torch.equal(g.get_state(), ref_g.get_state())  # one uniform a token


LARGE = [  # a 150k vocabulary, peaked as a model's; the last two flatter: a nucleus of ~1.6k tokens, then of most
    ({"temperature": 0.8, "top_k": 40, "top_p": 0.95}, 6.0), ({"temperature": 0.8, "top_p": 0.95}, 6.0),
    ({"temperature": 1.0, "min_p": 0.05}, 6.0), ({"temperature": 0.7}, 6.0), ({"temperature": 1.2, "top_k": 1}, 6.0),
    ({"temperature": 1.0, "top_k": 5000, "min_p": 0.01}, 6.0), ({"temperature": 1.1, "top_p": 0.9, "min_p": 0.2}, 6.0),
    ({"temperature": 1.0, "top_p": 0.9}, 3.5), ({"temperature": 1.0, "top_p": 0.9}, 1.0),
]
EXTRA = [{}, {"frequency_penalty": 0.5, "repetition_penalty": 1.2}, {"logit_bias": {3: 4.0, 149_998: 9.0}}]


def test_large_vocab_keeps_the_reference_set_and_draws_by_it():
    """Over a 150k vocabulary (filters rank pools of chunks, not the vocabulary; the draw reads chunk sums), one batch
    with every setting of ``LARGE``, some rows penalized and biased: each row keeps exactly transformers' set with its
    probabilities, and draws ``_inverse_cdf``'s tokens from the same seeds."""
    vocab = 150_000
    g0 = torch.Generator().manual_seed(3)
    logits = torch.stack([torch.randn(vocab, generator=g0) * scale for _, scale in LARGE])
    logits[:, :7] += torch.tensor([9.0, 8.5, 8.0, 6.0, 5.5, 5.0, 3.0])  # a few likely tokens, as after a prompt
    params = [SamplingParams(seed=20 + i, **kw, **EXTRA[i % 3]) for i, (kw, _) in enumerate(LARGE)]
    outputs, prompts = [[0, 0, 1, 5]] * len(LARGE), [[2, 6, 149_998]] * len(LARGE)
    shaped = [_hf_repetition(logits[i], prompts[i] + outputs[i], p.repetition_penalty) for i, p in enumerate(params)]
    for x, p in zip(shaped, params, strict=True):  # OpenAI's formula; tokens with count 0 lose 0
        for t in set(outputs[0]):
            x[t] -= p.frequency_penalty * outputs[0].count(t)
    for x, p in zip(shaped, params, strict=True):
        for t, b in (p.logit_bias or {}).items():
            x[t] += b
    refs = [torch.softmax(_hf_filter(x, p), -1) for x, p in zip(shaped, params, strict=True)]
    for x, p, ref in zip(shaped, params, refs, strict=True):
        got = torch.softmax(filter_logits(x, p), -1)
        assert torch.equal(got > 0, ref > 0), p  # exactly the same kept set
        assert float(((got - ref).abs() - 1e-5 * ref).max()) <= 1e-8, p
    gens, ref_gens = [p.generator() for p in params], [p.generator() for p in params]
    for _ in range(3):
        tokens, _ = sample_step(logits, params, gens, outputs, prompts)
        assert tokens == [_inverse_cdf(ref, g) for ref, g in zip(refs, ref_gens, strict=True)]


def test_draws_follow_the_kept_distribution():
    """Frequencies of 4000 seeded draws (top-k 6 of a 10k vocabulary) against the kept probabilities: a chi-square
    test at the 1e-4 level (27.9 for 5 degrees of freedom), and no token outside the kept set."""
    logits = torch.randn(10_000, generator=torch.Generator().manual_seed(1)) * 3
    params = SamplingParams(temperature=1.5, top_k=6, seed=4)
    ref = torch.softmax(_hf_filter(logits, params), -1)
    counts = torch.bincount(torch.tensor(_draw(logits, params, 4000)), minlength=10_000).double()
    kept = ref > 0
    assert counts[~kept].sum() == 0
    expected = ref[kept].double() * 4000
    assert float(((counts[kept] - expected) ** 2 / expected).sum()) < 27.9


# --- logprobs ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [0, 5])
def test_logprobs_are_of_the_raw_distribution(k):
    logits = torch.randn(3, 50) * 2
    params = [SamplingParams(temperature=0.0, logprobs=k), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.5, top_k=3, frequency_penalty=1.0, logprobs=k, seed=0)]
    tokens, lps = sample_step(logits, params, [None, None, params[2].generator()], [[1, 2], [], [7, 7]], [[], [], [3]])
    assert lps[1] is None
    ref = torch.log_softmax(logits, dim=-1)
    for b in (0, 2):
        lp = lps[b]
        assert lp is not None and lp.token_id == tokens[b]
        assert math.isclose(lp.logprob, float(ref[b, tokens[b]]), rel_tol=1e-6, abs_tol=1e-6)
        top = torch.topk(ref[b], k)
        assert [i for i, _ in lp.top] == top.indices.tolist()  # most likely first
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), top.values)
        assert all(a[1] >= c[1] for a, c in zip(lp.top, lp.top[1:], strict=False))
    assert len(lps[0].top) == k


# --- seeds, batching -----------------------------------------------------------------------------------------------

def _draws(g: torch.Generator, logits: torch.Tensor, n: int = 40) -> list[int]:
    p = SamplingParams(temperature=1.0)
    return [sample(logits[None], [p], [g])[0] for _ in range(n)]


def test_generator_index_reproducible_and_distinct():
    logits = torch.randn(200)
    params = SamplingParams(seed=7)
    assert _draws(params.generator(2), logits) == _draws(params.generator(2), logits)
    assert _draws(params.generator(2), logits) != _draws(params.generator(0), logits)
    assert _draws(params.generator(0), logits) == _draws(params.generator(), logits)
    assert _draws(params.generator(1), logits) == _draws(SamplingParams(seed=8).generator(), logits)  # seed + index


def test_batched_equals_row_by_row():
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 2
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=1.4, logprobs=3),
              SamplingParams(temperature=0.8, top_k=10, seed=1), SamplingParams(temperature=1.2, top_p=0.7, seed=2,
                                                                                   frequency_penalty=0.5, logprobs=0),
              SamplingParams(temperature=1.0, min_p=0.1, presence_penalty=-1.0, seed=3),
              SamplingParams(temperature=0.0, logprobs=2)]
    outputs = [[1], [2, 2, 5], [], [8, 8, 8, 30], [0, 39], [4]]
    prompts = [[0], [3, 5], [9], [], [1, 2, 3], [4, 4]]
    gens = [None if p.greedy else p.generator() for p in params]
    gens_row = [None if p.greedy else p.generator() for p in params]
    for _ in range(10):
        tokens, lps = sample_step(logits, params, gens, outputs, prompts)
        for b in range(6):
            t, lp = sample_step(logits[b:b + 1], params[b:b + 1], gens_row[b:b + 1], outputs[b:b + 1], prompts[b:b + 1])
            assert t == [tokens[b]] and lp == [lps[b]]


def test_fast_path_is_argmax_without_logprobs():
    logits = torch.randn(5, 30)
    tokens, lps = sample_step(logits, [SamplingParams(temperature=0.0)] * 5, [None] * 5, [[1, 2]] * 5, [[3]] * 5)
    assert tokens == logits.argmax(-1).tolist() and lps == [None] * 5


def _argmax_cases() -> list[torch.Tensor]:
    nan, inf = math.nan, math.inf
    x = torch.randn(6, 151_936, generator=torch.Generator().manual_seed(3))
    x[1, 7], x[1, 90_000] = nan, nan  # the first NaN wins
    x[2] = x[2].round()  # many ties: the first of the largest
    x[3] = -inf
    x[4, 5], x[4, 6], x[4, 100] = inf, inf, nan
    x[5, 0], x[5, 1] = -0.0, 0.0
    x[5, 2:] = -1.0
    small = torch.tensor([[1.0, 3.0, 3.0, 2.0], [nan, 1.0, nan, 0.0], [-inf, -inf, -inf, -inf], [0.0, -0.0, -0.0, 0.0]])
    return [x, x[:, 1000:], x[:, ::3], x.T.contiguous().T, x[2], small, x[1:2]]


@pytest.mark.parametrize("case", range(7))
def test_argmax_rows_is_torch_argmax(case):
    """The numpy route gives torch.argmax's index: ties, NaNs (the first), infinities, -0.0, strided and 1-D rows."""
    x = _argmax_cases()[case]
    want = torch.argmax(x, dim=-1)
    assert argmax_rows(x) == ([int(want)] if x.dim() == 1 else want.tolist())
    assert argmax_rows(x.to(torch.bfloat16)) == torch.argmax(x.to(torch.bfloat16), dim=-1).reshape(-1).tolist()


def test_an_unknown_field_is_a_sampling_error_with_a_suggestion():
    with pytest.raises(dtorch.SamplingError, match="unknown field .temprature'; did you mean 'temperature'"):
        SamplingParams(temprature=0.5)
    with pytest.raises(dtorch.SamplingError, match="unknown field .foo'; the fields are .*max_tokens"):
        SamplingParams(foo=1)
    assert SamplingParams(temperature=0.5).temperature == 0.5


@pytest.mark.parametrize("k", [1, 40, 700, 40_000])  # the chunk-maxima bound, smaller chunks, a plain topk
def test_top_k_keeps_the_k_largest_with_ties(k):
    """Every top-k route keeps exactly ``x >= kth`` (torch.topk's k-th value), ties of the k-th included."""
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(k)).mul_(4).round_()  # many ties
    params = SamplingParams(temperature=0.9, top_k=k)
    kth = torch.topk(x / 0.9, k).values[-1]
    got = torch.isfinite(filter_logits(x, params))
    assert torch.equal(got, x / 0.9 >= kth) and int(got.sum()) >= k


@pytest.mark.parametrize("bad", ["nan", "inf", "all -inf"])
def test_a_row_that_cannot_be_sampled_raises_sampling_error(bad):
    logits = torch.randn(2, 5000)
    if bad == "all -inf":
        logits[1] = -math.inf
    else:
        logits[1, 17] = float(bad)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1)] * 2
    with pytest.raises(dtorch.SamplingError, match="sample_step row 1: cannot sample"):
        sample_step(logits, params, [p.generator() for p in params], [[], []], [[], []])


def test_sampling_in_and_out_of_inference_mode():
    """The sampler's per-thread buffers are normal tensors: a first call under inference mode does not make later
    ones fail (torch refuses writes to inference tensors outside it), nor do logits that require grad. In a new
    thread: its buffers are made by its first call."""
    import threading

    logits = torch.randn(1, 9000)
    p = SamplingParams(temperature=0.8, top_p=0.9, frequency_penalty=0.3, seed=1)
    got: list = []

    def run() -> None:
        with torch.inference_mode():
            got.append(sample_step(logits, [p], [p.generator()], [[1]], [[]])[0])
        got.append(sample_step(logits, [p], [p.generator()], [[1]], [[]])[0])
        got.append(sample_step(logits.clone().requires_grad_(True), [p], [p.generator()], [[1]], [[]])[0])

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert len(got) == 3 and got[0] == got[1] == got[2]
