"""``llm.gated_delta_net``: the gated delta rule of Gated DeltaNet / Qwen3-Next linear attention.

Per head the state is S [K, V] (the flash-linear-attention convention); per step t:

    S = S * exp(g_t);  u_t = beta_t * (v_t - S^T k_t);  S = S + k_t u_t^T;  o_t = S^T (q_t * scale)

inputs:  q, k [B, T, Hk, K]; v [B, T, H, V] (H a multiple of Hk: each q/k head serves H // Hk consecutive
         value heads); g, beta [B, T, H]; initial_state [N, H, K, V] or None; cu_seqlens [N + 1] or None
         (varlen: B == 1 and segment n is tokens cu_seqlens[n]:cu_seqlens[n+1], with its own state).
outputs: o [B, T, H, V]; optionally the final state [N, H, K, V] (written when a second output is given).
params:  scale (None: K ** -0.5), use_qk_l2norm, mode ("recurrent" | "chunked"), chunk_size.

Two candidates share the key. "reference" is the per-step recurrence. "chunked" is the WY / UT-transform
form: within a chunk of C steps the C coupled state updates are one unit-lower-triangular solve, so the
sequential scan runs over T / C chunks with [C, K] x [K, V] matmuls instead of T rank-1 updates. It is a
second provider with a capability check (it declines ``mode="recurrent"``) rather than a branch inside one
kernel, so ``explain`` names the form that ran, ``DTORCH_DISABLE_PROVIDERS=chunked`` turns it off, and
verify mode checks it against the recurrence. Both compute in float32 (float64 for float64 inputs); the
initial state is copied before anything is written, so the final state may alias it (in-place decode).
"""

from __future__ import annotations

import torch

from dtorch.dispatch.meta import Call, KernelMeta
from dtorch.kernels.torch.registry import FLOATS, KERNELS

# In-place: outputs[1] may be inputs[5] (a decode step updating its state). Not capture-safe: varlen reads
# cu_seqlens on the host.
META = KernelMeta(inplace=True, capture_safe=False)
L2NORM_EPS = 1e-6  # fla's and transformers' l2norm: x * rsqrt(sum(x^2) + eps)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _heads_first(inputs, params) -> tuple[torch.Tensor, ...]:
    """q, k [B, H, T, K] (normalised, q scaled, repeated to H heads), v [B, H, T, V], g, beta [B, H, T]."""
    q, k, v, g, beta = inputs[:5]
    cd = _compute_dtype(q.dtype)
    q, k = q.to(cd), k.to(cd)
    if params.get("use_qk_l2norm", False):
        q, k = _l2norm(q), _l2norm(k)
    scale = params.get("scale")
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    groups = v.shape[2] // q.shape[2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    return (q.transpose(1, 2), k.transpose(1, 2), v.to(cd).transpose(1, 2),
            g.to(cd).transpose(1, 2), beta.to(cd).transpose(1, 2))


def _recurrent(q, k, v, g, beta, state, chunk_size):
    """One scan over T. q, k [N, T, K]; v [N, T, V]; g, beta [N, T]; state [N, K, V] (updated in place).

    Returns o [N, T, V].
    """
    o = v.new_empty(v.shape)
    decay = g.exp()
    for t in range(q.shape[1]):
        state.mul_(decay[:, t, None, None])
        kt = k[:, t, :, None]                                            # [N, K, 1]
        u = (v[:, t, None, :] - kt.transpose(1, 2) @ state) * beta[:, t, None, None]  # [N, 1, V]
        state.baddbmm_(kt, u)
        torch.bmm(q[:, t, None, :], state, out=o[:, t, None, :])
    return o


