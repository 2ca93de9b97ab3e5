"""The triton backend's row kernels against the torch backend's reference kernels, on CPU tensors through the
triton interpreter (TRITON_INTERPRET=1 must be set before triton's ``@triton.jit`` decorates the kernels)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import dtorch.kernels.triton as triton_backend  # noqa: E402
from dtorch.core.device import Device  # noqa: E402
from dtorch.dispatch.context import KernelContext, KernelParams  # noqa: E402
from dtorch.kernels.torch import llm as torch_llm  # noqa: E402
from dtorch.kernels.triton import elementwise as tk  # noqa: E402
from dtorch.kernels.triton.registry import FLOATS, KERNELS  # noqa: E402

CPU = Device("cpu")
T, H, D, R = 5, 3, 32, 16  # tokens, heads, head dim, rotary dims (R < D: dims R.. pass through)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def _ctx(**params) -> KernelContext:
    return KernelContext(CPU, None, None, KernelParams(**params))


def _tables(lead: tuple[int, ...], r: int = R) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.randn(*lead, r // 2) * 3
    return angles.cos(), angles.sin()


def _qkv(dtype: torch.dtype) -> torch.Tensor:
    """q's heads [T, H, D] as a row-strided view of a fused qkv [T, 3H, D], as the model has them."""
    return torch.randn(T, 3 * H, D, dtype=dtype)[:, :H]


# One row per case: op, its triton kernel, its torch reference, inputs for a dtype, params, and which input each
# output aliases in place (None: this case has no in-place form). Outputs are fresh tensors like the first input(s).
CASES = {
    "rms_norm": ("llm.rms_norm", tk.rms_norm, torch_llm.rms_norm_reference,
                 lambda dt: (torch.randn(T, H, D, dtype=dt), torch.randn(D, dtype=dt)), dict(eps=1e-6), (0,)),
    "rms_norm_strided": ("llm.rms_norm", tk.rms_norm, torch_llm.rms_norm_reference,
                         lambda dt: (_qkv(dt), torch.randn(D, dtype=dt)), dict(eps=1e-5), (0,)),
    "rms_norm_1d": ("llm.rms_norm", tk.rms_norm, torch_llm.rms_norm_reference,
                    lambda dt: (torch.randn(24, dtype=dt) * 4, torch.randn(24, dtype=dt)), dict(eps=1e-6), (0,)),
    "add_rms_norm": ("llm.add_rms_norm", tk.add_rms_norm, torch_llm.add_rms_norm_reference,
                     lambda dt: (torch.randn(T, 48, dtype=dt), torch.randn(T, 48, dtype=dt),
                                 torch.randn(48, dtype=dt)), dict(eps=1e-6), (0, 1)),
    "rope": ("llm.rope", tk.rope, torch_llm.rope_reference,
             lambda dt: (torch.randn(T, H, D, dtype=dt), *_tables((T,))),
             dict(rotary_dim=R, interleaved=False), (0,)),
    "rope_full": ("llm.rope", tk.rope, torch_llm.rope_reference,
                  lambda dt: (torch.randn(T, H, 16, dtype=dt), *_tables((T,), 16)),
                  dict(rotary_dim=16, interleaved=False), (0,)),
    "rope_interleaved_batched": ("llm.rope", tk.rope, torch_llm.rope_reference,
                                 lambda dt: (torch.randn(2, T, H, D, dtype=dt), *_tables((2, T), 12)),
                                 dict(rotary_dim=12, interleaved=True), (0,)),  # R/2 = 6: a masked block
    "rope_strided": ("llm.rope", tk.rope, torch_llm.rope_reference,
                     lambda dt: (_qkv(dt), *_tables((T,))), dict(rotary_dim=R, interleaved=False), (0,)),
    "silu_and_mul": ("llm.silu_and_mul", tk.silu_and_mul, torch_llm.silu_and_mul_reference,
                     lambda dt: (torch.randn(T, 40, dtype=dt) * 3, torch.randn(T, 40, dtype=dt)), {}, None),
    "silu_and_mul_halves": ("llm.silu_and_mul", tk.silu_and_mul, torch_llm.silu_and_mul_reference,
                            lambda dt: tuple(torch.randn(2, T, 2 * 1100, dtype=dt).chunk(2, -1)), {}, None),
    "silu_and_mul_fused": ("llm.silu_and_mul", tk.silu_and_mul, torch_llm.silu_and_mul_reference,
                           lambda dt: (torch.randn(T, 2 * 40, dtype=dt) * 3, None), {}, None),
    "gelu_tanh_and_mul": ("llm.gelu_tanh_and_mul", tk.gelu_tanh_and_mul, torch_llm.gelu_tanh_and_mul_reference,
                          lambda dt: (torch.randn(T, 40, dtype=dt) * 3, torch.randn(T, 40, dtype=dt)), {}, None),
    "gelu_tanh_and_mul_fused": ("llm.gelu_tanh_and_mul", tk.gelu_tanh_and_mul,
                                torch_llm.gelu_tanh_and_mul_reference,
                                lambda dt: (torch.randn(T, 2 * 40, dtype=dt) * 3, None), {}, None),
}


