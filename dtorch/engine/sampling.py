"""Sampling: ``SamplingParams`` (named as in vLLM) and choosing the next token from logits.

Each step: repetition, then frequency and presence penalties change the logits; greedy (temperature 0) takes
the argmax, otherwise the logits are divided by the temperature, top-k, top-p (nucleus) and min-p filters
remove tokens, and one token is drawn from what is left with the sequence's own ``torch.Generator`` (seeded
from ``seed`` when given, so a run is reproducible). Logprobs, when asked for, are of the model's own
distribution: log_softmax of the raw logits, before penalties, temperature and filters (vLLM's default).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from dtorch.core.errors import SamplingError
from dtorch.engine.draw import multinomial_one
from dtorch.engine.request import TokenLogprob
from dtorch.engine.structured import StructuredOutputsParams

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_N = 16
# repetition penalties outside this range divide or multiply float32 logits past their range (1e-300 is 0 in
# float32: logit / 0 is inf, then NaN in the softmax); a penalty of 1e4 already all but bans every seen token
REPETITION_PENALTY_RANGE = (1e-4, 1e4)
GREEDY_BELOW = 1e-5  # temperatures under this are greedy (vLLM's _SAMPLING_EPS): logits / 1e-45 overflow to NaN
# a temperature past float32's range is inf on the logits: a banned or masked token's -inf / inf is NaN
TEMPERATURE_MAX = float(torch.finfo(torch.float32).max)
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes
NUCLEUS_BINS = 8  # bins a halving of probability when looking for top_p's nucleus
NUCLEUS_DEPTH = 8 * 64  # bins in all: probabilities 2^-64 of the top one and below share the last


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature: 0 (or below 1e-5, as vLLM) is greedy; > 0 scales the logits. top_k: keep the k most likely
    (-1 or 0: all).
    top_p: keep the smallest set whose probability reaches p (1: all). min_p: drop tokens whose
    probability is below ``min_p`` times the most likely one's (0: none). seed: per-request seed (choice i of n
    seeds its generator with seed + i, within torch's range [-2**63, 2**64 - 1]).
    max_tokens: new tokens at most (None: up to the context). stop: strings that end the output (not
    included). stop_token_ids: ids that end it (included in ``token_ids``, not in the text).
    ignore_eos: keep going past end-of-sequence tokens. presence_penalty, frequency_penalty (OpenAI's, in
    [-2, 2]): ``logit[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)``, count over
    the generated tokens. repetition_penalty (HF/vLLM's, > 0, 1: none): the logit of every token in prompt
    or output is divided by it when positive, multiplied when negative. logprobs: None, or k in 0..20 to
    return the chosen token's logprob and the k most likely alternatives. n: choices per request (1..16).
    min_tokens: new tokens before an end-of-sequence token, a stop token id or a stop string may end the output
    (until then the stop ids cannot be sampled). skip_special_tokens: leave special tokens out of the text.
    include_stop_str_in_output: keep the stop string that ended the output at the end of its text.
    logit_bias: {token id: bias in [-100, 100]} added to the logits before sampling (OpenAI's; -100 bans a token,
    100 all but forces it). structured_outputs: a ``StructuredOutputsParams``: the output must match its JSON
    schema, regex, choice or grammar (tokens it cannot take are masked out; needs llguidance).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    n: int = 1
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Mapping[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _number("temperature", self.temperature)
        if not 0 <= self.temperature <= TEMPERATURE_MAX:
            raise SamplingError(f"SamplingParams: temperature must be in [0, {TEMPERATURE_MAX:.4g}] (0 is greedy; "
                                f"float32's range), got {self.temperature}")
        _number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"SamplingParams: top_p must be in (0, 1], got {self.top_p}")
        _int("top_k", self.top_k)
        if self.top_k < -1:
            raise SamplingError(f"SamplingParams: top_k must be -1 or 0 (all tokens) or >= 1, got {self.top_k}")
        _number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingError(f"SamplingParams: min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _int("seed", self.seed)
            low, high = SEED_RANGE[0], SEED_RANGE[1] - (self.n - 1 if isinstance(self.n, int) else 0)
            if not low <= self.seed <= high:
                raise SamplingError(f"SamplingParams: seed must be in [-2**63, 2**64 - n] = [{low}, {high}] (torch's "
                                    f"generator range; choice i uses seed + i), got {self.seed}")
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise SamplingError(f"SamplingParams: max_tokens must be >= 1 or None, got {self.max_tokens}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = ()
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise SamplingError(f"SamplingParams: stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids or ()
        if not isinstance(ids, (list, tuple)):
            raise SamplingError(f"SamplingParams: stop_token_ids must be a list of ints, got {ids!r}")
        for i in ids:
            _int("stop_token_ids item", i)
            if i < 0:
                raise SamplingError(f"SamplingParams: stop_token_ids has token id {i}; ids must be >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError(f"SamplingParams: ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _number(name, value)
            if not -2.0 <= value <= 2.0:
                raise SamplingError(f"SamplingParams: {name} must be in [-2, 2] (0: none), got {value}")
        _number("repetition_penalty", self.repetition_penalty)
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise SamplingError(f"SamplingParams: repetition_penalty must be in [{low:g}, {high:g}] (1: none), "
                                f"got {self.repetition_penalty}")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise SamplingError(f"SamplingParams: logprobs must be None or in 0..{MAX_LOGPROBS} "
                                    f"(alternatives per token), got {self.logprobs}")
        _int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise SamplingError(f"SamplingParams: n must be in 1..{MAX_N} (choices per request), got {self.n}")
        _int("min_tokens", self.min_tokens)
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise SamplingError(f"SamplingParams: min_tokens must be in 0..max_tokens ({self.max_tokens}), "
                                f"got {self.min_tokens}")
        for name in ("skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingError(f"SamplingParams: {name} must be a bool, got {getattr(self, name)!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise SamplingError(f"SamplingParams: logit_bias must be a dict {{token id: bias}}, "
                                    f"got {self.logit_bias!r:.100}")
            for t, b in self.logit_bias.items():
                _int("logit_bias key", t)
                _number(f"logit_bias[{t}]", b)
                if t < 0 or not -100 <= b <= 100:
                    raise SamplingError(f"SamplingParams: logit_bias maps token ids >= 0 to biases in [-100, 100], "
                                        f"got {t}: {b}")
            object.__setattr__(self, "logit_bias", dict(self.logit_bias) or None)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise SamplingError("SamplingParams: structured_outputs must be a StructuredOutputsParams, got "
                                f"{type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def plain(self) -> bool:
        """Greedy with nothing that changes the logits: the argmax is the token."""
        return self.greedy and not self.penalized and not self.logit_bias and self.structured_outputs is None

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def generator(self, index: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator on ``device`` (where the logits are) for choice ``index`` of a request: seeded from
        ``seed + index``, else fresh entropy."""
        g = torch.Generator(device=device)
        g.manual_seed(self.seed + index if self.seed is not None else random.SystemRandom().getrandbits(63))
        return g


