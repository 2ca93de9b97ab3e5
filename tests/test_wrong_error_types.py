"""Issue #25's "wrong error types": each input that used to escape as a torch, Python or ``tokenizers`` error is a
``DtorchError`` naming it, raised where the input is given; and the tokenizer's byte view of tokens (what the server's
logprobs carry) and its length bound, against the text's own UTF-8 bytes and the real encoding."""

from __future__ import annotations

import gc
import re
import threading

import pytest
import torch
from gguf import GGUFValueType as V
from test_untrusted_files import _gguf_meta, _write_gguf

from dtorch import DtorchError, ModelError
from dtorch.core.errors import DeviceError, KernelFailure, LayoutError
from dtorch.graph import DeviceMesh, LogicalGraph
from dtorch.models import load_checkpoint
from dtorch.runtime import Runner


def _double(shape=(2, 3)) -> LogicalGraph:
    """y = x + x."""
    g = LogicalGraph(DeviceMesh.cpu(1))
    x = g.input("x", shape)
    g.output("y", g.call("binary.add", x, x))
    return g


def _dtorch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dtorch-")]


@pytest.mark.parametrize("static", [False, True])
def test_meta_and_sparse_feeds_are_refused_naming_the_feed(static):
    with Runner(_double(), static=static) as r:
        with pytest.raises(DeviceError, match="feed 'x' is a meta tensor"):
            r.run({"x": torch.empty(2, 3, device="meta")})
        with pytest.raises(LayoutError, match="feed 'x' is a torch.sparse_coo tensor"):
            r.run({"x": torch.eye(2, 3).to_sparse()})
        assert torch.equal(r.run({"x": torch.ones(2, 3)})["y"], torch.full((2, 3), 2.0))  # still runs


def test_a_meta_param_is_refused_when_given():
    g = LogicalGraph(DeviceMesh.cpu(1))
    with pytest.raises(DeviceError, match="param 'w': a meta tensor holds no values"):
        g.param("w", torch.empty(2, 3, device="meta"))


def test_a_static_input_too_large_to_allocate_names_the_input_and_leaks_no_thread():
    before = set(_dtorch_threads())
    g = _double(shape=(1 << 20, 1 << 20))  # 2**40 float32: 4 TiB
    with pytest.raises(DtorchError, match=r"buffer of input 'x' \(\[1048576, 1048576\] float32, 4398046511104 bytes\)"):
        Runner(g, static=True)
    gc.collect()
    assert set(_dtorch_threads()) <= before


def test_a_python_kernel_returning_a_meta_tensor_is_refused_naming_it():
    g = LogicalGraph(DeviceMesh.cpu(1))
    x = g.input("x", (2, 3))
    g.output("y", g.python(lambda t: torch.empty_like(t, device="meta"), x, shape=(2, 3), dtype=torch.float32,
                           name="hollow"))
    with Runner(g) as r, pytest.raises(KernelFailure, match=r"python.hollow#\d+: the Python kernel returned a tensor "
                                                            r"on meta, but it runs on cpu:0"):
        r.run({"x": torch.ones(2, 3)})


# -- GGUF tokenizers ------------------------------------------------------------------------------------------------

TOKENS = ["a", "b", "ab", "c"] + [f"t{i}" for i in range(28)]  # the tiny model's 32 ids


def _tokenizer_meta(**override) -> dict:
    meta = {"tokenizer.ggml.model": ("gpt2", V.STRING), "tokenizer.ggml.tokens": (TOKENS, V.ARRAY),
            "tokenizer.ggml.merges": (["a b"], V.ARRAY)}
    return _gguf_meta(**(meta | override))


def test_a_well_formed_gguf_tokenizer_loads(tmp_path):
    ckpt = load_checkpoint(_write_gguf(tmp_path / "m.gguf", _tokenizer_meta()))
    assert ckpt.tokenizer.encode("abc") == [2, 3]


@pytest.mark.parametrize("override, match", [
    ({"tokenizer.chat_template": (7, V.UINT32)}, r"tokenizer.chat_template must be a string .*got int 7"),
    ({"tokenizer.ggml.merges": (["ab"], V.ARRAY)}, r"tokenizer.ggml.merges\[0\] is 'ab'; a merge is two tokens"),
    ({"tokenizer.ggml.merges": (["a x"], V.ARRAY)}, r"tokenizer.ggml.merges do not fit tokenizer.ggml.tokens .*`x`"),
    ({"tokenizer.ggml.merges": ([3], V.ARRAY)}, r"tokenizer.ggml.merges\[0\] must be a string, got int 3"),
    ({"tokenizer.ggml.tokens": (["a", "b", "ab", "a"] + TOKENS[4:], V.ARRAY)},
     r"tokenizer.ggml.tokens spells token 3 'a' like token 0"),
])
def test_malformed_gguf_tokenizers_are_model_errors_naming_the_fault(tmp_path, override, match):
    from dtorch.models.loaders import load_gguf_tokenizer

    path = _write_gguf(tmp_path / "m.gguf", _tokenizer_meta(**override))
    with pytest.raises(ModelError, match=rf"m.gguf: {match}"):
        load_gguf_tokenizer(path)
    ckpt = load_checkpoint(path)  # the weights load; what needs text is refused, naming the fault
    assert ckpt.tokenizer is None and re.match(match, ckpt.tokenizer_error)


@pytest.fixture(scope="module")
def smollm_tokenizer():
    from dtorch.models.default import default_model_path
    from dtorch.models.loaders.gguf import load_gguf_tokenizer

    return load_gguf_tokenizer(default_model_path())


TEXTS = ["Hi 日本語 🎉🎉 done", "naïve café – “quotes” ∑ ✓", "<|im_end|> special, then 한국어 text", "  \n\t x"]


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_to_the_texts_utf8_bytes(smollm_tokenizer, text):
    tok = smollm_tokenizer
    ids = tok.encode(text)
    parts = [tok.token_bytes(i) for i in ids]
    assert b"".join(parts) == text.encode()
    if "🎉" in text:  # the vocabulary has no token for it: its 4 bytes come in pieces that are not UTF-8 alone
        assert any(not _utf8(p) for p in parts)


def _utf8(b: bytes) -> bool:
    """Whether ``b`` is UTF-8 text on its own."""
    return b.decode("utf-8", "replace").encode() == b


def test_min_tokens_is_a_lower_bound_of_the_encoding(smollm_tokenizer):
    tok = smollm_tokenizer
    texts = TEXTS + ["a" * 5000, " " * 5000, "\n" * 777, "-" * 4000, "🎉" * 300, "The quick brown fox. " * 200]
    for t in texts:
        assert 0 < tok.min_tokens(t) <= len(tok.encode(t)), t[:40]
    big = "word " * 200_000  # 1 MB: bounded in microseconds, far above an 8k context
    assert tok.min_tokens(big) > 8192
