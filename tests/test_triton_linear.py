"""The triton gated delta rule and causal conv1d kernels (and flash-linear-attention's, when installed) against the
torch reference kernels, on CPU tensors through triton's interpreter; the tests marked cuda rerun them compiled on
a GPU (``scripts/device-check.sh`` sets TRITON_INTERPRET=0)."""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # chosen when @triton.jit runs, so before the kernels are imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dtorch.core.device import Device  # noqa: E402
from dtorch.dispatch.context import KernelContext, KernelParams  # noqa: E402
from dtorch.dispatch.meta import Call  # noqa: E402
from dtorch.kernels.torch import causal_conv1d as ref_conv  # noqa: E402
from dtorch.kernels.torch.gated_delta_net import gated_delta_net_recurrent as ref_gdn  # noqa: E402
from dtorch.kernels.triton import (  # noqa: E402
    causal_conv1d as tri_conv,
    fla as fla_provider,
    gated_delta_net as tri_gdn,
)
from dtorch.kernels.triton.registry import FLOATS, KERNELS  # noqa: E402

INTERPRETED = os.environ["TRITON_INTERPRET"] == "1"
HAS_FLA = importlib.util.find_spec("fla") is not None
# Outputs are rounded to the input dtype from float32 on both sides (one ulp apart at most); states stay float32.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
STATE_TOL = dict(atol=1e-4, rtol=1e-4)
DTYPES = [pytest.param(dt, id=str(dt).removeprefix("torch.")) for dt in FLOATS]


def _ctx(**params) -> KernelContext:
    return KernelContext(Device("cpu"), None, None, KernelParams(**params))


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# -- gated delta rule ----------------------------------------------------------------------------
# One row per case: lengths (a list: packed with cu_seqlens; an int T: the batched form with B = n_seqs), Hk, H, K,
# V, state ("pool": a pool with state_indices, "state": [N, H, K, V], None), final ("inplace": aliases the input
# state, "new", None), params.
GDN_CASES = {
    "decode_pool_inplace": (1, 3, 1, 2, 16, 32, "pool", "inplace", dict(use_qk_l2norm=True)),
    "varlen_pool_inplace": ([3, 1, 0, 6], 0, 1, 2, 16, 32, "pool", "inplace", dict(use_qk_l2norm=True)),
    "varlen_pool_new": ([2, 0, 5], 0, 2, 2, 16, 16, "pool", "new", dict(use_qk_l2norm=True)),
    "batched_prefill_state": (5, 2, 1, 2, 16, 16, "state", "new", dict(scale=0.3)),
    "varlen_no_initial": ([4, 1], 0, 1, 1, 32, 16, None, "new", dict(use_qk_l2norm=True)),
    "no_final_state": ([3, 2], 0, 1, 2, 16, 16, "state", None, dict()),
    "masked_k_two_v_tiles": ([2, 3], 0, 1, 1, 24, 48, "state", "inplace", dict(use_qk_l2norm=True)),
}


