"""The check every family's own test runs (``tests/test_family_<name>.py``): a tiny random transformers model of the
family (its ``Family.tiny``), saved by ``save_pretrained`` and written as llama.cpp's converter writes it
(``tiny.write_gguf``), loaded from its directory, from its GGUF file and on two devices; and the same model with a
real tokenizer converted to F16 by llama.cpp's own converter (``tests/llamacpp_convert.py``), on one device and on two,
and quantized to Q8_0 by llama.cpp where llama-cpp-python is installed. Its logits and greedy ids must be transformers'
own (with its weights rounded to float16 for the converted file), and llama.cpp's for the quantized one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dtorch.engine.llm import LLM
from dtorch.engine.sampling import SamplingParams
from dtorch.models.config import ModelConfig
from dtorch.models.tiny import hf_greedy, save_random, tiny_config, write_gguf
from tests import llamacpp_convert

# "llamacpp": converted to F16 by llama.cpp's converter; "llamacpp_q8": that file quantized by llama.cpp to Q8_0
SOURCES = ("hf", "gguf", "hf_tp2", "llamacpp", "llamacpp_tp2", "llamacpp_q8")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
_MODELS: dict[str, tuple[Path, Any, list[list[int]]]] = {}  # family -> (its directory, the transformers model, ids)
_TOKENIZERS: dict[str, str] = {}  # family -> the tokenizer kind its converted checkpoint has (every family_test's)
_CONVERTED: dict[str, tuple[Path, Any, list[list[int]]]] = {}  # family -> (the F16 file, transformers rounded, ids)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt(19, 1), prompt(7, 2)]  # longer and shorter than the tiny models' sliding windows
TEXT = "Once upon a time, 🦙 saw 中文 and 3.14 apples"


def family_test(family: str, check: Callable[[ModelConfig, Any], None] = lambda config, hf: None,
                tokenizer: str = "spm"):
    """The test of ``family``, one case per source (``SOURCES``): the logits of a prompt and the batched greedy ids of
    ``PROMPTS`` against transformers'; then ``check(config, transformers model)`` on what was loaded. ``tokenizer``:
    the kind llama.cpp's converter reads for the family ("spm" or "gpt2", see ``llamacpp_convert.add_tokenizer``).
    Bind it to a ``test_*`` name in the family's test module."""
    _TOKENIZERS[family] = tokenizer

    @pytest.mark.parametrize("source", SOURCES)
    def test(source: str, tmp_path_factory) -> None:
        transformers = pytest.importorskip("transformers")
        pytest.importorskip("gguf")
        if source == "llamacpp_q8":
            return _check_quantized(family, transformers, tmp_path_factory)
        if source.startswith("llamacpp"):
            path, hf, want = _converted(family, transformers, tmp_path_factory)
        else:
            path, hf, want = _written(family, transformers, tmp_path_factory)
            path = path / "model.gguf" if source == "gguf" else path
        llm = LLM(str(path), max_num_seqs=2, tensor_parallel_size=2 if source.endswith("_tp2") else 1)
        try:
            with torch.no_grad():
                want_logits = hf(torch.tensor([PROMPTS[0]])).logits[0]
            torch.testing.assert_close(llm.logits(PROMPTS[0]), want_logits, rtol=1e-4,
                                       atol=1e-4 * float(want_logits.abs().max()))
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
            check(llm.config, hf)
        finally:
            llm.close()

    return test


def _written(family: str, transformers, tmp_path_factory) -> tuple[Path, Any, list[list[int]]]:
    """(the directory holding the saved checkpoint and our ``model.gguf``, the transformers model, its greedy ids),
    written once per session."""
    if family not in _MODELS:
        path = tmp_path_factory.mktemp(family)
        hf = save_random(transformers, tiny_config(transformers, family), path)
        write_gguf(hf, path / "model.gguf")
        _MODELS[family] = path, hf, [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    return _MODELS[family]


def _converted(family: str, transformers, tmp_path_factory) -> tuple[Path, Any, list[list[int]]]:
    """(the F16 file llama.cpp's converter made of the family's tiny checkpoint with a real tokenizer, the
    transformers model with the weights the file holds in float16 rounded so, its greedy ids). The first call converts
    every family a ``family_test`` declared, in one run of the converter."""
    if family not in _CONVERTED:
        llamacpp_convert.converter()  # skips here where it is missing
        made = {}
        for name, kind in _TOKENIZERS.items():
            if name in _CONVERTED:
                continue
            path = tmp_path_factory.mktemp(f"{name}-hf")
            config = tiny_config(transformers, name, vocab_size=llamacpp_convert.VOCAB[kind])
            made[name] = path, save_random(transformers, config, path)
            llamacpp_convert.add_tokenizer(path, kind)
        wait = llamacpp_convert.convert([(path, path / "model-f16.gguf", "f16") for path, _ in made.values()])
        done = {}
        for name, (path, hf) in made.items():  # the references, while the converter runs
            with torch.no_grad():  # the converter stores every matrix in float16, every vector in float32
                for p in hf.parameters():
                    if p.ndim > 1:
                        p.copy_(p.half().float())
            done[name] = path / "model-f16.gguf", hf, [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
        wait()
        _CONVERTED.update(done)
    return _CONVERTED[family]


def _check_quantized(family: str, transformers, tmp_path_factory) -> None:
    """The converted file quantized to Q8_0 by llama.cpp, run by llama.cpp and by dtorch: the same tokens of a text,
    logits of a prompt within what llama.cpp's Q8_0 rounding of the activations moves them by (up to 10% of the
    largest on these random models, where transformers on the F16 weights is as far from llama.cpp), and the same
    top token at 80% of the positions at least. A misread weight moves every logit by about the largest one."""
    python = llamacpp_convert.llamacpp_python()
    if python is None:
        pytest.skip("llama-cpp-python is not installed ($LLAMACPP_PYTHON or .venv-llamacpp, made by "
                    "../shared/tools/llamacpp-venv.sh): the Q8_0 file is quantized and checked by llama.cpp")
    f16, _, _ = _converted(family, transformers, tmp_path_factory)
    q8 = f16.with_name("model-q8_0.gguf")
    ref = llamacpp_convert.quantize_and_run(python, f16, q8, "Q8_0", PROMPTS[0], TEXT)
    llm = LLM(str(q8), max_num_seqs=1)
    try:
        assert llm.tokenizer.encode(TEXT, add_special_tokens=False) == ref["tokens"]
        want = torch.tensor(ref["logits"])
        got = llm.logits(PROMPTS[0])
        torch.testing.assert_close(got, want, rtol=0, atol=0.15 * float(want.abs().max()))
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
    finally:
        llm.close()
