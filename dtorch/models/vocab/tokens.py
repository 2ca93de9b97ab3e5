"""The token list of a GGUF vocabulary with its types and scores, read and checked as llama.cpp reads them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dtorch.core.errors import ModelError

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """``tokens[i]``: token i's text; ``types[i]``: its llama.cpp type (NORMAL when the file gives none);
    ``scores[i]``: its SentencePiece score (0 when the file gives none); ``index``: text -> id, each token's."""

    tokens: list[str]
    types: list[int]
    scores: list[float]
    index: dict[str, int]

    @classmethod
    def read(cls, meta: Mapping[str, Any], source: str) -> Vocabulary:
        """From ``tokenizer.ggml.tokens`` / ``token_type`` / ``scores``; an empty token is "[EMPTY_i]" as llama.cpp
        names it, a text given twice a ``ModelError``."""
        if "tokenizer.ggml.tokens" not in meta:
            raise ModelError(f"{source}: tokenizer.ggml.tokens is missing; the file has no vocabulary")
        tokens = strings(meta["tokenizer.ggml.tokens"], f"{source}: tokenizer.ggml.tokens")
        if "" in tokens:  # (a scan in C first: 150k tokens cost a pass each)
            tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        n = len(tokens)
        types = _numbers(meta, "tokenizer.ggml.token_type", n, int, NORMAL, source)
        scores = _numbers(meta, "tokenizer.ggml.scores", n, float, 0.0, source)
        index = dict(zip(tokens, range(n), strict=True))
        if len(index) < n:  # a token spelled twice: name the first one
            seen: dict[str, int] = {}
            for i, t in enumerate(tokens):
                if seen.setdefault(t, i) != i:
                    raise ModelError(f"{source}: tokenizer.ggml.tokens spells token {i} {t!r:.60} like token "
                                     f"{seen[t]}; each token must be spelled once")
        return cls(tokens, types, scores, index)


def _numbers(meta: Mapping[str, Any], key: str, n: int, kind: type, default: Any, source: str) -> list[Any]:
    """The first ``n`` numbers of array ``key`` (``default`` each without it); ``ModelError`` when it is shorter or
    holds something else."""
    if key not in meta:
        return [default] * n
    value = meta[key]
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) < n:
        raise ModelError(f"{source}: {key} must be an array of {n} numbers (one per token), got "
                         f"{type(value).__name__} of {len(value) if isinstance(value, Sequence) else '?'}")
    out = list(value[:n])
    seen = set(map(type, out))  # (one pass in C; the element-wise checks only when it finds more than numbers)
    if not seen <= {int, float}:
        bad = next(i for i, x in enumerate(out) if isinstance(x, bool) or not isinstance(x, (int, float)))
        raise ModelError(f"{source}: {key}[{bad}] must be a number, got {out[bad]!r:.60}")
    return out if seen <= {kind} else list(map(kind, out))


def strings(value: Any, what: str) -> list[str]:
    """A GGUF string array as a list; ``ModelError`` naming ``what`` when it is not one."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ModelError(f"{what} must be an array of strings, got {type(value).__name__}")
    out = list(value)
    if set(map(type, out)) <= {str}:  # (one pass in C)
        return out
    bad = next((i for i, t in enumerate(out) if not isinstance(t, str)), None)
    if bad is not None:
        raise ModelError(f"{what}[{bad}] must be a string, got {type(out[bad]).__name__} {out[bad]!r:.60}")
    return out
