"""The 16-row interleaved layouts ("gguf.q8_0x16", "gguf.q5_0x16": the Q8_0 / Q5_0 projections where AVX-512 VNNI runs
them) against references no one here wrote: gguf's dequantization (and torch's matmul over it), and the row layout's
products bit for bit on every ISA path; the loader's choice (AVX-512 VNNI only, forced off: the row layout) and the
pack cache's entry made on the other choice rebuilt."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pack_load import load_packed
from quant_bytes import gguf_bytes, gguf_reference

import dtorch.kernels.native as nk
from dtorch.core import cpu
from dtorch.core.errors import ShapeError
from dtorch.kernels import layouts

X16 = {"gguf.q8_0x16": "gguf.q8_0", "gguf.q5_0x16": "gguf.q5_0"}
# (N, K): K / 32 = 20 (a whole super-group and a last one of 4 blocks), 28 (16 + 12: Qwen2.5's K = 896), 32 (two)
SHAPES = [(32, 640), (48, 896), (16, 1024)]
_REASON = nk.unavailable_reason()
native = pytest.mark.skipif(_REASON is not None, reason=f"native kernels unavailable: {_REASON}")


@pytest.mark.parametrize("x16", X16)
def test_pack_and_dequantize_equal_gguf(x16):
    """The interleaved bytes hold the weight gguf dequantizes, bit for bit, and turn back into the row layout."""
    base, gen = X16[x16], np.random.default_rng(0)
    for n, k in SHAPES:
        raw = torch.from_numpy(gguf_bytes(base, n, k, gen))
        packed = layouts.pack(raw, x16, k)
        rows = layouts.pack(raw, base, k)
        assert packed.shape == rows.shape and not torch.equal(packed, rows)  # the same bytes, moved
        assert torch.equal(layouts.x16_rows(packed, x16, k), rows)
        assert torch.equal(layouts.dequantize(packed, x16, k), gguf_reference(base, raw.numpy(), n, k))


def test_partial_groups_are_refused():
    raw = torch.from_numpy(gguf_bytes("gguf.q8_0", 24, 640, np.random.default_rng(1)))
    with pytest.raises(ShapeError, match="16 rows"):
        layouts.pack(raw, "gguf.q8_0x16", 640)
    raw = torch.from_numpy(gguf_bytes("gguf.q5_0", 16, 96, np.random.default_rng(1)))
    with pytest.raises(ShapeError, match="multiple of 64"):
        layouts.pack(raw, "gguf.q5_0x16", 96)
    assert not layouts.x16_fits(24, 640) and not layouts.x16_fits(16, 96) and layouts.x16_fits(32, 896)


@native
@pytest.mark.parametrize("x16", X16)
def test_native_pack_is_layouts_pack_bit_for_bit(x16):
    """Every bit pattern of scales, fifth bits and quants (random bytes), rows given as a strided view."""
    from dtorch.kernels.native.repack import repack

    base, g = X16[x16], torch.Generator().manual_seed(0)
    size = layouts.gguf_block_bytes(base)
    for n, k in SHAPES:
        raw = torch.randint(0, 256, (n, 2 * k // 32 * size), dtype=torch.uint8, generator=g)[:, :k // 32 * size]
        assert torch.equal(repack(raw, x16, k), layouts.pack(raw.contiguous(), x16, k)), (x16, k)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x16", X16)
def test_qlinear_is_the_row_layouts_bit_for_bit(x16, dtype, isa):
    """1, 2, 3 rows of x (the interleaved kernels on AVX-512 VNNI), 17 (rows turned back per thread), 17 coarse (one
    level) and a prompt past the float panels' threshold: the row layout's output bit for bit, with a bias, and
    within the two levels' error of gguf's dequantized weight times x in float64."""
    base, gen = X16[x16], np.random.default_rng(3)
    torch.manual_seed(3)
    for n, k in SHAPES:
        raw = gguf_bytes(base, n, k, gen)
        w16, wrow = layouts.pack(torch.from_numpy(raw), x16, k), layouts.pack(torch.from_numpy(raw), base, k)
        wref = gguf_reference(base, raw, n, k).double()
        bias = torch.randn(n).to(dtype)
        for m, coarse in ((1, False), (2, False), (3, False), (17, False), (17, True), (300, False)):
            x = torch.randn(m, k).to(dtype)
            got = nk.qlinear(x, w16, x16, bias, one_level=coarse)
            assert torch.equal(got, nk.qlinear(x, wrow, base, bias, one_level=coarse)), (x16, isa, n, k, m, coarse)
            ref = x.double() @ wref.T + bias.double()
            nmse = float(((got.double() - ref) ** 2).sum() / (ref ** 2).sum())
            assert nmse < (1e-3 if coarse or dtype == torch.bfloat16 else 1e-5), (x16, isa, m, coarse, nmse)


@native
def test_qlinear_refuses_partial_groups():
    w = layouts.pack(torch.from_numpy(gguf_bytes("gguf.q8_0", 32, 640, np.random.default_rng(1))), "gguf.q8_0x16", 640)
    with pytest.raises(ShapeError, match="multiple of 16"):
        nk.qlinear(torch.randn(1, 640), w[:24], "gguf.q8_0x16")


# -- the loader's choice and the pack cache -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> Path:
    """A tiny Qwen2 (tied head) with Q8_0 and Q5_0 projections (q, k Q5_0, v Q8_0: a fused qkv in two parts) and a
    Q8_0 embedding."""
    gguf = pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    from dtorch.models.tiny import write_gguf
    from tests.tiny_models import save_random, tiny_config

    Q = gguf.GGMLQuantizationType
    path = tmp_path_factory.mktemp("tiny-x16") / "tiny.gguf"
    hf = save_random(transformers, tiny_config(transformers, "qwen2"), path.parent)
    write_gguf(hf, path, qtype=lambda name: Q.Q8_0 if "token_embd" in name or "attn_v" in name or "ffn" in name
               else Q.Q5_0)
    return path


@native
def test_loader_interleaves_projections_only_on_avx512_and_the_cache_follows(quantized, tmp_path, monkeypatch):
    """On AVX-512 VNNI the Q8_0 / Q5_0 projections load interleaved, the embedding (the tied head) in rows; with
    AVX-512 VNNI forced off (DTORCH_CPU_FEATURES=-avx512_vnni's in-process form) all in rows. The pack cache's entry
    made on one choice is stale on the other and rebuilt; the logits agree with the row layout's."""
    monkeypatch.setenv("DTORCH_PACK_CACHE_DIR", str(tmp_path / "packed"))
    monkeypatch.delenv("DTORCH_PACK_CACHE", raising=False)
    with nk.use_isa("auto"):
        with cpu.forced(avx512_vnni=False):
            rows, logits_rows, status = load_packed(quantized, [3, 17, 5, 42])
        assert status == "miss"
        packed = {v for v, _ in rows.values() if v.startswith("gguf.")}
        assert packed and not packed & set(X16), rows  # every packed weight in its row layout
        found, logits, status = load_packed(quantized, [3, 17, 5, 42])
        if nk.isa() != "avx512":  # the CPU, or DTORCH_CPU_FEATURES=-avx512, rules AVX-512 VNNI out: rows again
            assert status == "hit" and found == rows and torch.equal(logits, logits_rows)
            return
        assert status == "stale", "an entry packed in rows must not serve the interleaved choice"
        for name, (layout, shape) in found.items():
            was = rows[name][0]
            k = shape[-1]
            if name.endswith("embed") or name == "lm_head" or was not in X16.values() or \
                    not (layouts.x16_fits(*shape) and layouts.x16_pays(was, k)):
                assert layout == was, name  # the embedding (and the head tied to it), other formats, partial groups
            else:
                assert layout == layouts.x16_of(was), (name, layout)
        assert "gguf.q5_0x16" in {layout for layout, _ in found.values()}  # (Q8_0 here: K = 64, kept in rows)
        torch.testing.assert_close(logits, logits_rows, rtol=1e-2, atol=1e-3)  # AVX2's kernels against AVX-512's
        with monkeypatch.context() as m:  # the row layout on AVX-512 VNNI: the same logits bit for bit
            m.setattr("dtorch.kernels.native.repack.x16_wanted", lambda dtype: False)
            m.setenv("DTORCH_PACK_CACHE", "0")
            plain, same, _ = load_packed(quantized, [3, 17, 5, 42])
        assert {layout for layout, _ in plain.values()} == {layout for layout, _ in rows.values()}
        assert torch.equal(same, logits)
        _, again, status = load_packed(quantized, [3, 17, 5, 42])
        assert status == "hit" and torch.equal(again, logits)
        with cpu.forced(avx512_vnni=False):
            back, _, status = load_packed(quantized, [3, 17, 5, 42])
        assert status == "stale" and back == rows
