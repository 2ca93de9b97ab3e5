"""``dtorch info`` and ``dtorch bench`` run as subprocesses, their output checked against the GGUF reader, the
config.json and transformers' model; the KV cache ``info`` computes against the one the engine allocates; the
loading bar."""

from __future__ import annotations

import io
import json
import os
import statistics
import subprocess
import sys
from collections import Counter

import pytest
import torch

from tests.tiny_models import families, save_random, tiny_config

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _dtorch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtorch", *args], capture_output=True, text=True, timeout=300,
                          env=ENV)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Llama as a Hugging Face directory (float32) and as a GGUF file of Q8_0 matrices; returns
    (directory, transformers model)."""
    from dtorch.models.tiny import write_gguf

    path = tmp_path_factory.mktemp("tiny-llama")
    config = families(transformers, heads=4, kv_heads=2, vocab=128, qwen3_head_dim=16)["llama"]()
    hf = save_random(transformers, config, path)
    write_gguf(hf, path / "tiny.gguf", qtype=lambda _name: gguf.GGMLQuantizationType.Q8_0)
    return path, hf


def test_info_of_the_default_model_matches_its_gguf_file(capsys):
    from dtorch.cli import main
    from dtorch.models.default import default_model_path

    assert main(["info", "--ctx", "1000", "--json"]) == 0  # in this process (the tiny model's runs as a command)
    info = json.loads(capsys.readouterr().out)
    reader = gguf.GGUFReader(default_model_path())

    def field(key):
        f = reader.fields[key]
        return f.contents()

    arch = field("general.architecture")
    assert (info["family"], info["layers"], info["hidden_size"], info["intermediate_size"]) == (
        arch, field(f"{arch}.block_count"), field(f"{arch}.embedding_length"), field(f"{arch}.feed_forward_length"))
    assert (info["heads"], info["kv_heads"], info["context_length"]) == (field(f"{arch}.attention.head_count"),
                                                                         field(f"{arch}.attention.head_count_kv"),
                                                                         field(f"{arch}.context_length"))
    # each type of the file with its count; each format as loaded takes the bytes the file stores it in
    assert info["file_formats"] == dict(Counter(t.tensor_type.name for t in reader.tensors))
    stored = Counter()
    for t in reader.tensors:
        stored[t.tensor_type.name] += int(t.n_bytes)
    loaded = {fmt: f["bytes"] for fmt, f in info["formats"].items()}
    assert loaded == {("float32" if k == "F32" else f"gguf.{k.lower()}"): v for k, v in stored.items()}
    assert info["weight_bytes"] == sum(stored.values())
    # keys and values of every layer, in float32, for 1000 tokens in blocks of 16
    head_dim = field(f"{arch}.embedding_length") // field(f"{arch}.attention.head_count")
    per_token = 2 * field(f"{arch}.block_count") * field(f"{arch}.attention.head_count_kv") * head_dim * 4
    assert info["kv_bytes_per_token"] == per_token and info["kv_cache_bytes"] == per_token * 1008
    assert info["total_bytes"] == info["weight_bytes"] + info["kv_cache_bytes"]
    template = field("tokenizer.chat_template").strip().splitlines()
    assert info["chat_template"] == {"lines": len(template), "first_lines": template[:4]}
    assert info["kernels"]["matmul.linear [gguf.q4_1] float32"]["count"] > 0


def test_info_text_names_what_config_json_says(tiny, capsys):
    from dtorch.cli import main

    path, _ = tiny
    done = _dtorch("info", str(path), "--ctx", "100")
    assert done.returncode == 0, done.stderr
    config = json.loads((path / "config.json").read_text())
    lines = {line[:14].strip(): line[14:] for line in done.stdout.splitlines() if not line.startswith(" ")}
    assert lines["family"].startswith(f"llama, {config['num_hidden_layers']} layers")
    assert lines["shapes"] == (f"hidden {config['hidden_size']}, intermediate {config['intermediate_size']}, vocab "
                               f"{config['vocab_size']}; {config['num_attention_heads']} heads, "
                               f"{config['num_key_value_heads']} KV heads of "
                               f"{config['hidden_size'] // config['num_attention_heads']}")
    assert lines["context"] == f"{config['max_position_embeddings']} tokens"
    assert lines["chat template"] == "none"
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * 16 * 4
    assert f"KV cache {per_token * 112 / 2**20:.1f} MiB (float32, {per_token} bytes a token)" in lines["memory"]
    assert "matmul." in done.stdout and "llm.rms_norm" in done.stdout
    assert main(["info", str(path), "--ctx", "100000"]) == 2
    assert "--ctx 100000 is more than the model's 128 positions" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_the_cache_info_computes_is_the_one_the_engine_allocates(tiny, tmp_path, kind):
    from dtorch.engine.info import kv_cache_bytes
    from dtorch.engine.llm import LLM

    if kind == "llama":
        model = tiny[0]
    else:
        save_random(transformers, tiny_config(transformers, "qwen3_5_text"), tmp_path)
        model = tmp_path
    for ctx in (40, 64):
        llm = LLM(model, max_model_len=ctx, max_num_seqs=1)
        try:
            kv, state = kv_cache_bytes(llm.config, torch.float32, ctx)
            assert kv + state == llm.cache.nbytes
            assert (state > 0) == (kind == "hybrid")
        finally:
            llm.close()


def test_bench_json_has_a_median_row_per_test_and_batch(tiny):
    path, hf = tiny
    done = _dtorch("bench", "--model", str(path), "-p", "16,20", "-n", "4", "-b", "1", "-b", "3", "-t", "1", "-r", "2",
                   "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [(r["batch"], r["test"]) for r in rows] == [(b, t) for b in (1, 3) for t in ("pp16", "pp20", "tg4")]
    params = sum(p.numel() for p in hf.parameters())
    for r in rows:
        assert (r["model"], r["params"], r["threads"], r["tp"], r["device"]) == (path.name, params, 1, 1, "cpu")
        # every prompt token; every token after the first (which comes with the prompt's step)
        assert r["tokens"] == [r["batch"] * (r["n_prompt"] or r["n_gen"] - 1)] * 2
        assert r["tps"] == pytest.approx([n / s for n, s in zip(r["tokens"], r["seconds"], strict=True)])
        assert r["tps_median"] == pytest.approx(statistics.median(r["tps"])) and min(r["tps"]) > 0


def test_bench_prints_a_table_row_per_test(tiny, capsys):
    from dtorch.cli import main

    path, _ = tiny
    done = _dtorch("bench", "--model", str(path / "tiny.gguf"), "-p", "16", "-n", "4", "-t", "1", "-r", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[-5:] == ["test", "t/s (median)", "min - max", "load s", "warm-up s"] and len(lines) == 4
    for line, test in zip(lines[2:], ("pp16", "tg4"), strict=True):
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        assert cells["model"] == "tiny.gguf" and cells["test"] == test and float(cells["t/s (median)"]) > 0
        seconds, cache = cells["load s"].split()  # the Q8_0 file's packed weights: made, or read from the cache
        assert float(seconds) > 0 and cache in ("(miss)", "(hit)") and float(cells["warm-up s"]) > 0
    assert main(["bench", "--model", str(path), "-n", "1"]) == 2
    assert "-p/-n: a test's length is 0 (no such test) or at least 2 tokens" in capsys.readouterr().err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("file", ["", "tiny.gguf"])
def test_loading_shows_a_bar_on_a_terminal_only(tiny, monkeypatch, file):
    from dtorch.engine.llm import LLM

    for stderr in (_Terminal(), io.StringIO()):
        monkeypatch.setattr(sys, "stderr", stderr)
        llm = LLM(tiny[0] / file, max_model_len=32, max_num_seqs=1)
        llm.close()
        shown = stderr.getvalue()
        if stderr.isatty():
            weights = len({id(w) for w in llm.model.weights.values()})
            assert "loading weights" in shown and f"/{weights} [" in shown, shown  # tensors to load, in all
        else:
            assert shown == ""


def test_weight_bytes_count_tied_embeddings_once(tmp_path):
    """A Qwen2 GGUF with tied embeddings in Q8_0: the LM head is the packed embedding itself, so the weights take
    what the file's tensors take (gguf's reader), not one embedding more."""
    from dtorch.engine.info import weight_formats
    from dtorch.engine.llm import LLM
    from dtorch.models.tiny import write_gguf

    config = tiny_config(transformers, "qwen2")
    assert config.tie_word_embeddings
    write_gguf(save_random(transformers, config, tmp_path), tmp_path / "tied.gguf",
               qtype=lambda _name: gguf.GGMLQuantizationType.Q8_0)
    stored = sum(int(t.n_bytes) for t in gguf.GGUFReader(tmp_path / "tied.gguf").tensors)
    llm = LLM(tmp_path / "tied.gguf", max_model_len=32, max_num_seqs=1)
    try:
        assert llm.model.weight_bytes() == stored == sum(f["bytes"] for f in weight_formats(llm.model).values())
    finally:
        llm.close()
