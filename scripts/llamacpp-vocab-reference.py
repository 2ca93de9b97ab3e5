"""Record what llama.cpp itself does with the vocabularies of its tokenizer suite, for tests/test_gguf_vocabs.py:
whether its detokenizer gives each test string back (``llama_detokenize`` as its test-tokenizer-0 calls it), its ids
of tests/data/multilingual.txt (with and without BOS/EOS, special tokens parsed as dtorch's ``encode`` does), and the
tokens that end generation (``llama_vocab_is_eog``).

Run with llama-cpp-python 0.3.36 (the llama.cpp the suite comes from) after scripts/llamacpp-vocabs.py:

    python scripts/llamacpp-vocab-reference.py > tests/data/llamacpp_vocabs.json
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import llama_cpp as ll

SUITE = Path.home() / ".cache" / "dtorch" / "llamacpp-vocabs" / "0.3.36"
TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "multilingual.txt"
DECODERS = ("aquila", "baichuan", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2",
            "gpt-neox", "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder")


def tokenize(vocab, text: str, add_special: bool, parse_special: bool) -> list[int]:
    data = text.encode("utf-8")
    n = len(data) + 8
    buf = (ll.llama_token * n)()
    got = ll.llama_tokenize(vocab, data, len(data), buf, n, add_special, parse_special)
    assert got >= 0, got
    return list(buf[:got])


def detokenize(vocab, ids: list[int]) -> str | None:
    """llama_detokenize(remove_special=false, unparse_special=true), as common_detokenize(ctx, ids) calls it; None
    when the bytes are not UTF-8."""
    arr = (ll.llama_token * max(len(ids), 1))(*ids)
    n = 64 + 16 * len(ids)
    buf = ctypes.create_string_buffer(n)
    got = ll.llama_detokenize(vocab, arr, len(ids), buf, n, False, True)
    assert got >= 0, got
    try:
        return buf.raw[:got].decode("utf-8")
    except UnicodeDecodeError:
        return None


def cases(name: str) -> list[str]:
    raw = (SUITE / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    texts = raw.split("\n__ggml_vocab_test__\n")
    return texts[:-1] if texts[-1] == "" else texts


def main() -> int:
    ll.llama_backend_init()
    text = TEXT.read_bytes().decode("utf-8")
    out: dict = {"llama_cpp_python": ll.__version__, "round_trips": {}, "multilingual": {}, "end_of_generation": {}}
    for name in DECODERS:
        params = ll.llama_model_default_params()
        params.vocab_only = True
        model = ll.llama_model_load_from_file(str(SUITE / f"ggml-vocab-{name}.gguf").encode(), params)
        assert model, name
        vocab = ll.llama_model_get_vocab(model)
        if (SUITE / f"ggml-vocab-{name}.gguf.inp").is_file():
            out["round_trips"][name] = [detokenize(vocab, tokenize(vocab, s, False, False)) == s for s in cases(name)]
        ids = tokenize(vocab, text, False, True)
        out["multilingual"][name] = {"ids": ids, "with_special": tokenize(vocab, text, True, True),
                                     "round_trip": detokenize(vocab, ids) == text}
        n = ll.llama_vocab_n_tokens(vocab)
        out["end_of_generation"][name] = [i for i in range(n) if ll.llama_vocab_is_eog(vocab, i)]
        ll.llama_model_free(model)
    json.dump(out, sys.stdout, separators=(",", ":"))
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