def _outputs(op: str, inputs) -> tuple[torch.Tensor, ...]:
    if op == "llm.add_rms_norm":
        return torch.empty_like(inputs[0]), torch.empty_like(inputs[0])
    if op in ("llm.silu_and_mul", "llm.gelu_tanh_and_mul") and inputs[1] is None:
        return (torch.empty_like(inputs[0][..., : inputs[0].shape[-1] // 2]),)
    return (torch.empty_like(inputs[0]),)


def _clone(inputs):
    return tuple(None if t is None else t.clone() for t in inputs)


def _no_fallback(*args):
    raise AssertionError("the triton kernel fell back to the torch kernel")


# silu_and_mul runs out of place only: its kernels are not declared inplace
RUNS = [(case, inplace) for case in CASES for inplace in (False, True) if not inplace or CASES[case][5] is not None]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(("case", "inplace"), RUNS, ids=[f"{c}-{'inplace' if i else 'out'}" for c, i in RUNS])
def test_kernel_matches_reference(case, dtype, inplace, monkeypatch):
    op, kernel, reference, make, params, aliases = CASES[case]
    for name in ("rms_norm_reference", "add_rms_norm_reference", "rope_reference", "silu_and_mul_reference",
                 "gelu_tanh_and_mul_reference"):
        monkeypatch.setattr(torch_llm, name, _no_fallback)  # `reference` is bound already; the kernel must not
    inputs = make(dtype)
    ctx = _ctx(**params)
    want = _outputs(op, inputs)
    reference(ctx, _clone(inputs), want)
    got_inputs = _clone(inputs)
    got = tuple(got_inputs[i] for i in aliases) if inplace else _outputs(op, inputs)
    kernel(ctx, got_inputs, got)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL[dtype])
    if not inplace:  # inputs untouched
        for g, i in zip(got_inputs, inputs, strict=True):
            assert g is None or torch.equal(g, i)


def test_rope_positions_form_falls_back_to_the_reference():
    x, positions = torch.randn(T, H, D), torch.arange(T)
    ctx = _ctx(rotary_dim=R, interleaved=False, inv_freq=tuple(torch.rand(R // 2).tolist()))
    want, got = torch.empty_like(x), torch.empty_like(x)
    torch_llm.rope_reference(ctx, (x, positions), (want,))
    tk.rope(ctx, (x, positions), (got,))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("op", ["llm.rms_norm", "llm.add_rms_norm", "llm.rope", "llm.silu_and_mul",
                                "llm.gelu_tanh_and_mul"])
def test_kernels_are_declared_for_cuda(op):
    entries = [e for e in KERNELS.entries if e.op == op and e.provider == "triton"]
    assert len(entries) == 1, entries
    (e,) = entries
    assert e.devices == ("cuda",) and set(e.dtypes) == set(FLOATS)
    meta = e.meta or torch_llm.INPLACE.__class__()
    assert meta.capture_safe
    assert meta.inplace == (op not in ("llm.silu_and_mul", "llm.gelu_tanh_and_mul"))  # as the torch kernels


def test_unavailable_says_why():
    assert "cpu" in triton_backend.unavailable("cpu")
    if not torch.cuda.is_available():
        assert triton_backend.unavailable("cuda")
