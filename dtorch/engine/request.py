"""What the engine reports about a request as it runs: a ``Delta`` per step that produced something for it.

A request with ``n`` choices runs as ``n`` sequences; each delta names its choice by ``index``. Deltas of one choice
arrive in order, and the last one has ``finish_reason`` set: "stop" (an end-of-sequence token, a stop token id or a
stop string), "length" (max_tokens or the context) or "abort" (cancelled, or the engine shut down). With speculative
decoding a step may produce several tokens of one choice: each comes in a delta of its own.

And what it reports about itself: ``EngineStats`` snapshots, and ``GenerationStats`` between two of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log-probability of one chosen token and, when asked for, the most likely alternatives at its position
    (``top``: (token id, logprob) pairs, most likely first). Log-probabilities are of the model's distribution
    (log_softmax of the raw logits, before penalties, temperature and filters)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # of the chosen token in the model's distribution, 1: the most likely


@dataclass(frozen=True, slots=True)
class Delta:
    """What one step added to choice ``index`` of request ``request_id``.

    token_ids: the new tokens (one per delta; none in the final delta of an aborted choice). text: the new text; a
    piece that could be the start of a stop string is held back until that is decided, and a stop string never
    appears. logprobs: one per new token when the request asked for logprobs, else None. finish_reason: None while
    the choice runs. The counts are the totals so far: prompt tokens, tokens generated, prompt tokens whose keys
    came from the prefix cache.
    """

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    stop_reason: int | str | None = None  # what ended a "stop": a stop token id, a stop string (None: end of sequence)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


Sink = Callable[[Delta], None]  # called on the engine's thread; must not block (hand the delta to your own queue)


# -- what LLM.generate returns (vLLM's shapes) ---------------------------------------------------------------------

@dataclass(slots=True)
class Logprob:
    """A token's log-probability in the model's distribution, its rank there (1: the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One choice of a request: its new text and token ids, and why it ended.

    finish_reason: "stop" (an end-of-sequence token, a stop token id or a stop string), "length" (max_tokens or the
    context) or "abort"; stop_reason: the stop token id or stop string that ended it (None for end-of-sequence).
    logprobs (when asked for): per new token, {token id: Logprob} for the chosen token and the top alternatives;
    cumulative_logprob: the sum of the chosen tokens' logprobs. From ``LLM.chat``, the reply split: ``text`` is its
    content, ``reasoning_content`` what it wrote in a ``<think>`` block (None: none), ``tool_calls`` the calls it
    made (``ToolCall``: id, name, arguments as JSON text; None: none); ``token_ids`` are all the tokens.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    reasoning_content: str | None = None
    tool_calls: list | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's result: the prompt and its ``n`` choices (``outputs``, by index)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot: sequences running and waiting, cache blocks in use, and totals since the engine started."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_resident: int  # held, or free with cached contents: the cache memory in use (on a CPU)
    prompt_tokens: int  # prompt (and recomputed) tokens computed
    generation_tokens: int  # tokens sampled
    decode_tokens: int  # tokens generated in steps that computed no prompt token
    preemptions: int
    prefix_queries: int  # prompt tokens of admitted sequences
    prefix_hits: int  # of them, found in the prefix cache
    steps: int
    prefill_seconds: float  # in steps that computed a prompt chunk
    decode_seconds: float  # in the other steps
    spec_draft_tokens: int = 0  # speculative draft tokens verified
    spec_accepted_tokens: int = 0  # of them, accepted

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass
class GenerationStats:
    """Timing of the last ``generate`` call: prefill and decode tokens and seconds (of every request that ran in
    its steps, when several callers share the engine), and the speculative draft tokens verified and accepted."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @classmethod
    def between(cls, before: EngineStats, after: EngineStats) -> GenerationStats:
        """The work of the engine between two ``EngineStats`` snapshots."""
        return cls(after.prompt_tokens - before.prompt_tokens, after.prefill_seconds - before.prefill_seconds,
                   after.decode_tokens - before.decode_tokens, after.decode_seconds - before.decode_seconds,
                   after.spec_draft_tokens - before.spec_draft_tokens,
                   after.spec_accepted_tokens - before.spec_accepted_tokens)

    @property
    def acceptance_rate(self) -> float:
        """The share of draft tokens accepted (0 without speculation)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0
