"""Tokenizer: byte-level BPE built with the ``tokenizers`` library from a GGUF's vocabulary or a
``tokenizer.json``; chat templates rendered with jinja2 in a sandbox; incremental decoding for streaming."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer as _Backend, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from dtorch.core.errors import ArgumentError, ModelError

# pre-tokenizer split patterns by llama.cpp's `tokenizer.ggml.pre` (the regexes of the original tokenizer.json)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GGUF_PRE = ("default", "gpt2", "smollm", "qwen2", "llama-bpe", "llama3", "llama-v3")

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map used to spell byte-level BPE tokens."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def _pre_tokenizer(pre: str) -> tuple[Any, Any]:
    """(normalizer, pre_tokenizer) for a llama.cpp pre-tokenizer name."""
    if pre == "smollm":  # GPT-2 regex with every digit on its own
        return None, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in ("qwen2", "llama-bpe", "llama3", "llama-v3"):
        split = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
        norm = normalizers.NFC() if pre == "qwen2" else None
        return norm, pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # "gpt2", "default"


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or {"content": ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template.

    Build with ``Tokenizer.from_gguf(metadata)`` or ``Tokenizer.from_hf(tokenizer_json, tokenizer_config)``.
    """

    def __init__(self, backend: _Backend, *, bos_token_id: int | None, eos_token_ids: Iterable[int],
                 chat_template: str | None = None, source: str = "") -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        self.source = source
        # the ids it knows are [0, vocab_size); a model's embedding is often padded past them, and ids sampled there
        # decode to "" (they have no text)
        self.vocab_size: int = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    # --- construction ---------------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], chat_template: str | None = None, source: str = "gguf") -> Tokenizer:
        """From GGUF metadata (``tokenizer.ggml.*``): byte-level BPE ("gpt2" model) vocabulary and merges."""
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelError(f"{source}: tokenizer.ggml.model is {model!r}; dtorch builds byte-level BPE "
                             "tokenizers only (expected 'gpt2')")
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in _GGUF_PRE:
            raise ModelError(f"{source}: tokenizer.ggml.pre {pre!r} is not supported; expected one of {_GGUF_PRE}")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        merges = meta.get("tokenizer.ggml.merges")
        if not merges:
            raise ModelError(f"{source}: tokenizer.ggml.merges is missing; a byte-level BPE vocabulary needs it")
        alphabet = _byte_alphabet()
        letters = set(alphabet.values())
        # llama.cpp spells byte-level tokens in GPT-2's alphabet; respell the rare token that is not
        vocab = {(t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))): i
                 for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        backend = _Backend(BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                               ignore_merges=pre in ("llama-bpe", "llama3", "llama-v3")))
        backend.normalizer, backend.pre_tokenizer = _pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        types = list(meta.get("tokenizer.ggml.token_type") or ())
        special = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, types, strict=False) if ty == _CONTROL and set(t) <= letters]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types, strict=False) if ty == _USER_DEFINED]
        backend.add_special_tokens(special)
        backend.add_tokens(user)

        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
        single, added = "$A", []
        if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
            single, added = f"{tokens[bos]} $A", [(tokens[bos], bos)]
        if meta.get("tokenizer.ggml.add_eos_token", False) and eos:
            single, added = f"{single} {tokens[eos[0]]}", [*added, (tokens[eos[0]], eos[0])]
        backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=added)
        return cls(backend, bos_token_id=bos, eos_token_ids=eos, chat_template=chat_template, source=source)

    @classmethod
    def from_hf(cls, tokenizer_json: str | Path, tokenizer_config: Mapping[str, Any] | None = None, *,
                chat_template: str | None = None, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """From a ``tokenizer.json`` and the ``tokenizer_config.json`` dict beside it (bos/eos tokens)."""
        try:
            backend = _Backend.from_file(str(tokenizer_json))
        except Exception as e:  # the library raises a bare Exception on a malformed file
            raise ModelError(f"{tokenizer_json}: not a readable tokenizer.json ({e})") from None
        cfg = dict(tokenizer_config or {})
        bos_text, eos_text = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        bos = backend.token_to_id(bos_text) if bos_text else None
        eos = list(eos_token_ids)
        if eos_text and backend.token_to_id(eos_text) is not None:
            eos.append(backend.token_to_id(eos_text))
        return cls(backend, bos_token_id=bos, eos_token_ids=eos,
                   chat_template=chat_template or cfg.get("chat_template"), source=str(tokenizer_json))

    # --- text <-> ids -----------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) stay whole."""
        if not isinstance(text, str):
            raise ArgumentError(f"Tokenizer.encode: text must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; ids past the tokenizer's ``vocab_size`` (a padded embedding's) give no text."""
        return self.backend.decode(self._check_ids(ids, "decode"), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token as the vocabulary spells it, or None."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary spelling of a token id, or None."""
        return self.backend.id_to_token(token_id)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A fresh incremental decoder for one sequence."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    def _check_ids(self, ids: Sequence[int], where: str) -> list[int]:
        """``ids`` as ints without those past ``vocab_size``; a negative id raises."""
        out = [int(i) for i in ids]
        bad = [i for i in out if i < 0]
        if bad:
            raise ArgumentError(f"Tokenizer.{where}: token ids must be >= 0, got {bad[:5]}")
        return [i for i in out if i < self.vocab_size]

    # --- chat -------------------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The model's chat template rendered over ``messages`` (``[{"role": ..., "content": ...}, ...]``)."""
        if self.chat_template is None:
            raise ModelError(f"{self.source}: the model has no chat template; pass a raw prompt instead")
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages):
            raise ArgumentError("apply_chat_template: messages must be a list of {'role': str, 'content': ...} "
                                f"dicts, got {messages!r:.200}")
        from jinja2.exceptions import TemplateError

        template = _compile(self.chat_template)
        special = {"bos_token": self._text_of(self.bos_token_id),
                   "eos_token": self._text_of(self.eos_token_ids[0] if self.eos_token_ids else None)}
        try:
            return template.render(messages=[dict(m) for m in messages],
                                   add_generation_prompt=add_generation_prompt, **(special | kwargs))
        except _TemplateRaised as e:
            raise ArgumentError(f"apply_chat_template: the model's template rejected the messages: {e}") from None
        except TemplateError as e:
            raise ModelError(f"{self.source}: the chat template failed to render ({e})") from None

    def _text_of(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")


def no_tokenizer_message(source: str, what: str) -> str:
    """What to tell a user who needs text (``what``: "text prompts", "chat" ...) from a model whose files carry no
    tokenizer (``source``: its ``.gguf`` file or directory): what is missing and what to add."""
    if source.endswith(".gguf"):
        fix = ("the .gguf file has no tokenizer.ggml.* metadata; convert the model again with llama.cpp's "
               "convert_hf_to_gguf.py, which writes the tokenizer into the file")
    else:
        fix = ("copy tokenizer.json and tokenizer_config.json from the original model into the directory (a model "
               "that has only tokenizer.model or vocab.json + merges.txt gets a tokenizer.json from transformers: "
               "AutoTokenizer.from_pretrained(original).save_pretrained(directory))")
    return f"{source}: the model has no tokenizer, so {what} is not available; {fix}; or pass prompts as token ids"


class _TemplateRaised(Exception):
    """``raise_exception(...)`` called from a chat template."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    """A chat template compiled in jinja2's immutable sandbox, with the helpers transformers provides."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ModelError(f"chat template does not compile ({e})") from None


class StreamDecoder:
    """Incremental detokenization: ``push(id)`` returns the new text, holding back partial UTF-8 characters.

    The text is the difference between decoding a small window of recent ids with and without the new
    one, so byte-level pieces of a multi-byte character come out together once the character is whole.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the window already emitted as context
        self._read = 0  # ids up to here have been emitted

    def push(self, token_id: int) -> str:
        """Feed one id; the text it completes ("" while a character is still partial, or for an id past the
        tokenizer's ``vocab_size``)."""
        ids = self.tokenizer._check_ids([token_id], "StreamDecoder.push")
        if not ids:
            return ""
        self._ids.extend(ids)
        dec = self.tokenizer.backend.decode
        before = dec(self._ids[self._prefix:self._read], skip_special_tokens=self.skip_special_tokens)
        after = dec(self._ids[self._prefix:], skip_special_tokens=self.skip_special_tokens)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def push_many(self, token_ids: Iterable[int]) -> str:
        """Feed several ids; the text they complete."""
        return "".join(self.push(t) for t in token_ids)