def _refuse_unknown_fields(cls: type) -> None:
    """Make ``cls(...)`` with a keyword that is not a field a ``SamplingError`` (with a did-you-mean) instead of
    Python's TypeError; the signature stays the dataclass's."""
    init, names = cls.__init__, {f.name for f in dataclasses.fields(cls)}

    @functools.wraps(init)
    def checked(self, *args: Any, **kwargs: Any) -> None:
        for key in kwargs:
            if key not in names:
                near = difflib.get_close_matches(key, sorted(names), n=1)
                hint = f"; did you mean {near[0]!r}?" if near else f"; the fields are {', '.join(sorted(names))}"
                raise SamplingError(f"SamplingParams: unknown field {key!r}{hint}")
        init(self, *args, **kwargs)

    cls.__init__ = checked


_refuse_unknown_fields(SamplingParams)


def _number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SamplingError(f"SamplingParams: {name} must be a finite number, got {value!r}")


def _int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingError(f"SamplingParams: {name} must be an int, got {value!r}")


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits with every token outside the top-k / top-p / min-p set at -inf.

    logits: [V] float32 -> [V] float32 (a new tensor).
    """
    return _filter(logits, params)[0]


def _filter(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``filter_logits``'s result and its support: the ascending ids of the tokens a filter left (the others are
    -inf), or None when no filter ran. Each filter after top-k looks at its tokens only, not the vocabulary."""
    x = logits.float() / params.temperature
    vocab, support = x.shape[-1], None
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k).values[-1]
        x, support = _keep(x, ~(x < kth))
    if params.top_p < 1.0:
        x, support = _keep(x, _nucleus(x, params.top_p, support))
    if params.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        x, support = _keep(x, ~(probs < params.min_p * probs.max()))
    return x, support


