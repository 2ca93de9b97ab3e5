"""The native CPU kernels (dtorch.kernels.native) against references no one here wrote: gguf's dequantize for the
quantized products, torch for the float GEMV and the fused decode ops; every ISA path this CPU runs.

The first run compiles the kernels into the cache (~20 s); later runs load them.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from quant_bytes import gguf_bytes, gguf_reference, qtype

import dtorch.kernels.native as nk
from dtorch.core import cpu
from dtorch.core.device import Device
from dtorch.core.dtypes import GGUF_LAYOUTS
from dtorch.core.errors import ArgumentError, DTypeError, LayoutError, ShapeError
from dtorch.dispatch.context import KernelContext, KernelParams
from dtorch.dispatch.key import KernelKey
from dtorch.dispatch.meta import Call
from dtorch.dispatch.registry import Dispatcher
from dtorch.kernels import layouts
from dtorch.kernels.native.build import cache_key
from dtorch.kernels.torch import (
    causal_conv1d as torch_conv,
    gated_delta_net as torch_gdn,
    llm as torch_llm,
    moe as torch_moe,
)
from dtorch.ops.binary import mul

_REASON = nk.unavailable_reason()
# the tests of the compiled kernels; the layouts and the fallback path run without them
native = pytest.mark.skipif(_REASON is not None, reason=f"native kernels unavailable: {_REASON}")
# two intra-op threads (conftest gives one): the kernels split a product's rows among threads, and the results below
# (against gguf-py, each row alone, the portable path) must hold under the split
pytestmark = pytest.mark.usefixtures("two_threads")


# -- weights (tests/quant_bytes.py) ---------------------------------------------------------------------------

_qtype, _raw, _reference = qtype, gguf_bytes, gguf_reference


def _packed(fmt: str, n: int, k: int, seed: int) -> torch.Tensor:
    return layouts.pack(torch.from_numpy(_raw(fmt, n, k, np.random.default_rng(seed))), fmt, k)


def _shapes(fmt: str) -> list[tuple[int, int]]:
    """(N, K): N off the SIMD widths and tiles; K one block, several, and (32-blocks) a partial last group."""
    ks = (32, 96, 128, 160, 576) if layouts.block_size(fmt) == 32 else (256, 768)
    return [(n, k) for n in (1, 7, 33) for k in ks]


# -- packing (dtorch.kernels.layouts: pure torch, runs without the native library) ---------------------------

# bits per weight held in memory; 4-bit formats stay at or under 5 (no int8 expansion)
BITS = {"gguf.q8_0": 8.5, "gguf.q4_0": 4.5, "gguf.q4_1": 5.0, "gguf.q4_k": 4.625, "gguf.q6_k": 6.5625,
        "gguf.q5_0": 5.5, "gguf.q5_1": 6.0, "gguf.iq4_nl": 4.5, "gguf.q2_k": 2.625, "gguf.q3_k": 3.5625,
        "gguf.q5_k": 5.625, "gguf.iq4_xs": 4.3125}


@pytest.mark.parametrize("fmt", GGUF_LAYOUTS)
def test_pack_dequantize_equals_gguf(fmt):
    gen = np.random.default_rng(0)
    assert layouts.layout_of_gguf(_qtype(fmt)) == fmt
    for n, k in _shapes(fmt):
        raw = _raw(fmt, n, k, gen)
        w = layouts.pack(torch.from_numpy(raw), fmt, k)
        assert w.dtype == torch.uint8 and w.shape == (n, layouts.row_bytes(fmt, k)) and w.is_contiguous()
        assert torch.equal(layouts.dequantize(w, fmt, k), _reference(fmt, raw, n, k)), (fmt, n, k)
        assert torch.equal(layouts.pack(torch.from_numpy(raw.reshape(-1)), fmt, k), w)  # flat bytes too
        assert 8 * layouts.row_bytes(fmt, k) / k == BITS[fmt]
    bf = layouts.dequantize(w, fmt, k, torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, _reference(fmt, raw, n, k).bfloat16())


@pytest.mark.parametrize("fmt", GGUF_LAYOUTS)
def test_row_and_k_slices_are_weights(fmt):
    """packed[r0:r1] is the weight of rows r0..r1; a K-slice of the GGUF bytes packs on its own."""
    n, block = 33, layouts.block_size(fmt)
    k = 3 * block
    raw = torch.from_numpy(_raw(fmt, n, k, np.random.default_rng(1)))
    w = layouts.pack(raw, fmt, k)
    full = layouts.dequantize(w, fmt, k)
    assert torch.equal(layouts.dequantize(w[5:17], fmt, k), full[5:17])
    size = raw.shape[1] // 3  # bytes of one block per row
    part = layouts.pack(raw[:, size:], fmt, 2 * block)  # blocks 1..2 of every row: K-slice [block, 3 block)
    assert torch.equal(layouts.dequantize(part, fmt, 2 * block), full[:, block:])


def test_layouts_name_what_is_wrong():
    raw = torch.zeros(7, 18, dtype=torch.uint8)
    assert layouts.layout_of_gguf(gguf.GGMLQuantizationType.F16) is None
    with pytest.raises(ShapeError, match="K a positive multiple of 32"):
        layouts.pack(raw, "gguf.q4_0", 33)
    with pytest.raises(ShapeError, match="K a positive multiple of 256"):
        layouts.row_bytes("gguf.q4_k", 576)
    with pytest.raises(ShapeError, match="row of K = 64 is 36 GGUF bytes"):
        layouts.pack(raw, "gguf.q4_0", 64)
    with pytest.raises(ShapeError, match="125 bytes .* are not whole gguf.q4_0 rows"):
        layouts.pack(raw.reshape(-1)[1:], "gguf.q4_0", 32)
    with pytest.raises(DTypeError, match="uint8"):
        layouts.pack(raw.to(torch.int16), "gguf.q4_0", 32)
    with pytest.raises(ArgumentError, match="unknown quantized layout 'q4_0'.*gguf.q4_0"):
        layouts.pack(raw, "q4_0", 32)
    w = layouts.pack(raw, "gguf.q4_0", 32)
    with pytest.raises(ShapeError, match="row of K = 64 is 36 bytes, got packed \\[7, 18\\]"):
        layouts.dequantize(w, "gguf.q4_0", 64)


# -- quantized products -----------------------------------------------------------------------------------
# Error bound: NMSE = sum((got - ref)^2) / sum(ref^2) over every output of the shapes above, ref =
# x @ gguf_dequantize(w).T in float64 (llama.cpp's test-backend-ops uses 5e-4 for its quantized mul_mat).
# Fewer than 32 rows (decode): x in two int8 levels per 32 values, x = d (hi + lo / 254) (csrc/generic.h), integer
# dot products; 32 rows and more (prefill): the weight dequantized to float32 in panels and a float GEMM (oneDNN's or
# torch's; on AVX-512 VNNI from 128 rows per thread but never for coarse rows, see INT_PREFILL_ISAS), exact up to
# float rounding. The weights enter exactly either way. Measured on these shapes (3 seeds, every ISA, which agree to
# float rounding), float32 x, Gaussian / with outliers (x = randn, K / 128 channels per row times 50 randn):
#
# | format | int8 x alone (before) | two levels, < 32 rows | float path, >= 32 rows |
# |---|---|---|---|
# | q8_0, q4_0, q4_1 | 2.7e-5 / 0.97e-4..1.8e-4 | 3.9e-10..4.4e-10 / 2.2e-9..2.5e-9 | 6e-14..8e-14 |
# | q4_k | 2.0e-5..2.5e-5 / 1.2e-4..1.7e-4 | 3.0e-10..4.6e-10 / 1.6e-9..3.2e-9 | 1.0e-13..1.2e-13 |
# | q6_k | 2.6e-5 / 1.3e-4..1.6e-4 | 4.1e-10..5.0e-10 / 1.9e-9..2.7e-9 | 1.0e-13..1.3e-13 |
#
# int8 alone was the noise floor of llama.cpp's q8 activations: on the default model it flipped the chat answer
# about France's capital (the down projection's input, silu(gate) * up, has heavy outliers). bf16 x: the one
# rounding of the output to bf16 dominates, 2.0e-6..3.6e-6 on every path. The bounds are ~2x the worst measured.
FLOAT_ROWS = 32  # qlinear's float path from this many rows (binding.cpp kFloatRows)
INT_PREFILL_ISAS = ("avx512",)  # but the super-grouped formats stay integer (Table::int_prefill) under ONEDNN_ROWS
ONEDNN_ROWS = 128  # rows per thread from which they take the float path in oneDNN's GEMM (binding.cpp kOneDnnRows)
FAST_TILES = ("gguf.q4_k", "gguf.q5_k", "gguf.iq4_xs", "gguf.q8_0")  # or at every row count (float_rows)
ONE_LEVEL_ROWS = 4  # a decode batch of this many rows: one int8 level in the super-grouped formats (kOneLevelRows)
GROUP_FORMATS = ("gguf.q2_k", "gguf.q3_k")  # always two levels under FLOAT_ROWS
NMSE_ONE_LEVEL = (5e-5, 4e-4)  # (Gaussian, outliers): int8 x alone, llama.cpp's noise floor (the table's first column)
NMSE_BOUND = {  # (Gaussian, outliers) for float32 x, fewer than FLOAT_ROWS rows
    "gguf.q8_0": (1e-9, 6e-9), "gguf.q4_0": (1e-9, 6e-9), "gguf.q4_1": (1e-9, 6e-9), "gguf.q4_k": (1e-9, 7e-9),
    "gguf.q6_k": (1e-9, 6e-9), "gguf.q5_0": (1e-9, 6e-9), "gguf.q5_1": (1e-9, 6e-9), "gguf.iq4_nl": (1e-9, 6e-9),
    "gguf.q2_k": (1e-9, 7e-9), "gguf.q3_k": (1e-9, 7e-9), "gguf.q5_k": (1e-9, 7e-9), "gguf.iq4_xs": (1e-9, 7e-9)}
NMSE_FLOAT_PATH = 1e-12  # float32 x, FLOAT_ROWS rows and more
NMSE_BF16 = 8e-6         # bfloat16 x and out, either path


def _nmse(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((got.double() - ref) ** 2).sum() / (ref ** 2).sum())


def _x(m: int, k: int, outliers: bool) -> torch.Tensor:
    x = torch.randn(m, k)
    if outliers:
        idx = torch.randint(0, k, (m, max(1, k // 128)))
        x.scatter_(1, idx, 50 * torch.randn(idx.shape))
    return x


def _integer_path(fmt: str, isa: str, m: int, one_level: bool = False) -> bool:
    """Whether qlinear multiplies m rows of x on the integer levels (else dequantized float panels); coarse rows
    (``one_level``) stay on VNNI's integer tiles at every row count."""
    if m < FLOAT_ROWS:
        return True
    if isa not in INT_PREFILL_ISAS or fmt in GROUP_FORMATS:
        return False
    return (one_level or m < ONEDNN_ROWS * torch.get_num_threads() or fmt in FAST_TILES
            or nk.float_gemm() != "onednn")


