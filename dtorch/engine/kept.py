"""The tokens a sampled row keeps (top-k, top-p, min-p) and one draw among them, in a pass or two over the vocabulary.

A row's scaled logits z [V] (raw / temperature) are read whole twice at most: once for the maxima of its chunks of
``CHUNK`` tokens (``Chunks``), once more for the softmax when top-p runs without top-k. Every filter keeps the tokens
at or above some logit, so the pool a filter ranks is the chunks whose maximum reaches a bound, gathered, never the
vocabulary:
- top-k: the k-th largest of the chunk maxima is at most the k-th largest logit (k chunks each hold a token at or
  above it): the chunks reaching it hold the k most likely tokens;
- top-p alone: the tokens of probability >= eps, eps lowered until their mass reaches top_p (the nucleus is a prefix
  of the ranking, so a prefix holding mass top_p holds it); a flat distribution's nucleus is ranked by a sort;
- min-p alone: the tokens within ln(min_p) of the top logit.
Each filter then ranks its pool exactly as the plain definitions do over the vocabulary (``reference_keep`` in the
tests): top-k keeps ties of the k-th, top-p keeps a token while the mass ranked above it is below top_p, min-p keeps
p >= min_p * p_max, each over what the filters before it left.

The draw takes one float64 uniform u from the row's generator and returns the kept token at u of their cumulative
distribution in token-id order (the first id whose cumulative probability exceeds u): one uniform a token rather
than torch.multinomial's V exponentials, the same distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dtorch.core.errors import SamplingError

CHUNK = 64  # tokens a chunk: the maxima of 128k logits in ~0.02 ms, and a pool's gather stays near its tokens
FIRST_EPS = 2.0 ** -6  # top-p alone: the first pool is the tokens of probability >= this
EPS_STEP = 2.0 ** -4  # each next pool lowers the bound this much
MASS_MARGIN = 1e-5  # a pool must hold top_p + this (float32 cumulative sums over it and over the vocabulary differ)
SORT_ABOVE = 4  # a pool past 1 / SORT_ABOVE of the vocabulary: rank the vocabulary by a sort


@dataclass(slots=True)
class Chunks:
    """One row's scaled logits and the maxima of their chunks.

    z: [V] float32; cmax: [ceil(V / CHUNK)] float32, chunk c's maximum over z[c * CHUNK:(c + 1) * CHUNK]; top: the
    largest logit (finite: ``of`` refuses a row with NaN or +inf, or with every token at -inf)."""

    z: torch.Tensor
    cmax: torch.Tensor
    top: float

    @classmethod
    def of(cls, z: torch.Tensor, where: str) -> Chunks:
        v = z.shape[0]
        n = v // CHUNK
        cmax = z[:n * CHUNK].view(n, CHUNK).amax(1)
        if n * CHUNK < v:
            cmax = torch.cat([cmax, z[n * CHUNK:].amax(0, keepdim=True)])
        top = float(cmax.max())  # NaN anywhere is NaN here
        if not math.isfinite(top):
            what = "every token is banned or masked (-inf)" if top == -math.inf else f"a logit is {top}"
            raise SamplingError(f"{where}: cannot sample: {what}; the logits or their penalties are broken")
        return cls(z, cmax, top)

    def above(self, bound: float) -> torch.Tensor:
        """Ascending ids of the tokens with z >= bound (bound is rounded to float32), from the chunks reaching it."""
        v = self.z.shape[0]
        chunks = torch.nonzero(self.cmax >= bound).squeeze(1)
        if chunks.shape[0] * SORT_ABOVE > self.cmax.shape[0]:  # most of the vocabulary: one pass over it
            return torch.nonzero(self.z >= bound).squeeze(1)
        ids = (chunks[:, None] * CHUNK + torch.arange(CHUNK, device=chunks.device)).flatten()
        if v % CHUNK and chunks.shape[0] and int(chunks[-1]) == self.cmax.shape[0] - 1:
            ids = ids[ids < v]  # the last chunk is short
        return ids[self.z[ids] >= bound]


def keep(z: torch.Tensor, top_k: int, top_p: float, min_p: float, where: str = "sampling") -> torch.Tensor | None:
    """The ids a row keeps after top-k, then top-p, then min-p, ascending; None when no filter runs (all tokens).

    z: [V] float32 scaled logits (-inf: banned). Raises ``SamplingError`` on a row that cannot be sampled (NaN or
    +inf logits, every token -inf)."""
    row = Chunks.of(z, where)
    v = z.shape[0]
    ids = None  # the support so far (any order), None: every token
    if 0 < top_k < v:
        ids = _top_k(row, top_k)
    if top_p < 1.0:
        ids = _nucleus(row, ids, top_p)
    if min_p > 0.0:
        ids = _min_p(row, ids, min_p)
    return None if ids is None else torch.sort(ids).values


def _top_k(row: Chunks, k: int) -> torch.Tensor:
    """Ids with z >= the k-th largest z (ties of the k-th kept, as ``x < kth`` drops)."""
    z = row.z
    if k * SORT_ABOVE > row.cmax.shape[0]:  # k near the number of chunks: the bound would select most of them
        return torch.nonzero(z >= torch.topk(z, k).values[-1]).squeeze(1)
    pool = row.above(float(torch.topk(row.cmax, k).values[-1]))  # >= k ids, the k most likely among them
    vals = z[pool]
    return pool[vals >= torch.topk(vals, k).values[-1]]


def _nucleus(row: Chunks, ids: torch.Tensor | None, top_p: float) -> torch.Tensor:
    """Ids of the support (``ids``, or every token) kept while the probability ranked above them is below top_p;
    the most likely always stays. Probabilities are the softmax over the support."""
    z = row.z
    if ids is not None:
        return _nucleus_of(ids, torch.softmax(z[ids], dim=-1), top_p)
    probs = torch.softmax(z, dim=-1)  # [V]: the mass of a pool needs the whole distribution's sum
    lse = row.top - math.log(float(probs.max()))  # z_j - lse = ln p_j
    floor = (1.0 - top_p) / (2 * z.shape[0])  # the tokens below it hold < (1 - top_p) / 2 together
    eps = FIRST_EPS
    while True:
        eps = max(eps, floor)
        pool = row.above(lse + math.log(eps))
        if pool.shape[0] * SORT_ABOVE > z.shape[0]:
            break
        p = probs[pool]
        if float(p.sum(dtype=torch.float64)) >= top_p + MASS_MARGIN:
            return _nucleus_of(pool, p, top_p)
        if eps == floor:
            break
        eps *= EPS_STEP
    return _nucleus_of(torch.arange(z.shape[0], device=z.device), probs, top_p)  # a flat distribution: a sort


def _nucleus_of(ids: torch.Tensor, probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus of a pool: ids [P] and their probabilities [P] (of the row's distribution; the pool holds every
    token of the nucleus)."""
    order = torch.sort(probs, descending=True, stable=True).indices
    ranked = probs[order]
    drop = (torch.cumsum(ranked, dim=-1) - ranked) >= top_p  # the cumulative sum only grows: a prefix stays
    drop[0] = False  # a top_p under float32's range (1e-300 is 0) would drop it too
    return ids[order[~drop]]


