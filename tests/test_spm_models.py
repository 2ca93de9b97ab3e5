"""Models whose GGUF files carry a SentencePiece vocabulary, as Gemma 3, Phi-3, Mistral and Llama 2 files do: random
tiny models written with the vocabulary of llama.cpp's suite (``tiny.write_gguf(vocab=...)``) load through the CLI
and match transformers' logits and greedy ids; streamed pieces and logprob bytes of SentencePiece tokens (spaces,
byte-fallback emoji, CJK) join into the full text, which is the tokens' pieces as llama.cpp spells them."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

from dtorch.engine.llm import LLM
from dtorch.engine.sampling import SamplingParams
from dtorch.models.loaders.gguf import load_gguf_tokenizer
from dtorch.models.tiny import vocab_metadata, write_gguf
from tests.test_gguf_vocabs import _file, _tokenizer
from tests.tiny_models import hf_greedy, random_model, tiny_config

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

# family -> (the suite's vocabulary its files carry, metadata as its files have it)
FAMILIES = {
    "llama": ("llama-spm", {}),  # Llama 2
    "mistral": ("llama-spm", {}),  # Mistral 7B's is Llama 2's 32000-token SentencePiece vocabulary
    "phi3": ("phi-3", {}),
    "gemma3": ("llama-spm", {"tokenizer.ggml.add_space_prefix": False}),  # Gemma's files put no space in front
}
PROMPT = "Once upon a time, 🦙 saw 中文 and"


@functools.cache
def _vocab(name: str) -> dict:
    return vocab_metadata(_file(f"ggml-vocab-{name}.gguf"))


def _pieces(vocab: dict, ids: list[int], skip_special: bool = True) -> str:
    """The text of ``ids`` as llama.cpp's token_to_piece spells a SentencePiece vocabulary's tokens (from the file's
    own token list and types): "▁" a space, ``<0xNN>`` a byte, control and unknown tokens nothing."""
    tokens, types = vocab["tokenizer.ggml.tokens"][0], vocab["tokenizer.ggml.token_type"][0]
    out = b""
    for i in ids:
        if types[i] == 6:  # byte
            out += bytes([int(tokens[i][3:5], 16)])
        elif types[i] in (2, 3):  # unknown, control
            out += b"" if skip_special else tokens[i].encode()
        else:
            out += tokens[i].replace("\u2581", " ").encode()
    return out.decode("utf-8", "replace")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request, tmp_path_factory):
    """(family, transformers model, its GGUF file with the family's vocabulary, that vocabulary's metadata)."""
    family = request.param
    name, overrides = FAMILIES[family]
    vocab = _vocab(name)
    vocab |= {k: (v, gguf.GGUFValueType.BOOL, None) for k, v in overrides.items()}
    n = len(vocab["tokenizer.ggml.tokens"][0])
    hf = random_model(transformers, tiny_config(transformers, family, vocab_size=n, bos_token_id=1,
                                                eos_token_id=vocab["tokenizer.ggml.eos_token_id"][0]))
    path = tmp_path_factory.mktemp(family) / "m.gguf"
    write_gguf(hf, path, vocab=vocab)
    return family, hf, path, vocab


def test_a_sentencepiece_model_generates_through_the_cli_as_transformers(model):
    family, hf, path, vocab = model
    tok = load_gguf_tokenizer(path)
    ids = tok.encode(PROMPT)
    assert ids[0] == 1 and tok.decode(ids) == PROMPT  # BOS, and the text back
    want = hf_greedy(hf, ids, 8)
    proc = subprocess.run([sys.executable, "-m", "dtorch", "generate", "--model", str(path), "--raw", PROMPT,
                           "--max-tokens", "8", "--ignore-eos"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == _pieces(vocab, want) + "\n", (family, want)


def test_a_sentencepiece_model_matches_transformers_logits_and_greedy_ids(model):
    family, hf, path, vocab = model
    llm = LLM(str(path), max_num_seqs=2)
    try:
        ids = llm.tokenizer.encode(PROMPT)
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(llm.logits(ids), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        pieces: list[str] = []
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0),
                           on_text=lambda _i, piece: pieces.append(piece))[0].outputs[0]
        assert out.token_ids == hf_greedy(hf, ids, 12)
        # the reply is its tokens' pieces: streamed, whole, as the logprobs' bytes and (whole characters) their texts
        assert out.text == "".join(pieces) == _pieces(vocab, out.token_ids)
        plain = [i for i in out.token_ids if i not in llm.tokenizer._special_ids]
        assert b"".join(llm.tokenizer.token_bytes(i) for i in plain).decode("utf-8", "replace") == out.text
        texts = [step[i].decoded_token for step, i in zip(out.logprobs, out.token_ids, strict=True) if i in plain]
        if not any(llm.tokenizer.id_to_token(i).startswith("<0x") for i in plain):
            assert "".join(texts) == out.text
    finally:
        llm.close()


@pytest.mark.parametrize("name", ["llama-spm", "phi-3", "gemma-4"])
def test_streamed_pieces_and_token_bytes_join_into_the_text(name):
    """Spaces ("▁"), an emoji in four byte-fallback tokens, CJK (by byte or by token), newlines: token by token, the
    stream decoder and the tokens' bytes give the text the ids decode to as a continuation, which is the text itself
    after the one space a SentencePiece encoder puts in front."""
    tok = _tokenizer(name)  # loaded once for both test files
    text = "Hello  world 🦙🚀 中文字 日本語\n\n  tabs\tand ✅ done "
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids)  # byte fallback is exercised
    assert tok.decode(ids) == text
    whole = tok.decode(ids, continuation=True)
    prefix = " " if name != "gemma-4" else ""  # Gemma 4's vocabulary adds no space in front
    assert whole == prefix + text
    stream = tok.stream_decoder()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == whole
    assert all("\ufffd" not in p for p in pieces)  # a character's bytes come out together
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == whole
