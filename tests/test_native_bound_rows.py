"""Bound native calls (``bind``, what a static plan's bare loop runs each step for a declared row, rope and
cache_store): parsed and checked once, then run with no arguments; the same bits as the module function on the same
tensors, torch's values, and the kernel's fallback where the C++ refuses the tensors at bind time. Every ISA path this
CPU runs."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

import dtorch.kernels.native as nk
from dtorch.core.device import Device
from dtorch.core.errors import ArgumentError, LayoutError
from dtorch.dispatch.context import KernelContext, KernelParams
from dtorch.kernels.native import kernels

_REASON = nk.unavailable_reason()
# two intra-op threads (conftest gives one): the kernels split rows among threads, and each row's bits must not
# depend on the split
pytestmark = [pytest.mark.skipif(_REASON is not None, reason=f"native kernels unavailable: {_REASON}"),
              pytest.mark.usefixtures("two_threads")]
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def _rms(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    hf = h.float()
    return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def _cases(dtype: torch.dtype):
    """(row name, its arguments, the outputs it writes, torch's values of them): a decode row, rows, token-strided
    heads (a fused qkv output's q heads), the fused gate/up halves, in place."""
    g = torch.Generator().manual_seed(3)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)
    x, w, res = r(1, 896), r(896), r(1, 896)
    qkv = r(3, (6 + 2 * 2) * 64)
    heads, wh = qkv[:, :6 * 64].view(3, 6, 64), r(64)
    gu = 3 * r(2, 2 * 1536)
    gate, up = gu.chunk(2, -1)
    out, o2, o3, o4, o5 = (torch.empty(1, 896, dtype=dtype), torch.empty(3, 6, 64, dtype=dtype),
                           torch.empty(2, 1536, dtype=dtype), torch.empty(2, 1536, dtype=dtype),
                           torch.empty(1, 896, dtype=dtype))
    res2 = res.clone()
    return [
        ("rms_norm", (x, w, out, 1e-6), (out,), (_rms(x, w, 1e-6),)),
        ("rms_norm", (heads, wh, o2, 1e-5), (o2,), (_rms(heads, wh, 1e-5),)),
        ("add_rms_norm", (x, res2, w, o5, res2, 1e-6), (o5, res2), (_rms(res + x, w, 1e-6), res + x)),
        ("silu_and_mul", (gu, None, o3), (o3,), (F.silu(gate) * up,)),
        ("gelu_tanh_and_mul", (gate, up, o4), (o4,), (F.gelu(gate, approximate="tanh") * up,)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bound_row_gives_the_row_functions_bits(dtype, isa):
    mod = nk.load()
    for name, args, outs, want in _cases(dtype):
        fn = getattr(mod, name)
        saved = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        fn(*args)
        direct = [o.clone() for o in outs]
        for a, s in zip(args, saved, strict=True):  # the inputs back (add_rms_norm updates its residual in place)
            if isinstance(a, torch.Tensor):
                a.copy_(s)
        for o in outs:
            if o.data_ptr() not in {a.data_ptr() for a in args[:2] if isinstance(a, torch.Tensor)}:
                o.fill_(float("nan"))
        bound = mod.bind(fn, *args)
        assert type(bound).__name__ == "BoundCall"
        bound()
        for o, d, t in zip(outs, direct, want, strict=True):
            assert torch.equal(o, d), f"{name} {isa}: the bound call's bits differ from the direct call's"
            torch.testing.assert_close(o, t, **TOL[dtype], msg=f"{name} {isa} against torch")


def test_a_bound_row_keeps_its_tensors_and_takes_no_arguments():
    mod = nk.load()

    def make(out):
        x, w = torch.randn(4, 256), torch.rand(256)
        return mod.bind(mod.rms_norm, x, w, out, 1e-6), _rms(x, w, 1e-6)
    out = torch.empty(4, 256)
    bound, want = make(out)
    gc.collect()
    for _ in range(3):  # the same call each step
        out.zero_()
        bound()
        torch.testing.assert_close(out, want, **TOL[torch.float32])
    with pytest.raises(TypeError, match="takes no arguments"):
        bound(1)
    with pytest.raises(ArgumentError, match="a declared row's module function, rope or cache_store"):
        mod.bind(mod.qlinear, out)


def test_a_call_the_cpp_refuses_binds_to_the_fallback():
    """Refused at bind (a last dim that is not dense): the error bind raises is the row function's; the row
    kernel's bound call is then its closure with the torch fallback, which still gives torch's values."""
    mod = nk.load()
    x, w = torch.randn(2, 64, 2)[..., 0], torch.rand(64)
    out = torch.empty(2, 64)
    with pytest.raises(LayoutError, match="must be dense in its last dim"):
        mod.bind(mod.rms_norm, x, w, out, 1e-6)
    (entry,) = [e for e in kernels.KERNELS.entries if e.op == "llm.rms_norm" and e.provider == "native"]
    ctx = KernelContext(Device("cpu"), None, None, KernelParams(eps=1e-6))
    bound = entry.fn.bind(ctx, (x, w), (out,))
    assert type(bound).__name__ != "BoundCall"
    bound()
    torch.testing.assert_close(out, _rms(x, w, 1e-6), **TOL[torch.float32])
    ok = entry.fn.bind(ctx, (x.contiguous(), w), (out,))
    assert type(ok).__name__ == "BoundCall"


def test_a_bound_row_runs_the_isa_in_use_at_its_call():
    """bind keeps the row, not its kernel: after use_isa the bound call runs that ISA's kernel (the same bits as
    the row function called under it)."""
    mod = nk.load()
    x = 5 * torch.randn(3, 2 * 700)
    out, want = torch.empty(3, 700), torch.empty(3, 700)
    bound = mod.bind(mod.silu_and_mul, x, None, out)
    for isa in nk.available_isas():
        with nk.use_isa(isa):
            mod.silu_and_mul(x, None, want)
            bound()
            assert torch.equal(out, want), isa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bound_rope_and_cache_store_read_their_buffers_each_call(dtype, isa):
    """rope on a fused q/k view and the cache write, bound once; each call reads the buffers' values then (new cos and
    sin, a new slot, as each decode step writes its feeds): the same bits as the direct calls, torch's rotation, and
    a slot past the cache refused at the call that reads it."""
    mod = nk.load()
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(1, (4 + 2 * 2) * 64, generator=g).to(dtype)
    qk = qkv[:, :6 * 64].view(1, 6, 64)
    cos, sin = torch.empty(1, 32), torch.empty(1, 32)
    kc, vc = torch.zeros(3, 4, 2, 64, dtype=dtype), torch.zeros(3, 4, 2, 64, dtype=dtype)
    k, v = qkv[:, 4 * 64:6 * 64].view(1, 2, 64), qkv[:, 6 * 64:].view(1, 2, 64)
    slots = torch.zeros(1, dtype=torch.int64)
    rope, store = mod.bind(mod.rope, qk, cos, sin, qk, 64, False), mod.bind(mod.cache_store, k, v, kc, vc, slots)
    assert type(rope).__name__ == type(store).__name__ == "BoundCall"
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    for pos in (3, 9):
        ang = pos * inv
        cos[0], sin[0] = ang.cos(), ang.sin()
        slots[0] = pos
        before = qk.clone()
        want = qk.clone()
        mod.rope(want, cos, sin, want, 64, False)
        x1, x2 = before.float()[..., :32], before.float()[..., 32:]
        rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(dtype)
        rope()
        assert torch.equal(qk, want)
        torch.testing.assert_close(qk, rot, **TOL[dtype])
        store()
        assert torch.equal(kc.flatten(0, 1)[pos], k[0]) and torch.equal(vc.flatten(0, 1)[pos], v[0])
    slots[0] = 12
    with pytest.raises(ArgumentError, match="slot 12 is past the cache's 12 rows"):
        store()
