"""A GGUF file whose vocabulary dtorch cannot build still runs: ``info``, ``bench`` and generation from token ids work
(greedy ids equal transformers'), a warning says once what is missing and why, and everything that needs text (text
prompts, chat, the server's text routes) is refused with that reason; ``info --model`` as every command takes it."""

from __future__ import annotations

import json
import logging

import pytest

from dtorch.core.errors import ArgumentError, ModelError
from tests.live_server import live_server
from tests.tiny_models import hf_greedy, save_random, tiny_config

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

PRE = "no-such-pre"  # a pre-tokenizer llama.cpp does not know either: the vocabulary cannot be built
PROMPT = [1, 5, 9, 33, 70]


def _vocabulary(pre: str, model: str = "gpt2") -> dict:
    """A byte-level BPE vocabulary of 128 tokens (the tiny model's) with the pre-tokenizer ``pre``."""
    V = gguf.GGUFValueType
    tokens = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(128)]
    return {"tokenizer.ggml.model": (model, V.STRING), "tokenizer.ggml.pre": (pre, V.STRING),
            "tokenizer.ggml.tokens": (tokens, V.ARRAY), "tokenizer.ggml.merges": (["a a"], V.ARRAY),
            "tokenizer.chat_template": ("{% for m in messages %}{{ m.content }}{% endfor %}", V.STRING)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the GGUF path, transformers' model) of a tiny Llama whose vocabulary has an unknown pre-tokenizer."""
    from dtorch.models.tiny import write_gguf

    path = tmp_path_factory.mktemp("no-vocabulary")
    hf = save_random(transformers, tiny_config(transformers, "llama"), path)
    write_gguf(hf, path / "m.gguf", metadata=_vocabulary(PRE))
    return path / "m.gguf", hf


@pytest.fixture(scope="module")
def llm(tiny):
    from dtorch import LLM

    llm = LLM(str(tiny[0]), max_num_seqs=2)
    yield llm
    llm.close()


def test_the_checkpoint_loads_without_a_tokenizer_and_says_why(tiny, tmp_path):
    from dtorch.models.loaders import load_gguf_tokenizer, open_checkpoint
    from dtorch.models.tiny import write_gguf

    with open_checkpoint(tiny[0]) as ckpt:
        assert ckpt.tokenizer is None and PRE in ckpt.tokenizer_error
        assert ckpt.chat_template is not None  # still there to show
    with pytest.raises(ModelError, match=PRE):  # the tokenizer alone: still refused
        load_gguf_tokenizer(tiny[0])
    other = tmp_path / "t5.gguf"  # a vocabulary kind dtorch does not build
    write_gguf(tiny[1], other, metadata=_vocabulary("default", model="no-such-model"))
    with open_checkpoint(other) as ckpt:
        assert ckpt.tokenizer is None and "no-such-model" in ckpt.tokenizer_error


def test_generation_from_ids_equals_transformers(llm, tiny):
    from dtorch import SamplingParams

    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == hf_greedy(tiny[1], PROMPT, 6)
    assert out.text == ""  # no tokenizer: no text


def test_text_and_chat_are_refused_naming_the_reason(llm):
    from dtorch import SamplingError, SamplingParams

    with pytest.raises(SamplingError, match="stop strings need the model's tokenizer"):  # no text to match them in
        llm.generate([PROMPT], SamplingParams(max_tokens=2, stop=["a"]))

    with pytest.raises(ModelError, match=rf"vocabulary could not be built \(.*{PRE}.*\), so text prompts is not"):
        llm.generate("hello", SamplingParams(max_tokens=2))
    with pytest.raises(ModelError, match=rf"{PRE}.*so chat is not available"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_the_warning_comes_once(tiny, caplog):
    from dtorch import LLM
    from dtorch.engine import llm as llm_module

    llm_module._said.clear()
    with caplog.at_level(logging.WARNING, logger="dtorch.models"):
        for _ in range(2):
            LLM(str(tiny[0]), max_num_seqs=1).close()
    said = [r.getMessage() for r in caplog.records if PRE in r.getMessage()]
    assert len(said) == 1 and "runs on token ids only" in said[0]


def test_info_and_bench_run_and_info_takes_model(tiny, capsys):
    from dtorch.cli import main

    path = str(tiny[0])
    assert main(["info", "--model", path, "--json"]) == 0
    by_option = json.loads(capsys.readouterr().out)
    assert by_option["model"] == path and by_option["tokenizer"] is None and PRE in by_option["tokenizer_error"]
    assert main(["info", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == by_option
    assert main(["info", path]) == 0
    assert f"tokenizer     none: the vocabulary could not be built (tokenizer.ggml.pre '{PRE}'" in \
        capsys.readouterr().out.replace('"', "'")
    assert main(["info", path, "--model", path + "x"]) == 2
    assert "two models given" in capsys.readouterr().err
    assert main(["bench", "--model", path, "-p", "8", "-n", "4", "-t", "1", "-r", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["test"] for r in rows] == ["pp8", "tg4"] and all(r["tps_median"] > 0 for r in rows)


def test_generate_cli_takes_ids_and_refuses_text(tiny, capsys):
    from dtorch.cli import main

    path = str(tiny[0])
    assert main(["generate", "--model", path, "--prompt-ids", ",".join(map(str, PROMPT)), "--temperature", "0",
                 "--max-tokens", "5", "--ignore-eos"]) == 0
    printed = capsys.readouterr().out.split()
    assert [int(i) for i in printed] == hf_greedy(tiny[1], PROMPT, 5)
    for command in (["generate", "--model", path, "hello"], ["chat", "--model", path]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "vocabulary could not be built" in err and PRE in err
    with pytest.raises(SystemExit, match="2"):  # argparse's usage error
        main(["generate", "--model", path, "--prompt-ids", "1,x"])
    assert "expected token ids" in capsys.readouterr().err


def test_the_server_refuses_text_with_400_and_serves_ids(llm):
    with live_server(llm) as post:
        for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/tokenize", {"prompt": "hi"})):
            status, r = post(path, body)
            assert status == 400 and PRE in r["error"]["message"], (path, r)
        status, r = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
        assert status == 200 and r["usage"]["completion_tokens"] == 3, r


def test_read_prompt_takes_one_source():
    import argparse

    from dtorch.engine.cli import read_prompt

    args = argparse.Namespace(prompt="a", file=None, prompt_ids=[1, 2])
    with pytest.raises(ArgumentError, match="one of them"):
        read_prompt(args)
