"""Op-table rows for the ``llm.*`` ops, appended by the engineers who write those kernels.

Each entry is a ``tests.op_table.Row``; ``tests/test_op_table.py`` imports ``LLM_ROWS`` and runs every row
through the functional wrapper, ``dtorch.ops.invoke``, each candidate provider alone and the prepared
operator (when the op has one), exactly like the generic rows. Append rows here; do not edit the runner.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dtorch import ops
from tests.op_table import HALF_TOL, Row, rand

LLM_ROWS: list = []

# llm.* ops that do not fit a Row (several outputs, optional None inputs, in-place state, host-read offsets),
# with where they are tested instead.
LLM_NOT_IN_TABLE: dict[str, str] = {
    "llm.gated_delta_net": "two outputs (o, final state), optional initial_state/cu_seqlens/state_indices inputs, "
                           "two providers; "
                           "tested in tests/test_gated_delta_net.py against a per-step recurrence and transformers",
    "llm.causal_conv1d": "optional bias/initial_states inputs and an optional second output (final states); "
                         "tested in tests/test_causal_conv1d.py against torch conv1d",
    "llm.causal_conv1d_update": "updates conv_state (or pool rows named by state_indices) in place (output 1 is "
                                "read and written); tested step by step against the full form in "
                                "tests/test_causal_conv1d.py",
    "llm.causal_conv1d_varlen": "packed segments with host-read cu_seqlens, a state pool written in place; tested "
                                "in tests/test_causal_conv1d.py against transformers' causal_conv1d_fn per sequence",
    "llm.gdn_gates": "two outputs (g float32, beta); tested in tests/test_gdn_gates.py against transformers' "
                     "Qwen3NextGatedDeltaNet formula",
    "llm.reshape_and_cache": "writes its two cache inputs in place through a slot mapping; tested in "
                             "tests/test_kv_cache_ops.py against plain indexing",
    "llm.flash_attention_with_kvcache": "reads keys through a block table with host-read lengths; tested in "
                                        "tests/test_kv_cache_ops.py against torch sdpa on the gathered keys",
}


# -- llm.embedding, rms_norm, rope, softmax_last_dim, silu_and_mul, flash_attention(_varlen) -----------
# Rows hold the kernel's inputs (what ``invoke`` gets); ``call`` maps them to the functional wrapper where
# its arguments differ. References compute in float64 from the math, or with torch, and cast back.

ROW_CASES = {"contig": (2, 3, 8), "strided": (2, 3, 8), "size1": (1, 1, 8), "empty": (0, 3, 8)}


def _row_inputs(*widths: int):
    """Inputs [..., w] per width, on the case's leading shape."""
    def make(dtype: torch.dtype, case: str) -> list:
        lead = ROW_CASES[case][:-1]
        return [rand((*lead, w), dtype, case == "strided") for w in widths]
    return make


def _embedding_inputs(dtype: torch.dtype, case: str) -> list:
    lead = ROW_CASES[case][:-1]
    return [rand((7, 8), dtype, case == "strided"), torch.randint(0, 7, lead)]


def _rms_ref(inputs: list, p: dict) -> torch.Tensor:
    x, w = inputs[0].double(), inputs[1].double()
    return (w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + p["eps"])).to(inputs[0].dtype)


# rope: x [B, T, H, D] = [2, 3, 2, 8] (size1: T = 1), positions ride along as a tuple for the wrapper
ROPE_POSITIONS = {"contig": (0, 5, 9), "strided": (3, 4, 5), "size1": (17,), "empty": ()}


def _rope_params(rotary_dim: int, interleaved: bool):
    def params(dtype: torch.dtype, case: str) -> dict:
        return {"rotary_dim": rotary_dim, "interleaved": interleaved, "positions": ROPE_POSITIONS[case]}
    return params


def _rope_angles(positions, rotary_dim: int) -> torch.Tensor:
    inv = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    return torch.tensor(positions, dtype=torch.float64).unsqueeze(-1) * inv  # [T, R/2]


