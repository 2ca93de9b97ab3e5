"""Sampling: ``SamplingParams`` (named as in vLLM) and choosing the next token from logits.

Greedy is temperature 0. Otherwise the logits are divided by the temperature, then top-k, top-p
(nucleus) and min-p filters remove tokens, and one token is drawn from what is left with the
sequence's own ``torch.Generator`` (seeded from ``seed`` when given, so a run is reproducible).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dtorch.core.errors import SamplingError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature: 0 is greedy; > 0 scales the logits. top_k: keep the k most likely (-1 or 0: all).
    top_p: keep the smallest set whose probability reaches p (1: all). min_p: drop tokens whose
    probability is below ``min_p`` times the most likely one's (0: none). seed: per-request seed.
    max_tokens: new tokens at most (None: up to the context). stop: strings that end the output (not
    included). stop_token_ids: ids that end it (included in ``token_ids``, not in the text).
    ignore_eos: keep going past end-of-sequence tokens.
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

    def __post_init__(self) -> None:
        _number("temperature", self.temperature)
        if self.temperature < 0:
            raise SamplingError(f"SamplingParams: temperature must be >= 0 (0 is greedy), got {self.temperature}")
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
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError(f"SamplingParams: ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> torch.Generator:
        """A CPU generator for one request: seeded from ``seed``, else from fresh entropy."""
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else random.SystemRandom().getrandbits(63))
        return g


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
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the most likely always stays)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted), -math.inf)
    if params.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < params.min_p * probs.max(), -math.inf)
    return x


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """The next token of each row. logits: [B, V]; ``params[b]`` and ``generators[b]`` belong to row b."""
    if all(p.greedy for p in params):
        return torch.argmax(logits, dim=-1).tolist()
    out = []
    for b, p in enumerate(params):
        if p.greedy:
            out.append(int(torch.argmax(logits[b])))
            continue
        probs = torch.softmax(filter_logits(logits[b], p), dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=generators[b])))
    return out
