"""The check every family's own test runs (``tests/test_family_<name>.py``): a tiny random transformers model of the
family (its ``Family.tiny``), saved by ``save_pretrained`` and written as llama.cpp's converter writes it
(``tiny.write_gguf``), loaded from its directory, from its GGUF file and on two devices; and the same model with a
real tokenizer converted by llama.cpp's own converter (``tests/llamacpp_convert.py``) to F16 (on one device and on two)
and to Q8_0, and quantized to Q8_0 by llama.cpp where llama-cpp-python is installed. Its logits and greedy ids must be
transformers' own (on its weights rounded as each converted file stores them), and llama.cpp's for the quantized
one."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import dtorch
from dtorch.engine.llm import LLM
from dtorch.engine.sampling import SamplingParams
from dtorch.models.config import ModelConfig
from dtorch.models.tiny import hf_greedy, save_random, tiny_config, write_gguf
from tests import llamacpp_convert

# "convert_*": converted by llama.cpp's converter to F16 (on one device and two) and to Q8_0; "quantize_q8_0": the F16
# file quantized to Q8_0 by llama.cpp's quantizer
SOURCES = ("hf", "gguf", "hf_tp2", "convert_f16", "convert_f16_tp2", "convert_q8_0", "quantize_q8_0")
_OUTTYPES = ("f16", "q8_0")  # the converter's outputs, each checked against transformers on weights rounded alike
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
_MODELS: dict[str, tuple[Path, Any, list[list[int]]]] = {}  # family -> (its directory, the transformers model, ids)
_TOKENIZERS: dict[str, str] = {}  # family -> the tokenizer kind its converted checkpoint has (every family_test's)
# (family, outtype) -> (the converted file, transformers on its weights, its greedy ids)
_CONVERTED: dict[tuple[str, str], tuple[Path, Any, list[list[int]]]] = {}


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt(19, 1), prompt(7, 2)]  # longer and shorter than the tiny models' sliding windows
TEXT = "Once upon a time, 🦙 saw 中文 and 3.14 apples"


def family_test(family: str, check: Callable[[ModelConfig, Any], None] = lambda config, hf: None,
                tokenizer: str = "spm", converted_tp2: bool = False):
    """The test of ``family``, one case per source (``SOURCES``): the logits of a prompt and the batched greedy ids of
    ``PROMPTS`` against transformers'; then ``check(config, transformers model)`` on what was loaded. ``tokenizer``:
    the kind llama.cpp's converter reads for the family ("spm" or "gpt2", see ``llamacpp_convert.add_tokenizer``).
    ``converted_tp2``: the converted F16 file on two devices too (``hf_tp2`` covers tensor parallelism for every
    family; one whose difference spans heads asks for it). Bind it to a ``test_*`` name in the family's test module."""
    _TOKENIZERS[family] = tokenizer

    @pytest.mark.parametrize("source", [s for s in SOURCES if converted_tp2 or s != "convert_f16_tp2"])
    def test(source: str, tmp_path_factory) -> None:
        transformers = pytest.importorskip("transformers")
        pytest.importorskip("gguf")
        if source == "quantize_q8_0":
            return _check_quantized(family, transformers, tmp_path_factory)
        if source.startswith("convert_"):
            path, hf, want = _converted(family, source.removeprefix("convert_").removesuffix("_tp2"), transformers,
                                        tmp_path_factory)
        else:
            path, hf, want = _written(family, transformers, tmp_path_factory)
            path = path / "model.gguf" if source == "gguf" else path
        # the native kernels multiply Q8_0 blocks by activations rounded to 8 bits, as llama.cpp does (their accuracy
        # is tests/test_llamacpp_files.py's); the reference kernels read the blocks and multiply in float32
        with dtorch.dispatcher.disabled(*(("native",) if source == "convert_q8_0" else ())):
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


def _converted(family: str, outtype: str, transformers, tmp_path_factory) -> tuple[Path, Any, list[list[int]]]:
    """(the ``outtype`` file llama.cpp's converter made of the family's tiny checkpoint with a real tokenizer, the
    transformers model with its weights rounded as the file holds them, its greedy ids). The first call converts
    every family a ``family_test`` declared to every one of ``_OUTTYPES``, in one run of the converter."""
    if (family, outtype) not in _CONVERTED:
        llamacpp_convert.converter()  # skips here where it is missing
        made = {}
        for name, kind in _TOKENIZERS.items():
            if (name, outtype) in _CONVERTED:
                continue
            path = tmp_path_factory.mktemp(f"{name}-hf")
            config = tiny_config(transformers, name, vocab_size=llamacpp_convert.VOCAB[kind])
            made[name] = path, save_random(transformers, config, path)
            llamacpp_convert.add_tokenizer(path, kind)
        wait = llamacpp_convert.convert([(path, path / f"model-{t}.gguf", t) for path, _ in made.values()
                                         for t in _OUTTYPES])
        done = {}
        for name, (path, hf) in made.items():  # the references, while the converter runs
            for t in _OUTTYPES:
                ref = _rounded(hf, t)
                done[name, t] = path / f"model-{t}.gguf", ref, [hf_greedy(ref, p, GREEDY.max_tokens) for p in PROMPTS]
        wait()
        _CONVERTED.update(done)
    return _CONVERTED[family, outtype]


def _rounded(hf, outtype: str):
    """A copy of the transformers model ``hf`` with every matrix rounded as the converter stores it in an ``outtype``
    file (every vector stays float32): to float16, or through gguf-py's Q8_0 blocks of 32 along each row (llama.cpp's
    q/k row permutation moves whole rows, so it commutes with them)."""
    import gguf

    out = copy.deepcopy(hf)
    with torch.no_grad():
        for p in out.parameters():
            if p.ndim < 2:
                continue
            if outtype == "f16":
                p.copy_(p.half().float())
            else:
                Q = gguf.GGMLQuantizationType.Q8_0
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), Q), Q)))
    return out


def _check_quantized(family: str, transformers, tmp_path_factory) -> None:
    """The converted file quantized to Q8_0 by llama.cpp, run by llama.cpp and by dtorch: the same tokens of a text,
    logits of a prompt within what llama.cpp's Q8_0 rounding of the activations moves them by (up to 10% of the
    largest on these random models, where transformers on the F16 weights is as far from llama.cpp), and the same
    top token at 80% of the positions at least. A misread weight moves every logit by about the largest one."""
    python = llamacpp_convert.llamacpp_python()
    if python is None:
        pytest.skip("llama-cpp-python is not installed ($LLAMACPP_PYTHON or .venv-llamacpp, made by "
                    "../shared/tools/llamacpp-venv.sh): the Q8_0 file is quantized and checked by llama.cpp")
    f16, _, _ = _converted(family, "f16", transformers, tmp_path_factory)
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
