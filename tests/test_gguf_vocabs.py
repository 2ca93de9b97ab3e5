"""GGUF vocabularies against llama.cpp's own tokenizer suite (llama-cpp-python 0.3.36's vendored
``models/ggml-vocab-*.gguf`` with ``.inp`` / ``.out``, fetched by ``scripts/llamacpp-vocabs.py``): every decoder
vocabulary loads and gives llama.cpp's ids for every test string, and its text back wherever llama.cpp's detokenizer
gives it back; the pre-tokenizer table against llama.cpp's ``llama-vocab.cpp``; transformers' GGUF conversion as a
second reference; the multilingual text against the ids llama.cpp itself gave (``tests/data/llamacpp_vocabs.json``)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest

from dtorch.core.errors import ModelError
from dtorch.models.loaders.gguf import load_gguf_tokenizer
from dtorch.models.vocab import BUILT_KINDS, REFUSED_KINDS
from dtorch.models.vocab.pretokenize import NAMES, SPLITS

SUITE = Path.home() / ".cache" / "dtorch" / "llamacpp-vocabs" / "0.3.36"
DATA = Path(__file__).parent / "data"
# the suite's vocabularies with test strings: every one but BERT's (an encoder's WordPiece) is a decoder LLM's
TESTED = ("command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe", "llama-spm", "mpt",
          "phi-3", "qwen2", "qwen35", "refact", "starcoder")
UNTESTED = ("aquila", "baichuan", "gpt-neox")  # decoder vocabularies the suite ships without test strings
REFUSED = {"bert-bge": "a WordPiece (BERT) vocabulary", "nomic-bert-moe": "a Unigram (T5) vocabulary"}


def _file(name: str) -> Path:
    """A file of the suite; missing, the test fails (never skips) naming the script that fetches it."""
    path = SUITE / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `python scripts/llamacpp-vocabs.py` (the README's set-up command does)")
    return path


@functools.cache
def _tokenizer(name: str):
    return load_gguf_tokenizer(_file(f"ggml-vocab-{name}.gguf"))


def _cases(name: str) -> list[tuple[str, list[int]]]:
    """(test string, llama.cpp's ids) as llama.cpp's test-tokenizer-0 reads the .inp / .out pair."""
    raw = _file(f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    out = _file(f"ggml-vocab-{name}.gguf.out").read_bytes().decode("utf-8").split("\n")
    texts = raw.split("\n__ggml_vocab_test__\n")
    if texts[-1] == "":
        texts.pop()
    assert len(out) >= len(texts) and not any(line.strip() for line in out[len(texts):])
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, out, strict=False)]


@functools.cache
def _reference() -> dict:
    """What llama.cpp 0.3.36 itself gave (scripts/llamacpp-vocab-reference.py): per vocabulary, whether its
    detokenizer gives each test string back, its ids of tests/data/multilingual.txt, its end-of-generation ids."""
    return json.loads((DATA / "llamacpp_vocabs.json").read_text())


def test_the_suite_is_all_here_and_all_named():
    _file("files.txt")  # written last by the script: missing, the suite was never fetched (or not wholly)
    names = sorted(p.name[len("ggml-vocab-"):-len(".gguf")] for p in SUITE.glob("ggml-vocab-*.gguf"))
    assert names == sorted([*TESTED, *UNTESTED, *REFUSED]), "a vocabulary of the suite that no list here names"
    with_tests = sorted(p.name[len("ggml-vocab-"):-len(".gguf.inp")] for p in SUITE.glob("*.inp"))
    assert with_tests == sorted([*TESTED, "bert-bge"])


@pytest.mark.parametrize("name", TESTED)
def test_every_test_string_gives_llamacpps_ids(name):
    tok = _tokenizer(name)
    round_trips = _reference()["round_trips"][name]
    cases = _cases(name)
    assert len(round_trips) == len(cases)
    for (text, want), back in zip(cases, round_trips, strict=True):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == want, f"{name}: {text!r}"
        if back:  # llama.cpp's detokenizer gives the text back: so does ours
            assert tok.decode(ids, skip_special_tokens=False) == text, f"{name}: {text!r}"


@pytest.mark.parametrize("name", [*TESTED, *UNTESTED])
def test_the_multilingual_text_gives_llamacpps_ids_and_generation_ends_where_llamacpps_does(name):
    tok = _tokenizer(name)
    assert sorted(tok.eos_token_ids) == _reference()["end_of_generation"][name]
    text = (DATA / "multilingual.txt").read_bytes().decode("utf-8")
    want = _reference()["multilingual"][name]
    assert tok.encode(text, add_special_tokens=True) == want["with_special"]
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == want["ids"]
    if want["round_trip"]:
        assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("name", REFUSED)
def test_encoder_vocabularies_are_refused_naming_why(name):
    why = re.escape(REFUSED[name])
    with pytest.raises(ModelError, match=rf"ggml-vocab-{name}.gguf: tokenizer.ggml.model is .*{why}"):
        _tokenizer(name)


# --- the pre-tokenizer table against llama.cpp's source ---------------------------------------------------------

# llama.cpp's regexes that name its hand-written splitters, and the regex each splitter implements here
_HAND_WRITTEN = {
    r"\p{AFMoE_digits}": r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))",
    r"\d{1,3}(?=(?:\d{3})*\b)": r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))",  # tiny_aya: llama.cpp runs AFMoE's splitter
    r"(?=(\d{3})+(?!\d))": r"(?=([0-9]{3})+(?![0-9]))",  # std::wregex's \d is ASCII
}


def _cpp_string(literal: str) -> str:
    """A C++ string literal's text, its regex escapes ``\\r`` ``\\n`` ``\\t`` as the characters (as ``_ours``)."""
    text = re.sub(r"\\(.)", lambda m: {"r": "\r", "n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), literal)
    return text.replace(r"\r", "\r").replace(r"\n", "\n").replace(r"\t", "\t")


def _ours(regex: str) -> str:
    """Our regex as llama.cpp's source spells it: ``\\x{HHHH}`` as the character, ``\\r`` ``\\n`` ``\\t`` too."""
    regex = re.sub(r"\\x\{([0-9A-F]+)\}", lambda m: chr(int(m.group(1), 16)), regex)
    return regex.replace(r"\r", "\r").replace(r"\n", "\n").replace(r"\t", "\t")


@functools.cache
def _llamacpp_table() -> tuple[dict[str, list[str]], dict[str, tuple[str, set[str]]], set[str]]:
    """From llama-vocab.cpp: pre-tokenizer type -> its regexes; pre-tokenizer name -> (type, flags it sets); the
    tokenizer.ggml.model names it reads."""
    src = _file("llama-vocab.cpp").read_text(encoding="utf-8")
    switch = src[src.index("llm_tokenizer_bpe(const llama_vocab & vocab) {"):]
    switch = switch[:switch.index("std::vector<std::string> regex_exprs;")]
    regexes = {}
    for block in re.split(r"\n\s*break;", switch):
        code = "\n".join(line for line in block.split("\n") if not line.strip().startswith("//"))
        types = re.findall(r"case LLAMA_VOCAB_PRE_TYPE_(\w+):", code) or (["DEFAULT"] if "default:" in code else [])
        listed = re.search(r"regex_exprs = \{(.*?)\};", code, re.S)
        for t in types:
            regexes[t.lower()] = [_cpp_string(s) for s in re.findall(r'"((?:[^"\\]|\\.)*)"', listed.group(1))]
    load = src[src.index('} else if (tokenizer_pre == "default") {'):src.index("unknown pre-tokenizer type")]
    names = {}
    for cond, body in re.findall(r"if \(((?:\s*tokenizer_pre == \"[^\"]+\"\s*\|*)+)\)\s*\{(.*?)\}", load, re.S):
        kind = re.search(r"LLAMA_VOCAB_PRE_TYPE_(\w+)", body).group(1).lower()
        flags = {f for f in ("ignore_merges", "add_bos", "escape_whitespaces") if f"{f} = true" in body}
        for name in re.findall(r'"([^"]+)"', cond):
            names[name] = (kind, flags)
    models = set(re.findall(r'tokenizer_model == "([^"]+)"', src))
    return regexes, names, models


def test_every_pre_tokenizer_name_llamacpp_knows_is_mapped_to_its_split():
    regexes, names, _ = _llamacpp_table()
    assert len(names) > 80
    assert set(NAMES) - {""} == set(names)
    for name, (kind, flags) in names.items():
        pre = NAMES[name]
        theirs = [_HAND_WRITTEN.get(r, r) for r in regexes[kind]]
        assert [_ours(r) for r in SPLITS[pre.type]] == theirs or kind == "kimi_k2", name
        assert (pre.ignore_merges, pre.add_bos, pre.escape_spaces) == tuple(
            f in flags for f in ("ignore_merges", "add_bos", "escape_whitespaces")), name


def test_every_vocabulary_kind_llamacpp_reads_is_built_or_refused_naming_why():
    *_, models = _llamacpp_table()
    assert models == set(BUILT_KINDS) | set(REFUSED_KINDS)


@pytest.mark.parametrize("name", ["no-such-pre", "gpt2"])
def test_an_unknown_pre_tokenizer_name_is_refused_naming_it(name):
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": name, "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"]}
    from dtorch.models.tokenizer import Tokenizer

    with pytest.raises(ModelError, match=f"x.gguf: tokenizer.ggml.pre '{name}' is not a pre-tokenizer llama.cpp"):
        Tokenizer.from_gguf(meta, source="x.gguf")


# --- transformers' GGUF conversion: a second reference ----------------------------------------------------------

# where transformers' reading of a vocabulary gives other ids than llama.cpp's (ours follows llama.cpp): which texts
_TRANSFORMERS_DIFFERS = {
    # its GGUFLlamaConverter puts no "▁" before a text that starts with a space (llama.cpp and SentencePiece do)
    "llama-spm": lambda text: text.startswith(" "),
    # its Digits pre-tokenizer splits ASCII digits only; llama.cpp's \p{N} split takes "½" for a digit too
    "starcoder": lambda text: "½" in text,
}


@pytest.mark.parametrize("name", ["llama-spm", "phi-3", "gpt-2", "starcoder"])
def test_transformers_gguf_conversion_gives_the_same_ids_where_it_gives_llamacpps(name):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(SUITE, gguf_file=f"ggml-vocab-{name}.gguf")
    ours = _tokenizer(name)
    differs = _TRANSFORMERS_DIFFERS.get(name, lambda _text: False)
    text = (DATA / "multilingual.txt").read_bytes().decode("utf-8")
    for s, want in [*_cases(name), (text, _reference()["multilingual"][name]["ids"])]:
        got = theirs.encode(s, add_special_tokens=False)
        assert (got != want) == differs(s), f"{name}: {s!r:.60}"
        if got == want:
            assert ours.encode(s, add_special_tokens=False) == got
            assert ours.decode(got, skip_special_tokens=False) == theirs.decode(got), f"{name}: {s!r:.60}"
    if not differs(text):
        assert ours.encode(text) == theirs.encode(text)  # BOS / EOS as each adds them
