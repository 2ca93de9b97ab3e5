"""A GGUF file's vocabulary (its ``tokenizer.ggml.*`` metadata) as llama.cpp 0.3.36 reads it, built as a ``tokenizers``
backend that gives llama.cpp's token ids: byte-level BPE (``gpt2``, under every pre-tokenizer name llama.cpp knows),
SentencePiece (``llama``: scores, byte fallback, the "▁" space) and Gemma 4's SentencePiece-style BPE (``gemma4``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Tokenizer as Backend, processors

from dtorch.core.errors import ModelError
from dtorch.models.vocab import bpe, spm
from dtorch.models.vocab.tokens import CONTROL, UNKNOWN, USER_DEFINED, Vocabulary

# tokenizer.ggml.model values llama.cpp reads that dtorch does not build, and why
REFUSED_KINDS = {
    "bert": "a WordPiece (BERT) vocabulary, which encoder models use; dtorch runs decoder LLMs",
    "t5": "a Unigram (T5) vocabulary, which T5 and embedding models use; dtorch runs decoder LLMs",
    "rwkv": "RWKV's vocabulary; dtorch has no RWKV models",
    "plamo2": "PLaMo-2's vocabulary; dtorch has no PLaMo-2 models",
    "hybriddna": "a DNA k-mer vocabulary; dtorch has no DNA models",
    "whitespace": "a whitespace-split vocabulary, which embedding models (Jina) use; dtorch runs decoder LLMs",
    "test": "llama.cpp's test vocabulary (ids are hashes of text)",
    "no_vocab": "no vocabulary (the file says it has none)",
    "none": "no vocabulary (the file says it has none)",
}
BUILT_KINDS = ("gpt2", "llama", "gemma4")
# llama.cpp ends generation at these tokens wherever a vocabulary has them (llama_vocab::impl::load): by their text,
# and the fill-in-the-middle pad / repository / file-separator tokens (by key or text)
_END_OF_GENERATION = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                      "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                      "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                      "<｜end▁of▁sentence｜>", "[e~[")
_FIM = {"pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
        "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
        "sep": ("<|file_sep|>",)}


@dataclass(frozen=True, slots=True)
class GgufVocab:
    """A built vocabulary: the backend (BOS/EOS added as the file asks), its BOS token, the tokens that end
    generation as llama.cpp's ``llama_vocab_is_eog`` has them (the file's EOS first), and its number of tokens."""

    backend: Backend
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    size: int


def build(meta: Mapping[str, Any], source: str) -> GgufVocab:
    """The vocabulary of GGUF metadata ``meta`` (``source``: the file, for errors); ``ModelError`` naming the key
    when it is missing, malformed or of a kind dtorch does not build."""
    model = meta.get("tokenizer.ggml.model")
    if model in REFUSED_KINDS:
        raise ModelError(f"{source}: tokenizer.ggml.model is {model!r}: {REFUSED_KINDS[model]}")
    if model not in BUILT_KINDS:
        raise ModelError(f"{source}: tokenizer.ggml.model {model!r} is not a vocabulary llama.cpp reads; dtorch builds "
                         f"{', '.join(map(repr, BUILT_KINDS))}")
    v = Vocabulary.read(meta, source)
    if model == "llama":
        backend, add_bos, bos, eos = spm.build(v, meta), True, 1, 2  # llama.cpp's SentencePiece defaults
    else:
        backend, pre = bpe.build(v, meta, source)
        add_bos, bos, eos = pre.add_bos, None, None
    _add_special_tokens(backend, v)
    bos = _token_id(meta, "tokenizer.ggml.bos_token_id", bos, len(v.tokens))
    eos = _token_id(meta, "tokenizer.ggml.eos_token_id", eos, len(v.tokens))
    add_bos = model == "gemma4" or bool(meta.get("tokenizer.ggml.add_bos_token", add_bos))  # llama.cpp forces it
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _post_processor(v, bos if add_bos else None, eos if add_eos else None)
    return GgufVocab(backend, bos, _end_of_generation(meta, v, eos), len(v.tokens))


def _add_special_tokens(backend: Backend, v: Vocabulary) -> None:
    """Control and unknown tokens as special added tokens (split out of a text before anything else, skipped when
    decoding without specials), user-defined ones as plain added tokens (split out too, always decoded), as
    llama.cpp's ``tokenizer_st_partition`` does."""
    # (the tokens picked in C: a Python pass over 150k tokens costs more than the rest of this)
    special = [AddedToken(t, special=True, normalized=False)
               for t in itertools.compress(v.tokens, map((CONTROL, UNKNOWN).__contains__, v.types))]
    user = [AddedToken(t, special=False, normalized=False)
            for t in itertools.compress(v.tokens, map(USER_DEFINED.__eq__, v.types))]
    backend.add_special_tokens(special)
    backend.add_tokens(user)


def _token_id(meta: Mapping[str, Any], key: str, default: int | None, n: int) -> int | None:
    """A special token id from ``key`` (``default`` without it); None when it is past the vocabulary's ``n`` tokens
    (llama.cpp disables such a token)."""
    value = meta.get(key, default)
    return int(value) if isinstance(value, int) and 0 <= value < n else None


def _end_of_generation(meta: Mapping[str, Any], v: Vocabulary, eos: int | None) -> tuple[int, ...]:
    """EOS, EOT, EOM, the fill-in-the-middle pad / repository / file-separator tokens and the tokens llama.cpp treats
    as end-of-generation by their text."""
    n, index = len(v.tokens), v.index
    ids = [eos, *(_token_id(meta, f"tokenizer.ggml.{k}_token_id", None, n) for k in ("eot", "eom"))]
    for kind, texts in _FIM.items():
        given = _token_id(meta, f"tokenizer.ggml.fim_{kind}_token_id", None, n)
        ids += [given] if given is not None else [index[t] for t in texts if t in index]
    ends = [t for t in _END_OF_GENERATION if t in index]
    if "<|end|>" in ends and ({"<|return|>", "<|call|>"} <= set(ends) or {"<|calls|>", "<|flush|>"} <= set(ends)):
        ends.remove("<|end|>")  # gpt-oss's and Solar's <|end|> ends a message, not the reply (llama.cpp drops it)
    if "</s>" in ends and ("<|tool_response>" in ends or "<|plamo:eos|>" in index):
        ends.remove("</s>")  # a plain token of Gemma 4's and PLaMo's
    return tuple(dict.fromkeys(i for i in [*ids, *(index[t] for t in ends)] if i is not None))


def _post_processor(v: Vocabulary, bos: int | None, eos: int | None) -> Any:
    """BOS before and EOS after a text encoded with its special tokens."""
    ends = [(v.tokens[i], i) for i in (bos, eos) if i is not None]
    single = ([v.tokens[bos]] if bos is not None else []) + ["$A"] + ([v.tokens[eos]] if eos is not None else [])
    return processors.TemplateProcessing(single=single, special_tokens=ends)
