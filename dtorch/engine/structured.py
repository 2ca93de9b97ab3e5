"""Structured outputs: a grammar (JSON schema, regex, choice, Lark/GBNF) turned into a token mask by llguidance.

``StructuredOutputsParams`` (vLLM's name and fields) says what the output must match; ``SamplingParams(
structured_outputs=...)`` asks for it. The engine's ``Grammars`` compiles each distinct grammar once per tokenizer
(an ``LLMatcher`` kept as a template, copied for each sequence) and, every step, fills one bitmask row per constrained
sequence: bit ``t`` of row ``r`` says whether token ``t`` may come next. The sampler sets the logits of the others to
-inf, on those rows only. End-of-sequence is in the mask only where the grammar accepts, and a sequence whose grammar
can take no more tokens ends there (finish_reason "stop").

llguidance (a Rust wheel with no dependencies) comes with ``pip install 'dtorch[serve]'``; without it, asking for
structured outputs is a ``DtorchError`` that says what to install.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtorch.core.errors import DtorchError, SamplingError
from dtorch.engine.grammar_bounds import (
    MAX_ALTERNATIVES,
    MAX_SCHEMA_DEPTH,
    check_alternatives,
    check_gbnf,
    check_parts,
    endless_at,
    grammar_parts,
    heap_bytes,
    nesting_depth,
    on_big_stack,
)

CACHE_BYTES = 1 << 30  # compiled grammars kept per tokenizer, by their estimated size (least recently used go first)
# the heap a compiled grammar holds, per character of its text, when the heap cannot be read (or reads less while
# other threads free memory): the low end of what llguidance 1.9 held (enums 21-39, schemas 86-107, regexes with
# counted repeats up to 835), plus a base for the lexer's first states
BYTES_PER_CHAR, BASE_BYTES = 100, 150_000
# llguidance's parser limits: a row may hold as many items as a step (llguidance's 2000 cut a choice or Lark
# alternation of more options short: the answer "option" with finish_reason "stop"); errors without the parser state
# and grammar (those ran to 470 KB of log per request)
LIMITS = {"max_items_in_row": MAX_ALTERNATIVES, "step_max_items": MAX_ALTERNATIVES, "verbose_errors": False}
# the JSON layout of json.dumps (", " and ": ", no other whitespace): what models are trained on, and no room for a
# sampled run of blank lines that never closes the object
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """What the output must match: exactly one of

    json: a JSON schema (a dict, or its JSON text); json_object: any JSON object; regex: a regular expression (Rust
    ``regex`` syntax, matched in full); choice: one of these strings; grammar: a Lark or GBNF (llama.cpp) grammar.
    strict: refuse schema keywords llguidance does not enforce (else they are ignored, as vLLM does).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    strict: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise SamplingError("SamplingParams: structured_outputs must set exactly one of json, regex, choice, "
                                f"grammar, json_object; got {', '.join(given) or 'none'}")
        if not isinstance(self.json_object, bool) or not isinstance(self.strict, bool):
            raise SamplingError("SamplingParams: structured_outputs: json_object and strict must be bools")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise SamplingError(f"SamplingParams: structured_outputs: json is not valid JSON ({e})") from None
                except RecursionError:  # nested past Python's stack: past the depth below too
                    raise SamplingError(_too_deep()) from None
            if schema is False:
                raise SamplingError("SamplingParams: structured_outputs: json is the schema false, which no output "
                                    "matches")
            if schema is True:  # the schema every JSON value matches
                object.__setattr__(self, "json", schema := {})
            if nesting_depth(schema) > MAX_SCHEMA_DEPTH:
                raise SamplingError(_too_deep())
            if not isinstance(schema, dict):
                raise SamplingError("SamplingParams: structured_outputs: json must be a JSON schema (an object), "
                                    f"got {type(schema).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingError(f"SamplingParams: structured_outputs: {name} must be a non-empty str")
            if value is not None and not _utf8(value):
                raise SamplingError(f"SamplingParams: structured_outputs: {name} has a lone surrogate (such as "
                                    f"\\ud800), which is no character; write whole characters")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, Sequence) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise SamplingError("SamplingParams: structured_outputs: choice must be a non-empty list of "
                                    f"non-empty strings, got {self.choice!r:.200}")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not all(_utf8(c) for c in self.choice):
                raise SamplingError("SamplingParams: structured_outputs: choice has a lone surrogate (such as "
                                    "\\ud800), which is no character; write whole characters")

    def grammar_text(self) -> str:
        """llguidance's grammar for this constraint; ``SamplingError`` naming the field when it has none."""
        try:
            return self._grammar_text()
        except SamplingError:
            raise
        except (ValueError, TypeError, UnicodeError, RecursionError) as e:
            raise SamplingError(f"SamplingParams: structured_outputs: {self.field}: no grammar can be made of it "
                                f"({type(e).__name__}: {str(e)[:300]})") from None

    def _grammar_text(self) -> str:
        import llguidance

        m = llguidance.LLMatcher
        options = JSON_OPTIONS | {"lenient": not self.strict}
        if self.json is not None:
            return m.grammar_from_json_schema(self.json, overrides=options)
        if self.json_object:
            return m.grammar_from_json_schema({"type": "object"}, overrides=options)
        if self.regex is not None:
            return m.grammar_from_regex(self.regex)
        if self.choice is not None:  # one lexeme: the lexer's automaton, not a parser row of len(choice) items
            return m.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in self.choice))
        try:
            return llguidance.grammar_from("grammar", self.grammar)  # Lark as is, GBNF converted
        except ValueError as e:
            raise SamplingError(f"SamplingParams: structured_outputs: grammar: {e}") from None

    @property
    def field(self) -> str:
        """The field that holds the constraint: json, regex, choice, grammar or json_object."""
        return "json_object" if self.json_object else \
            next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None)

    def check_size(self, key: str) -> None:
        """``SamplingError`` naming the field and the limit when the constraint is past ``grammar_bounds``' bounds
        (counted on what the client sent, before any of it is compiled); ``key``: its ``key`` (a JSON schema's
        text)."""
        if self.choice is not None:
            check_parts(len(self.choice), "choice")
        elif self.json is not None:
            check_parts(grammar_parts(key), "json")
        elif self.grammar is not None:
            check_parts(grammar_parts(self.grammar), "grammar")
            check_alternatives(self.grammar, "grammar")
            if "::=" in self.grammar:
                import llguidance

                if not llguidance.gbnf_to_lark.is_lark_syntax(self.grammar):
                    check_gbnf(self.grammar)

    @property
    def key(self) -> str:
        """The cache key: equal for equal constraints."""
        value = self.json if self.json is None or isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
        kind = self.field
        return json.dumps([kind, value if kind == "json" else getattr(self, kind), self.strict])


