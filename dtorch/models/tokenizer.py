"""Tokenizer: byte-level BPE built with the ``tokenizers`` library from a GGUF's vocabulary or a
``tokenizer.json``; chat templates rendered with jinja2 in a sandbox; incremental decoding for streaming."""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer as _Backend, decoders
from tokenizers.models import BPE

from dtorch.core.errors import ArgumentError, ContextLengthError, ModelError
from dtorch.models import chat_template, vocab
from dtorch.models.vocab.bpe import byte_alphabet as _byte_alphabet

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback token (SentencePiece-style vocabularies)


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
                 chat_template: str | None = None, source: str = "", template_source: str | None = None,
                 vocab_size: int | None = None) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        self.source = source
        self.template_source = template_source or source  # the file that errors in the template name
        # the ids it knows are [0, vocab_size); a model's embedding is often padded past them, and ids sampled there
        # decode to "" (they have no text). ``vocab_size``: the caller knows it (a GGUF's ids are its tokens' places;
        # asking the backend for its vocabulary copies 150k strings: 0.4 s)
        self.vocab_size: int = vocab_size if vocab_size is not None else \
            max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    # --- construction ---------------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], chat_template: str | None = None, source: str = "gguf") -> Tokenizer:
        """From GGUF metadata (``tokenizer.ggml.*``), as llama.cpp reads it: byte-level BPE under any pre-tokenizer
        llama.cpp knows, SentencePiece, Gemma 4's (``dtorch.models.vocab``)."""
        if chat_template is not None and not isinstance(chat_template, str):
            raise ModelError(f"{source}: tokenizer.chat_template must be a string (a Jinja template), got "
                             f"{type(chat_template).__name__} {chat_template!r:.60}")
        v = vocab.build(meta, source)
        return cls(v.backend, bos_token_id=v.bos_token_id, eos_token_ids=v.eos_token_ids, chat_template=chat_template,
                   source=source, template_source=f"{source} (tokenizer.chat_template)", vocab_size=v.size)

    @classmethod
    def from_hf(cls, tokenizer_json: str | Path, tokenizer_config: Mapping[str, Any] | None = None, *,
                chat_template: str | None = None, eos_token_ids: Iterable[int] = (),
                template_source: str | None = None) -> Tokenizer:
        """From a ``tokenizer.json`` and the ``tokenizer_config.json`` dict beside it (bos/eos tokens, and the chat
        template unless ``chat_template`` is given; ``template_source``: the file that one came from)."""
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
        config_file = Path(tokenizer_json).parent / "tokenizer_config.json"
        if not chat_template and isinstance(cfg.get("chat_template"), str):
            chat_template, template_source = cfg["chat_template"], str(config_file)
        if template_source is None:  # given by the loader: from chat_template.jinja if there is one (transformers 5)
            jinja = config_file.with_name("chat_template.jinja")
            template_source = str(jinja if jinja.is_file() else config_file)
        return cls(backend, bos_token_id=bos, eos_token_ids=eos, chat_template=chat_template,
                   source=str(tokenizer_json), template_source=template_source)

    # --- text <-> ids -----------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) stay whole."""
        check_text(text, "Tokenizer.encode: text")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, continuation: bool = False) -> str:
        """The text of ``ids``; ids past the tokenizer's ``vocab_size`` (a padded embedding's) give no text.

        ``continuation``: the text that ``ids`` add after earlier text (a generated reply, a streamed piece): the
        concatenation of their tokens' bytes. Without it, ``ids`` are a text of their own, and a SentencePiece
        vocabulary drops the space its encoder put in front ("▁Hello" alone is "Hello", after "Say" it is " Hello").
        """
        ids = self._check_ids(ids, "decode")
        if self._raw_added and not self._raw_added.keys().isdisjoint(ids):
            return self._decode_around_raw_added(ids, skip_special_tokens, continuation)
        if not continuation or self._piece_decoder is None:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        skip = self._special_ids if skip_special_tokens else frozenset()
        return self._piece_decoder.decode([self.backend.id_to_token(i) for i in ids if i not in skip])

    def _decode_around_raw_added(self, ids: list[int], skip_special_tokens: bool, continuation: bool) -> str:
        """``decode`` where some ids are added tokens that the byte-level decoder would misread (their text has
        letters of GPT-2's byte alphabet, "ö" a user-defined token of DeepSeek's): those are their text, as
        llama.cpp's token_to_piece has them, the runs between decoded as usual."""
        out, run = [], []
        for i in [*ids, None]:
            if i is not None and i not in self._raw_added:
                run.append(i)
                continue
            if run:
                out.append(self.decode(run, skip_special_tokens, continuation))
                run = []
            if i is not None and not (skip_special_tokens and i in self._special_ids):
                out.append(self._raw_added[i])
        return "".join(out)

    @functools.cached_property
    def _raw_added(self) -> dict[int, str]:
        """Added tokens of a byte-level vocabulary whose text the byte-level decoder would turn into other bytes."""
        if not self._byte_level:
            return {}
        mangled = {c for c in self._byte_letters if ord(c) > 126}
        return {i: t.content for i, t in self.backend.get_added_tokens_decoder().items()
                if not mangled.isdisjoint(t.content)}

    def token_to_id(self, token: str) -> int | None:
        """The id of a token as the vocabulary spells it, or None."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary spelling of a token id, or None."""
        return self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes that ``token_id`` adds to a text: a byte-level token's raw bytes (a part of a UTF-8 character
        stays that part), a special or added token's text; ``b""`` for an id past ``vocab_size``."""
        spelling = self.backend.id_to_token(int(token_id))
        if spelling is None:
            return b""
        if spelling in self._added:
            return spelling.encode()
        if self._byte_level and set(spelling) <= self._byte_letters.keys():
            return bytes(self._byte_letters[c] for c in spelling)
        m = _BYTE_TOKEN.fullmatch(spelling)  # a byte-fallback token ("<0xE6>")
        return bytes([int(m.group(1), 16)]) if m else spelling.replace("\u2581", " ").encode()

    def min_tokens(self, text: str) -> int:
        """A lower bound of ``len(self.encode(text))`` found without encoding: no token spells more bytes than the
        vocabulary's longest entry (a quarter of that where a normalizer may shrink the text first). 0 when the
        tokenizer has no such bound (an unknown token may stand for a whole word)."""
        per_token = self._max_token_bytes
        return -(-len(text.encode("utf-8", "surrogatepass")) // per_token) if per_token else 0

    @functools.cached_property
    def _max_token_bytes(self) -> int:
        model = self.backend.model
        if not isinstance(model, BPE) or (model.unk_token is not None and not model.byte_fallback):
            return 0
        letters = self._byte_level  # a byte-level spelling has one character per byte it stands for
        longest = max((len(t) if letters and t not in self._added else len(t.encode())
                       for t in self.backend.get_vocab(with_added_tokens=True)), default=1)
        return longest * (4 if self.backend.normalizer is not None else 1)

    @functools.cached_property
    def _piece_decoder(self) -> Any:
        """The backend's decoder without its ``Strip`` steps (the space a SentencePiece encoder adds in front of a
        text), or None when it has none."""
        if self.backend.decoder is None:
            return None
        state = json.loads(self.backend.decoder.__getstate__())
        steps = state.get("decoders") if state.get("type") == "Sequence" else [state]
        kept = [d for d in steps if d.get("type") != "Strip"]
        if len(kept) == len(steps):
            return None
        piece = decoders.Sequence([])
        piece.__setstate__(json.dumps({"type": "Sequence", "decoders": kept}).encode())
        return piece

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    @functools.cached_property
    def _byte_level(self) -> bool:
        return isinstance(self.backend.decoder, decoders.ByteLevel)

    @functools.cached_property
    def _byte_letters(self) -> dict[str, int]:
        return {c: b for b, c in _byte_alphabet().items()}

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
                            continue_final_message: bool = False, **kwargs: Any) -> str:
        """The model's chat template rendered over ``messages`` (``[{"role": ..., "content": ...}, ...]``), in a
        sandbox bounded in time and size (``chat_template.render``); ``kwargs`` (``tools``, ``enable_thinking``
        ...) are the template's too. continue_final_message: end the text with the last message's content, open, so
        the reply continues it (transformers' option)."""
        if self.chat_template is None:
            raise ModelError(f"{self.source}: the model has no chat template; pass a raw prompt instead")
        messages = _checked_messages(messages)
        special = {"bos_token": self._text_of(self.bos_token_id),
                   "eos_token": self._text_of(self.eos_token_ids[0] if self.eos_token_ids else None)}
        context = special | kwargs | {"messages": messages, "add_generation_prompt": add_generation_prompt}
        size = sum(len(str(v)) for m in messages for v in m.values())
        text = chat_template.render(self.chat_template, self.template_source, context, size)
        if continue_final_message:
            final = str(messages[-1].get("content") or "").strip()
            at = text.rfind(final) if final else -1
            if at < 0:
                raise ArgumentError("apply_chat_template: continue_final_message: the final message's content is "
                                    "not in the rendered template")
            text = text[:at + len(final)]
        return text

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
                    allow_special_tokens: bool = False, continue_final_message: bool = False,
                    limit: int | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``messages`` rendered with the chat template.

        Special tokens (``<|im_start|>`` ...) come only from the template: written in the messages or in ``kwargs``
        (content, tools, tool arguments, documents, a ``bos_token`` override: any string, dict keys included), they
        are encoded as text, so a client cannot forge a system turn. With
        ``allow_special_tokens=True`` they become control tokens (the rendered text encoded as a whole).
        ``limit``: tokens at most; a rendered text that ``min_tokens`` puts past it is a ``ModelError`` before any
        encoding (the encoding of megabytes takes seconds).
        """
        specials = self._specials
        if allow_special_tokens or not specials:
            text = self.apply_chat_template(messages, add_generation_prompt, continue_final_message, **kwargs)
            self._check_limit(text, limit)
            return self.encode(text, add_special_tokens=False)
        # each special token in the messages becomes a mark no template alters; the rendered text is split at the
        # special tokens the template wrote, and the text between them encoded with the marks spelled back as text
        nonce = secrets.token_hex(8)
        find = re.compile("|".join(re.escape(t) for t in specials))
        marks = re.compile(f"\ue000{nonce}(\\d+)\ue001")
        index = {t: i for i, t in enumerate(specials)}

        def hide(value: Any) -> Any:
            if isinstance(value, str):
                return find.sub(lambda m: f"\ue000{nonce}{index[m.group()]}\ue001", value)
            if isinstance(value, Mapping):
                return {hide(k): hide(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [hide(v) for v in value]
            return value

        hidden = [hide(m) if isinstance(m, Mapping) else m for m in messages]
        rendered = self.apply_chat_template(hidden, add_generation_prompt, continue_final_message,
                                            **{k: hide(v) for k, v in kwargs.items()})
        self._check_limit(rendered, limit)
        if not marks.search(rendered):  # nothing to keep as text: exactly the plain encoding
            return self.encode(rendered, add_special_tokens=False)
        ids: list[int] = []
        pieces = re.split(f"({find.pattern})", rendered)  # text, special, text, ..., text
        for k, piece in enumerate(pieces):
            if k % 2:
                ids.append(self.backend.token_to_id(piece))
                continue
            text = marks.sub(lambda m: specials[int(m.group(1))], piece)
            before = self._added.get(pieces[k - 1]) if k else None
            after = self._added.get(pieces[k + 1]) if k + 1 < len(pieces) else None
            if before is not None and before.rstrip:
                text = text.lstrip()
            if after is not None and after.lstrip:
                text = text.rstrip()
            ids += self._text_backend.encode(text, add_special_tokens=False).ids
        return ids

    def _check_limit(self, text: str, limit: int | None) -> None:
        least = self.min_tokens(text) if limit is not None else 0
        if limit is not None and least > limit:
            raise ContextLengthError(f"the conversation has at least {least} tokens once rendered ({len(text)} "
                                     f"characters), but at most {limit} fit before the reply (max_model_len)",
                                     tokens=least, limit=limit + 1, at_least=True)

    @functools.cached_property
    def _added(self) -> dict[str, AddedToken]:
        return {t.content: t for t in self.backend.get_added_tokens_decoder().values()}

    @functools.cached_property
    def _specials(self) -> list[str]:
        """The special tokens' texts, longest first (so a regex prefers ``<|im_start|>`` to a prefix of it)."""
        return sorted((t for t, a in self._added.items() if a.special and t), key=len, reverse=True)

    @functools.cached_property
    def _text_backend(self) -> _Backend:
        """A copy of the backend that encodes special tokens' texts as text."""
        backend = _Backend.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    def _text_of(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")


def check_text(text: Any, what: str) -> None:
    """``text`` is a str of valid Unicode (no lone surrogate, which has no UTF-8); ``ArgumentError`` naming ``what``
    otherwise."""
    if not isinstance(text, str):
        raise ArgumentError(f"{what} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ArgumentError(f"{what} is not valid Unicode: a lone surrogate {text[e.start]!r} at character {e.start} "
                            "(decode the bytes with errors='replace', or drop it)") from None


def _checked_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages as the template gets them: dicts with a str ``role`` and a ``content`` that is a str, None (a
    tool-calling turn) or a list of text parts (``{"type": "text", "text": ...}``, joined into one str)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ArgumentError("apply_chat_template: messages must be a non-empty list of {'role': str, 'content': str} "
                            f"dicts, got {messages!r:.200}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ArgumentError("apply_chat_template: messages must be a list of {'role': str, 'content': ...} "
                                f"dicts; messages[{i}] is {m!r:.200}")
        m = dict(m)
        content = m.get("content")
        if isinstance(content, (list, tuple)):
            bad = [p for p in content if not (isinstance(p, Mapping) and p.get("type") == "text"
                                              and isinstance(p.get("text"), str))]
            if bad:
                raise ArgumentError(f"apply_chat_template: messages[{i}]['content'] has a part that is not "
                                    f"{{'type': 'text', 'text': str}}: {bad[0]!r:.200} (dtorch models take text only)")
            m["content"] = content = "".join(p["text"] for p in content)
        if content is not None:
            check_text(content, f"apply_chat_template: messages[{i}]['content']")
        out.append(m)
    return out


def no_tokenizer_message(source: str, what: str, reason: str | None = None) -> str:
    """What to tell a user who needs text (``what``: "text prompts", "chat" ...) from a model whose files carry no
    tokenizer (``source``: its ``.gguf`` file or directory), or one whose vocabulary could not be built (``reason``:
    why): what is missing and what to add."""
    if reason is not None:
        return (f"{source}: the model's vocabulary could not be built ({reason}), so {what} is not available; the "
                "model still runs on token ids (pass prompts as lists of ids)")
    if source.endswith(".gguf"):
        fix = ("the .gguf file has no tokenizer.ggml.* metadata; convert the model again with llama.cpp's "
               "convert_hf_to_gguf.py, which writes the tokenizer into the file")
    else:
        fix = ("copy tokenizer.json and tokenizer_config.json from the original model into the directory (a model "
               "that has only tokenizer.model or vocab.json + merges.txt gets a tokenizer.json from transformers: "
               "AutoTokenizer.from_pretrained(original).save_pretrained(directory))")
    return f"{source}: the model has no tokenizer, so {what} is not available; {fix}; or pass prompts as token ids"


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
        dec, skip = self.tokenizer.decode, self.skip_special_tokens
        before = dec(self._ids[self._prefix:self._read], skip_special_tokens=skip, continuation=True)
        after = dec(self._ids[self._prefix:], skip_special_tokens=skip, continuation=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def push_many(self, token_ids: Iterable[int]) -> str:
        """Feed several ids; the text they complete."""
        return "".join(self.push(t) for t in token_ids)