def _chunked(q, k, v, g, beta, state, chunk_size):
    """Chunked scan, same contract as ``_recurrent``.

    Within a chunk with cumulative log decay G_i (from the chunk start) and state S0 before it:
      u = (I + A)^-1 (beta v - (beta k exp(G)) S0), A[i, j] = beta_i exp(G_i - G_j) k_i.k_j for j < i;
      o = (q exp(G)) S0 + P u, P[i, j] = exp(G_i - G_j) q_i.k_j for j <= i;
      S = exp(G_last) S0 + (k exp(G_last - G))^T u.
    Padding steps (k = v = beta = g = 0) leave the state untouched.
    """
    n, t, kd = q.shape
    vd = v.shape[-1]
    c = min(chunk_size, t)  # a short segment (a decode step) is one chunk of its own length, not padded
    pad = (-t) % c
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    nc = (t + pad) // c
    q, k, v = q.reshape(n, nc, c, kd), k.reshape(n, nc, c, kd), v.reshape(n, nc, c, vd)
    beta = beta.reshape(n, nc, c, 1)
    cum = g.reshape(n, nc, c).cumsum(-1)                                  # G [n, nc, c]
    above = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(above, float("-inf")).exp()  # [n, nc, c, c]
    kb = k * beta
    a = (kb @ k.transpose(-1, -2)) * decay                                # its diagonal is ignored below
    rhs = torch.cat([v * beta, kb * cum.exp()[..., None]], dim=-1)
    u0, w = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True).split([vd, kd], dim=-1)
    p = (q @ k.transpose(-1, -2)) * decay
    qg = q * cum.exp()[..., None]
    kg = k * (cum[..., -1:] - cum).exp()[..., None]
    last = cum[..., -1].exp()                                             # [n, nc]
    o = v.new_empty(n, nc, c, vd)
    for i in range(nc):
        u = torch.baddbmm(u0[:, i], w[:, i], state, alpha=-1)             # [n, c, V]
        torch.baddbmm(p[:, i] @ u, qg[:, i], state, out=o[:, i])
        state.mul_(last[:, i, None, None]).baddbmm_(kg[:, i].transpose(1, 2), u)
    return o.reshape(n, nc * c, vd)[:, :t]


def _run(scan, ctx, inputs, outputs) -> None:
    q, k, v, g, beta = _heads_first(inputs, ctx.params)                   # [B, H, T, *]
    initial, cu_seqlens = inputs[5], inputs[6]
    b, h, t, kd = q.shape
    vd = v.shape[-1]
    chunk = ctx.params.get("chunk_size", 64)
    bounds = [0, t] if cu_seqlens is None else cu_seqlens.tolist()
    segments = list(zip(bounds[:-1], bounds[1:], strict=True))
    n = b if cu_seqlens is None else len(segments)
    states = q.new_zeros(n, h, kd, vd)
    if initial is not None:
        states.copy_(initial)                                             # a copy: outputs[1] may alias it
    o = v.new_empty(b, h, t, vd)
    for i, (s, e) in enumerate(segments):
        if e == s:
            continue
        rows = slice(None) if cu_seqlens is None else slice(i, i + 1)     # varlen: batch row 0, state row i
        seg = [x[:, :, s:e].flatten(0, 1) for x in (q, k, v, g, beta)]
        state = states[rows].flatten(0, 1)                                 # a view: updated in place
        o[:, :, s:e] = scan(*seg, state, chunk).view(-1, h, e - s, vd)
    outputs[0].copy_(o.transpose(1, 2))
    if len(outputs) > 1:
        outputs[1].copy_(states)


@KERNELS.kernel("llm.gated_delta_net", FLOATS, meta=META)
def gated_delta_net_recurrent(ctx, inputs, outputs) -> None:
    _run(_recurrent, ctx, inputs, outputs)


def _chunked_mode(call: Call) -> str | None:
    mode = call.params.get("mode", "chunked")
    return None if mode == "chunked" else f"mode={mode!r} asks for the per-step recurrence"


@KERNELS.kernel("llm.gated_delta_net", FLOATS, provider="chunked", priority=10, meta=META, check=_chunked_mode,
                 varies="the per-step recurrence (reference) runs when params ask for mode='recurrent'")
def gated_delta_net_chunked(ctx, inputs, outputs) -> None:
    _run(_chunked, ctx, inputs, outputs)