def _too_deep() -> str:
    return (f"SamplingParams: structured_outputs: json nests deeper than {MAX_SCHEMA_DEPTH} levels of objects and "
            "arrays; share deep parts by $ref to $defs")


def _utf8(text: str) -> bool:
    """Whether ``text`` is whole characters (no lone surrogate, which UTF-8 cannot write)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def require_llguidance() -> Any:
    """The llguidance module; a ``DtorchError`` saying how to install it when it is missing."""
    try:
        import llguidance
        import llguidance.torch  # noqa: F401
    except ImportError as e:
        raise DtorchError(f"structured outputs need the llguidance package ({e}); install it with: "
                          "pip install 'dtorch[serve]' (or pip install llguidance)") from None
    return llguidance


class Grammars:
    """Compiled grammars for one tokenizer, and the per-step masks of the sequences that use them.

    tokenizer: the model's ``Tokenizer``; vocab_size: the logits' width (may pass the tokenizer's: a padded
    embedding); eos_token_ids: the ids that end a sequence, allowed where a grammar accepts.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_bytes: int = CACHE_BYTES) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._lltok: Any = None
        self._executor: Any = None
        self._cache: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # key -> (template matcher, its bytes)
        self.cached_bytes = 0  # the estimated heap of the cached matchers
        self.words = (vocab_size + 31) // 32  # int32 words of a mask row

    def _ll_tokenizer(self) -> Any:
        if self._lltok is None:
            llg = require_llguidance()
            if self.tokenizer is None:
                raise SamplingError("SamplingParams: structured_outputs needs the model's tokenizer, and this model "
                                    "has none")
            if not self.eos_token_ids:
                raise SamplingError("SamplingParams: structured_outputs needs an end-of-sequence token, and this "
                                    "model has none")
            self._lltok = llg.LLTokenizer(_plain_added_tokens(self.tokenizer.backend.to_str()),
                                          n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        return self._lltok

    def compile(self, so: StructuredOutputsParams) -> Any:
        """The template matcher of ``so`` (compiled once, then cached); ``SamplingError`` when the library cannot
        compile it, with its message, or when it is past a bound (``grammar_bounds``)."""
        key = so.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit[0]
            so.check_size(key)
            self._ll_tokenizer()
            m, size = on_big_stack(self._build, so)  # llguidance recurses over the rules: a deep chain needs room
            self._keep(key, m, size)
            return m

    def _build(self, so: StructuredOutputsParams) -> tuple[Any, int]:
        """(the template matcher of ``so``, the heap bytes it holds): compiled, its first mask made (the parser's
        first row, the lexer's first states), and checked."""
        llg = require_llguidance()
        check_finite(json.loads(so.json) if isinstance(so.json, str) else so.json)
        text = so.grammar_text()
        check_parts(grammar_parts(text), so.field)  # the text llguidance reads (a GBNF grammar's Lark, a schema's)
        if so.grammar is not None:
            check_alternatives(text, "grammar")
        before = heap_bytes()
        m = llg.LLMatcher(self._lltok, text, log_level=0, limits=llg.LLParserLimits(**LIMITS))
        if m.is_error():
            raise SamplingError(f"SamplingParams: structured_outputs: the grammar does not compile: "
                                f"{error_line(m.get_error())}")
        allowed = ~self.masks([m])[0]  # [vocab] bool
        if m.is_error():
            raise SamplingError(f"SamplingParams: structured_outputs: {so.field}: the grammar is past llguidance's "
                                f"bounds at its start: {error_line(m.get_error())}")
        allowed[[t for t in self.eos_token_ids if t < self.vocab_size]] = False
        if so.json is not None and not bool(allowed.any()):  # nothing but an end: an empty output
            raise SamplingError("SamplingParams: structured_outputs: json: no JSON value matches the schema "
                                "(a $ref to itself with nothing else, or constraints no value meets)")
        after = heap_bytes()
        measured = after - before if before is not None and after is not None else 0
        return m, max(measured, BASE_BYTES + BYTES_PER_CHAR * len(text))

    def _keep(self, key: str, m: Any, size: int) -> None:
        """Cache matcher ``m`` (``size`` bytes), dropping the least recently used until the cache fits
        ``cache_bytes``; one past the budget alone is not kept."""
        if size > self.cache_bytes:
            return
        self._cache[key] = (m, size)
        self.cached_bytes += size
        while self.cached_bytes > self.cache_bytes:
            _, (_, dropped) = self._cache.popitem(last=False)
            self.cached_bytes -= dropped

    def matcher(self, so: StructuredOutputsParams) -> Any:
        """A fresh matcher of ``so`` for one sequence (a copy of the compiled template)."""
        return self.compile(so).deep_copy()

    def masks(self, matchers: Sequence[Any]) -> torch.Tensor:
        """The tokens each matcher refuses at its next position: [R, vocab_size] bool (True: refused)."""
        from llguidance.torch import fill_next_token_bitmask, fill_next_token_bitmask_par

        words = torch.empty(len(matchers), self.words, dtype=torch.int32)  # [R, W]
        if len(matchers) == 1:
            fill_next_token_bitmask(matchers[0], words, 0)
        else:  # llguidance's threads, one row each
            if self._executor is None:
                self._executor = require_llguidance().LLExecutor()
            fill_next_token_bitmask_par(self._executor, [(m, r) for r, m in enumerate(matchers)], words)
        return unpack_bits(words, self.vocab_size, refused=True)

    def draft_masks(self, matcher: Any, draft: Sequence[int]) -> torch.Tensor:
        """The tokens ``matcher`` refuses after none, one, ... all of ``draft`` (a speculative step's rows): [len(draft)
        + 1, vocab_size] bool (True: refused). Rows past a draft token it refuses repeat that row (the step keeps no
        later draft). The matcher is left as it was."""
        from llguidance.torch import fill_next_token_bitmask

        words = torch.empty(len(draft) + 1, self.words, dtype=torch.int32)  # [k + 1, W]
        taken = 0
        for j in range(len(draft) + 1):
            if j > taken:
                words[j] = words[j - 1]
                continue
            fill_next_token_bitmask(matcher, words, j)
            if j < len(draft) and not matcher.is_stopped() and matcher.try_consume_tokens([draft[j]]) == 1:
                taken += 1
        matcher.rollback(taken)
        return unpack_bits(words, self.vocab_size, refused=True)


def check_finite(schema: Any, what: str = "SamplingParams: structured_outputs: json") -> None:
    """``SamplingError`` (``what``: the field, first) when no finite JSON value matches ``schema``: a part of it
    requires itself without end (``grammar_bounds.endless_at``)."""
    if isinstance(schema, dict) and (where := endless_at(schema)) is not None:
        raise SamplingError(f"{what}: no JSON value matches the schema: {where} requires itself without end (a "
                            "required property, minItems item or $ref that refers back to it); make the reference "
                            "optional")


def error_line(error: str) -> str:
    """llguidance's error message, its first line at most 300 characters (the rest is its parser state)."""
    return (error.strip().splitlines() or [""])[0][:300]


def _plain_added_tokens(tokenizer_json: str) -> str:
    """The tokenizer for llguidance, its added tokens that are not special (Qwen's ``<tool_call>``, ``<think>``) moved
    into a byte-level vocabulary as plain tokens: llguidance takes every added token for a special one, which no
    grammar text can produce (its mask offered ``<tool_call>`` for the text "<tool_call>", then refused it)."""
    from dtorch.models.tokenizer import _byte_alphabet

    d = json.loads(tokenizer_json)
    model = d.get("model") or {}
    if model.get("type") != "BPE" or (d.get("decoder") or {}).get("type") != "ByteLevel":
        return tokenizer_json
    alphabet = _byte_alphabet()
    plain = [t for t in d.get("added_tokens", ()) if not t.get("special")]
    for t in plain:
        model["vocab"]["".join(alphabet[b] for b in t["content"].encode())] = t["id"]
    d["added_tokens"] = [t for t in d.get("added_tokens", ()) if t.get("special")]
    return json.dumps(d)


_BITS = (torch.ones(32, dtype=torch.int64) << torch.arange(32)).to(torch.int32)  # 1 << j (bit 31: the sign bit)


def unpack_bits(words: torch.Tensor, vocab: int, refused: bool = False) -> torch.Tensor:
    """A bitmask [R, W] int32 (bit j of word w: token 32 w + j) as [R, vocab] bool, True where the bit is set (or,
    with ``refused``, where it is clear)."""
    set_ = words.unsqueeze(-1) & _BITS.to(words.device)  # [R, W, 32]
    return (set_.eq(0) if refused else set_.ne(0)).view(words.shape[0], -1)[:, :vocab]
