"""Step shapes: the buckets a step of T rows of N sequences is padded to, so that one graph (and one ``Runner``) serves
every step of a bucket (``Transformer.graph`` builds it, ``Executor`` keeps one per bucket), and when a prompt step's
products may trade each row's precision for speed (``COARSE_PROMPT_ROWS``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# Prompts of this many tokens and more are coarse (``Transformer._proj``): their products are compute-bound, and 8
# bits per 32 activations run them 1.4-1.9x faster on AVX-512 VNNI. Shorter ones (a chat turn's question: tens of
# milliseconds either way) keep the two levels' precision, as a lone decode does (it waits on memory, not on the
# products). The default SmolLM2 Q4_1 ranks "The" over "L" by 0.08 after "What is the capital of France?" with two
# levels; with 8 bits, as in llama.cpp, "L" wins and the answer never names Paris. The rule is the prompt's, not the
# step's: sixteen short prompts that arrive together fill a step of 128 rows, and each must still get the answer it
# gets alone.
COARSE_PROMPT_ROWS = 128


@dataclass(frozen=True, slots=True)
class Bucket:
    """A step shape: ``tokens`` rows of ``seqs`` sequences (padded); ``all_logits``: logits of every row;
    ``decode``: every sequence has exactly one row (the gated delta net layers then take their per-step form);
    ``hidden``: the final norm's output of every row instead of logits (embeddings); ``rows``: logits of this many
    rows (0: each sequence's last), the last few of each sequence (a speculative step's rows beside prompt chunks).
    ``coarse``: a prompt step of ``COARSE_PROMPT_ROWS`` rows and more whose every prompt is that long
    (``bucket_for``)."""

    tokens: int
    seqs: int
    all_logits: bool = False
    decode: bool = False
    hidden: bool = False
    rows: int = 0
    coarse: bool = False


def _pow2(n: int, least: int = 1) -> int:
    b = least
    while b < n:
        b *= 2
    return b


def bucket_for(tokens: int, seqs: int, all_logits: bool = False, hidden: bool = False, rows: int = 0,
               long: bool = False) -> Bucket:
    """The bucket that holds a step of ``tokens`` rows of ``seqs`` sequences; padding rows form one more sequence.

    Decode steps (one row per sequence) pad to a power of two of sequences; other steps pad their rows to a
    power of two (at least 16) and their sequences to a power of two. ``hidden``: every row's hidden state.
    ``long``: every prompt in the step has ``COARSE_PROMPT_ROWS`` tokens or more (``long_prompts``); a step of the
    last row of each sequence then is ``coarse`` from ``COARSE_PROMPT_ROWS`` rows.
    ``rows`` > ``seqs``: a speculative step wants the logits of that many rows. When they are all its rows (each
    sequence's last token and its drafts) up to 16 rows are not padded: every row of a small step costs a third to half
    a decode step on a CPU, which padding to 16 would spend; otherwise the rows pad to a power of two.
    """
    if rows > seqs and not all_logits and not hidden:
        if rows == tokens:
            t = tokens if tokens <= 16 else _pow2(tokens)
            return Bucket(t, _pow2(seqs + (t > tokens)), all_logits=True)
        t = _pow2(tokens, 16)
        return Bucket(t, _pow2(seqs + (t > tokens)), rows=_pow2(rows))
    if tokens == seqs and not all_logits and not hidden:
        b = _pow2(seqs)
        return Bucket(b, b, decode=True)
    t = _pow2(tokens, 16)
    coarse = long and t >= COARSE_PROMPT_ROWS and not (all_logits or hidden)
    return Bucket(t, _pow2(seqs + (t > tokens)), all_logits or hidden, hidden=hidden, coarse=coarse)


def long_prompts(plan: Iterable[tuple[Any, int]]) -> bool:
    """Whether every sequence of ``plan`` ((sequence, n) pairs; each with ``computed`` and ``num_prompt``) that
    steps through its prompt has a prompt of ``COARSE_PROMPT_ROWS`` tokens or more. Sequences past their prompt (a
    decode, a preempted sequence's outputs) say nothing either way."""
    return all(s.num_prompt >= COARSE_PROMPT_ROWS for s, _ in plan if s.computed < s.num_prompt)
