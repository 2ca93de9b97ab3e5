"""llm.gdn_gates against the formula of transformers' Qwen3NextGatedDeltaNet (beta = b.sigmoid(),
g = -A_log.float().exp() * softplus(a.float() + dt_bias)), both providers, out form, graph placements, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import ops
from dtorch.dispatch import dispatcher
from dtorch.graph import DeviceMesh, LogicalGraph, Replicate, Shard
from dtorch.runtime import Runner

ALL_PROVIDERS = ("native", "torch", "reference")
PROVIDERS = tuple(p for p in ALL_PROVIDERS if p not in dispatcher.unavailable("cpu"))
NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # the native kernel's keys


def only(provider):
    """Every other provider of llm.gdn_gates disabled."""
    return dispatcher.disabled(*(set(ALL_PROVIDERS) - {provider}))


def want(a, b, a_log, dt_bias):
    """transformers' Qwen3NextGatedDeltaNet.forward, verbatim."""
    beta = b.sigmoid()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta


def make(t=5, h=4, dtype=torch.float32, param_dtype=torch.float32):
    return (torch.randn(t, h, dtype=dtype) * 3, torch.randn(t, h, dtype=dtype), torch.randn(h, dtype=param_dtype),
            torch.randn(h, dtype=param_dtype))


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("dtype,param_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32), (torch.float16, torch.float32)])
def test_matches_the_transformers_formula(provider, dtype, param_dtype):
    if provider == "native" and dtype not in NATIVE_DTYPES:
        pytest.skip("native registers float32 and bfloat16 only; other dtypes run the torch kernel")
    args = make(dtype=dtype, param_dtype=param_dtype)
    with only(provider):
        g, beta = ops.gdn_gates(*args)
    g_want, beta_want = want(*args)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    torch.testing.assert_close(g, g_want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(beta, beta_want, rtol=0, atol=0)


def test_out_form_and_strided_inputs():
    ab = torch.randn(6, 8)
    a, b = ab[:, :4], ab[:, 4:]                                 # column views of one projection
    _, _, a_log, dt_bias = make()
    g, beta = torch.empty(6, 4), torch.empty(6, 4)
    assert ops.gdn_gates_out(a, b, a_log, dt_bias, g_out=g, beta_out=beta) == (g, beta)
    g_want, beta_want = want(a, b, a_log, dt_bias)
    torch.testing.assert_close(g, g_want)
    torch.testing.assert_close(beta, beta_want)


@pytest.mark.parametrize("pl", ["R", "tokens", "heads"])
def test_graph_on_two_devices_equals_one(pl):
    a, b, a_log, dt_bias = make(t=6, h=4)
    act, par = {"R": (Replicate(), Replicate()), "tokens": (Shard(0), Replicate()), "heads": (Shard(1), Shard(0))}[pl]
    g = LogicalGraph(DeviceMesh.cpu(2))
    ga, gb = g.input("a", a.shape, placement=act), g.input("b", b.shape, placement=act)
    gg, gbeta = g.call("llm.gdn_gates", ga, gb, g.param("A_log", a_log, par), g.param("dt_bias", dt_bias, par))
    assert (gg.placement, gbeta.placement) == (act, act) and gg.dtype == torch.float32
    g.output("g", gg)
    g.output("beta", gbeta)
    with Runner(g) as r:
        got = r.run({"a": a, "b": b})
    g_want, beta_want = want(a, b, a_log, dt_bias)
    torch.testing.assert_close(got["g"], g_want)
    torch.testing.assert_close(got["beta"], beta_want)


@pytest.mark.parametrize("call,error,words", [
    (lambda a, b, al, dt: ops.gdn_gates(a, b[:, :3], al, dt), dtorch.ShapeError, "'b'"),
    (lambda a, b, al, dt: ops.gdn_gates(a, b, al[:3], dt), dtorch.ShapeError, "'A_log'"),
    (lambda a, b, al, dt: ops.gdn_gates(a, b, al, dt[None]), dtorch.ShapeError, "'dt_bias'"),
    (lambda a, b, al, dt: ops.gdn_gates(a[None], b, al, dt), dtorch.ShapeError, "rank 2"),
    (lambda a, b, al, dt: ops.gdn_gates(a, b.double(), al, dt), dtorch.DTypeError, "disagree"),
    (lambda a, b, al, dt: ops.gdn_gates(a, b, al.int(), dt), dtorch.DTypeError, "'A_log'"),
    (lambda a, b, al, dt: ops.gdn_gates_out(a, b, al, dt, g_out=torch.empty(5, 4, dtype=torch.bfloat16),
                                            beta_out=torch.empty(5, 4)), dtorch.DTypeError, "'g_out'"),
])
def test_bad_inputs_name_the_argument(call, error, words):
    with pytest.raises(error, match=words) as info:
        call(*make())
    assert "llm.gdn_gates" in str(info.value)
