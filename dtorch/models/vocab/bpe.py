"""BPE vocabularies as llama.cpp tokenizes them (``llm_tokenizer_bpe_session``): the text split by the regexes of its
pre-tokenizer (``tokenizer.ggml.pre``), each piece merged by rank (``tokenizer.ggml.merges``). Byte-level ones
(``gpt2``) spell bytes in GPT-2's alphabet; Gemma 4's (``gemma4``) and other SentencePiece-style ones keep raw UTF-8
with "▁" for a space and ``<0xNN>`` tokens for bytes no token holds.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from operator import itemgetter
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer as Backend, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from dtorch.core.errors import ModelError
from dtorch.models.vocab import spm
from dtorch.models.vocab.pretokenize import NAMES, RAW_UTF8, Pre, splits
from dtorch.models.vocab.tokens import Vocabulary, strings


@functools.cache
def byte_alphabet() -> dict[int, str]:
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


def build(v: Vocabulary, meta: Mapping[str, Any], source: str) -> tuple[Backend, Pre]:
    """The BPE vocabulary ``v`` of ``meta`` (``tokenizer.ggml.model`` "gpt2" or "gemma4") as a backend without special
    tokens or post-processor, and what its pre-tokenizer name means."""
    pre = _pre(meta, source)
    raw = pre.type in RAW_UTF8
    pairs = _merges(meta, source)
    # tokens as the file spells them (byte-level ones in GPT-2's alphabet; a control or user-defined token, or a stray
    # raw one, in its text, matched by it as llama.cpp matches it)
    try:
        backend = Backend(BPE(vocab=v.index, merges=pairs, fuse_unk=False, byte_fallback=raw,
                              ignore_merges=pre.ignore_merges))
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception ("Token `x` out of vocabulary")
        raise ModelError(f"{source}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens ({e})") from None
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits(pre)]
    if not raw:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    if pre.escape_spaces:
        backend.normalizer = normalizers.Replace(" ", spm.SPACE)
    backend.decoder = spm.decoder(strip_first_space=False) if raw else decoders.ByteLevel()
    if pre.type == "gemma4":
        # a run of newlines that is a token is that token, merges or not (llama.cpp's fix for Gemma 4)
        backend.add_tokens([AddedToken(t, normalized=False) for t in v.tokens if t and not t.strip("\n")])
    return backend, pre


def _pre(meta: Mapping[str, Any], source: str) -> Pre:
    """The pre-tokenizer of ``meta``: Gemma 4's for a "gemma4" vocabulary, else that of ``tokenizer.ggml.pre``."""
    if meta.get("tokenizer.ggml.model") == "gemma4":
        return NAMES["gemma4"]
    name = meta.get("tokenizer.ggml.pre", "")
    if not isinstance(name, str) or name not in NAMES:
        raise ModelError(f"{source}: tokenizer.ggml.pre {name!r} is not a pre-tokenizer llama.cpp 0.3.36 knows "
                         f"(it knows {len(NAMES) - 1}: {', '.join(sorted(n for n in NAMES if n))})")
    return NAMES[name]


def _merges(meta: Mapping[str, Any], source: str) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` as pairs, split at the first space after the first character as llama.cpp does."""
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise ModelError(f"{source}: tokenizer.ggml.merges is missing; a BPE vocabulary needs it")
    merges = strings(merges, f"{source}: tokenizer.ggml.merges")
    if not any(m[:1] == " " for m in merges):  # then the first space is the split: one partition each (150k of them)
        pairs = [m.partition(" ")[::2] for m in merges]
        if all(map(itemgetter(1), pairs)):  # (each right token there: checked in C)
            return pairs
    pairs = []
    for i, m in enumerate(merges):
        at = m.find(" ", 1)
        if at < 0 or at == len(m) - 1:
            raise ModelError(f"{source}: tokenizer.ggml.merges[{i}] is {m!r:.60}; a merge is two tokens separated by "
                             "one space")
        pairs.append((m[:at], m[at + 1:]))
    return pairs
