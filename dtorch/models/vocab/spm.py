"""SentencePiece vocabularies (``tokenizer.ggml.model`` = ``llama``: Llama 2, Mistral, Gemma, Phi-3 ...) as llama.cpp
tokenizes them, built as a ``tokenizers`` BPE model.

llama.cpp's SentencePiece tokenizer (``llm_tokenizer_spm_session``) starts from the characters of the text, with a
space put in front (``add_space_prefix``) and every space written "▁", and merges, again and again, the neighbouring
pair whose joined text is the token of highest score (the leftmost of equal ones), until no neighbours join into a
token; a character that is no token becomes its bytes' ``<0xNN>`` tokens. That is BPE whose merges are every split of
every token into two tokens, ranked by the joined token's score: what is built here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import Tokenizer as Backend, decoders, normalizers
from tokenizers.models import BPE

from dtorch.models.vocab.tokens import UNKNOWN, Vocabulary

SPACE = "\u2581"  # "▁", SentencePiece's space


def build(v: Vocabulary, meta: Mapping[str, Any]) -> Backend:
    """The SentencePiece vocabulary ``v`` (``meta``: its file's metadata, for ``add_space_prefix`` and the unknown
    token) as a backend without special tokens or post-processor."""
    vocab = v.index
    unk_id = meta.get("tokenizer.ggml.unknown_token_id", next((i for i, ty in enumerate(v.types) if ty == UNKNOWN), 0))
    unk = v.tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(v.tokens) else None
    backend = Backend(BPE(vocab=vocab, merges=merges(v, vocab), byte_fallback=True, unk_token=unk, fuse_unk=False))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.normalizer = normalizers.Sequence([*([normalizers.Prepend(SPACE)] if prefix else []),
                                               normalizers.Replace(" ", SPACE)])
    backend.decoder = decoder(prefix)
    return backend


def merges(v: Vocabulary, vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) pair of tokens whose joined text is a token, the pairs that make a token of higher score
    first (of equal scores, the token of lower id first)."""
    ranked = []
    for t, i in vocab.items():
        score = v.scores[i]
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            if left in vocab and right in vocab:
                ranked.append((-score, i, k, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def decoder(strip_first_space: bool) -> Any:
    """Tokens to text: "▁" is a space, ``<0xNN>`` tokens are bytes; with ``strip_first_space`` the space the encoder
    put in front of the text goes (as llama.cpp's detokenizer removes it)."""
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    return decoders.Sequence([*steps, *([decoders.Strip(" ", 1, 0)] if strip_first_space else [])])
