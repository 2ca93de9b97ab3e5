"""llm.embedding, rms_norm, add_rms_norm, rope, softmax_last_dim and silu_and_mul against torch and
transformers' Llama modules; each numeric case runs with the active provider and the reference only."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

import dtorch
from dtorch import ops
from dtorch.core.dtypes import tolerance

PROVIDERS = ["active", "reference"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def providers(which: str):
    return contextlib.nullcontext() if which == "active" else dtorch.dispatcher.disabled("torch", "sdpa")


def close(got, want, dtype, scale=1.0):
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol * scale, atol=atol * scale)


def init(dtype=torch.float32):
    return dtorch.OperatorInitContext("cpu", dtype)


# -- embedding -----------------------------------------------------------------------------------

@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_matches_torch(id_dtype, dtype):
    weight = torch.randn(11, 6).to(dtype)
    ids = torch.randint(0, 11, (2, 3), dtype=id_dtype)
    got = ops.embedding(ids, weight)
    assert torch.equal(got, F.embedding(ids.long(), weight))
    out = torch.empty(6, 4, 6, dtype=dtype).transpose(0, 1)[:2, :3]  # a strided out
    ops.embedding_out(ids, weight, out=out)
    assert torch.equal(out, got)
    prepared = ops.Embedding().prepare(init(dtype))
    assert torch.equal(prepared.forward(ids, weight), got)


def test_embedding_bad_inputs():
    weight = torch.randn(5, 3)
    with pytest.raises(dtorch.ArgumentError, match="id 7"):
        ops.embedding(torch.tensor([1, 7]), weight)
    with pytest.raises(dtorch.ArgumentError, match="id -1"):
        ops.embedding(torch.tensor([-1, 2]), weight)
    with pytest.raises(dtorch.DTypeError, match="'ids'"):
        ops.embedding(torch.tensor([1.0]), weight)
    with pytest.raises(dtorch.ShapeError, match="'weight'"):
        ops.embedding(torch.tensor([1]), torch.randn(5))
    with pytest.raises(dtorch.ShapeError, match="'out'"):
        ops.embedding_out(torch.tensor([1]), weight, out=torch.empty(2, 3))
    assert ops.embedding(torch.empty(0, dtype=torch.long), weight).shape == (0, 3)
    meta = ops.embedding(torch.empty(4, 2, dtype=torch.long, device="meta"), weight.to("meta"))
    assert meta.shape == (4, 2, 3)


# -- rms_norm ------------------------------------------------------------------------------------

def llama_rms_norm(x, weight, eps):
    mod = LlamaRMSNorm(x.shape[-1], eps=eps).to(x.dtype)
    with torch.no_grad():
        mod.weight.copy_(weight)
        return mod(x)


@pytest.mark.parametrize("which", PROVIDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_llama(which, dtype):
    x = torch.randn(3, 5, 32).to(dtype)
    weight = (1 + 0.1 * torch.randn(32)).to(dtype)
    with providers(which):
        got = ops.rms_norm(x, weight, 1e-5)
        strided = ops.rms_norm(x.transpose(0, 1), weight, 1e-5)
        inplace = x.clone()
        ops.rms_norm_out(inplace, weight, 1e-5, out=inplace)
    want = llama_rms_norm(x, weight, 1e-5)
    if dtype == torch.float64:  # LlamaRMSNorm computes in float32 even for float64; dtorch keeps float64
        want = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    close(got, want, dtype)
    close(strided, want.transpose(0, 1), dtype)
    close(inplace, want, dtype)


@pytest.mark.parametrize("which", PROVIDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_updates_residual(which, dtype):
    x, residual = torch.randn(4, 16).to(dtype), torch.randn(4, 16).to(dtype)
    weight = torch.randn(16).to(dtype)
    summed = residual + x
    want = llama_rms_norm(summed, weight, 1e-6)
    with providers(which):
        out, res = ops.add_rms_norm(x, residual, weight)
        close(out, want, dtype)
        assert torch.equal(res, summed)
        stream = residual.clone()
        out2 = torch.empty_like(x)
        ops.add_rms_norm_out(x, stream, weight, out=out2)  # residual updated in place
        assert torch.equal(stream, summed)
        close(out2, want, dtype)
        prepared = ops.AddRMSNorm(1e-6).prepare(init(dtype))
        stream = residual.clone()
        out3, res3 = prepared.forward_out(x, stream, weight, out=torch.empty_like(x))
        assert res3 is stream and torch.equal(stream, summed) and torch.equal(out3, out2)


def _native() -> bool:
    """Whether the native CPU backend loaded here (it registers rms_norm, silu_and_mul and rope over torch's)."""
    return "native" not in dtorch.dispatcher.unavailable("cpu")


def test_rms_norm_prepared_and_errors():
    x, weight = torch.randn(2, 8), torch.randn(8)
    op = ops.RMSNorm(1e-6).prepare(init())
    assert op.provider == ("native" if _native() else "torch")
    assert torch.equal(op.forward(x, weight), ops.rms_norm(x, weight))
    with pytest.raises(dtorch.ShapeError, match="'weight'"):
        ops.rms_norm(x, torch.randn(4))
    with pytest.raises(dtorch.DTypeError, match="dtypes disagree"):
        ops.rms_norm(x, weight.double())
    with pytest.raises(dtorch.ArgumentError, match="eps"):
        ops.rms_norm(x, weight, -1.0)
    with pytest.raises(dtorch.ShapeError, match="'residual'"):
        ops.add_rms_norm(x, torch.randn(3, 8), weight)
    with pytest.raises(dtorch.ShapeError, match="'out'"):
        ops.rms_norm_out(x, weight, out=torch.empty(2, 9))
    with pytest.raises(dtorch.DTypeError, match="'x'"):
        ops.rms_norm(torch.ones(2, 8, dtype=torch.int64), torch.ones(8, dtype=torch.int64))
    assert ops.rms_norm(x.to("meta"), weight.to("meta")).shape == (2, 8)


# -- rope ----------------------------------------------------------------------------------------

def llama_rope(x, positions, theta, rope_scaling=None):
    """x [B, T, H, D], positions [B, T] -> x rotated by transformers' Llama rotary embedding (half rotation)."""
    d = x.shape[-1]
    cfg = LlamaConfig(hidden_size=d * x.shape[2], num_attention_heads=x.shape[2], head_dim=d, rope_theta=theta,
                      max_position_embeddings=131072, rope_scaling=rope_scaling)
    emb = LlamaRotaryEmbedding(cfg)
    cos, sin = emb(x.float(), positions)
    rotated, _ = apply_rotary_pos_emb(x.float(), x.float(), cos, sin, unsqueeze_dim=2)
    return rotated, emb.inv_freq


def complex_rope(x, positions, theta, rotary_dim):
    """Interleaved (GPT-J) rotation of the first rotary_dim dims via complex multiplication."""
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2).double() / rotary_dim)
    angles = positions.double()[..., None] * inv  # [..., T, R/2]
    rot = torch.polar(torch.ones_like(angles), angles).unsqueeze(-2)  # [..., T, 1, R/2]
    pairs = torch.view_as_complex(x[..., :rotary_dim].double().unflatten(-1, (rotary_dim // 2, 2)).contiguous())
    return torch.cat([torch.view_as_real(pairs * rot).flatten(-2), x[..., rotary_dim:].double()], -1)


@pytest.mark.parametrize("which", PROVIDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_half_rotation_matches_llama(which, dtype):
    x = torch.randn(2, 5, 3, 16).to(dtype)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    want, _ = llama_rope(x, positions, 10000.0)
    with providers(which):
        close(ops.rope(x, positions), want, dtype, scale=2)
        close(ops.rope(x[0], positions[0]), want[0], dtype, scale=2)  # [T, H, D] with positions [T]
        close(ops.rope(x, positions[1]), llama_rope(x, positions[1].expand(2, 5), 10000.0)[0], dtype, scale=2)


def test_rope_partial_and_scaled_frequencies():
    x = torch.randn(1, 4, 2, 12)
    positions = torch.arange(3, 7).unsqueeze(0)
    rotated, _ = llama_rope(x[..., :8].contiguous(), positions, 500000.0)
    got = ops.rope(x, positions, theta=500000.0, rotary_dim=8)
    close(got, torch.cat([rotated, x[..., 8:]], -1), torch.float32)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    big = torch.arange(100, 104).unsqueeze(0)
    want, inv_freq = llama_rope(x, big, 500000.0, scaling)
    close(ops.rope(x, big, inv_freq=inv_freq.float()), want, torch.float32)


@pytest.mark.parametrize("which", PROVIDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [8, 16])
def test_rope_interleaved_matches_complex(which, dtype, rotary_dim):
    x = torch.randn(2, 4, 3, 16).to(dtype)
    positions = torch.arange(8).view(2, 4)
    with providers(which):
        got = ops.rope(x, positions, rotary_dim=rotary_dim, interleaved=True)
    close(got, complex_rope(x, positions, 10000.0, rotary_dim), dtype, scale=2)


def test_rope_prepared_in_place_on_views():
    qkv = torch.randn(2, 3, 4 + 2 + 2, 16)  # fused projection [B, T, H + 2 Hkv, D]
    q, k = qkv[:, :, :4], qkv[:, :, 4:6]
    positions = torch.tensor([[5, 6, 7], [0, 1, 2]])
    want_q, want_k = ops.rope(q, positions), ops.rope(k, positions)
    rope = ops.RoPE(16, max_positions=32).prepare(init())
    assert torch.equal(rope.forward(q, positions), want_q)
    v_before = qkv[:, :, 6:].clone()
    rope.apply_(q, k, positions)
    close(q, want_q, torch.float32)
    close(k, want_k, torch.float32)
    assert torch.equal(qkv[:, :, 6:], v_before)  # v untouched
    x = torch.randn(4, 2, 16)  # [T, H, D]
    close(rope.forward_(x.clone(), torch.arange(4)), ops.rope(x, torch.arange(4)), torch.float32)
    partial = ops.RoPE(16, rotary_dim=8, interleaved=True, max_positions=8).prepare(init())
    close(partial.forward(x, torch.arange(4)), ops.rope(x, torch.arange(4), rotary_dim=8, interleaved=True),
          torch.float32)
    with pytest.raises(dtorch.ArgumentError, match="position 40"):
        rope.forward(x, torch.tensor([0, 1, 2, 40]))
    with pytest.raises(dtorch.ArgumentError, match="position -1"):
        rope.forward(x, torch.tensor([-1, 1, 2, 3], dtype=torch.int32))
    close(rope.forward(x, torch.arange(4, dtype=torch.int32)), ops.rope(x, torch.arange(4)), torch.float32)
    with pytest.raises(dtorch.ShapeError, match="head dim"):
        rope.forward(torch.randn(4, 1, 8), torch.arange(4))


@pytest.mark.parametrize("call, error, match", [
    (lambda x, p: ops.rope(x[0, 0], p), dtorch.ShapeError, "rank >= 3"),
    (lambda x, p: ops.rope(x, p[:2]), dtorch.ShapeError, "T = 4"),
    (lambda x, p: ops.rope(x[0], p.view(1, 4)), dtorch.ShapeError, r"\[B, T\]"),
    (lambda x, p: ops.rope(x, p.float()), dtorch.DTypeError, "'positions'"),
    (lambda x, p: ops.rope(x, p, rotary_dim=5), dtorch.ArgumentError, "even"),
    (lambda x, p: ops.rope(x, p, rotary_dim=32), dtorch.ArgumentError, "exceeds"),
    (lambda x, p: ops.rope(x, p, theta=0.0), dtorch.ArgumentError, "theta"),
    (lambda x, p: ops.rope(x, p, interleaved="yes"), dtorch.ArgumentError, "interleaved"),
    (lambda x, p: ops.rope(x, p, inv_freq=torch.ones(3)), dtorch.ShapeError, "inv_freq"),
    (lambda x, p: ops.rope(x, p, inv_freq=torch.ones(8, dtype=torch.float64)), dtorch.DTypeError, "inv_freq"),
    (lambda x, p: ops.rope_out(x, p, out=torch.empty(2, 4, 3, 8)), dtorch.ShapeError, "'out'"),
    (lambda x, p: ops.RoPE(16, rotary_dim=3), dtorch.ArgumentError, "even"),
])
def test_rope_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.randn(2, 4, 3, 16), torch.arange(4))


def test_rope_meta_shapes():
    x = torch.empty(2, 4, 3, 16, device="meta")
    assert ops.rope(x, torch.empty(2, 4, dtype=torch.long, device="meta")).shape == (2, 4, 3, 16)


# -- softmax_last_dim, silu_and_mul --------------------------------------------------------------

@pytest.mark.parametrize("which", PROVIDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_last_dim(which, dtype):
    x = (3 * torch.randn(4, 3, 33)).to(dtype)
    with providers(which):
        got = ops.softmax_last_dim(x)
        strided = ops.softmax_last_dim(x.transpose(0, 1))
        inplace = x.clone()
        ops.softmax_last_dim_out(inplace, out=inplace)
    want = torch.softmax(x.double(), -1)
    close(got, want, dtype)
    close(strided, want.transpose(0, 1), dtype)
    close(inplace, want, dtype)
    assert ops.softmax_last_dim(torch.empty(0, 5, dtype=dtype)).shape == (0, 5)


@pytest.mark.parametrize("which", PROVIDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(which, dtype):
    x = torch.randn(3, 2, 24).to(dtype)
    want = F.silu(x[..., :12].double()) * x[..., 12:].double()
    with providers(which):
        close(ops.silu_and_mul(x), want, dtype, scale=2)
        close(ops.silu_and_mul(x[..., :12], x[..., 12:]), want, dtype, scale=2)  # two-input form, strided views
        out = torch.empty(3, 2, 12, dtype=dtype)
        ops.silu_and_mul_out(x, out=out)
        close(out, want, dtype, scale=2)
        prepared = ops.SiluAndMul().prepare(init(dtype))
        assert torch.equal(prepared.forward(x), ops.silu_and_mul(x))


def test_softmax_silu_errors_and_meta():
    with pytest.raises(dtorch.ShapeError, match="even"):
        ops.silu_and_mul(torch.randn(2, 5))
    with pytest.raises(dtorch.ShapeError, match="'up'"):
        ops.silu_and_mul(torch.randn(2, 4), torch.randn(2, 3))
    with pytest.raises(dtorch.DTypeError, match="dtypes disagree"):
        ops.silu_and_mul(torch.randn(2, 4), torch.randn(2, 4).double())
    with pytest.raises(dtorch.ShapeError, match="'out'"):
        ops.silu_and_mul_out(torch.randn(2, 4), out=torch.empty(2, 4))
    with pytest.raises(dtorch.DTypeError, match="'x'"):
        ops.softmax_last_dim(torch.ones(3, dtype=torch.int32))
    with pytest.raises(dtorch.ShapeError, match="rank"):
        ops.softmax_last_dim(torch.tensor(1.0))
    assert ops.silu_and_mul(torch.empty(3, 8, device="meta")).shape == (3, 4)
    assert ops.softmax_last_dim(torch.empty(3, 8, device="meta")).shape == (3, 8)


def test_prepared_explain_names_the_providers():
    native = _native()
    for op, provider in ((ops.RMSNorm(), "native" if native else "torch"),
                         (ops.SiluAndMul(), "native" if native else "torch"), (ops.Embedding(), "reference"),
                         (ops.RoPE(8), "native" if native else "reference")):
        op.prepare(init())
        text = str(op.explain())
        assert op.provider == provider and provider in text


def test_verify_mode_covers_in_place_kernels():
    x, w = torch.randn(2, 3, 4, 16), torch.randn(16)
    with dtorch.verify():
        inplace = x.clone()
        ops.rope_out(inplace, torch.arange(3), out=inplace, ctx=dtorch.RuntimeContext("cpu"))
        ops.rms_norm_out(x, w, out=torch.empty_like(x))
        ops.softmax_last_dim(x)
        ops.silu_and_mul(x)
    close(inplace, ops.rope(x, torch.arange(3)), torch.float32)


def test_rope_tables_gathered_once_serve_every_call():
    rope = ops.RoPE(16, max_positions=32).prepare(init())
    qk = torch.randn(3, 4 + 2, 16)  # [T, H + Hkv, D]: q and k heads side by side, rotated by one call
    positions = torch.tensor([7, 8, 9])
    want = ops.rope(qk, positions)
    tables = rope.tables(positions)
    assert rope.forward_(qk, tables) is qk
    close(qk, want, torch.float32)
    q, k = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16)  # [B, T, H, D] with positions [T]: a valid broadcast
    want_q, want_k = ops.rope(q, positions), ops.rope(k, positions)
    rope.apply_(q, k, tables)
    close(q, want_q, torch.float32)
    close(k, want_k, torch.float32)
    with pytest.raises(dtorch.ShapeError, match=r"must have T = 1 .*got \(3,\)"):
        rope.forward_(torch.randn(1, 4, 16), tables)  # one row would broadcast silently over three positions
    with pytest.raises(dtorch.ShapeError, match="head dim"):
        rope.forward_(torch.randn(3, 4, 8), tables)
    with pytest.raises(dtorch.DTypeError, match="prepared for float32"):
        rope.forward_(torch.randn(3, 4, 16).double(), tables)
    with pytest.raises(dtorch.ArgumentError, match="another RoPE"):
        ops.RoPE(16, max_positions=32).prepare(init()).forward_(qk, tables)
    with pytest.raises(dtorch.ArgumentError, match="position 40"):
        rope.tables(torch.tensor([40]))
    with pytest.raises(dtorch.DTypeError, match="'positions'"):
        rope.tables(positions.float())


@pytest.mark.parametrize("call, error, match", [
    # what the prepared hot paths must still catch: torch would broadcast, resize out or promote silently
    (lambda x, w: ops.RMSNorm().prepare(init()).forward_out(x, w, out=torch.empty(1, 8)), dtorch.ShapeError, "'out'"),
    (lambda x, w: ops.RMSNorm().prepare(init()).forward_out(x, w[:1], out=x), dtorch.ShapeError, "'weight'"),
    (lambda x, w: ops.RMSNorm().prepare(init()).forward_out(x, w.double(), out=x), dtorch.DTypeError, "disagree"),
    (lambda x, w: ops.RMSNorm().prepare(init()).forward_out(x.double(), w, out=x), dtorch.DTypeError, "prepared"),
    (lambda x, w: ops.AddRMSNorm().prepare(init()).forward_out(x[:1], x, w, out=x), dtorch.ShapeError, "'residual'"),
    (lambda x, w: ops.AddRMSNorm().prepare(init()).forward_out(x, x.double(), w, out=x), dtorch.DTypeError,
     "disagree"),
    (lambda x, w: ops.AddRMSNorm().prepare(init()).forward_out(x, x.clone(), w, out=x, residual_out=x[:, :4]),
     dtorch.ShapeError, "'out'"),
    (lambda x, w: ops.AddRMSNorm().prepare(init()).forward_out(x, [1.0], w, out=x), dtorch.DTypeError,
     "torch.Tensor"),
    (lambda x, w: ops.SiluAndMul().prepare(init()).forward_out(x, out=torch.empty(3, 8)), dtorch.ShapeError, "'out'"),
    (lambda x, w: ops.SiluAndMul().prepare(init()).forward_out(x, out=torch.empty(3, 4).double()), dtorch.DTypeError,
     "'out'"),
    (lambda x, w: ops.SiluAndMul().prepare(init()).forward_out(x[:, :7], out=torch.empty(3, 3)), dtorch.ShapeError,
     "even"),
    (lambda x, w: ops.RMSNorm().forward_out(x, w, out=x), dtorch.ArgumentError, "not prepared"),
    (lambda x, w: ops.RMSNorm().prepare(init()).forward_out([1.0], w, out=x), dtorch.DTypeError, "torch.Tensor"),
    (lambda x, w: ops.AddRMSNorm().prepare(init()).forward_out(None, x, w, out=x), dtorch.DTypeError, "torch.Tensor"),
    (lambda x, w: ops.RoPE(8).prepare(init()).forward([1.0], torch.arange(3)), dtorch.DTypeError, "torch.Tensor"),
])
def test_prepared_hot_paths_reject_bad_calls(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.randn(3, 8), torch.randn(8))


def test_prepared_norms_match_functional():
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    norm, add_norm = ops.RMSNorm(1e-5).prepare(init()), ops.AddRMSNorm(1e-5).prepare(init())
    assert torch.equal(norm.forward(x, w), ops.rms_norm(x, w, 1e-5))
    want_out, want_res = ops.add_rms_norm(x, r, w, 1e-5)
    out, res = add_norm.forward(x, r, w)
    assert torch.equal(out, want_out) and torch.equal(res, want_res)
    res = r.clone()
    add_norm.forward_out(x, res, w, out=torch.empty_like(x))  # residual updated in place
    assert torch.equal(res, want_res)
