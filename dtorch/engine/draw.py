"""``multinomial_one``: torch.multinomial's draw of one token, without its cost over a large vocabulary.

Speculative verification and the draft model draw with it (from a whole vocabulary's probabilities); ``sample_step``
draws with ``engine/kept.py``'s one-uniform inverse CDF over the kept tokens instead (the same distribution, other
tokens for a seed: it does not consume V uniforms).

torch draws one sample of probs [V] as an exponential race: q_j = -log1p(-u_j) (u_j: the generator's j-th float64
uniform, one per token, rounded to float32 after the log), token = argmax(probs / q). Its serial exponential costs
~25-30 ns a token of one core's time (twice that in wall time on a busy machine): ~4 ms over a 152k vocabulary, 6-8
ms over 262k, a third of a small model's decode step.
This module draws the same V uniforms (so the generator ends in the same state, and the next draw matches too) with
torch's vectorizable uniform kernel, then works q out only where a token can win: the ``TOP`` most likely tokens, and
any other token j whose u_j is small enough that its score could reach theirs (with S the best of their scores and
p_M the least of their probabilities, p_j <= p_M, so p_j / q_j >= S needs q_j <= p_M / S, i.e.
u_j <= 1 - exp(-p_M / S)). The token is the same one, bit for bit: ``exact()`` checks that once per process against
torch.multinomial itself, and where a torch build draws otherwise every draw goes to torch.multinomial.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

log = logging.getLogger("dtorch.engine")
TOP = 64  # tokens whose scores are worked out first (most likely first)
MARGIN = 1e-6  # the bound on u_j widened by this much: more candidates, never a missed one
SMALL = 4096  # vocabularies up to this size go to torch.multinomial itself (nothing to save)


def multinomial_one(probs: torch.Tensor, generator: torch.Generator | None,
                    support: torch.Tensor | None = None) -> int:
    """``int(torch.multinomial(probs, 1, generator=generator))`` with the same token and the generator left in the
    same state. probs: [V] float32 on the CPU (a CPU generator or None: torch's default one); support: ascending
    ids outside which every probability is 0 (a top-k's tokens), or None."""
    if (probs.dim() != 1 or probs.dtype != torch.float32 or probs.device.type != "cpu" or probs.shape[0] <= SMALL
            or (generator is not None and generator.device.type != "cpu") or not exact()):
        return int(torch.multinomial(probs, 1, generator=generator))
    return _race(probs, generator, support)


def _race(probs: torch.Tensor, generator: torch.Generator | None, support: torch.Tensor | None = None) -> int:
    lo, hi = torch.aminmax(probs)
    if not (float(lo) >= 0.0 and float(hi) < math.inf and float(probs.sum()) > 0.0):
        return int(torch.multinomial(probs, 1, generator=generator))  # raises as torch does, drawing nothing
    v = probs.shape[0]
    u = torch.empty(v, dtype=torch.float64).uniform_(generator=generator)  # the race's V uniforms, in its order
    if support is not None and support.shape[0] <= TOP:
        top_i, least = support, 0.0  # every other token has probability 0
    else:
        pool = support if support is not None else slice(None)
        top_p, top_i = torch.topk(probs[pool], min(TOP, v))  # [M], most likely first
        top_i, least = (top_i if support is None else support[top_i]), float(top_p[-1])
    best = float(_screen(probs, u, top_i).max())
    if not math.isfinite(best) or best <= 0.0:  # a q of 0 (u = 0, odds 2^-53 a token): every token, as torch does
        return _winner(probs, u, torch.arange(v))
    bound = -math.expm1(-least / best * (1 + MARGIN)) * (1 + MARGIN)  # u_j above this cannot win
    near = (u <= bound).index_fill_(0, top_i, True)  # [V] bool: the tokens that may win
    return _winner(probs, u, torch.nonzero(near).squeeze(1))  # ascending, as argmax scans


def _screen(probs: torch.Tensor, u: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """probs[ids] / q[ids], q from torch's vectorized log1p (within an ulp or two of libm's; ``_winner`` decides
    with libm's)."""
    return probs[ids] / torch.log1p(-u[ids]).neg_().float()


def _winner(probs: torch.Tensor, u: torch.Tensor, ids: torch.Tensor) -> int:
    """The first of ``ids`` (ascending) with the greatest probs / q, q = float32(-log1p(-u)) with libm's log1p as
    torch's serial exponential makes it: screened vectorized, decided exactly among those near the best."""
    s = _screen(probs, u, ids)
    top = float(s.max())
    if math.isfinite(top):  # (NaN and inf: every candidate exactly)
        ids = ids[s >= top * (1 - MARGIN)]
    q = torch.tensor([-math.log1p(-x) for x in u[ids].tolist()], dtype=torch.float64).float()
    return int(ids[torch.argmax(probs[ids] / q)])


@functools.cache
def exact() -> bool:
    """Whether ``_race`` draws torch.multinomial's tokens and leaves its generator state, on probes of a 32k-token
    vocabulary (a peaked, a flat and a top-k-like distribution, three seeds). Checked once per process (~50 ms)."""
    g = torch.Generator().manual_seed(0)
    v = 32_768
    logits = torch.randn(v, generator=g) * 4
    sparse = torch.full((v,), -math.inf)
    sparse[torch.randperm(v, generator=g)[:40]] = torch.randn(40, generator=g)
    for probs in (torch.softmax(logits, -1), torch.softmax(logits / 20, -1), torch.softmax(sparse, -1)):
        for seed in (1, 2, 3):
            a, b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            for _ in range(2):
                if _race(probs, a) != int(torch.multinomial(probs, 1, generator=b)):
                    log.warning("torch.multinomial draws differently in this torch build; sampling uses it as is")
                    return False
            if not torch.equal(a.get_state(), b.get_state()):
                log.warning("torch.multinomial consumes its generator differently in this torch build; sampling "
                            "uses it as is")
                return False
    return True