def _gdn_inputs(case: str, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """(inputs, a fresh-outputs factory) for ``case``; q, k, v are column views of one fused projection."""
    lengths, b, hk, h, kd, vd, state, final, _ = GDN_CASES[case]
    gen = torch.Generator().manual_seed(seed)
    packed = isinstance(lengths, list)
    n = len(lengths) if packed else b
    bsz, t = (1, sum(lengths)) if packed else (b, lengths)
    qkv = torch.randn(bsz, t, 2 * hk * kd + h * vd, generator=gen).to(dtype)
    q, k, v = qkv.split((hk * kd, hk * kd, h * vd), dim=-1)
    q, k, v = q.unflatten(-1, (hk, kd)), k.unflatten(-1, (hk, kd)), v.unflatten(-1, (h, vd))
    g = torch.nn.functional.logsigmoid(torch.randn(bsz, t, h, generator=gen)).to(dtype)
    beta = torch.rand(bsz, t, h, generator=gen).to(dtype)
    cu = _cu(lengths) if packed else None
    indices = None
    if state == "pool":
        h0 = torch.randn(n + 3, h, kd, vd, generator=gen)
        indices = torch.randperm(n + 3, generator=gen)[:n]
    elif state == "state":
        h0 = torch.randn(n, h, kd, vd, generator=gen)
    else:
        h0 = None
    inputs = [q, k, v, g, beta, h0, cu, indices]
    inputs = [x.to(device) if x is not None else None for x in inputs]

    def outputs(inputs):
        o = torch.full(v.shape, 7.0, dtype=dtype, device=device)
        if final is None:
            return (o,)
        if final == "inplace":
            return (o, inputs[5])
        rows = h0.shape[0] if h0 is not None else n
        return (o, torch.full((rows, h, kd, vd), 5.0, device=device))
    return inputs, outputs


def _compare_gdn(kernel, case: str, dtype: torch.dtype, device: str = "cpu", **extra) -> None:
    params = {"scale": None, "use_qk_l2norm": False, "mode": "chunked", "chunk_size": 64, **GDN_CASES[case][-1],
              **extra}
    results = []
    for fn in (ref_gdn, kernel):
        inputs, outputs = _gdn_inputs(case, dtype, device)
        outs = outputs(inputs)
        fn(_ctx(**params), tuple(inputs), outs)
        results.append([x.cpu() for x in outs])
    (want_o, *want_s), (got_o, *got_s) = results
    torch.testing.assert_close(got_o.float(), want_o.float(), **TOL[dtype])
    for got, want in zip(got_s, want_s, strict=True):
        torch.testing.assert_close(got, want, **STATE_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GDN_CASES)
def test_gated_delta_net_matches_reference(case, dtype):
    _compare_gdn(tri_gdn.gated_delta_net_triton, case, dtype)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy
def test_gated_delta_net_nan_stays_in_its_sequence():
    results = []
    for fn in (ref_gdn, tri_gdn.gated_delta_net_triton):
        inputs, outputs = _gdn_inputs("varlen_pool_new", torch.float32)
        inputs[2][0, 3, 1, 4] = float("nan")  # v of sequence 2's second token, head 1
        outs = outputs(inputs)
        fn(_ctx(scale=None, use_qk_l2norm=True), tuple(inputs), outs)
        results.append(outs)
    (want_o, want_s), (got_o, got_s) = results
    assert got_o[0, :2].isfinite().all() and got_o[0, 3, 1].isnan().any()
    torch.testing.assert_close(got_o, want_o, **STATE_TOL, equal_nan=True)
    torch.testing.assert_close(got_s, want_s, **STATE_TOL, equal_nan=True)


# -- causal conv1d -------------------------------------------------------------------------------
# One row per case: op kind, its triton kernel, its reference, inputs for a dtype, params. Kinds: "full"
# (x [B, D, L], initial_states, final_states out), "update" (conv_state / pool advanced in place), "varlen".
D, W = 80, 4  # 80 channels: two channel tiles, the second masked


def _conv_weights(dtype, gen, bias=True):
    w = torch.randn(D, W, generator=gen).to(dtype)
    return w, (torch.randn(D, generator=gen).to(dtype) if bias else None)


def _full(initial: bool, final: bool, length: int = 9):
    def make(dtype, gen):
        x = torch.randn(2, D, length, generator=gen).to(dtype)
        w, b = _conv_weights(dtype, gen)
        init = torch.randn(2, D, W - 1, generator=gen).to(dtype) if initial else None
        outs = (torch.full_like(x, 7.0), *((torch.full((2, D, W - 1), 5.0, dtype=dtype),) if final else ()))
        return (x, w, b, init), outs
    return make


def _update(batch: int, length: int, keep: int, pool_rows: int | None, two_d: bool = False):
    def make(dtype, gen):
        shape = (batch, D) if two_d else (batch, D, length)
        x = torch.randn(*shape, generator=gen).to(dtype)
        w, b = _conv_weights(dtype, gen, bias=pool_rows is None)
        rows = pool_rows or batch
        pool = torch.randn(rows, D, keep, generator=gen).to(dtype)
        indices = torch.randperm(rows, generator=gen)[:batch] if pool_rows else None
        return (x, w, b, pool, indices), (torch.full_like(x, 7.0), pool)
    return make


def _varlen(lengths: list[int], keep: int):
    def make(dtype, gen):
        t = sum(lengths)
        x = torch.randn(t, 2 * D, generator=gen).to(dtype)[:, D:]  # a column view of a wider projection
        w, b = _conv_weights(dtype, gen)
        pool = torch.randn(len(lengths) + 2, D, keep, generator=gen).to(dtype)
        indices = torch.randperm(len(lengths) + 2, generator=gen)[:len(lengths)]
        return (x, w, b, pool, _cu(lengths), indices), (torch.full((t, D), 7.0, dtype=dtype), pool)
    return make


FULL = (tri_conv.causal_conv1d_triton, ref_conv.causal_conv1d_reference)
UPDATE = (tri_conv.causal_conv1d_update_triton, ref_conv.causal_conv1d_update_reference)
VARLEN = (tri_conv.causal_conv1d_varlen_triton, ref_conv.causal_conv1d_varlen_reference)
CONV_CASES = {
    "full_initial_final": (*FULL, _full(True, True), "silu"),
    "full_zeros_no_final": (*FULL, _full(False, False), None),
    "full_zeros_final": (*FULL, _full(False, True), "silu"),
    "full_empty_x": (*FULL, _full(True, True, length=0), None),  # final_states is initial_states
    "update_decode_pool": (*UPDATE, _update(3, 1, W, pool_rows=5), "silu"),
    "update_2d_x": (*UPDATE, _update(2, 1, W, pool_rows=4, two_d=True), "silu"),
    "update_two_steps_short_state": (*UPDATE, _update(2, 2, W - 1, pool_rows=None), None),
    "varlen_pool": (*VARLEN, _varlen([3, 0, 1, 40, 2], W), "silu"),  # 40 tokens: two token tiles
    "varlen_short_state": (*VARLEN, _varlen([5, 2], W - 1), None),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CONV_CASES)
def test_causal_conv1d_matches_reference(case, dtype):
    kernel, reference, make, activation = CONV_CASES[case]
    results = []
    for fn in (reference, kernel):
        inputs, outputs = make(dtype, torch.Generator().manual_seed(0))
        fn(_ctx(activation=activation), inputs, outputs)
        results.append(outputs)
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


# -- registration ---------------------------------------------------------------------------------
# op -> whether its kernel writes an input in place (as the reference's meta says)
TRITON_OPS = {"llm.gated_delta_net": True, "llm.causal_conv1d": False, "llm.causal_conv1d_update": True,
              "llm.causal_conv1d_varlen": True}


@pytest.mark.parametrize("op", TRITON_OPS)
def test_registered_for_cuda_and_capture_safe(op):
    (entry,) = [e for e in KERNELS.entries if e.op == op and e.provider == "triton"]
    assert entry.devices == ("cuda",) and entry.dtypes == FLOATS
    assert entry.meta.capture_safe and entry.meta.inplace == TRITON_OPS[op]


def test_fla_candidate_declines_with_a_reason_when_missing(monkeypatch):
    (entry,) = [e for e in KERNELS.entries if e.provider == "fla"]
    assert entry.op == "llm.gated_delta_net" and entry.devices == ("cuda",)
    assert entry.meta.inplace and not entry.meta.capture_safe  # fla allocates, and reads cu_seqlens on the host
    monkeypatch.setattr(fla_provider, "_fla", lambda: (None, "flash-linear-attention not installed (test)"))
    assert "not installed" in entry.check(Call(Device("cuda"), torch.bfloat16, KernelParams()))


# -- flash-linear-attention -----------------------------------------------------------------------
# Its fused recurrent kernel (decode, mode="recurrent") runs under triton's interpreter; its chunked kernels need a
# GPU driver (they query the device when launched), so the prefill form is checked on cuda only.
needs_fla = pytest.mark.skipif(not HAS_FLA, reason="flash-linear-attention is not installed")


@needs_fla
@pytest.mark.filterwarnings("ignore")  # fla warns that it runs without a GPU
@pytest.mark.parametrize("case", ["decode_pool_inplace", "varlen_pool_new", "batched_prefill_state"])
def test_fla_recurrent_matches_reference(case):
    _compare_gdn(fla_provider.gated_delta_net_fla, case, torch.float32, mode="recurrent")


@needs_fla
@pytest.mark.parametrize("case", ["varlen_pool_inplace", "varlen_no_initial", "batched_prefill_state"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fla_chunked_matches_reference_on_cuda(case, dtype):
    _compare_gdn(fla_provider.gated_delta_net_fla, case, dtype, device="cuda")


# -- compiled on a GPU ----------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs a CUDA device, TRITON_INTERPRET=0")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GDN_CASES)
def test_gated_delta_net_compiled_on_cuda(case, dtype):
    _compare_gdn(tri_gdn.gated_delta_net_triton, case, dtype, device="cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs a CUDA device, TRITON_INTERPRET=0")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CONV_CASES)
def test_causal_conv1d_compiled_on_cuda(case, dtype):
    kernel, reference, make, activation = CONV_CASES[case]
    inputs, outputs = make(dtype, torch.Generator().manual_seed(0))
    reference(_ctx(activation=activation), inputs, outputs)
    dev_in, dev_out = make(dtype, torch.Generator().manual_seed(0))
    dev_in = tuple(x.cuda() if x is not None else None for x in dev_in)
    dev_out = tuple(x.cuda() for x in dev_out)
    if dev_in[3] is not None and kernel is not tri_conv.causal_conv1d_triton:
        dev_out = (dev_out[0], dev_in[3])  # the state / pool is advanced in place
    kernel(_ctx(activation=activation), dev_in, dev_out)
    for got, want in zip(dev_out, outputs, strict=True):
        torch.testing.assert_close(got.cpu().float(), want.float(), **TOL[dtype])
