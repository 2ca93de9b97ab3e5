"""``bench/_roofline.py``: the bytes a decode step reads, counted from a GGUF file gguf-py writes here with known
tensors (their bytes: numpy's ``nbytes`` of what was written) and a known shape, tied head and not."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _roofline  # noqa: E402

LAYERS, HEADS, KV_HEADS, WIDTH, VOCAB, FFN = 2, 4, 2, 64, 100, 96


def _write(path: Path, tied: bool, key_length: int | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": rng.standard_normal((VOCAB, WIDTH), dtype=np.float32),
               "output_norm.weight": np.ones(WIDTH, np.float32)}
    if not tied:
        tensors["output.weight"] = rng.standard_normal((VOCAB, WIDTH)).astype(np.float16)
    kv = KV_HEADS * (key_length or WIDTH // HEADS)
    for i in range(LAYERS):
        for name, shape in (("attn_q", (WIDTH, WIDTH)), ("attn_k", (kv, WIDTH)), ("attn_v", (kv, WIDTH)),
                            ("attn_output", (WIDTH, WIDTH)), ("ffn_up", (FFN, WIDTH)), ("ffn_down", (WIDTH, FFN))):
            tensors[f"blk.{i}.{name}.weight"] = rng.standard_normal(shape).astype(np.float16)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_embedding_length(WIDTH)
    if key_length:
        w.add_key_length(key_length)
        w.add_value_length(key_length)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.mark.parametrize("tied", [False, True])
def test_step_bytes_count_every_weight_once_and_one_embedding_row(tmp_path, tied):
    tensors = _write(tmp_path / "m.gguf", tied)
    got = _roofline.step_bytes(tmp_path / "m.gguf", position=150)
    embedding = tensors["token_embd.weight"]
    total = sum(t.nbytes for t in tensors.values())
    want = total if tied else total - embedding.nbytes + embedding.nbytes // VOCAB
    assert got["weights"] == want
    assert got["tied"] == float(tied)
    assert got["kv"] == LAYERS * KV_HEADS * 2 * (WIDTH // HEADS) * 2 * 150  # keys and values, 2 bytes each
    assert got["bytes"] == got["weights"] + got["kv"]


def test_step_bytes_read_the_key_length_when_the_file_gives_it(tmp_path):
    _write(tmp_path / "m.gguf", tied=False, key_length=32)
    assert _roofline.step_bytes(tmp_path / "m.gguf", position=10, kv_element=4)["kv"] == LAYERS * KV_HEADS * 64 * 4 * 10


def test_a_row_puts_each_engine_against_the_roof():
    step = {"weights": 4e8, "kv": 1e6, "bytes": 4.01e8, "tied": 1.0}
    row = dict(zip(_roofline.COLUMNS, _roofline.row("f", 2, step, 40.1, 50.0, 80.0, read_4k=20.05), strict=True))
    assert row["roof tok/s"] == pytest.approx(100.0)
    assert row["lcpp / roof"] == pytest.approx(0.5) and row["dtorch / roof"] == pytest.approx(0.8)
    assert row["lcpp / roof 4K"] == pytest.approx(1.0)
    assert row[f"{_roofline.TARGET}x lcpp / roof"] == pytest.approx(_roofline.TARGET * 0.5)
    assert _roofline.row("f", 1, step, None, 50.0, 80.0)[4] is None  # no read rate: no roof