def _min_p(row: Chunks, ids: torch.Tensor | None, min_p: float) -> torch.Tensor:
    """Ids of the support whose probability is >= min_p times the most likely one's."""
    if ids is None:  # p_j >= min_p * p_max  <=>  z_j >= top + ln(min_p); the pool is a little wider for rounding
        ids = row.above(row.top + math.log(min_p) - 1e-3 * max(1.0, abs(row.top)))
    probs = torch.softmax(row.z[ids], dim=-1)
    return ids[~(probs < min_p * probs.max())]


def draw(z: torch.Tensor, ids: torch.Tensor | None, generator: torch.Generator | None) -> int:
    """One token of softmax(z) restricted to ``ids`` (ascending; None: every token): the first id whose cumulative
    probability in id order exceeds u, one float64 uniform of ``generator`` (None: torch's default one)."""
    device = generator.device if generator is not None else "cpu"
    u = float(torch.rand((), dtype=torch.float64, generator=generator, device=device))
    if ids is None:
        return _draw_all(torch.softmax(z, dim=-1), u)
    probs = torch.softmax(z[ids], dim=-1)
    return int(ids[_at(probs, u)])


def _at(probs: torch.Tensor, u: float) -> int:
    """The index i of probs [N] (>= 0, some > 0) with cum[i - 1] <= u * cum[-1] < cum[i] (float64 sums); never one
    of probability 0."""
    cum = torch.cumsum(probs, dim=0, dtype=torch.float64)
    i = int(torch.searchsorted(cum, torch.tensor([u * float(cum[-1])], dtype=torch.float64), right=True))
    if i >= probs.shape[0]:  # u * sum rounded up to the sum: the last positive one (cum[i] > cum[i - 1] elsewhere)
        i = int(torch.nonzero(probs)[-1])
    return i


def _draw_all(probs: torch.Tensor, u: float) -> int:
    """``_at`` over a whole vocabulary's probs [V] by chunk sums: the chunk at u, then the token within it."""
    v = probs.shape[0]
    n = v // CHUNK
    sums = probs[:n * CHUNK].view(n, CHUNK).sum(1)
    if n * CHUNK < v:
        sums = torch.cat([sums, probs[n * CHUNK:].sum(0, keepdim=True)])
    c = _at(sums, u)
    cum = torch.cumsum(sums, dim=0, dtype=torch.float64)
    before, total = (float(cum[c - 1]) if c else 0.0), float(cum[-1])
    part = probs[c * CHUNK:(c + 1) * CHUNK]
    # u within the chunk: (u * total - before) / its sum, in [0, 1) up to rounding (``_at`` takes the last then)
    within = min(max((u * total - before) / float(cum[c] - (cum[c - 1] if c else 0.0)), 0.0), 1.0)
    return c * CHUNK + _at(part, within)