@pytest.mark.parametrize("outliers", [False, True], ids=["gaussian", "outliers"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", GGUF_LAYOUTS)
def test_qlinear_matches_gguf_reference(fmt, dtype, outliers, isa):
    gen = np.random.default_rng(2)
    torch.manual_seed(2)
    # path ("two", "one" level, "float") -> [sum of squared errors, sum of squared refs]
    err = {"two": [0.0, 0.0], "one": [0.0, 0.0], "float": [0.0, 0.0]}
    for n, k in _shapes(fmt):
        raw = _raw(fmt, n, k, gen)
        w = layouts.pack(torch.from_numpy(raw), fmt, k)
        wref = _reference(fmt, raw, n, k).double()
        # (rows, coarse?): 17 coarse rows (a batch of decodes) take one level from ONE_LEVEL_ROWS, but in the group
        # formats; the same rows otherwise keep two; a long coarse prompt stays on the integer tiles on VNNI
        big = ONEDNN_ROWS * torch.get_num_threads() + 2
        for m, batch in ((1, False), (3, True), (17, False), (17, True), (33, True), (big, False), (big, True)):
            x = _x(m, k, outliers).to(dtype)
            got = nk.qlinear(x, w, fmt, one_level=batch)
            assert got.dtype == dtype and got.shape == (m, n)
            ref = x.double() @ wref.T
            integer = _integer_path(fmt, isa, m, batch)
            one = batch and ONE_LEVEL_ROWS <= m and integer and fmt not in GROUP_FORMATS
            path = "float" if not integer else "one" if one else "two"
            err[path][0] += float(((got.double() - ref) ** 2).sum())
            err[path][1] += float((ref ** 2).sum())
            if isa != "portable" and m < FLOAT_ROWS:  # the SIMD paths sum the same integers as the scalar one
                with nk.use_isa("portable"):
                    plain = nk.qlinear(x, w, fmt, one_level=batch)
                bound = 1e-9 if dtype == torch.float32 else 2 ** -16  # bf16: a rounding may flip by one ulp
                assert _nmse(got, plain.double()) < bound, (fmt, isa, n, k, m, batch)
    nmse = {path: e / r for path, (e, r) in err.items() if r}
    if dtype == torch.bfloat16:
        bounds = {"two": NMSE_BF16, "one": max(NMSE_BF16, NMSE_ONE_LEVEL[outliers]), "float": NMSE_BF16}
    else:
        bounds = {"two": NMSE_BOUND[fmt][outliers], "one": NMSE_ONE_LEVEL[outliers], "float": NMSE_FLOAT_PATH}
    for path, value in nmse.items():
        assert value < bounds[path], f"{fmt} {isa} {dtype}, {path} path: NMSE {value:.2e}"
    if fmt not in GROUP_FORMATS and dtype == torch.float32:  # the one level is coarser than two, as it should be
        assert nmse["one"] > 10 * nmse["two"]


@pytest.mark.parametrize("fmt", ["gguf.q5_0", "gguf.q6_k", "gguf.q8_0", "gguf.q4_k", "gguf.q3_k"])
def test_prompt_rows_in_either_float_gemm(fmt, isa):
    # a prompt's rows through the float panels (oneDNN's GEMM, or torch's mm where torch lacks oneDNN) or the integer
    # tiles, with a bias: exact float products against gguf's dequantization, whichever GEMM is set
    gen = np.random.default_rng(5)
    torch.manual_seed(5)
    n, k = 300, 576 if layouts.block_size(fmt) == 32 else 768
    raw = _raw(fmt, n, k, gen)
    w = layouts.pack(torch.from_numpy(raw), fmt, k)
    x, bias = torch.randn(ONEDNN_ROWS * torch.get_num_threads() + 3, k), torch.randn(n)
    ref = x.double() @ _reference(fmt, raw, n, k).double().T + bias.double()
    got = {}
    for gemm in ("onednn", "torch"):
        with nk.use_float_gemm(gemm):
            got[gemm] = nk.qlinear(x, w, fmt, bias)
            bound = NMSE_BOUND[fmt][0] if _integer_path(fmt, isa, x.shape[0]) else NMSE_FLOAT_PATH
            assert _nmse(got[gemm], ref) < bound, (fmt, isa, gemm)
    assert _nmse(got["onednn"], got["torch"].double()) < 2 * NMSE_BOUND[fmt][0]
    with pytest.raises(ArgumentError, match="float GEMM must be"):
        nk.load().set_float_gemm("blas")


# x and the weight each rounded to bfloat16: measured 0.68e-5..0.85e-5 (one level: 2.6e-5..2.9e-5)
NMSE_BF16_PANELS = 2e-5


@pytest.mark.parametrize("fmt", ["gguf.q4_k", "gguf.q6_k", "gguf.q5_0", "gguf.q8_0", "gguf.q2_k"])
def test_coarse_rows_through_bf16_panels_where_amx_works(fmt, isa):
    """Where AMX works (forced here: oneDNN's bf16 GEMM runs the same products on any CPU, only slower without AMX),
    coarse rows of FLOAT_ROWS and more go through bfloat16 panels, with the bias added in float32; fewer coarse rows
    and precise rows keep their paths. Forced off (DTORCH_CPU_FEATURES=-amx_bf16), the integer tiles or float32
    panels."""
    from dtorch.core import cpu

    if nk.float_gemm() != "onednn":
        pytest.skip("torch lacks oneDNN: no bf16 panels")
    if not cpu.onednn_bf16():
        with cpu.forced(amx_bf16=True):  # forcing AMX on cannot pick panels oneDNN cannot build here
            assert not nk.bf16_panels()
        pytest.skip("oneDNN has no bfloat16 kernels on this CPU (they need AVX-512): no bf16 panels")
    gen = np.random.default_rng(7)
    torch.manual_seed(7)
    n, k = 300, 576 if layouts.block_size(fmt) == 32 else 768
    raw = _raw(fmt, n, k, gen)
    w = layouts.pack(torch.from_numpy(raw), fmt, k)
    wref = _reference(fmt, raw, n, k).double()
    x, bias = torch.randn(FLOAT_ROWS + 8, k), torch.randn(n)
    ref = x.double() @ wref.T + bias.double()
    with cpu.forced(amx_bf16=True):
        assert nk.bf16_panels()
        coarse = _nmse(nk.qlinear(x, w, fmt, bias, one_level=True), ref)
        precise = _nmse(nk.qlinear(x, w, fmt, bias), ref)
        few = _nmse(nk.qlinear(x[:8], w, fmt, bias[:], one_level=True), ref[:8])
    assert 1e-7 < coarse < NMSE_BF16_PANELS, coarse  # bf16's rounding, not float32's nor a wrong product
    assert precise < NMSE_BOUND[fmt][0]  # two levels or float32 panels, as before
    assert few < NMSE_ONE_LEVEL[0] and abs(few - coarse) > 1e-9  # 8 rows: the integer levels
    with cpu.forced(amx_bf16=False):
        assert not nk.bf16_panels()
        off = _nmse(nk.qlinear(x, w, fmt, bias, one_level=True), ref)
    assert off < NMSE_ONE_LEVEL[0] and off != coarse
    with cpu.forced(amx_bf16=True, amx_int8=False):  # -amx_int8 forces the path without AMX as well
        assert not nk.bf16_panels()
        assert _nmse(nk.qlinear(x, w, fmt, bias, one_level=True), ref) == off


def test_amx_is_used_only_where_a_child_process_ran_it(monkeypatch):
    """cpu.amx_works(): False without asking when torch's probe says no AMX; with it, the answer of a bf16 product in a
    child process, whose crash (a VM that reports AMX and faults on it) answers False instead of killing this one."""
    from dtorch.core import cpu

    monkeypatch.setattr(cpu, "really_has", lambda feature: feature == "amx_bf16")
    monkeypatch.setattr(cpu, "onednn_bf16", lambda: False)  # forced on, AMX still needs oneDNN's bf16 kernels
    with cpu.forced(amx_bf16=True):
        assert cpu.use_amx() is False
    monkeypatch.setattr(cpu, "onednn_bf16", lambda: True)  # a CPU with AMX has them
    for script, works in (("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", False),
                          (cpu._AMX_CHECK, True)):
        monkeypatch.setattr(cpu, "_AMX_CHECK", script)
        cpu.amx_works.cache_clear()
        try:
            assert cpu.amx_works() is works
            assert cpu.use_amx() is works
            with cpu.forced(amx_bf16=not works):
                assert cpu.use_amx() is not works
            for feature in cpu.AMX:  # either feature forced off turns the AMX paths off
                with cpu.forced(**{feature: False}):
                    assert cpu.use_amx() is False
                with cpu.forced(**{feature: True}):
                    assert cpu.use_amx() is True
        finally:
            cpu.amx_works.cache_clear()
    monkeypatch.setattr(cpu, "really_has", lambda feature: False)
    monkeypatch.setattr(cpu, "_AMX_CHECK", "raise SystemExit('must not run')")
    assert cpu.amx_works() is False
    monkeypatch.undo()
    cpu.amx_works.cache_clear()
    nk.loader._bf16_panels()  # the setting the real probe gives, for the tests after this one
    assert nk.bf16_panels() is cpu.use_amx()


@pytest.mark.parametrize("fmt", [f for f in GGUF_LAYOUTS if f not in GROUP_FORMATS])
def test_rows_together_equal_each_row_alone(fmt, isa):
    # a speculative verify step scores a sequence's last token and its drafts as rows of one product; its greedy
    # output equals plain decoding only if every row's result is the bits that row gets alone (a one-row decode
    # step). K with and without a last super-group of under 16 blocks (its rows' own pass), N over several panels
    # of the tiles and off the 16-row chunks, with a bias; last super-groups of 1, 2, 15, 5, 12 and 4 blocks (the
    # activations' period 1, 2, 16, 8 spread from 5 blocks, 16: K = 896 of Qwen2.5-0.5B, 4: K = 640 of Gemma 3
    # 270M, whose last half ends the row at a whole step; K = 128, that group alone); rows over 4 KB, which the
    # decodes stream a super-group at a time (K = 7360 with a last super-group of 6 blocks, 8192 without; K-quants:
    # 7424, 29 super-blocks, the last one alone); 4-bit K-quant rows of whole super-groups up to 2 KB, which the
    # decodes read as four streams of rows (K = 1536: 37 rows, 9 a stream and one after)
    gen = np.random.default_rng(7)
    torch.manual_seed(7)
    ks = ((544, 576, 480, 1536, 672, 896, 640, 128, 7360, 8192) if layouts.block_size(fmt) == 32
          else (768, 1280, 1536, 7424))
    for k in ks:
        n = 1100 if k == 576 else 37
        w = layouts.pack(torch.from_numpy(_raw(fmt, n, k, gen)), fmt, k)
        bias = torch.randn(n)
        x = _x(17, k, outliers=True)
        alone = torch.cat([nk.qlinear(x[i:i + 1], w, fmt, bias) for i in range(17)])
        for m in (2, 3, 4, 5, 9, 17):
            got = nk.qlinear(x[:m], w, fmt, bias)
            assert torch.equal(got, alone[:m]), (fmt, isa, k, m, (got - alone[:m]).abs().max().item())


@pytest.mark.parametrize("fmt", ["gguf.q4_k", "gguf.q6_k", "gguf.q8_0", "gguf.q5_0"])
def test_claimed_row_split_equals_each_row_alone(fmt, isa, two_threads):
    # set_row_split("claimed"): two threads claim a product's rows in chunks from a counter (largest first, 16-row
    # boundaries) instead of halves; every row must still get the bits it gets alone (the float GEMV's too: the
    # bits of the static split), and the chunks must cover the rows once (row_counts: rows per thread). K = 1536
    # (the K-quants' four streams; the 32-block formats' whole super-groups), N = 1100 (chunks down to the least,
    # a ragged end), one and three rows of x; 48 rows equal the static split's
    gen = np.random.default_rng(5)
    torch.manual_seed(5)
    k, n = 1536, 1100
    w = layouts.pack(torch.from_numpy(_raw(fmt, n, k, gen)), fmt, k)
    x = _x(3, k, outliers=True)
    alone = torch.cat([torch.cat([nk.qlinear(x[i:i + 1], w[j:j + 100], fmt) for j in range(0, n, 100)], 1)
                       for i in range(3)])
    with nk.use_row_split("claimed"):
        assert nk.row_split() == "claimed"
        nk.row_counts(reset=True)
        for m in (1, 3):
            assert torch.equal(nk.qlinear(x[:m], w, fmt), alone[:m]), (fmt, isa, m)
        counts = nk.row_counts(reset=True)
        many = _x(48, k, outliers=False)  # a prompt's rows (74k multiply-adds a row: chunks of the 16-row least)
        claimed = nk.qlinear(many, w, fmt)
    assert sum(counts) == 2 * n, counts
    assert torch.equal(claimed, nk.qlinear(many, w, fmt))
    wf = torch.randn(n, k).half()  # the float GEMV shares the split
    static = nk.gemv(x, wf)
    with nk.use_row_split("claimed"):
        assert torch.equal(nk.gemv(x, wf), static)
    assert nk.row_split() == "static"
    with pytest.raises(ArgumentError, match="'claimed' or 'static'"):
        nk.load().set_row_split("dynamic")


@pytest.mark.parametrize("fmt", ["gguf.q4_k", "gguf.q6_k", "gguf.q5_k", "gguf.q5_0"])
def test_every_row_one_level(fmt, isa, monkeypatch):
    """one_level=2 (DTORCH_ONE_LEVEL=1 passes it for every product): a lone row takes one int8 level per 32 values
    too. x rounded to 8 bits per block of 32 (error uniform within d / 2, d = amax / 127, ~2e-5 of x's power for
    Gaussian x): NMSE under NMSE_ONE_LEVEL and well above two levels'; the SIMD paths sum the same integers as the
    scalar one; every row of a batch gets the bits it gets alone (K with a lone last super-block: 768)."""
    gen = np.random.default_rng(11)
    torch.manual_seed(11)
    k = 768 if layouts.block_size(fmt) == 256 else 576
    raw = _raw(fmt, 37, k, gen)
    w = layouts.pack(torch.from_numpy(raw), fmt, k)
    ref_w = _reference(fmt, raw, 37, k).double()
    bias = torch.randn(37)
    x = _x(17, k, outliers=False)
    alone = torch.cat([nk.qlinear(x[i:i + 1], w, fmt, bias, one_level=2) for i in range(17)])
    ref = x.double() @ ref_w.T + bias.double()
    two = _nmse(torch.cat([nk.qlinear(x[i:i + 1], w, fmt, bias) for i in range(17)]), ref)
    assert _nmse(alone, ref) < NMSE_ONE_LEVEL[0] and _nmse(alone, ref) > 10 * two, (fmt, isa)
    if isa != "portable":
        with nk.use_isa("portable"):
            assert _nmse(alone, nk.qlinear(x, w, fmt, bias, one_level=2).double()) < 1e-9
    for m in (2, 3, 5, 17):
        assert torch.equal(nk.qlinear(x[:m], w, fmt, bias, one_level=2), alone[:m]), (fmt, isa, m)
    key = KernelKey("matmul.linear", "cpu", torch.float32, fmt)
    out = torch.empty(1, 37)
    monkeypatch.setenv("DTORCH_ONE_LEVEL", "1")  # the dispatched kernel: one level for a precise lone row
    kernel = Dispatcher().select(key).fn
    kernel(_ctx(), (x[:1], w, bias), (out,))
    assert torch.equal(out, alone[:1])
    out.zero_()
    kernel.bind(_ctx(), (x[:1], w, bias), (out,))()  # a step's bound call (a decode step's products): one level too
    assert torch.equal(out, alone[:1])
    with pytest.raises(ArgumentError, match="one_level must be 0, 1"):
        nk.qlinear(x[:1], w, fmt, bias, one_level=3)


@pytest.mark.parametrize("fmt", ["gguf.q5_0", "gguf.q8_0", "gguf.q4_k"])
def test_one_level_at_the_real_shapes_tails(fmt, isa):
    # one_level=2 at K = 896 and 640 (last super-groups of 12 and 4 blocks, the four-row decode path of the 32-block
    # formats): a lone row takes int8 noise (not two levels' ~1e-9), and rows together equal each row alone
    gen = np.random.default_rng(11)
    torch.manual_seed(11)
    for k in ((896, 640) if layouts.block_size(fmt) == 32 else (768,)):
        w = layouts.pack(torch.from_numpy(_raw(fmt, 45, k, gen)), fmt, k)
        x = _x(5, k, outliers=False)
        two = nk.qlinear(x[:1], w, fmt)
        alone = torch.cat([nk.qlinear(x[i:i + 1], w, fmt, one_level=2) for i in range(5)])
        assert torch.equal(nk.qlinear(x, w, fmt, one_level=2), alone), (fmt, isa, k)
        want = x.double() @ layouts.dequantize(w, fmt, k).double().T
        assert _nmse(two, want[:1]) < NMSE_BOUND[fmt][0] < 10 * NMSE_BOUND[fmt][0] < _nmse(alone[:1], want[:1])
        assert _nmse(alone, want) < NMSE_ONE_LEVEL[0], (fmt, isa, k)


@native
def test_qlinear_leading_dims_out_bias_and_slices():
    w = _packed("gguf.q4_1", 16, 64, 3)
    x = torch.randn(2, 3, 64)
    out = torch.empty(2, 3, 16)
    assert nk.qlinear(x, w, "gguf.q4_1", out=out) is out
    torch.testing.assert_close(out, nk.qlinear(x.reshape(6, 64), w, "gguf.q4_1").reshape(2, 3, 16), rtol=0, atol=0)
    bias = torch.randn(16)
    torch.testing.assert_close(nk.qlinear(x, w, "gguf.q4_1", bias), out + bias)
    torch.testing.assert_close(nk.qlinear(x, w[5:12], "gguf.q4_1"), out[..., 5:12], rtol=0, atol=0)  # a row shard
    xb = x.bfloat16()
    ref = xb.double() @ layouts.dequantize(w, "gguf.q4_1", 64).double().T + bias.bfloat16().double()
    torch.testing.assert_close(nk.qlinear(xb, w, "gguf.q4_1", bias.bfloat16()).double(), ref, rtol=0.02, atol=0.05)


@native
def test_qlinear_checks_name_the_argument():
    w = _packed("gguf.q4_0", 8, 64, 4)
    with pytest.raises(ShapeError, match="out must be"):
        nk.qlinear(torch.randn(2, 64), w, "gguf.q4_0", out=torch.empty(2, 9))
    with pytest.raises(ShapeError, match="packed \\[8, 36\\] does not fit K = 96: a row is 54 bytes"):
        nk.qlinear(torch.randn(1, 96), w, "gguf.q4_0")
    with pytest.raises(ShapeError, match="bias must be \\[N = 8\\]"):
        nk.qlinear(torch.randn(1, 64), w, "gguf.q4_0", torch.randn(7))
    with pytest.raises(LayoutError, match="x .* must be contiguous"):
        nk.qlinear(torch.randn(64, 2).T, w, "gguf.q4_0")
    with pytest.raises(DTypeError, match="x must be float32 or bfloat16, got Half"):
        nk.qlinear(torch.randn(1, 64).half(), w, "gguf.q4_0")
    with pytest.raises(ArgumentError, match="unknown quantized layout"):
        nk.qlinear(torch.randn(1, 64), w, "gguf.iq2_xxs")


# -- float GEMV -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_gemv_matches_torch(xdtype, wdtype, isa):
    torch.manual_seed(5)
    for n, k, m in [(1, 1, 1), (7, 33, 1), (33, 576, 3), (70, 100, 2)]:
        x, w = torch.randn(m, k).to(xdtype), torch.randn(n, k).to(wdtype)
        got = nk.gemv(x, w)
        ref = (x.double() @ w.double().T).to(xdtype)
        tol = 1e-5 if xdtype == torch.float32 else 2 ** -7  # summation order; bf16: one rounding of the output
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol * math.sqrt(k), msg=f"{n}x{k}, M={m}")


# -- fused decode ops vs torch formulas (those of dtorch/kernels/torch/llm.py) ----------------------------------
# float32: equal up to summation order; bfloat16: the same roundings, at most one bf16 ulp apart (where a float32
# sum order flips a rounding).

FUSED_TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=2 ** -7, atol=2 ** -7)}


