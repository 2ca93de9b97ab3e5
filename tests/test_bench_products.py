"""``bench/gguf_formats.py``'s ``products``: each one-row product is called with x at the levels a decode step's bound
calls use (two by default, one under ``DTORCH_ONE_LEVEL=1``: products.py's ``_one_level``), so the per-format GB/s of
the two settings can be told apart. A Q8_0 weight quantized by gguf-py, packed by ``layouts.pack``; the calls go to
the real native ``qlinear`` through a recorder."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gguf_formats  # noqa: E402

N, K = 64, 256


class Recorder:
    def __init__(self, lib):
        self.lib, self.levels = lib, []

    def qlinear(self, x, w, code, bias, y, one_level):
        self.levels.append(one_level)
        self.lib.qlinear(x, w, code, bias, y, one_level)


def _model():
    from dtorch.kernels import layouts

    raw = gguf.quants.quantize(np.random.default_rng(0).standard_normal((N, K), dtype=np.float32),
                               gguf.GGMLQuantizationType.Q8_0)
    packed = layouts.pack(torch.from_numpy(np.ascontiguousarray(raw)), "gguf.q8_0", K)
    weight = SimpleNamespace(shape=(N, K), layout="gguf.q8_0", blobs={0: SimpleNamespace(tensor=packed)})
    return SimpleNamespace(model=SimpleNamespace(weights={"blk.0.ffn_up.weight": weight}))


@pytest.mark.parametrize("flag, level", [("", 0), ("1", 2)])
def test_products_follow_one_level(monkeypatch, flag: str, level: int):
    from dtorch.kernels.native import loader

    lib = loader._mod or loader.load()
    rec = Recorder(lib)
    monkeypatch.setattr(loader, "_mod", rec)
    monkeypatch.setenv("DTORCH_ONE_LEVEL", flag)
    rows = gguf_formats.products(_model(), passes=1)
    assert rec.levels == [level, level], rec.levels  # a warm-up pass and one timed pass
    assert [(r["layout"], r["n"], r["k"], r["count"]) for r in rows] == [("gguf.q8_0", N, K, 1)]
    assert rows[0]["gbs"] > 0
