"""The tokens a sampled row keeps (top-k, top-p, min-p) and one draw among them, in a pass or two over the vocabulary.

A row's logits x [V] are read whole once for the maxima of their chunks of ``CHUNK`` tokens (``Row``), and
once more for the softmax when top-p runs without top-k. Every filter keeps the tokens at or above some value, so the
pool a filter ranks is the chunks whose maximum reaches a bound, gathered, never the vocabulary:
- top-k: the k-th largest chunk maximum is at most the k-th largest logit (k chunks each hold a token at or above
  it): the chunks reaching it hold the k most likely tokens (a large k takes smaller chunks);
- top-p alone: the tokens of probability >= 2^-13 (8192 at most), cut to the bins of probability (8 an octave) from
  the top down to where their mass reaches top_p: a prefix of the ranking holding top_p holds the nucleus; when the
  tokens of 2^-13 and above hold less, the bins are summed over the vocabulary, and a nucleus of more than a quarter
  of it is ranked by a sort;
- min-p alone: the tokens within ln(min_p) of the top logit.
Each filter then ranks its pool as the plain definitions rank the vocabulary (transformers' warpers in the tests):
top-k keeps ties of the k-th, top-p keeps a token while the mass ranked above it is below top_p (tied tokens rank
by id, the lower first), min-p keeps p >= min_p * p_max, each over what the filters before it left.

The draw takes one float64 uniform u from the row's generator and returns the kept token at u of their cumulative
distribution in token-id order (the first id whose cumulative probability exceeds u times the total): one uniform a
token rather than torch.multinomial's V exponentials, the same distribution. ``Kept`` holds a row's distribution over
its kept tokens for speculative decoding (the draft's q, the target's p): the rejection rule reads a token's
probability, the residual max(0, p - q) over p's kept tokens, and draws from either the same way.
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass

import torch

from dtorch.core.errors import SamplingError

CHUNK = 64  # tokens a chunk: the maxima of 128k logits in ~0.02 ms, and a pool's gather stays near its tokens
FLOOR = 2.0 ** -13  # top-p alone: first the tokens of probability >= this (8192 at most; a bin floor)
BIN_SHIFT = 20  # bins of probability, 8 an octave (a float32's exponent and top 3 mantissa bits)
NBINS = 1 << (31 - BIN_SHIFT)  # probabilities are >= 0: the sign bit is 0
MASS_MARGIN = 1e-5  # a pool must hold top_p + this (float32 sums: over it and over the vocabulary they differ)
SORT_ABOVE = 4  # a bound reaching more than 1 / SORT_ABOVE of the chunks: one pass over the values instead
_SCRATCH = threading.local()  # this thread's buffers of ``scratch``


def scratch(name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[n] of this thread's buffer ``name``, kept across rows and steps: a new [V] tensor is fresh pages, which cost
    ~1-10 us each to touch on a VM (~0.3 ms for a 128k float32 row). The next call with the same name reuses it:
    nothing returned from this module aliases one, but a ``Kept.of(..., own=False)``'s whole-vocabulary probs."""
    bufs = _SCRATCH.__dict__.setdefault("bufs", {})
    t = bufs.get((name, dtype, device))
    if t is None or t.shape[0] < n:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            t = bufs[(name, dtype, device)] = torch.empty(n, dtype=dtype, device=device)
    return t[:n]


def _softmax(z: torch.Tensor) -> torch.Tensor:
    """softmax(z) [V] into the buffer "probs" (torch.softmax's kernel: the same values)."""
    return torch._softmax(z, 0, False, out=scratch("probs", z.shape[0], torch.float32, z.device))