def _keep(x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x with -inf where ``keep`` [V] bool is False, and the ids where it is True (ascending)."""
    return x.masked_fill(~keep, -math.inf), torch.nonzero(keep).squeeze(1)


def _nucleus(x: torch.Tensor, top_p: float, support: torch.Tensor | None) -> torch.Tensor:
    """[V] bool: the nucleus, True where the tokens ranked above a token reach less than ``top_p`` together (the most
    likely always stays). x: [V] float32 logits, -inf outside ``support`` (ascending ids, or None: anywhere).

    The ranking is a top-k over the tokens that can be in it rather than a sort of the vocabulary (~25 ms for 152k
    float32 on one core): the support, or the tokens of the bins (``NUCLEUS_BINS`` a halving of probability, from the
    most likely down) whose summed probability first reaches ``top_p``, with one bin more for rounding. Should their
    ranked sums still fall short, the ranking widens to the whole vocabulary; a nucleus of more than a quarter of it
    (a flat distribution) is ranked by a sort."""
    vocab = x.shape[-1]
    probs = torch.softmax(x, dim=-1)
    if support is not None:
        pool = support
    else:
        top = float(x.max())  # log2(p_j / p_top) = (x_j - top) / ln 2: bins from the logits, no log taken
        bins = (top - x).mul_(NUCLEUS_BINS / math.log(2)).clamp_(max=NUCLEUS_DEPTH).long()  # [V], 0: the top
        mass = torch.bincount(bins, weights=probs, minlength=NUCLEUS_DEPTH + 1).cumsum_(0)  # float64
        last = min(int(torch.searchsorted(mass, top_p)) + 1, NUCLEUS_DEPTH)
        pool = torch.nonzero(bins <= last).squeeze(1)
    while True:
        if pool.shape[0] * 4 > vocab:  # a flat distribution's nucleus is most of the vocabulary: a sort costs less
            order = torch.sort(x, descending=True).indices
        else:
            order = pool[torch.topk(x[pool], pool.shape[0]).indices]  # most likely first
        ranked = probs[order]
        drop = (torch.cumsum(ranked, dim=-1) - ranked) >= top_p  # the cumulative sum only grows: a prefix stays
        drop[0] = False  # a top_p under float32's range (1e-300 is 0) would drop it too: all -inf, NaN
        if support is not None or order.shape[0] == vocab or bool(drop[-1]):  # (outside the support: probability 0)
            return torch.zeros(vocab, dtype=torch.bool, device=x.device).index_fill_(0, order[~drop], True)
        pool = torch.arange(vocab, device=x.device)


def _counts(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each sequence: [len(seqs), vocab] int64. Ids >= vocab are not counted."""
    ids = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long, device=device).clamp_(max=vocab)
    lengths = torch.tensor([len(s) for s in seqs], device=device)
    # row r counts into [r * (vocab + 1), (r + 1) * (vocab + 1)); the last column catches ids past the vocab
    offsets = torch.repeat_interleave(torch.arange(len(seqs), device=device) * (vocab + 1), lengths)
    counts = torch.bincount(ids + offsets, minlength=len(seqs) * (vocab + 1))
    return counts.view(len(seqs), vocab + 1)[:, :vocab]


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], output_ids: Sequence[Sequence[int]],
                    prompt_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Logits with each row's repetition, then frequency and presence penalties applied.

    logits: [B, V]; ``output_ids[b]`` / ``prompt_ids[b]``: row b's generated / prompt tokens. Returns [B, V]
    float32: a new tensor when some row is penalized, else ``logits`` itself.
    """
    rows = [b for b, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    x = logits[rows].float()  # [R, V], a copy
    vocab, dev = x.shape[-1], x.device
    out_counts = _counts([output_ids[b] for b in rows], vocab, dev)  # [R, V]
    rep = [params[b].repetition_penalty for b in rows]
    if any(r != 1.0 for r in rep):
        seen = out_counts > 0
        seen |= _counts([prompt_ids[b] if r != 1.0 else () for b, r in zip(rows, rep, strict=True)], vocab, dev) > 0
        penalty = torch.tensor(rep, device=dev)[:, None]
        x = torch.where(seen, torch.where(x < 0, x * penalty, x / penalty), x)
    freq = torch.tensor([params[b].frequency_penalty for b in rows], device=dev)[:, None]
    pres = torch.tensor([params[b].presence_penalty for b in rows], device=dev)[:, None]
    x = x - (freq * out_counts + pres * (out_counts > 0))
    if len(rows) == len(params):
        return x
    full = logits.float().clone()
    full[rows] = x
    return full


def token_logprobs(logprobs: torch.Tensor, rows: list[int], params: Sequence[SamplingParams],
                    tokens: list[int]) -> list[TokenLogprob | None]:
    """logprobs: [L, V], row i belonging to batch row ``rows[i]``; one ``TokenLogprob`` per batch row asking."""
    out: list[TokenLogprob | None] = [None] * len(params)
    chosen = torch.tensor([tokens[b] for b in rows], device=logprobs.device)[:, None]
    picked = logprobs.gather(1, chosen)  # [L, 1]
    values = picked[:, 0].tolist()
    ranks = ((logprobs > picked).sum(-1) + 1).tolist()  # 1: the most likely token
    k_max = min(max(params[b].logprobs or 0 for b in rows), logprobs.shape[-1])
    top_v: list[list[float]] = [[] for _ in rows]
    top_i: list[list[int]] = [[] for _ in rows]
    if k_max:
        top = torch.topk(logprobs, k_max, dim=-1)  # [L, k_max], most likely first
        top_v, top_i = top.values.tolist(), top.indices.tolist()
    for i, b in enumerate(rows):
        k = params[b].logprobs or 0
        out[b] = TokenLogprob(tokens[b], values[i], tuple(zip(top_i[i][:k], top_v[i][:k], strict=True)), ranks[i])
    return out


def shape_logits(logits: torch.Tensor, params: Sequence[SamplingParams], output_ids: Sequence[Sequence[int]],
                 prompt_ids: Sequence[Sequence[int]], banned: Sequence[Sequence[int]] | None = None,
                 allowed: tuple[Sequence[int], torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Each row's logits with its penalties, logit bias, grammar mask and bans applied (arguments as ``sample_step``):
    [B, V] float32 (``logits`` itself when nothing changes it), and {row: refused [V] bool} of the grammar's rows."""
    bans = [(b, list(ids)) for b, ids in enumerate(banned or ()) if ids]
    x = apply_penalties(logits, params, output_ids, prompt_ids)
    biased = [b for b, p in enumerate(params) if p.logit_bias]
    if bans or biased or allowed is not None:
        x = x.clone() if x is logits else x
    for b in biased:
        bias = params[b].logit_bias
        ids = torch.tensor([t for t in bias if t < x.shape[-1]], dtype=torch.int64)
        x[b, ids] += torch.tensor([bias[t] for t in bias if t < x.shape[-1]], dtype=x.dtype)
    refused = {}
    if allowed is not None:
        rows, refuse = allowed
        for i, b in enumerate(rows):
            refused[b] = refuse[i]
            x[b].masked_fill_(refuse[i], -math.inf)  # in place, row by row: no copy of the batch
    for b, ids in bans:
        ids = torch.tensor(ids, dtype=torch.int64)
        if b in refused and refused[b].clone().index_fill_(0, ids, True).all():
            continue  # the grammar allows nothing but these (its EOS before min_tokens): the grammar wins
        x[b, ids] = -math.inf
    return x, refused


