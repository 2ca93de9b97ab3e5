"""Speculative verification's sampled draws (``engine/verify.py``'s rejection rule over ``engine/kept.py``'s kept
sets) against the math written out here: transformers' warpers give the kept sets and probabilities, a float64
inverse CDF over the dense distribution (and the residual max(0, p - q) of Leviathan et al.) gives each seeded token,
and the first token of a run follows p, the acceptance rate sum min(p, q) (chi-square and binomial tests on fixed
seeds: deterministic)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dtorch.engine.kept import Kept, uniform
from dtorch.engine.sampling import SamplingParams
from dtorch.engine.verify import _sampled_run
from tests.test_sampling import _hf_filter, _inverse_cdf

VOCAB = 5000
PARAMS = [  # kept sets of each filter, and every token (the whole vocabulary's chunked draw)
    {"temperature": 0.8, "top_k": 20, "top_p": 0.9}, {"temperature": 1.2, "min_p": 0.05}, {"temperature": 1.0},
]


def rows(seed: int, n: int = 2) -> torch.Tensor:
    """n target rows [n, VOCAB] peaked as a model's, and a draft row close to the first (its last row)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, VOCAB, generator=g) * 2.5
    x[:, :6] += torch.tensor([6.0, 5.5, 5.0, 4.5, 4.0, 3.0])
    return torch.cat([x, x[:1] + torch.randn(1, VOCAB, generator=g) * 1.5])


def dense(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The row's sampling distribution [V] float64 by transformers' warpers."""
    return torch.softmax(_hf_filter(x, params).double(), -1)


def seq(params: SamplingParams, g: torch.Generator) -> SimpleNamespace:
    return SimpleNamespace(params=params, generator=g, request_id="test")


@pytest.mark.parametrize("kwargs", PARAMS)
def test_kept_sets_and_probabilities_are_transformers(kwargs):
    x = rows(1)[0]
    params = SamplingParams(**kwargs)
    ref = dense(x, params)
    for own in (True, False):
        k = Kept.of(x, params.temperature, params.top_k, params.top_p, params.min_p, own=own)
        got = torch.zeros(VOCAB, dtype=torch.float64)
        got[k.ids if k.ids is not None else slice(None)] = k.probs.double()
        assert torch.equal(got > 0, ref > 0)  # exactly the same kept set
        torch.testing.assert_close(got, ref, atol=1e-7, rtol=1e-5)
        assert all(k.at(t) == float(got[t]) for t in (0, 3, int(ref.argmin()), VOCAB - 1))


def reference_run(x: torch.Tensor, params: SamplingParams, q: torch.Tensor | None, t: int, g: torch.Generator
                  ) -> list[int]:
    """One draft t (q [V] float64: its draft distribution; None: picked outright) over rows x[0] (t's) and x[1]:
    kept when u * q(t) < p(t), else a draw from max(0, p - q) normalized (p without t when q is None); after a kept
    t, a draw from x[1]'s distribution. Each u one float64 uniform of g."""
    p = dense(x[0], params)
    qt = 1.0 if q is None else float(q[t])
    if float(torch.rand((), dtype=torch.float64, generator=g)) * qt < float(p[t]):
        return [t, _inverse_cdf(dense(x[1], params), g)]
    if q is None:
        residual = p.clone()
        residual[t] = 0.0
    else:
        residual = (p - q).clamp(min=0.0)
    return [_inverse_cdf(residual, g)]


@pytest.mark.parametrize("kwargs", PARAMS)
@pytest.mark.parametrize("drafter", ["draft model", "prompt lookup", "point mass"])
def test_seeded_runs_are_the_rejection_rule_by_inverse_cdf(kwargs, drafter):
    """Seeded runs of one draft equal the reference's token for token (both outcomes occur), with the generator
    left where the reference leaves it (one uniform a decision and a draw)."""
    params = SamplingParams(**kwargs)
    x = rows(2)
    p0 = dense(x[0], params)
    qd = dense(x[2], params)
    t = int((qd - p0).argmax())  # likelier to the draft than to the target: refused often, kept sometimes
    if drafter == "draft model":
        q, qref = [Kept.of(x[2], params.temperature, params.top_k, params.top_p, params.min_p)], qd
    elif drafter == "point mass":  # the draft model's stand-in for a broken row: q(t) = 1
        q, qref = [Kept.point(t, "cpu")], None
    else:
        q, qref = None, None
    outcomes = set()
    for seed in range(40):
        g, ref_g = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        run = _sampled_run(x[:2], 0, seq(params, g), [t], q, {}, [0, 0])
        assert run == reference_run(x[:2], params, qref, t, ref_g), seed
        assert torch.equal(g.get_state(), ref_g.get_state())
        outcomes.add(len(run))
    assert outcomes == {1, 2}


@pytest.mark.parametrize("kwargs", [PARAMS[0], PARAMS[2]])
def test_the_first_token_follows_p_and_drafts_are_kept_at_sum_min_p_q(kwargs):
    """4000 rounds of a draft drawn from q and verified against p: the first token's frequencies fit p (chi-square,
    cells of expected count under 5 pooled, p-value above 1e-4) and the drafts are kept at the rate sum min(p, q)
    (within 4.5 standard deviations)."""
    params, n = SamplingParams(**kwargs), 4000
    x = rows(3)
    p, qref = dense(x[0], params), dense(x[2], params)
    q = Kept.of(x[2], params.temperature, params.top_k, params.top_p, params.min_p)
    g = torch.Generator().manual_seed(5)
    first, kept = torch.zeros(VOCAB, dtype=torch.float64), 0
    for _ in range(n):
        d = q.draw(uniform(g))
        run = _sampled_run(x[:2], 0, seq(params, g), [d], [q], {}, [0, 0])
        first[run[0]] += 1
        kept += len(run) == 2
    assert float(first[p == 0].sum()) == 0.0  # nothing outside the target's kept set
    first, expected = first[p > 0], p[p > 0] * n
    small = expected < 5
    obs = torch.cat([first[~small], first[small].sum(0, keepdim=True)]) if small.any() else first
    exp = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)]) if small.any() else expected
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = obs.shape[0] - 1
    assert float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2))) > 1e-4, (stat, df)
    rate = float(torch.minimum(p, qref).sum())
    assert abs(kept - n * rate) < 4.5 * (n * rate * (1 - rate)) ** 0.5, (kept, n * rate)