@dataclass(slots=True)
class Row:
    """One row's logits x [V] (raw, or shaped in place), its temperature, and the maxima of its chunks of scaled
    logits z = x / temperature: cmax [ceil(V / chunk)] float32. z is made only where a pass over all of it is needed
    (softmax, a bound most chunks reach): a filter reads x / temperature of its pool alone, the same floats
    (division rounds monotonically: the maximum of the quotients is the quotient of the maximum)."""

    x: torch.Tensor
    temperature: float
    cmax: torch.Tensor
    chunk: int
    scaled: torch.Tensor | None = None

    @classmethod
    def of(cls, x: torch.Tensor, temperature: float, chunk: int = CHUNK) -> Row:
        n = x.shape[0] // chunk
        cmax = x[:n * chunk].view(n, chunk).amax(1)
        if n * chunk < x.shape[0]:
            cmax = torch.cat([cmax, x[n * chunk:].amax(0, keepdim=True)])
        return cls(x, temperature, cmax if temperature == 1.0 else cmax.div_(temperature), chunk)

    def z(self) -> torch.Tensor:
        """z [V] float32, made once (in the buffer "z", or x itself at temperature 1)."""
        if self.scaled is None:
            self.scaled = self.x if self.temperature == 1.0 else torch.div(
                self.x, self.temperature, out=scratch("z", self.x.shape[0], torch.float32, self.x.device))
        return self.scaled

    def at(self, ids: torch.Tensor) -> torch.Tensor:
        """z[ids]."""
        return self.scaled[ids] if self.scaled is not None else self.x[ids] / self.temperature

    def above(self, bound: float) -> torch.Tensor:
        """Ascending ids of the tokens with z >= bound (compared as float32), from the chunks reaching it."""
        chunks = torch.nonzero(self.cmax >= bound).squeeze(1)
        v = self.x.shape[0]
        if chunks.shape[0] * SORT_ABOVE > self.cmax.shape[0]:  # most of them: one pass over the values
            return torch.nonzero(torch.ge(self.z(), bound, out=scratch("mask", v, torch.bool, self.x.device))
                                 ).squeeze(1)
        ids = (chunks[:, None] * self.chunk + torch.arange(self.chunk, device=chunks.device)).flatten()
        if v % self.chunk and chunks.shape[0] and int(chunks[-1]) == self.cmax.shape[0] - 1:
            ids = ids[ids < v]  # the last chunk is short
        return ids[self.at(ids) >= bound]


def keep(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
         where: str = "sampling") -> torch.Tensor | None:
    """The ids a row keeps after top-k, then top-p, then min-p, ascending; None when no filter runs (all tokens).

    x: [V] float32 logits (-inf: banned), scaled here by ``temperature`` (> 0). Raises ``SamplingError`` on a row
    that cannot be sampled (NaN or +inf logits, every token -inf)."""
    row = Row.of(x, temperature)
    top = float(row.cmax.max())  # NaN anywhere is NaN here
    if not math.isfinite(top):
        what = "every token is banned or masked (-inf)" if top == -math.inf else f"a logit is {top}"
        raise SamplingError(f"{where}: cannot sample: {what}; the logits or their penalties are broken")
    v = x.shape[0]
    ids = None  # the support so far (any order), None: every token
    if 0 < top_k < v:
        ids = _top_k(row, top_k)
    if top_p < 1.0:
        ids = _nucleus(row, top, ids, top_p)
    if min_p > 0.0:
        ids = _min_p(row, top, ids, min_p)
    return None if ids is None else torch.sort(ids).values


