"""Tokenizer from the default GGUF and from tokenizer.json, against transformers' tokenizers and chat templates."""

from __future__ import annotations

import gguf
import pytest
import transformers

from dtorch import ArgumentError, ModelError
from dtorch.models import Tokenizer, default_model_path, load_checkpoint
from dtorch.models.loaders.gguf import load_gguf_tokenizer, read_metadata
from tests.tiny_models import save_random, tiny_config

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnew\n\nlines\r\n  indented",
    "Ünïcödé: café, naïve, Ελληνικά, русский, 中文字符, 日本語のテキスト, 한국어",
    "emoji 🦙🔥 and a family 👨‍👩‍👧‍👦 and flags 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "",
    "a" * 50 + " " * 7 + "!!!???",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 👋"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "×3?"}],
]


@pytest.fixture(scope="module")
def meta() -> dict:
    return read_metadata(gguf.GGUFReader(str(default_model_path())), default_model_path())


@pytest.fixture(scope="module")
def ours(meta) -> Tokenizer:
    return Tokenizer.from_gguf(meta, chat_template=meta["tokenizer.chat_template"], source="default")


def test_load_gguf_tokenizer(tmp_path, meta):
    tok = load_gguf_tokenizer(default_model_path())
    assert tok.chat_template == meta["tokenizer.chat_template"] and tok.vocab_size == len(meta["tokenizer.ggml.tokens"])
    with pytest.raises(ModelError, match="no such file"):
        load_gguf_tokenizer(tmp_path / "none.gguf")


@pytest.fixture(scope="module")
def theirs():
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours, theirs, text):
    for special in (True, False):
        assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(ours, theirs, text):
    ids = theirs.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_special_ids_and_vocab(ours, theirs):
    assert ours.vocab_size == len(theirs) == 49152
    assert ours.bos_token_id == theirs.bos_token_id
    # the file's EOS, then the tokens llama.cpp 0.3.36 also ends generation at (llama_vocab_is_eog: ids 0, 2 and 4)
    assert ours.eos_token_ids == (theirs.eos_token_id, *theirs.convert_tokens_to_ids(["<reponame>", "<|endoftext|>"]))
    assert ours.token_to_id("<|im_end|>") == theirs.convert_tokens_to_ids("<|im_end|>")
    assert ours.id_to_token(ours.token_to_id("<|im_start|>")) == "<|im_start|>"


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(ours, theirs, messages, gen):
    ref = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours.apply_chat_template(messages, add_generation_prompt=gen) == ref


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_never_splits_characters(ours, theirs, text):
    ids = theirs.encode(text)
    dec = ours.stream_decoder(skip_special_tokens=False)
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) == theirs.decode(ids, skip_special_tokens=False)
    assert not any("\ufffd" in p for p in pieces)


def test_stream_decoder_holds_back_partial_utf8(ours):
    ids = ours.encode("🦙")
    assert len(ids) > 1  # a byte-level vocabulary spells this emoji in several tokens
    dec = ours.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🦙"


def test_ids_past_the_vocabulary_give_no_text(ours):
    """A model's embedding padded past its tokenizer (common in real checkpoints) may sample ids the tokenizer does
    not know: they decode to "" instead of failing mid-stream."""
    ids = ours.encode("Hello, world!")
    past = [ours.vocab_size, ours.vocab_size + 63]
    assert ours.decode([*ids[:2], *past, *ids[2:]]) == ours.decode(ids) == "Hello, world!"
    assert ours.decode(past) == ""
    dec = ours.stream_decoder()
    pieces = [dec.push(i) for i in [*ids[:2], past[0], *ids[2:], past[1]]]
    assert pieces[2] == pieces[-1] == "" and "".join(pieces) == "Hello, world!"


def test_bad_input(ours):
    with pytest.raises(ArgumentError, match=r"token ids must be >= 0, got \[-1\]"):
        ours.decode([1, -1])
    with pytest.raises(ArgumentError, match=r"StreamDecoder.push: token ids must be >= 0"):
        ours.stream_decoder().push(-3)
    with pytest.raises(ArgumentError, match="text must be a str"):
        ours.encode(["not", "a", "string"])
    with pytest.raises(ArgumentError, match="messages must be a list of"):
        ours.apply_chat_template([{"content": "no role"}])
    bare = Tokenizer(ours.backend, bos_token_id=None, eos_token_ids=(), chat_template=None, source="bare")
    with pytest.raises(ModelError, match="bare: the model has no chat template"):
        bare.apply_chat_template(CHATS[0])
    strict = Tokenizer(ours.backend, bos_token_id=None, eos_token_ids=(), source="strict",
                       chat_template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}"
                                     "{% endif %}{{ messages[0]['content'] }}")
    assert strict.apply_chat_template(CHATS[0]) == CHATS[0][0]["content"]
    with pytest.raises(ArgumentError, match="template rejected the messages: user first"):
        strict.apply_chat_template(CHATS[1])
    sandboxed = Tokenizer(ours.backend, bos_token_id=None, eos_token_ids=(), source="evil",
                          chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ModelError, match="evil: the chat template failed to render"):
        sandboxed.apply_chat_template(CHATS[0])


def test_unsupported_gguf_tokenizer():
    meta = {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(ModelError, match="tokenizer.ggml.model is 'bert': a WordPiece"):
        Tokenizer.from_gguf(meta, source="x.gguf")
    with pytest.raises(ModelError, match="tokenizer.ggml.model 'sentencepiece' is not a vocabulary llama.cpp reads"):
        Tokenizer.from_gguf(meta | {"tokenizer.ggml.model": "sentencepiece"}, source="x.gguf")
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "deepseek-koder", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(ModelError, match="tokenizer.ggml.pre 'deepseek-koder' is not a pre-tokenizer llama.cpp"):
        Tokenizer.from_gguf(meta, source="x.gguf")


def test_qwen2_pre_tokenizer_from_gguf(tmp_path, meta):
    """A GGUF stating the qwen2 pre-tokenizer (the default vocabulary under it) against transformers' reading."""
    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    qwen = Tokenizer.from_gguf(meta | {"tokenizer.ggml.pre": "qwen2"}, source="q.gguf")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="q.gguf")
    for text in TEXTS:
        assert qwen.encode(text) == ref.encode(text), text
    assert qwen.encode("abc 12345") == ref.encode("abc 12345")


def test_hf_directory_tokenizer(tmp_path, theirs):
    """tokenizer.json + tokenizer_config.json (+ chat template) written by transformers load with the checkpoint."""
    cfg = tiny_config(transformers, "llama", vocab_size=49152, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    save_random(transformers, cfg, tmp_path)
    theirs.save_pretrained(tmp_path)
    ck = load_checkpoint(tmp_path)
    tok = ck.tokenizer
    assert tok is not None and ck.chat_template is not None
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == theirs.bos_token_id
    for text in TEXTS:
        assert tok.encode(text) == theirs.encode(text), text
    for messages in CHATS:
        assert tok.apply_chat_template(messages) == theirs.apply_chat_template(messages, tokenize=False,
                                                                              add_generation_prompt=True)
