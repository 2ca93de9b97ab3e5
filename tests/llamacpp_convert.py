"""Tiny checkpoints as llama.cpp's own tools make GGUF files of them: its converter (``convert_hf_to_gguf.py``, kept by
``scripts/llamacpp-vocabs.py`` from llama-cpp-python's source release) and, where llama-cpp-python is installed, its
quantizer, with llama.cpp's own logits of the quantized file as the reference.

The converter reads a checkpoint's tokenizer as its family's model does: a SentencePiece ``tokenizer.model`` (Llama,
Granite, SmolLM3, Gemma 2), or a BPE ``tokenizer.json`` whose pre-tokenizer it recognizes by the ids of a fixed text
(OLMo 2): ``add_tokenizer`` writes one of each kind, a SentencePiece model trained here and GPT-2's BPE vocabulary from
llama.cpp's tokenizer suite.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

SUITE = Path.home() / ".cache" / "dtorch" / "llamacpp-vocabs" / "0.3.36"
CONVERTER = SUITE / "convert" / "convert_hf_to_gguf.py"
TEXT = Path(__file__).parent / "data" / "multilingual.txt"
# tokenizer kind -> the vocabulary size a checkpoint needs for it (the converter refuses ids past vocab_size)
VOCAB = {"spm": 1280, "gpt2": 50257}


def converter() -> Path:
    """The converter's script; the test skips, saying how to get it, where it is missing."""
    if not CONVERTER.is_file():
        pytest.skip(f"llama.cpp's converter is not at {CONVERTER}: run `python scripts/llamacpp-vocabs.py` (the "
                    "README's set-up command does)")
    return CONVERTER


def add_tokenizer(directory: Path, kind: str) -> None:
    """Write a tokenizer of ``kind`` into the checkpoint ``directory``: "spm", a byte-fallback SentencePiece BPE model
    of ``VOCAB["spm"]`` pieces trained on tests/data/multilingual.txt (``tokenizer.model``); "gpt2", GPT-2's BPE
    (``tokenizer.json`` built with the tokenizers library from the suite's ggml-vocab-gpt-2.gguf: its tokens and
    merges, byte-level pre-tokenization), which the converter knows by its ids of its test text."""
    if kind == "spm":
        spm = pytest.importorskip("sentencepiece", reason="the converter reads SentencePiece vocabularies with it")
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(TEXT.read_text(encoding="utf-8").splitlines()), model_writer=model,
            vocab_size=VOCAB["spm"], model_type="bpe", byte_fallback=True, character_coverage=1.0, minloglevel=2)
        (directory / "tokenizer.model").write_bytes(model.getvalue())
    elif kind == "gpt2":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        from dtorch.models.loaders.gguf_header import _open, read_metadata  # gguf-py's reader, without its 8 s parse

        path = SUITE / "ggml-vocab-gpt-2.gguf"
        meta = read_metadata(_open(path), path)
        tokens, merges = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"]
        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.save(str(directory / "tokenizer.json"))
    else:
        raise ValueError(f"add_tokenizer: kind must be one of {sorted(VOCAB)}, got {kind!r}")


# runs the converter's main() once per (checkpoint, output file, type), in one process: its import of torch and
# transformers is most of a conversion's time
_CONVERT = r"""
import json, sys
jobs = json.loads(sys.argv[2])
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf
for model, out, outtype in jobs:
    sys.argv = ["convert_hf_to_gguf.py", "--outtype", outtype, "--outfile", out, model]
    convert_hf_to_gguf.main()
"""


def convert(jobs: list[tuple[Path, Path, str]]) -> Callable[[], None]:
    """Start converting each (checkpoint directory, GGUF file, outtype: "f32", "f16", "bf16" or "q8_0") with llama.cpp's
    converter, all in one process; returns the wait for it (which fails with the converter's last lines when it
    refused one). Work done before the wait overlaps the converter's."""
    script = converter()
    args = json.dumps([[str(model), str(out), outtype] for model, out, outtype in jobs])
    proc = subprocess.Popen([sys.executable, "-c", _CONVERT, str(script.parent), args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)

    def wait() -> None:
        _, err = proc.communicate(timeout=300)
        if proc.returncode or not all(out.is_file() for _, out, _ in jobs):
            hint = ""
            if "tokenizer" in err:  # e.g. tiktoken failing to parse a SentencePiece tokenizer.model as BPE ranks
                hint = (" (a family whose converter reads a BPE tokenizer.json only fails on the SentencePiece "
                        "tokenizer.model: give its test family_test(..., tokenizer=\"gpt2\"), docs/adding-a-family.md "
                        "step 7)")
            pytest.fail("llama.cpp's converter failed: " + " | ".join(err.strip().splitlines()[-6:]) + hint)

    return wait


def llamacpp_python() -> str | None:
    """A Python with llama-cpp-python installed (``$LLAMACPP_PYTHON``, else this checkout's ``.venv-llamacpp``, as
    ``../shared/tools/llamacpp-venv.sh`` makes it), or None."""
    root = Path(__file__).resolve().parent.parent
    for candidate in (os.environ.get("LLAMACPP_PYTHON"), str(root / ".venv-llamacpp" / "bin" / "python")):
        if candidate and Path(candidate).is_file():
            if subprocess.run([candidate, "-c", "import llama_cpp"], capture_output=True).returncode == 0:
                return candidate
    return None


# quantizes argv[1] to argv[2] (preset argv[3]) with llama.cpp, then runs the quantized file: prints its logits of
# every position of the ids argv[4] and its tokens of the text argv[5], as JSON
_QUANTIZE_AND_RUN = r"""
import ctypes, json, sys
import llama_cpp
src, dst, preset, ids, text = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + preset)
params.nthread = 1
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
if rc:
    sys.exit(f"llama_model_quantize returned {rc}")
llm = llama_cpp.Llama(dst, n_ctx=64, n_batch=64, n_threads=1, logits_all=True, verbose=False)
llm.eval(ids)
print(json.dumps({"logits": [list(map(float, row)) for row in llm.scores[:len(ids)]],
                  "tokens": llm.tokenize(text.encode(), add_bos=False, special=False)}))
"""


def quantize_and_run(python: str, src: Path, dst: Path, preset: str, ids: list[int], text: str) -> dict:
    """``src`` quantized to ``preset`` (a LLAMA_FTYPE_MOSTLY_* name: "Q8_0" ...) into ``dst`` by llama.cpp, which then
    runs it: {"logits": [[float]] of each position of ``ids``, "tokens": its ids of ``text`` (no BOS)}."""
    proc = subprocess.run([python, "-c", _QUANTIZE_AND_RUN, str(src), str(dst), preset, json.dumps(ids), text],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode:
        pytest.fail("llama.cpp could not quantize or run the file: " + " | ".join(proc.stderr.splitlines()[-4:]))
    return json.loads(proc.stdout.strip().splitlines()[-1])
