"""Sampling: ``SamplingParams`` (named as in vLLM) and choosing the next token from logits.

Each step: repetition, then frequency and presence penalties change the logits; greedy (temperature 0) takes
the argmax, otherwise the logits are divided by the temperature, top-k, top-p (nucleus) and min-p filters
remove tokens, and one token is drawn from what is left with the sequence's own ``torch.Generator`` (seeded
from ``seed`` when given, so a run is reproducible): one float64 uniform u a token, the kept token at u of their
cumulative distribution in id order (``engine/kept.py``, which finds the kept set without sorting the vocabulary).
Logprobs, when asked for, are of the model's own distribution: log_softmax of the raw logits, before penalties,
temperature and filters (vLLM's default).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dtorch.core.errors import SamplingError
from dtorch.engine.kept import draw, keep, scratch
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


@torch.no_grad()
def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits with every token outside the top-k / top-p / min-p set at -inf.

    logits: [V] float32 -> [V] float32 (a new tensor). Raises ``SamplingError`` when a filter meets NaN or +inf
    logits, or nothing but -inf.
    """
    x = logits.float()
    ids = keep(x, params.temperature, params.top_k, params.top_p, params.min_p, "filter_logits")
    z = x / params.temperature
    return z if ids is None else torch.full_like(z, -math.inf).index_copy_(0, ids, z[ids])


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], output_ids: Sequence[Sequence[int]],
                    prompt_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Logits with each row's repetition, then frequency and presence penalties applied.

    logits: [B, V]; ``output_ids[b]`` / ``prompt_ids[b]``: row b's generated / prompt tokens. Returns [B, V]
    float32: a new tensor when some row is penalized, else ``logits`` itself.
    """
    rows = [b for b, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    x = logits.float()
    x = x.clone() if x is logits else x  # [B, V]
    for b in rows:
        _penalize(x[b], params[b], output_ids[b], prompt_ids[b])
    return x


def _penalize(row: torch.Tensor, p: SamplingParams, output: Sequence[int], prompt: Sequence[int]) -> None:
    """Row [V] float32 with p's penalties, in place: repetition (every token of prompt or output divided when
    positive, else multiplied), then ``count * frequency + (count > 0) * presence`` subtracted (OpenAI's; count over
    the output). Only the tokens seen change: the cost grows with the history, not the vocabulary."""
    vocab = row.shape[0]
    counts = Counter(t for t in output if t < vocab)
    seen = set(counts)
    if p.repetition_penalty != 1.0:
        seen.update(t for t in prompt if t < vocab)
    if not seen:
        return
    order = sorted(seen)
    ids = torch.tensor(order, dtype=torch.int64, device=row.device)
    v = row[ids]
    if p.repetition_penalty != 1.0:
        v = torch.where(v < 0, v * p.repetition_penalty, v / p.repetition_penalty)
    if counts and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
        n = torch.tensor([counts.get(t, 0) for t in order], device=row.device)
        v = v - (p.frequency_penalty * n + p.presence_penalty * (n > 0))  # a count of 0 takes 0 off
    row[ids] = v


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


def _shapes(p: SamplingParams, ban: Sequence[int], refused: torch.Tensor | None) -> bool:
    """Whether row shaping changes a row's logits."""
    return p.penalized or bool(p.logit_bias) or bool(ban) or refused is not None


def _shape(row: torch.Tensor, p: SamplingParams, output: Sequence[int], prompt: Sequence[int], ban: Sequence[int],
           refused: torch.Tensor | None) -> None:
    """Row [V] float32 with its penalties, logit bias, grammar mask (``refused`` [V] bool, True: masked) and bans
    applied, in place; a ban that would leave the grammar nothing yields to it (its EOS before min_tokens)."""
    if p.penalized:
        _penalize(row, p, output, prompt)
    if p.logit_bias:
        vocab = row.shape[0]
        ids = torch.tensor([t for t in p.logit_bias if t < vocab], dtype=torch.int64, device=row.device)
        row[ids] += torch.tensor([p.logit_bias[t] for t in p.logit_bias if t < vocab], dtype=row.dtype,
                                 device=row.device)
    if refused is not None:
        row.masked_fill_(refused, -math.inf)
    if ban:
        ids = torch.tensor(list(ban), dtype=torch.int64, device=row.device)
        if refused is None or not refused.clone().index_fill_(0, ids, True).all():
            row[ids] = -math.inf