def sample_step(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None], output_ids: Sequence[Sequence[int]],
                prompt_ids: Sequence[Sequence[int]], banned: Sequence[Sequence[int]] | None = None,
                allowed: tuple[Sequence[int], torch.Tensor] | None = None
                ) -> tuple[list[int], list[TokenLogprob | None]]:
    """The next token of each row and, for rows whose ``params.logprobs`` is set, its ``TokenLogprob``.

    logits: [B, V] float32, raw model logits; ``params[b]``, ``generators[b]``, ``output_ids[b]`` (generated so
    far), ``prompt_ids[b]`` and ``banned[b]`` (ids that cannot be chosen: the stop ids before ``min_tokens``)
    belong to row b. allowed: (rows, refused [R, V] bool): the tokens each of those rows may not take (True; a
    grammar's mask); a ban that would leave such a row nothing yields to the grammar. Returns (B token ids, B
    ``TokenLogprob`` or None).
    """
    lp_rows = [b for b, p in enumerate(params) if p.logprobs is not None]
    if not lp_rows and not any(banned or ()) and allowed is None and all(p.plain for p in params):
        return torch.argmax(logits, dim=-1).tolist(), [None] * len(params)
    logprobs = torch.log_softmax(logits[lp_rows].float(), dim=-1) if lp_rows else None  # [L, V]
    x, refused = shape_logits(logits, params, output_ids, prompt_ids, banned, allowed)
    # a broken grammar refuses all: its matcher ends the sequence, and the argmax stands in
    argmax = [b for b, p in enumerate(params) if p.greedy or (b in refused and bool(refused[b].all()))]
    skip = set(argmax)
    tokens = [0] * len(params)
    if argmax:  # the greedy rows only: a pass over the vocabulary each
        for b, t in zip(argmax, torch.argmax(x[argmax] if len(argmax) < len(params) else x, dim=-1).tolist(),
                        strict=True):
            tokens[b] = t
    for b, p in enumerate(params):
        if b in skip:
            continue
        kept, support = _filter(x[b], p)
        probs = torch.softmax(kept, dim=-1)
        g = generators[b]
        if g is not None and g.device != probs.device:
            probs, support = probs.to(g.device), None
        tokens[b] = multinomial_one(probs, g, support)  # torch.multinomial's token, without its V exponentials
    if logprobs is None:
        return tokens, [None] * len(params)
    return tokens, token_logprobs(logprobs, lp_rows, params, tokens)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """The next token of each row, with no history (penalties see nothing). logits: [B, V]; ``params[b]`` and
    ``generators[b]`` belong to row b."""
    empty = [()] * len(params)
    return sample_step(logits, params, generators, empty, empty)[0]