def _rms_ref(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hf = h.float()
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_add_rms_norm(dtype, isa):
    torch.manual_seed(6)
    for shape in [(1, 576), (5, 33), (2, 3, 64)]:
        x, res, w = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), torch.rand(shape[-1]).to(dtype)
        torch.testing.assert_close(nk.rms_norm(x, w, 1e-5), _rms_ref(x, w, 1e-5), **FUSED_TOL[dtype])
        out, h = nk.add_rms_norm(x, res, w, 1e-6)
        assert torch.equal(h, res + x)
        torch.testing.assert_close(out, _rms_ref(res + x, w, 1e-6), **FUSED_TOL[dtype])
        want = _rms_ref(res + x, w, 1e-6)
        r2, x2 = res.clone(), x.clone()
        nk.add_rms_norm(x2, r2, w, 1e-6, out=x2, residual_out=r2)  # in place, as a decoder layer runs it
        torch.testing.assert_close(x2, want, **FUSED_TOL[dtype])
        assert torch.equal(r2, res + x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_on_token_strided_heads(dtype, isa):
    """Qwen3's per-head q / k norms run on [T, H, D] views of a fused qkv output (tokens a row of q, k and v heads
    apart): the same values as on a contiguous copy, into a fresh out or in place; with a residual too (the DTN_OP
    row's token-strided rows)."""
    torch.manual_seed(8)
    w = torch.rand(64).to(dtype)
    for t in (1, 7):
        qkv = torch.randn(t, (6 + 2 * 2) * 64).to(dtype)
        for x in (qkv[:, :6 * 64].view(t, 6, 64), qkv[:, 6 * 64:8 * 64].view(t, 2, 64), qkv[:, 8 * 64:9 * 64]):
            want = nk.rms_norm(x.contiguous(), w, 1e-6)
            assert torch.equal(nk.rms_norm(x, w, 1e-6), want)
            torch.testing.assert_close(want, _rms_ref(x, w, 1e-6), **FUSED_TOL[dtype])
            before = qkv.clone()
            nk.rms_norm(x, w, 1e-6, out=x)  # in place on the view: the other heads untouched
            assert torch.equal(x, want)
            assert torch.equal(qkv.flatten()[_outside(qkv, x)], before.flatten()[_outside(qkv, x)])
    q, res = torch.randn(3, 10, 64).to(dtype)[:, :4], torch.randn(3, 4, 64).to(dtype)
    out, h = nk.add_rms_norm(q, res, w, 1e-6)
    want, want_h = nk.add_rms_norm(q.contiguous(), res, w, 1e-6)
    assert torch.equal(h, res + q) and torch.equal(h, want_h) and torch.equal(out, want)
    with pytest.raises(LayoutError, match=r"x \[2, 3, 4, 64\] must have its rows one stride apart, or be heads"):
        nk.rms_norm(torch.randn(2, 6, 8, 64).to(dtype)[:, :3, :4], w, 1e-6)


def _outside(base: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """The flat indices of ``base`` that ``view`` does not cover."""
    idx = torch.arange(base.numel()).view(base.shape)
    inside = torch.as_strided(idx, view.shape, view.stride(), view.storage_offset() - base.storage_offset())
    keep = torch.ones(base.numel(), dtype=torch.bool)
    keep[inside.flatten()] = False
    return keep.nonzero().flatten()


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int, interleaved: bool) -> torch.Tensor:
    xf, out = x.float(), x.float().clone()
    if interleaved:
        x1, x2 = xf[..., 0:rot:2], xf[..., 1:rot:2]
    else:
        x1, x2 = xf[..., : rot // 2], xf[..., rot // 2:rot]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [..., T, 1, R/2]
    y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
    if interleaved:
        out[..., 0:rot:2], out[..., 1:rot:2] = y1, y2
    else:
        out[..., : rot // 2], out[..., rot // 2:rot] = y1, y2
    return out.to(x.dtype)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope(dtype, interleaved, isa):
    torch.manual_seed(7)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    for xshape, pos_shape, rot in [((1, 9, 64), (1,), 64), ((5, 3, 64), (5,), 32), ((2, 4, 2, 64), (2, 4), 64)]:
        x = torch.randn(xshape).to(dtype)
        pos = torch.randint(0, 4096, pos_shape)
        ang = pos.float().unsqueeze(-1) * inv_freq[: rot // 2]
        cos, sin = ang.cos(), ang.sin()
        want = _rope_ref(x, cos, sin, rot, interleaved)
        torch.testing.assert_close(nk.rope(x, cos, sin, rot, interleaved), want, **FUSED_TOL[dtype])
        y = x.clone()
        nk.rope(y, cos, sin, rot, interleaved, out=y)
        torch.testing.assert_close(y, want, **FUSED_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype, isa):
    torch.manual_seed(8)
    for shape in [(1, 2 * 1536), (3, 2 * 33), (2, 2, 2 * 8)]:
        x = (4 * torch.randn(shape)).to(dtype)
        g, u = x.chunk(2, -1)
        want = torch.mul(F.silu(g), u)
        tol = dict(rtol=3e-6, atol=1e-6) if dtype == torch.float32 else FUSED_TOL[dtype]
        torch.testing.assert_close(nk.silu_and_mul(x), want, **tol)
        torch.testing.assert_close(nk.silu_and_mul(g.contiguous(), u.contiguous()), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul(dtype, isa):
    """The DTN_OP row with DTN_HALF(up): fused [..., 2I] (up None) or two halves, rows one stride apart (a view of the
    fused tensor's halves), against torch's F.gelu(approximate="tanh") * up."""
    torch.manual_seed(10)
    mod = nk.load()
    for shape in [(1, 2 * 1536), (3, 2 * 33), (2, 2, 2 * 8)]:
        x = (3 * torch.randn(shape)).to(dtype)
        g, u = x.chunk(2, -1)
        want = torch.mul(F.gelu(g, approximate="tanh"), u)
        tol = dict(rtol=2e-5, atol=2e-6) if dtype == torch.float32 else FUSED_TOL[dtype]
        torch.testing.assert_close(nk.gelu_tanh_and_mul(x), want, **tol)
        out = torch.empty_like(g)
        mod.gelu_tanh_and_mul(g, u, out)  # the halves as views: rows 2I apart
        torch.testing.assert_close(out, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_last_dim(dtype, isa):
    """The DTN_OP row ops/softmax.def (checks and registration from the row): float32 softmax rounded once, on
    contiguous rows, rows one stride apart (a view of wider rows) and in place."""
    mod = nk.load()
    torch.manual_seed(9)
    tol = dict(rtol=2e-6, atol=1e-9) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)
    for shape in [(1, 4099), (3, 33), (2, 2, 16)]:
        x = (6 * torch.randn(shape)).to(dtype)
        want = torch.softmax(x.float(), -1).to(dtype)
        out = torch.empty_like(x)
        mod.softmax_last_dim(x, out)
        torch.testing.assert_close(out, want, **tol)
        wide = torch.cat([x, x], -1)[..., : shape[-1]]  # row stride 2 N
        mod.softmax_last_dim(wide, wide)  # in place
        torch.testing.assert_close(wide, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mul_scalar_is_torchs_product(dtype, isa):
    """The DTN_OP row mul_scalar (binary.mul_scalar): torch.mul by a Python number, bit for bit (one product, the
    number in float32, rounded once), on contiguous rows, rows one stride apart, in place, and through the dispatcher
    (Gemma's embedding scale, rounded to the model's dtype first)."""
    mod = nk.load()
    torch.manual_seed(4)
    value = float(torch.tensor(640 ** 0.5, dtype=dtype))
    for shape in [(1, 640), (3, 33), (2, 2, 1157)]:
        x = (8 * torch.randn(shape)).to(dtype)
        x.view(-1)[:3] = torch.tensor([float("inf"), float("nan"), -0.0])
        want = torch.mul(x, value)
        out = torch.empty_like(x)
        mod.mul_scalar(x, out, value)
        torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
        wide = torch.cat([x, x], -1)[..., : shape[-1]]  # row stride 2 N
        mod.mul_scalar(wide, wide, value)  # in place
        torch.testing.assert_close(wide, want, rtol=0, atol=0, equal_nan=True)
    exp = Dispatcher().explain(KernelKey("binary.mul_scalar", "cpu", dtype))
    assert exp.winner is not None and exp.winner.provider == "native", str(exp)
    torch.testing.assert_close(mul(x, value), want, rtol=0, atol=0, equal_nan=True)


@native
def test_a_declared_op_checks_its_arguments_as_its_row_says():
    """binding.cpp's checks of a DTN_OP row (read from its RowInfo at run time) name the argument and what was
    wrong."""
    mod = nk.load()
    x = torch.randn(3, 8)
    with pytest.raises(DTypeError, match="softmax_last_dim: out must have x's dtype Float, got Double"):
        mod.softmax_last_dim(x, x.double())
    with pytest.raises(ShapeError, match=r"softmax_last_dim: out must have x's shape \[3, 8\], got \[3, 4\]"):
        mod.softmax_last_dim(x, torch.empty(3, 4))
    with pytest.raises(LayoutError, match="out .* must be dense in its last dim"):
        mod.softmax_last_dim(x, torch.empty(8, 3).t())
    with pytest.raises(ArgumentError, match=r"argument 2 \(out\) is missing; it takes DTN_IN\(x\) DTN_OUT\(out\)"):
        mod.softmax_last_dim(x)
    with pytest.raises(ArgumentError, match="takes 2 arguments"):
        mod.softmax_last_dim(x, x, x)
    with pytest.raises(DTypeError, match="x must be float32 or bfloat16, got Double"):
        mod.softmax_last_dim(x.double(), x.double())
    # DTN_HALF (silu_and_mul's up): None means gate is the fused [..., 2D]; the other rows name their arguments too
    with pytest.raises(ShapeError, match=r"silu_and_mul: with up None, gate must be the fused \[\.\.\., 2D\]"):
        mod.silu_and_mul(torch.randn(2, 7), None, torch.empty(2, 3))
    with pytest.raises(ShapeError, match=r"out must have gate's shape \[2, 4\] \(its last dim halved\), got \[2, 8\]"):
        mod.silu_and_mul(x[:2], None, torch.empty(2, 8))
    with pytest.raises(ShapeError, match=r"add_rms_norm: residual must have x's shape \[3, 8\], got \[3, 4\]"):
        mod.add_rms_norm(x, torch.empty(3, 4), torch.ones(8), x, x, 1e-6)
    with pytest.raises(ShapeError, match=r"rms_norm: weight must be \[D = 8\], got \[4\]"):
        mod.rms_norm(x, torch.ones(4), x, 1e-6)


# -- build and cache --------------------------------------------------------------------------------------

def test_cache_key_follows_torch_and_python():
    key = cache_key()
    assert key.startswith(f"torch{torch.__version__.replace('+', '_')}-py")
    assert cache_key(torch_version="2.12.0") != key
    assert cache_key(python_version="312") != key
    assert cache_key() == key


def test_no_compiler_gives_a_reason(tmp_path):
    env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"), DTORCH_NATIVE_CACHE=str(tmp_path / "cache"))
    code = "import dtorch.kernels.native as n; print(n.unavailable_reason())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "no C++ compiler" in out.stdout and "no-such-c++" in out.stdout and "set CXX" in out.stdout


def test_build_command_without_a_compiler_exits_0_unless_strict(tmp_path):
    """The README's set-up command chains `python -m dtorch.kernels.native.build`: no compiler is not a failure."""
    env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"), DTORCH_NATIVE_CACHE=str(tmp_path / "cache"))
    for flags, rc in (([], 0), (["--strict"], 1)):
        out = subprocess.run([sys.executable, "-m", "dtorch.kernels.native.build", *flags], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == rc, out.stderr
        assert "native kernels unavailable: no C++ compiler" in out.stderr
        assert "dtorch will run on its torch kernels" in out.stderr


@native
def test_forcing_an_isa_the_cpu_lacks_is_refused():
    missing = [i for i in nk.ISAS if i not in nk.available_isas()]
    if not missing:
        pytest.skip("this CPU runs every native ISA path")
    with pytest.raises(Exception, match="this CPU cannot run"):
        nk.set_isa(missing[0])


# -- the backend through the dispatcher ------------------------------------------------------------------------
# A fresh Dispatcher loads the cpu backends (torch, then native); native wins its keys, disabling it falls back to
# the torch backend, and each kernel gives the torch backend's result (the same ABI: inputs, outputs, params).

CPU = Device("cpu")
NATIVE_KEYS = [("matmul.linear", layout) for layout in GGUF_LAYOUTS] + [
    (op, "strided") for op in ("llm.rms_norm", "llm.add_rms_norm", "llm.silu_and_mul", "llm.rope")]


def _ctx(**params) -> KernelContext:
    return KernelContext(CPU, None, None, KernelParams(**params))


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatcher_chooses_native_and_falls_back(dtype):
    d = Dispatcher()
    for op, layout in NATIVE_KEYS:
        key = KernelKey(op, "cpu", dtype, layout)
        exp = d.explain(key)
        assert exp.winner is not None and exp.winner.provider == "native", str(exp)
        if layout != "strided" and len(exp.rows) == 1:
            continue  # known gap until the torch backend registers its dequantize-then-linear reference for gguf.*
        with d.disabled("native"):
            assert d.select(key).provider != "native"
    assert "native" not in d.unavailable("cpu")


def _llm_cases(dtype):
    """(op, inputs, make outputs, params) of decode-sized calls, including row-strided views."""
    torch.manual_seed(9)
    x, res, w = (torch.randn(3, 576).to(dtype) for _ in range(3))
    gate_up = torch.randn(3, 2 * 96).to(dtype)
    qkv = torch.randn(2, 15 * 64).to(dtype)
    qk = qkv[:, :12 * 64].view(2, 12, 64)  # the q and k heads of a fused qkv output: row-strided
    cs = torch.randn(2, 2, 32)
    inv_freq = tuple((1.0 / 10000 ** (torch.arange(0, 64, 2) / 64)).tolist())
    return [
        ("llm.rms_norm", (x, w), lambda: (torch.empty_like(x),), dict(eps=1e-5)),
        ("llm.rms_norm", (x.T.contiguous().T, w), lambda: (torch.empty_like(x),), dict(eps=1e-5)),  # strided: torch
        ("llm.add_rms_norm", (x, res, w), lambda: (torch.empty_like(x), torch.empty_like(x)), dict(eps=1e-6)),
        ("llm.silu_and_mul", (gate_up[:, :96], gate_up[:, 96:]), lambda: (x.new_empty(3, 96),), {}),
        ("llm.silu_and_mul", (gate_up, None), lambda: (x.new_empty(3, 96),), {}),
        ("llm.rope", (qk, cs[:, 0], cs[:, 1]), lambda: (torch.empty_like(qk),), dict(rotary_dim=64, interleaved=False)),
        ("llm.rope", (qk, cs[:, 0, :16], cs[:, 1, :16]), lambda: (torch.empty_like(qk),),
         dict(rotary_dim=32, interleaved=True)),
        ("llm.rope", (qk, torch.tensor([5, 9])), lambda: (torch.empty_like(qk),),  # positions form: torch's
         dict(rotary_dim=64, interleaved=False, inv_freq=inv_freq)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatched_decode_ops_match_torch(dtype, isa):
    d = Dispatcher()
    for op, inputs, outputs, params in _llm_cases(dtype):
        key = KernelKey(op, "cpu", dtype)
        got, want = outputs(), outputs()
        d.select(key).fn(_ctx(**params), inputs, got)
        with d.disabled("native"):
            d.select(key).fn(_ctx(**params), inputs, want)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **FUSED_TOL[dtype], msg=f"{op} {isa}")
    x = torch.randn(2, 1, 12, 64).to(dtype)  # in place, as RoPE.apply_ runs it
    cs = torch.randn(2, 1, 2, 32)
    want = x.clone()
    torch_llm.rope_reference(_ctx(rotary_dim=64, interleaved=False), (want, cs[..., 0, :], cs[..., 1, :]), (want,))
    d.select(KernelKey("llm.rope", "cpu", dtype)).fn(_ctx(rotary_dim=64, interleaved=False),
                                                      (x, cs[..., 0, :], cs[..., 1, :]), (x,))
    torch.testing.assert_close(x, want, **FUSED_TOL[dtype])


@pytest.mark.parametrize("fmt", GGUF_LAYOUTS)
def test_dispatched_quantized_linear(fmt, isa):
    d = Dispatcher()
    k = 2 * layouts.block_size(fmt) if layouts.block_size(fmt) == 256 else 160
    w = _packed(fmt, 19, k, 10)
    wref = layouts.dequantize(w, fmt, k).double()
    bias = torch.randn(19)
    # a few dozen outputs: the measured NMSE varies more than over the big table; 5 and 14 rows of a decode batch
    # (param coarse): one level but in the group formats
    two, one = 5 * NMSE_BOUND[fmt][0], 5 * (NMSE_BOUND[fmt][0] if fmt in GROUP_FORMATS else NMSE_ONE_LEVEL[0])
    for x in (torch.randn(5, k), torch.randn(2, 7, 2 * k)[..., ::2]):  # the second one strided
        ref = x.double() @ wref.T + bias.double()
        got = {}
        for path, ctx, bound in (("two", _ctx(), two), ("one", _ctx(coarse=True), one)):
            out = got[path] = x.new_empty(*x.shape[:-1], 19)
            d.select(KernelKey("matmul.linear", "cpu", torch.float32, fmt)).fn(ctx, (x, w, bias), (out,))
            assert _nmse(out, ref) < bound, (fmt, isa, ctx.params)
        if fmt not in GROUP_FORMATS:  # the hint took the one-level path: coarser than two levels
            assert _nmse(got["one"], ref) > 10 * _nmse(got["two"], ref)
    out = torch.empty(19, 5).T  # a strided output
    d.select(KernelKey("matmul.linear", "cpu", torch.float32, fmt)).fn(_ctx(), (x[0, :5], w, None), (out,))
    assert _nmse(out, x[0, :5].double() @ wref.T) < two


def test_without_a_compiler_the_dispatcher_falls_back(tmp_path):
    env = dict(os.environ, CXX="/nonexistent", DTORCH_NATIVE_CACHE=str(tmp_path / "cache"))
    env.pop("DTORCH_NATIVE_ISA", None)
    code = ("import torch\nfrom dtorch.dispatch.registry import Dispatcher\nfrom dtorch.dispatch.key import KernelKey\n"
            "d = Dispatcher()\nexp = d.explain(KernelKey('llm.rms_norm', 'cpu', torch.float32))\n"
            "print(exp.winner.provider)\nprint(exp)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "torch"
    assert "backend 'native' unavailable on cpu: no C++ compiler: CXX='/nonexistent'" in out.stdout


@native
def test_forced_isa_setting_reaches_the_kernels(tmp_path):
    """DTORCH_NATIVE_ISA (dtorch.core.env.native_isa) picks the path a fresh process loads."""
    env = dict(os.environ, DTORCH_NATIVE_ISA="portable")
    code = "import dtorch.kernels.native as n; print(n.isa())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "portable"


@native
def test_cpu_features_forced_off_pick_the_next_isa():
    """"auto" follows DTORCH_CPU_FEATURES as every other CPU-dependent choice does: a feature forced off takes the
    kernels that do without it, in a fresh process and within ``cpu.forced``; forcing one on picks nothing the CPU
    cannot run."""
    runs = nk.available_isas()
    if len(runs) < 2:
        pytest.skip("this CPU runs only the portable kernels")
    code = "import dtorch.kernels.native as n; print(n.isa())"
    below_vnni = runs[1] if "avx512_vnni" in nk.ISA_FEATURES[runs[0]] else runs[0]  # an AVX2-only CPU: its best
    for forced, want in (("-avx512_vnni", below_vnni), ("-avx2", "portable"), ("+avx512,+avx512_vnni", runs[0])):
        env = dict(os.environ, DTORCH_CPU_FEATURES=forced)
        env.pop("DTORCH_NATIVE_ISA", None)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == want, forced
    with nk.use_isa("auto"):
        best = nk.isa()  # the session's own DTORCH_CPU_FEATURES may already rule the best ones out
        if best != "portable":
            with cpu.forced(**{nk.ISA_FEATURES[best][0]: False}):
                assert nk.isa() == runs[runs.index(best) + 1]
        assert nk.isa() == best


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
def test_dispatched_float_linear_matches_float64(rows, isa):
    """matmul.linear on a bf16 W [N, K]: our GEMV up to 8 rows (x a strided view, a bias, leading dims), torch's
    kernels beyond; every path within bf16 rounding of the float64 product."""
    d = Dispatcher()
    key = KernelKey("matmul.linear", "cpu", torch.bfloat16)
    assert d.explain(key).winner.provider == "native"
    torch.manual_seed(rows)
    wide = torch.randn(rows, 1, 160).bfloat16()
    x, w, bias = wide[..., :130], (torch.randn(70, 130) * 0.1).bfloat16(), torch.randn(70).bfloat16()
    want = torch.nn.functional.linear(x.double(), w.double(), bias.double())
    for b in (None, bias):
        out = torch.empty(rows, 1, 70, dtype=torch.bfloat16)
        d.select(key).fn(_ctx(), (x, w, b), (out,))
        ref = want if b is not None else want - bias.double()
        torch.testing.assert_close(out.double(), ref, rtol=2 ** -7, atol=2 ** -7 * float(ref.abs().max()))


@pytest.mark.parametrize("rows", [1, 8, 9])
@pytest.mark.parametrize("layout", ["f16", "bf16"])
def test_dispatched_16_bit_weight_linear_matches_float64(layout, rows, isa):
    """matmul.linear on a 16-bit W [N, K] beside float32 x (layouts "f16", "bf16"): our GEMV up to 8 rows reads the
    weight as stored, the torch backend's panels beyond; both within float32 summation of the float64 product."""
    d = Dispatcher()
    key = KernelKey("matmul.linear", "cpu", torch.float32, layout)
    assert d.explain(key).winner.provider == "native"
    torch.manual_seed(rows)
    dt = torch.float16 if layout == "f16" else torch.bfloat16
    x, w, bias = torch.randn(rows, 2, 130)[:, 1], (torch.randn(70, 130) * 0.1).to(dt), torch.randn(70)
    for b in (None, bias):
        out = torch.empty(rows, 70)
        d.select(key).fn(_ctx(), (x, w, b), (out,))
        want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


# -- the hybrid models' decode steps: causal_conv1d_update, gated_delta_net (T == 1), moe_experts (one token) -------
# Each against the torch backend's reference kernel for the key: float32 to float32 rounding, bfloat16 within one
# bf16 rounding. Pools: rows the step does not name stay as they were; padding rows that share a pool row (the
# duplicate index) give the others' results unchanged.
STEP_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -7, atol=2 ** -7)}


def _select(op: str, dtype: torch.dtype, call: Call | None = None, provider: str = "native"):
    d = Dispatcher()
    key = KernelKey(op, "cpu", dtype)
    assert d.explain(key, call).winner.provider == provider, str(d.explain(key, call))
    return d.select(key, call).fn


def _conv_case(dtype, width, keep, bias, pooled, seed=0):
    torch.manual_seed(seed)
    b, d = 3, 200
    wide = torch.randn(b, d + 30).to(dtype)
    x = wide[:, 10:10 + d]                                   # a column view of a projection's output
    weight, bias_t = torch.randn(d, width).to(dtype), torch.randn(d).to(dtype) if bias else None
    if pooled:
        state, idx = torch.randn(7, d, keep).to(dtype), torch.tensor([5, 2, 5])  # 5: two padding rows
        return (x, weight, bias_t, state, idx)
    return (x, weight, bias_t, torch.randn(b, d, keep).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width, keep", [(4, 3), (4, 4), (3, 5), (1, 1)])
def test_conv1d_update_step_matches_reference(dtype, width, keep, isa):
    fn = _select("llm.causal_conv1d_update", dtype)
    for bias, pooled, act in [(False, True, "silu"), (True, True, None), (True, False, "silu")]:
        inputs = _conv_case(dtype, width, keep, bias, pooled)
        x, state = inputs[0], inputs[3]
        got_state, want_state = state.clone(), state.clone()
        got, want = x.new_empty(x.shape), x.new_empty(x.shape)
        fn(_ctx(activation=act), (*inputs[:3], got_state, *inputs[4:]), (got, got_state))
        torch_conv.causal_conv1d_update_reference(_ctx(activation=act), (*inputs[:3], want_state, *inputs[4:]),
                                                   (want, want_state))
        torch.testing.assert_close(got, want, **STEP_TOL[dtype], msg=f"{isa} bias={bias} pooled={pooled}")
        if not pooled:
            torch.testing.assert_close(got_state, want_state, rtol=0, atol=0)  # copies: exact
            continue
        # row 5, named by batch rows 0 and 2 (padding): either one's step lands (the reference's index_put_ picks
        # either too); the other rows exact, the ones not named untouched
        others = [0, 1, 2, 3, 4, 6]
        torch.testing.assert_close(got_state[others], want_state[others], rtol=0, atol=0)
        assert torch.equal(got_state[[0, 1, 3, 4, 6]], state[[0, 1, 3, 4, 6]])
        assert any(torch.equal(got_state[5], torch.cat([state[5, :, 1:], x[b, :, None]], -1)) for b in (0, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv1d_update_other_forms_go_to_torch(dtype, isa):
    """x [B, D, 1] runs the step; x [B, D, 2] and a bias of another dtype run the torch backend's update."""
    fn = _select("llm.causal_conv1d_update", dtype)
    torch.manual_seed(1)
    weight, bias, state = torch.randn(64, 4).to(dtype), torch.randn(64), torch.randn(2, 64, 3).to(dtype)
    for x, b in [(torch.randn(2, 64, 1).to(dtype), None), (torch.randn(2, 64, 2).to(dtype), None),
                 (torch.randn(2, 64, 1).to(dtype), bias)]:
        got_state, want_state = state.clone(), state.clone()
        got, want = torch.empty_like(x), torch.empty_like(x)
        fn(_ctx(activation="silu"), (x, weight, b, got_state), (got, got_state))
        torch_conv.causal_conv1d_update_reference(_ctx(activation="silu"), (x, weight, b, want_state),
                                                   (want, want_state))
        torch.testing.assert_close(got, want, **STEP_TOL[dtype])
        torch.testing.assert_close(got_state, want_state, rtol=0, atol=0)


def _gdn_inputs(dtype, b=3, t=1, hk=2, h=4, kd=32, vd=48, seed=0):
    """q, k as head views of a fused qkv projection (row-strided), v, g (float32), beta."""
    torch.manual_seed(seed)
    qkv = torch.randn(b, t, 2 * hk * kd + h * vd + 8).to(dtype)
    q = qkv[..., :hk * kd].unflatten(-1, (hk, kd))
    k = qkv[..., hk * kd:2 * hk * kd].unflatten(-1, (hk, kd))
    v = qkv[..., 2 * hk * kd:2 * hk * kd + h * vd].unflatten(-1, (h, vd))
    g = -torch.rand(b, t, h) * 2
    beta = torch.rand(b, t, h).to(dtype)
    return q, k, v, g, beta


def _gdn_run(fn, params, inputs, initial, indices, final, provider=None):
    """Runs fn on copies of the states; returns (o, final state or None). With a provider, fn is the dispatcher's
    choice for this call, which must be that provider's kernel."""
    if provider is not None:
        call = Call(CPU, inputs[0].dtype, KernelParams(**params), (*inputs, initial, None, indices))
        fn = _select("llm.gated_delta_net", inputs[0].dtype, call, provider)
    initial = None if initial is None else initial.clone()
    if final == "alias":
        final = initial
    elif final is not None:
        final = final.clone()
    o = inputs[2].new_empty(inputs[2].shape)
    extra = () if indices is None else (indices,)
    fn(_ctx(**params), (*inputs, initial, None, *extra), (o, final) if final is not None else (o,))
    return o, final


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta_net_step_matches_reference(dtype, isa):
    inputs = _gdn_inputs(dtype)
    b, h, kd, vd = 3, 4, 32, 48
    pool = torch.randn(6, h, kd, vd) * 0.3
    idx = torch.tensor([4, 0, 4])  # 4: two padding rows
    states = torch.randn(b, h, kd, vd) * 0.3
    cases = [  # (params, initial, indices, final)
        (dict(use_qk_l2norm=True), pool, idx, "alias"),                      # the model's in-place pool
        (dict(use_qk_l2norm=True, scale=0.3), pool, idx, torch.zeros_like(pool)),  # a separate pool: a copy first
        (dict(), states, None, torch.zeros_like(states)),
        (dict(use_qk_l2norm=True), states, None, None),                      # no final output
        (dict(use_qk_l2norm=True), None, None, torch.zeros_like(states)),    # zero initial state
        (dict(use_qk_l2norm=True, mode="recurrent"), states, None, "alias"),
    ]
    for params, initial, indices, final in cases:
        got_o, got_s = _gdn_run(None, params, inputs, initial, indices, final, provider="native")
        want_o, want_s = _gdn_run(torch_gdn.gated_delta_net_recurrent, params, inputs, initial, indices, final)
        msg = f"{isa} {params} pooled={indices is not None}"
        torch.testing.assert_close(got_o, want_o, **STEP_TOL[dtype], msg=msg)
        if indices is None:
            if got_s is not None:
                torch.testing.assert_close(got_s, want_s, **STEP_TOL[torch.float32], msg=msg)
            continue
        # row 4, named by batch rows 0 and 2 (padding): either one's step lands (the reference's index_put_ picks
        # either too); rows not named stay as they were
        torch.testing.assert_close(got_s[:4], want_s[:4], **STEP_TOL[torch.float32], msg=msg)
        assert torch.equal(got_s[[1, 2, 3, 5]], pool[[1, 2, 3, 5]])
        alone = [_gdn_run(torch_gdn.gated_delta_net_recurrent, params, [x[b:b + 1] for x in inputs], initial,
                          indices[b:b + 1], final)[1][4] for b in (0, 2)]
        assert any(torch.allclose(got_s[4], a, **STEP_TOL[torch.float32]) for a in alone), msg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta_net_other_calls_go_to_torch(dtype, isa):
    """Several tokens (or a prepared operator's bare call) pick the chunked torch kernel, or the reference recurrence
    under mode="recurrent"; the native kernel called with them hands them to the same kernel."""
    inputs = _gdn_inputs(dtype, b=2, t=5)
    states = torch.randn(2, 4, 32, 48) * 0.3
    native_fn = Dispatcher().select(KernelKey("llm.gated_delta_net", "cpu", dtype),
                                    Call(CPU, dtype, KernelParams(), (*(x[:, :1] for x in inputs), None, None)))
    assert native_fn.provider == "native"
    for params, provider, ref in [(dict(use_qk_l2norm=True), "chunked", torch_gdn.gated_delta_net_chunked),
                                  (dict(use_qk_l2norm=True, mode="recurrent"), "reference",
                                   torch_gdn.gated_delta_net_recurrent)]:
        want_o, want_s = _gdn_run(ref, params, inputs, states, None, "alias")
        _select("llm.gated_delta_net", dtype, Call(CPU, dtype, KernelParams(**params)), provider)
        for got_o, got_s in (_gdn_run(None, params, inputs, states, None, "alias", provider=provider),
                             _gdn_run(native_fn.fn, params, inputs, states, None, "alias")):
            assert torch.equal(got_o, want_o) and torch.equal(got_s, want_s), params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_one_token_matches_reference(dtype, isa):
    """One token through the selected local experts (ids past this device's experts skipped) in one call."""
    fn = _select("llm.moe_experts", dtype)
    torch.manual_seed(3)
    e, hd, inter, start = 6, 70, 24, 10
    x = torch.randn(1, hd).to(dtype)
    w_gate_up, w_down = (torch.randn(e, 2 * inter, hd) * 0.2).to(dtype), (torch.randn(e, hd, inter) * 0.2).to(dtype)
    for ids in ([[12, 10, 15]], [[13, 3, 17]], [[1, 2, 30]]):  # all local; one outside; none local
        ids = torch.tensor(ids)
        weights = torch.rand(1, 3).to(dtype)
        got, want = x.new_empty(x.shape), x.new_empty(x.shape)
        fn(_ctx(expert_start=start), (x, w_gate_up, w_down, weights, ids), (got,))
        torch_moe.moe_experts_reference(_ctx(expert_start=start), (x, w_gate_up, w_down, weights, ids), (want,))
        scale = float(want.abs().max()) or 1.0
        tol = STEP_TOL[dtype]
        torch.testing.assert_close(got, want, rtol=tol["rtol"], atol=tol["atol"] * scale, msg=f"{isa} {ids}")


# -- llm.gdn_gates: beta is at::sigmoid_out, exact; g our float32 loop, within an ulp or two ---------------------

@pytest.mark.parametrize("dtype, param_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float64)])
@pytest.mark.parametrize("tokens", [1, 5])
def test_gdn_gates_match_the_torch_kernel(dtype, param_dtype, tokens, isa):
    """a and b as column views of one projection; a float64 A_log goes to the torch kernel."""
    from dtorch.kernels.torch import gdn_gates as torch_gates

    fn = _select("llm.gdn_gates", dtype)
    torch.manual_seed(tokens)
    h = 16
    ab = (torch.randn(tokens, 2 * h + 3) * 8).to(dtype)  # |a + dt_bias| past softplus' threshold 20 at times
    ab[0, 0] = 25.0
    a, b = ab[:, :h], ab[:, h:2 * h]
    a_log, dt_bias = torch.randn(h, dtype=param_dtype), torch.randn(h, dtype=param_dtype)
    got = (torch.empty(tokens, h), torch.empty(tokens, h, dtype=dtype))
    want = (torch.empty(tokens, h), torch.empty(tokens, h, dtype=dtype))
    fn(_ctx(), (a, b, a_log, dt_bias), got)
    torch_gates.gdn_gates_torch(_ctx(), (a, b, a_log, dt_bias), want)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6, msg=isa)
    assert torch.equal(got[1], want[1]), isa