def _rope_inputs(rotary_dim: int):
    def make(dtype: torch.dtype, case: str) -> list:
        angles = _rope_angles(ROPE_POSITIONS[case], rotary_dim)
        x = rand((2, len(ROPE_POSITIONS[case]), 2, 8), dtype, case == "strided")
        return [x, angles.cos().float(), angles.sin().float()]
    return make


def _rope_ref(inputs: list, p: dict) -> torch.Tensor:
    """Multiplication by e^(i * angle) of each rotated pair, as complex numbers."""
    x, r = inputs[0].double(), p["rotary_dim"]
    rot = torch.polar(torch.ones_like(inputs[1].double()), _rope_angles(p["positions"], r)).unsqueeze(-2)
    if p["interleaved"]:
        pairs = torch.view_as_complex(x[..., :r].unflatten(-1, (r // 2, 2)).contiguous())
        rotated = torch.view_as_real(pairs * rot).flatten(-2)
    else:
        z = torch.complex(x[..., : r // 2], x[..., r // 2:r]) * rot
        rotated = torch.cat([z.real, z.imag], -1)
    return torch.cat([rotated, x[..., r:]], -1).to(inputs[0].dtype)


def _rope_call(inputs: list, p: dict) -> torch.Tensor:
    positions = torch.tensor(p["positions"], dtype=torch.long)
    return ops.rope(inputs[0], positions, rotary_dim=p["rotary_dim"], interleaved=p["interleaved"])


# attention: q [B, T, H, D], k/v [B, S, Hkv, D] with H = 4, Hkv = 2; case -> (B, T, S)
ATTN_CASES = {"contig": (2, 3, 5), "strided": (2, 3, 5), "size1": (1, 1, 6), "empty": (1, 0, 4),
              "square": (2, 4, 4), "empty_k": (1, 2, 0)}


def _attn_inputs(dtype: torch.dtype, case: str) -> list:
    b, t, s = ATTN_CASES[case]
    strided = case == "strided"
    return [rand((b, t, 4, 8), dtype, strided), rand((b, s, 2, 8), dtype, strided), rand((b, s, 2, 8), dtype, strided)]


def _attn_ref(inputs: list, p: dict) -> torch.Tensor:
    """softmax(q k^T * scale, bottom-right causal mask) v in float64; rows that see no key are 0."""
    q, k, v = (t.double() for t in inputs)
    t, s = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * p["scale"]
    visible = torch.ones(t, s, dtype=torch.bool)
    if p["causal"]:
        visible = visible.tril(s - t)
    probs = torch.softmax(scores.masked_fill(~visible, -math.inf), -1).nan_to_num(0.0)
    return torch.einsum("bhts,bshd->bthd", probs, v).to(inputs[0].dtype)


def _attn_params(causal: bool):
    return lambda dtype, case: {"causal": causal, "scale": 8 ** -0.5}


# varlen: case -> (query lengths, key lengths) per segment
VARLEN_CASES = {"contig": ((3, 1, 2), (3, 4, 5)), "decode": ((1, 1, 1), (2, 7, 1)), "empty": ((0, 2), (1, 2))}


def _varlen_inputs(dtype: torch.dtype, case: str) -> list:
    lq, lk = VARLEN_CASES[case]
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lq, lk)]
    return [rand((sum(lq), 4, 8), dtype), rand((sum(lk), 2, 8), dtype), rand((sum(lk), 2, 8), dtype), *cu]


def _varlen_params(causal: bool):
    def params(dtype: torch.dtype, case: str) -> dict:
        lq, lk = VARLEN_CASES[case]
        return {"max_seqlen_q": max(lq), "max_seqlen_k": max(lk), "causal": causal, "scale": 0.3}
    return params


def _varlen_ref(inputs: list, p: dict) -> torch.Tensor:
    q, k, v, cu_q, cu_k = inputs
    out = torch.zeros(q.shape, dtype=q.dtype)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bq) - 1):
        seg = [q[None, bq[i]:bq[i + 1]], k[None, bk[i]:bk[i + 1]], v[None, bk[i]:bk[i + 1]]]
        out[bq[i]:bq[i + 1]] = _attn_ref(seg, p)[0]
    return out


LLM_ROWS += [
    Row("llm.embedding", _embedding_inputs, lambda i, p: F.embedding(i[1], i[0]), cases=tuple(ROW_CASES),
        call=lambda i, p: ops.embedding(i[1], i[0])),
    Row("llm.rms_norm", lambda dt, case: _row_inputs(8)(dt, case) + [rand((8,), dt)], _rms_ref, {"eps": 1e-6},
        tol=HALF_TOL, cases=tuple(ROW_CASES)),
    Row("llm.softmax_last_dim", _row_inputs(8), lambda i, p: torch.softmax(i[0].double(), -1).to(i[0].dtype),
        cases=tuple(ROW_CASES)),
    Row("llm.silu_and_mul", _row_inputs(8, 8),
        lambda i, p: (F.silu(i[0].double()) * i[1].double()).to(i[0].dtype), tol=HALF_TOL, cases=tuple(ROW_CASES)),
    Row("llm.gelu_tanh_and_mul", _row_inputs(8, 8),
        lambda i, p: (F.gelu(i[0].double(), approximate="tanh") * i[1].double()).to(i[0].dtype), tol=HALF_TOL,
        cases=tuple(ROW_CASES)),
    Row("llm.rope", _rope_inputs(8), _rope_ref, _rope_params(8, False), tol=HALF_TOL,
        cases=tuple(ROPE_POSITIONS), call=_rope_call, name="half"),
    Row("llm.rope", _rope_inputs(4), _rope_ref, _rope_params(4, True), tol=HALF_TOL,
        cases=tuple(ROPE_POSITIONS), call=_rope_call, name="interleaved_partial"),
    Row("llm.flash_attention", _attn_inputs, _attn_ref, _attn_params(False), tol=HALF_TOL, cases=tuple(ATTN_CASES),
        name="full"),
    Row("llm.flash_attention", _attn_inputs, _attn_ref, _attn_params(True), tol=HALF_TOL, cases=tuple(ATTN_CASES),
        name="causal"),
    Row("llm.flash_attention_varlen", _varlen_inputs, _varlen_ref, _varlen_params(True), tol=HALF_TOL,
        cases=tuple(VARLEN_CASES), name="causal"),
]

LLM_NOT_IN_TABLE["llm.add_rms_norm"] = ("two outputs (normed, updated residual); tested in tests/test_llm_ops.py "
                                        "against transformers' LlamaRMSNorm of residual + x")



# -- llm.moe_experts: x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], weights [T, k], ids [T, k] -------------
# E = 8, k = 2, H = 8, I = 6. "size1" (T*k <= E/4) takes the torch kernel's gathered path, "contig" and "strided"
# its grouped one. The router has two outputs: tests/test_moe.py.

MOE_TOKENS = {"contig": 5, "strided": 5, "size1": 1, "empty": 0}


def _moe_inputs(dtype: torch.dtype, case: str) -> list:
    t, strided = MOE_TOKENS[case], case == "strided"
    ids = torch.rand(t, 8).argsort(-1)[:, :2]  # two distinct experts per token
    return [rand((t, 8), dtype, strided), rand((8, 12, 8), dtype, strided, -0.5, 0.5),
            rand((8, 8, 6), dtype, strided, -0.5, 0.5), rand((t, 2), dtype, low=0.0, high=1.0), ids]


def _moe_ref(inputs: list, p: dict) -> torch.Tensor:
    """sum_j weights[t, j] * down(silu(gate(x)) * up(x)) of expert ids[t, j], in float64 from the math."""
    x, wgu, wd, w = (t.double() for t in inputs[:4])
    ids = inputs[4]
    gate, up = torch.einsum("th,tkih->tki", x, wgu[ids]).chunk(2, -1)  # [T, k, I] each
    y = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, wd[ids])      # [T, k, H]
    return (w.unsqueeze(-1) * y).sum(1).to(inputs[0].dtype)


LLM_ROWS.append(Row("llm.moe_experts", _moe_inputs, _moe_ref, tol=HALF_TOL, cases=tuple(MOE_TOKENS)))
LLM_NOT_IN_TABLE["llm.moe_router"] = ("two outputs (weights, int64 ids); tested in tests/test_moe.py against "
                                      "torch math and transformers' Qwen3MoeTopKRouter")