def _refusals(allowed: tuple[Sequence[int], torch.Tensor] | None) -> dict[int, torch.Tensor]:
    """{row: refused [V] bool} of ``allowed`` = (rows, refused [R, V])."""
    return {} if allowed is None else {b: allowed[1][i] for i, b in enumerate(allowed[0])}


def shape_logits(logits: torch.Tensor, params: Sequence[SamplingParams], output_ids: Sequence[Sequence[int]],
                 prompt_ids: Sequence[Sequence[int]], banned: Sequence[Sequence[int]] | None = None,
                 allowed: tuple[Sequence[int], torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Each row's logits with its penalties, logit bias, grammar mask and bans applied (arguments as ``sample_step``):
    [B, V] float32 (``logits`` itself when nothing changes it), and {row: refused [V] bool} of the grammar's rows."""
    bans = list(banned or ()) + [()] * (len(params) - len(banned or ()))
    refused = _refusals(allowed)
    rows = [b for b, p in enumerate(params) if _shapes(p, bans[b], refused.get(b))]
    if not rows:
        return logits, refused
    x = logits.float()
    x = x.clone() if x is logits else x  # [B, V]
    for b in rows:
        _shape(x[b], params[b], output_ids[b], prompt_ids[b], bans[b], refused.get(b))
    return x, refused


def argmax_rows(x: torch.Tensor) -> list[int]:
    """The index of each row's largest value: x [B, V] -> B ints (x [V] -> one int in a list), as torch.argmax: the
    first of equal values, a NaN above everything (its first one). A float32 CPU tensor goes through numpy's argmax,
    whose AVX2 loop reads a 152k-262k vocabulary in 40-65 us where torch's takes 280-470 us (one thread, Zen 1)."""
    numpy = x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad
    picked = np.argmax(x.numpy(), axis=-1) if numpy else torch.argmax(x, dim=-1)
    return [int(picked)] if x.dim() == 1 else picked.tolist()


@torch.no_grad()
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

    Each row is shaped (``shape_logits``'s row) in a buffer of this thread's, not in a copy of the batch.
    """
    lp_rows = [b for b, p in enumerate(params) if p.logprobs is not None]
    if not lp_rows and not any(banned or ()) and allowed is None and all(p.plain for p in params):
        return argmax_rows(logits), [None] * len(params)
    logprobs = torch.log_softmax(logits[lp_rows].float(), dim=-1) if lp_rows else None  # [L, V]
    bans = list(banned or ()) + [()] * (len(params) - len(banned or ()))
    refused = _refusals(allowed)
    vocab, tokens = logits.shape[-1], [0] * len(params)
    plain_greedy = []  # greedy rows nothing shapes: one argmax over them together
    for b, p in enumerate(params):
        shaped = _shapes(p, bans[b], refused.get(b))
        if p.greedy and not shaped:
            plain_greedy.append(b)
            continue
        x = logits[b]  # [V]
        if shaped or x.dtype != torch.float32 or not x.is_contiguous():
            x = scratch("row", vocab, torch.float32, logits.device).copy_(x)
            _shape(x, p, output_ids[b], prompt_ids[b], bans[b], refused.get(b))
        # a broken grammar refuses all: its matcher ends the sequence, and the argmax stands in
        if p.greedy or (b in refused and bool(refused[b].all())):
            tokens[b] = argmax_rows(x)[0]
            continue
        kept = keep(x, p.temperature, p.top_k, p.top_p, p.min_p, f"sample_step row {b}")
        tokens[b] = draw(x, p.temperature, kept, generators[b])
    if plain_greedy:
        rows = logits[plain_greedy] if len(plain_greedy) < len(params) else logits
        for b, t in zip(plain_greedy, argmax_rows(rows), strict=True):
            tokens[b] = t
    if logprobs is None:
        return tokens, [None] * len(params)
    return tokens, token_logprobs(logprobs, lp_rows, params, tokens)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """The next token of each row, with no history (penalties see nothing). logits: [B, V]; ``params[b]`` and
    ``generators[b]`` belong to row b."""
    empty = [()] * len(params)
    return sample_step(logits, params, generators, empty, empty)[0]