def _top_k(row: Row, k: int) -> torch.Tensor:
    """Ids with z >= the k-th largest z (ties of the k-th kept, as ``x < kth`` drops)."""
    v = row.x.shape[0]
    if k * SORT_ABOVE > row.cmax.shape[0]:  # a large k: chunks small enough that k of them are few
        chunk = 1 << max(0, (v // (k * SORT_ABOVE)).bit_length() - 1)
        if chunk < 2:
            z = row.z()
            return torch.nonzero(z >= torch.topk(z, k).values[-1]).squeeze(1)
        row = Row.of(row.x, row.temperature, chunk)
    pool = row.above(float(torch.topk(row.cmax, k).values[-1]))  # >= k ids, the k most likely among them
    vals = row.at(pool)
    return pool[vals >= torch.topk(vals, k).values[-1]]


def _nucleus(row: Row, top: float, ids: torch.Tensor | None, top_p: float) -> torch.Tensor:
    """Ids of the support (``ids``, or every token) kept while the probability ranked above them is below top_p;
    the most likely always stays. Probabilities are the softmax over the support."""
    if ids is not None:
        probs = torch.softmax(row.at(ids), dim=-1)
        return _nucleus_of(ids, probs, top_p * float(torch.sum(probs, dtype=torch.float64)))
    z = row.z()
    probs = _softmax(z)  # [V]: a pool's mass needs the whole distribution's sum
    mass = top_p * float(torch.sum(probs, dtype=torch.float64))  # top_p of what the float32 softmax sums to
    need = mass + MASS_MARGIN
    c = int(row.cmax.argmax())  # the top logit's chunk: p_top = exp(top - lse)
    lse = top - math.log(float(probs[c * CHUNK:(c + 1) * CHUNK].max()))  # ln p_j = z_j - lse
    pool = _at_least(row, probs, lse, FLOOR)  # at most 1 / FLOOR tokens
    if float(probs[pool].sum()) >= need:  # they hold the nucleus: cut them to the bin reaching it
        p = probs[pool]
        pool = pool[p >= _mass_floor(p, need)]
    else:  # a flat distribution: the bins over the vocabulary
        floor = _mass_floor(probs, need)
        pool = None if floor is None or floor <= 0.0 else _at_least(row, probs, lse, floor)
        if pool is None or pool.shape[0] * SORT_ABOVE > z.shape[0] \
                or float(probs[pool].sum()) < need:
            pool = torch.arange(z.shape[0], device=z.device)  # flatter still: rank the vocabulary
    return _nucleus_of(pool, probs[pool], mass)


def _at_least(row: Row, probs: torch.Tensor, lse: float, p: float) -> torch.Tensor:
    """Ascending ids of the tokens with probs >= p, from the chunks of logits reaching ln p + lse (less a margin
    for the softmax's rounding)."""
    bound = lse + math.log(p)
    ids = row.above(bound - 1e-4 * max(1.0, abs(bound)))
    return ids[probs[ids] >= p]


def _mass_floor(probs: torch.Tensor, need: float) -> float | None:
    """The greatest bin floor f (bins of ``BIN_SHIFT``: 8 an octave) with the mass of the tokens of probability >= f
    at least ``need``; None when even the whole vocabulary's sums fall short. probs: [V] float32 >= 0."""
    bins = torch.bitwise_right_shift(probs.view(torch.int32), BIN_SHIFT,  # [V]: exponent and top 3 bits, as p
                                     out=scratch("bins", probs.shape[0], torch.int32, probs.device))
    mass = torch.bincount(bins, weights=probs, minlength=NBINS)  # [NBINS] float64
    from_top = mass.flip(0).cumsum(0)  # [i]: bins NBINS - 1 - i and above
    i = int((from_top < need).sum())  # the first bin where it reaches need (from_top does not decrease)
    return None if i >= NBINS else struct.unpack("<f", struct.pack("<i", (NBINS - 1 - i) << BIN_SHIFT))[0]


def _nucleus_of(ids: torch.Tensor, probs: torch.Tensor, mass: float) -> torch.Tensor:
    """The nucleus of a pool: ids [P] and their probabilities [P] (of the row's distribution; the pool holds every
    token of the nucleus); ``mass``: top_p times the distribution's float32 probabilities' sum (torch's vectorized
    softmax sums to 1 within ~2e-5 by CPU: over a flat nucleus of thousands that moves its edge), the mass above a
    kept token is below it."""
    order = torch.sort(probs, descending=True, stable=True).indices
    ranked = probs[order].double()
    drop = (torch.cumsum(ranked, dim=-1) - ranked) >= mass  # the cumulative sum only grows: a prefix stays
    drop[0] = False  # a top_p under float32's range (1e-300 is 0) would drop it too
    return ids[order[~drop]]


def _min_p(row: Row, top: float, ids: torch.Tensor | None, min_p: float) -> torch.Tensor:
    """Ids of the support whose probability is >= min_p times the most likely one's."""
    if ids is None:  # p_j >= min_p * p_max  <=>  z_j >= top + ln(min_p); the pool is a little wider for rounding
        ids = row.above(top + math.log(min_p) - 1e-3 * max(1.0, abs(top)))
    probs = torch.softmax(row.at(ids), dim=-1)
    return ids[~(probs < min_p * probs.max())]


def uniform(generator: torch.Generator | None) -> float:
    """One float64 uniform in [0, 1) of ``generator`` (None: torch's default one), on its device."""
    device = generator.device if generator is not None else "cpu"
    return float(torch.rand((), dtype=torch.float64, generator=generator, device=device))


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """x [V] / temperature in this thread's buffer "z" (x itself at temperature 1)."""
    if temperature == 1.0:
        return x
    return torch.div(x, temperature, out=scratch("z", x.shape[0], torch.float32, x.device))


def draw(x: torch.Tensor, temperature: float, ids: torch.Tensor | None, generator: torch.Generator | None) -> int:
    """One token of softmax(x / temperature) restricted to ``ids`` (ascending; None: every token): the first id
    whose cumulative probability in id order exceeds u, one float64 uniform of ``generator`` (None: torch's default
    one)."""
    u = uniform(generator)
    if ids is None:
        return _draw_all(_softmax(_scaled(x, temperature)), u)
    probs = torch.softmax(x[ids] / temperature, dim=-1)
    return int(ids[_at(probs, u)])


@dataclass(slots=True)
class Kept:
    """A row's sampling distribution over its kept tokens: ids [K] ascending int64 (None: every token) and probs [K]
    float32, softmax(x / temperature) over them ([V] when ids is None); every other token has probability 0."""

    ids: torch.Tensor | None
    probs: torch.Tensor

    @classmethod
    def of(cls, x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
           where: str = "sampling", own: bool = True) -> Kept:
        """``keep``'s tokens of the row x [V] float32 and their probabilities. own=False: a whole vocabulary's probs
        may be this thread's buffer "probs" (valid until the next row; no page faults), else a new tensor."""
        ids = keep(x, temperature, top_k, top_p, min_p, where)
        if ids is not None:
            return cls(ids, torch.softmax(x[ids] / temperature, dim=-1))
        if own:
            return cls(None, torch.softmax(x / temperature if temperature != 1.0 else x, dim=-1))
        return cls(None, _softmax(_scaled(x, temperature)))

    @classmethod
    def point(cls, t: int, device: torch.device | str) -> Kept:
        """All the mass on token t."""
        return cls(torch.tensor([t], device=device), torch.ones(1, device=device))

    def index(self, t: int) -> int | None:
        """Where token t sits in ids/probs (t itself when every token is kept); None when it is not kept."""
        if self.ids is None:
            return t
        i = int(torch.searchsorted(self.ids, torch.tensor(t, device=self.ids.device)))
        return i if i < self.ids.shape[0] and int(self.ids[i]) == t else None

    def at(self, t: int) -> float:
        """The probability of token t (0 where not kept)."""
        i = self.index(t)
        return 0.0 if i is None else float(self.probs[i])

    def minus(self, q: Kept | int) -> torch.Tensor:
        """max(0, p - q) over this distribution p's kept tokens: [K] float32 (a new tensor); q a ``Kept``, or a
        token id (a point mass: the residual is p without that token)."""
        r = self.probs.clone()
        if isinstance(q, int):
            i = self.index(q)
            if i is not None:
                r[i] = 0.0
            return r
        ids, qp = (None if q.ids is None else q.ids.to(r.device)), q.probs.to(r.device)
        if ids is None:  # q over every token
            r -= qp if self.ids is None else qp[self.ids]
        elif self.ids is None:  # q's few tokens off a whole vocabulary's p
            r[ids] -= qp
        else:  # q's probabilities at p's tokens: 0 where q did not keep them
            pos = torch.searchsorted(ids, self.ids).clamp_(max=ids.shape[0] - 1)  # [K]: where each sits in q's
            r -= torch.where(ids[pos] == self.ids, qp[pos], 0.0)
        return r.clamp_(min=0.0)

    def draw(self, u: float, weights: torch.Tensor | None = None) -> int:
        """The kept token at u in [0, 1) of the cumulative distribution of ``weights`` [K] (>= 0, some > 0; None:
        probs) in id order: the first token whose cumulative weight exceeds u times the total."""
        w = self.probs if weights is None else weights
        if self.ids is None:
            return _draw_all(w, u)
        return int(self.ids[_at(w, u)])


def _at(probs: torch.Tensor, u: float) -> int:
    """The index i of probs [N] (>= 0, some > 0) with cum[i - 1] <= u * cum[-1] < cum[i] (float64 sums); never one
    of probability 0."""
    cum = torch.cumsum(probs, dim=0, dtype=torch.float64)
    i = int((cum <= u * float(cum[-1])).sum())  # the first index past u * sum (cum does not decrease)
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
