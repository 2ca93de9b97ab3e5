"""``llm.gated_delta_net``: the gated delta rule of Gated DeltaNet / Qwen3-Next linear attention.

Per head the state is S [K, V] (the flash-linear-attention convention); per step t:

    S = S * exp(g_t);  u_t = beta_t * (v_t - S^T k_t);  S = S + k_t u_t^T;  o_t = S^T (q_t * scale)

inputs:  q, k [B, T, Hk, K]; v [B, T, H, V] (H a multiple of Hk: each q/k head serves H // Hk consecutive
         value heads); g, beta [B, T, H]; initial_state [N, H, K, V] or None; cu_seqlens [N + 1] or None
         (varlen: B == 1 and segment n is tokens cu_seqlens[n]:cu_seqlens[n+1], with its own state);
         state_indices [N] int32/int64 or None (8th input, may be absent): initial_state is then a pool
         [S, H, K, V] and sequence n starts from its row state_indices[n].
outputs: o [B, T, H, V]; optionally the final state (written when a second output is given): [N, H, K, V], or
         with state_indices the pool [S, H, K, V] with each named row advanced (other rows copied from, or,
         when it aliases initial_state, left as they are in the pool).
params:  scale (None: K ** -0.5), use_qk_l2norm, mode ("recurrent" | "chunked"), chunk_size.

Two candidates share the key. "reference" is the per-step recurrence. "chunked" is the WY / UT-transform
form: within a chunk of C steps the C coupled state updates are one unit-lower-triangular solve, so the
sequential scan runs over T / C chunks with [C, K] x [K, V] matmuls instead of T rank-1 updates. It is a
second provider with a capability check (it declines ``mode="recurrent"``) rather than a branch inside one
kernel, so ``explain`` names the form that ran, ``DTORCH_DISABLE_PROVIDERS=chunked`` turns it off, and
verify mode checks it against the recurrence. Both compute in float32 (float64 for float64 inputs); the
initial state is copied (or its rows gathered) before anything is written, so the final state may alias it
(in-place decode). A segment of one token runs the plain recurrent step in both; one token per sequence without
cu_seqlens (decode) runs ``_step``, a handful of batched ops with no host read of any device value.
"""

from __future__ import annotations

import torch

from dtorch.dispatch.meta import Call, KernelMeta
from dtorch.kernels.torch.registry import FLOATS, KERNELS

# In-place: outputs[1] may be inputs[5] (a decode step updating its state or pool). Not capture-safe: varlen
# reads cu_seqlens on the host (decode, without cu_seqlens, reads nothing).
META = KernelMeta(inplace=True, capture_safe=False)
L2NORM_EPS = 1e-6  # fla's and transformers' l2norm: x * rsqrt(sum(x^2) + eps)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _l2norm(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, times ``scale`` (folded into the [..., 1] factor)."""
    inv = torch.linalg.vecdot(x, x).add_(L2NORM_EPS).rsqrt_()
    return x * (inv if scale == 1.0 else inv.mul_(scale)).unsqueeze(-1)


def _heads_first(inputs, params) -> tuple[torch.Tensor, ...]:
    """q, k [B, H, T, K] (normalised, q scaled, repeated to H heads), v [B, H, T, V], g, beta [B, H, T]."""
    q, k, v, g, beta = inputs[:5]
    cd = _compute_dtype(q.dtype)
    q, k = q.to(cd), k.to(cd)
    scale = params.get("scale")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if params.get("use_qk_l2norm", False):
        q, k = _l2norm(q, scale), _l2norm(k)
    else:
        q = q * scale
    groups = v.shape[2] // q.shape[2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    return (q.transpose(1, 2), k.transpose(1, 2), v.to(cd).transpose(1, 2),
            g.to(cd).transpose(1, 2), beta.to(cd).transpose(1, 2))


def _recurrent(q, k, v, g, beta, state, chunk_size, out):
    """One scan over T. q, k [N, T, K]; v [N, T, V]; g, beta [N, T]; state [N, K, V] (updated in place).

    Writes o into ``out`` [B, H, T, V] (N = B H; a view of the op's output, any strides and dtype).
    """
    o = v.new_empty(v.shape)
    decay = g.exp()
    for t in range(q.shape[1]):
        state.mul_(decay[:, t, None, None])
        kt = k[:, t, :, None]                                            # [N, K, 1]
        u = (v[:, t, None, :] - kt.transpose(1, 2) @ state) * beta[:, t, None, None]  # [N, 1, V]
        state.baddbmm_(kt, u)
        torch.bmm(q[:, t, None, :], state, out=o[:, t, None, :])
    out.copy_(o.view(out.shape))


def _chunk_major(x: torch.Tensor, c: int, nc: int) -> torch.Tensor:
    """x [N, T, D] (any strides) -> [nc, N, c, D] contiguous, zero-padded to nc * c steps: chunk i is one dense
    [N, c, D] block, so the scan's matmuls below read it without copies."""
    n, t, d = x.shape
    out = x.new_empty(nc, n, c, d) if t == nc * c else x.new_zeros(nc, n, c, d)
    full = t // c
    out[:full].copy_(x[:, :full * c].unflatten(1, (full, c)).transpose(0, 1))
    if full < nc:
        out[full, :, :t - full * c].copy_(x[:, full * c:])
    return out


def _chunked(q, k, v, g, beta, state, chunk_size, out):
    """Chunked scan, same contract as ``_recurrent``.

    Within a chunk with cumulative log decay G_i (from the chunk start) and state S0 before it:
      u = (I + A)^-1 (beta v - (beta k exp(G)) S0), A[i, j] = beta_i exp(G_i - G_j) k_i.k_j for j < i;
      o = (q exp(G)) S0 + P u, P[i, j] = exp(G_i - G_j) q_i.k_j for j <= i;
      S = exp(G_last) S0 + (k exp(G_last - G))^T u.
    All but the S0 terms are batched over every chunk: one triangular solve for the [c, c] inverse (not for the
    [c, V + K] right-hand side, which LAPACK would copy twice), whose columns take beta (and exp(G)) so that
    u0 = (I + A)^-1 beta v and w = (I + A)^-1 beta exp(G) k are plain matmuls. The scan then runs four matmuls
    per chunk, in place on dense [N, c, *] blocks. Padding steps (k = v = beta = g = 0) leave the state
    untouched.
    """
    n, t, kd = q.shape
    vd = v.shape[-1]
    c = min(chunk_size, t)  # a short segment (a decode step) is one chunk of its own length, not padded
    nc = -(-t // c)
    q, k, v = (_chunk_major(x, c, nc) for x in (q, k, v))                  # [nc, N, c, *]
    g, beta = (_chunk_major(x[..., None], c, nc) for x in (g, beta))        # [nc, N, c, 1]
    cum = g.cumsum(2)                                                     # G
    below = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) on and below the diagonal, 0 above (clamped first: no exp of the huge masked differences)
    decay = (cum - cum.transpose(-1, -2)).clamp_(max=0).exp_().mul_(below)    # [nc, N, c, c]
    kt = k.transpose(-1, -2)
    a = (k @ kt).mul_(decay).mul_(beta)                                   # A; its diagonal is ignored below
    eye = torch.eye(c, dtype=q.dtype, device=q.device).expand_as(a)
    inv = torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True).mul_(beta.transpose(-1, -2))
    u = inv @ v                                                           # u0 = (I + A)^-1 beta v
    ge = cum.exp()
    w = inv.mul_(ge.transpose(-1, -2)) @ k                                # (I + A)^-1 beta exp(G) k
    p = (q @ kt).mul_(decay)                                              # P
    qg, kg = q.mul_(ge), k.mul_((cum[:, :, -1:] - cum).exp_())           # q exp(G), k exp(G_last - G)
    last = ge[:, :, -1:]                                                  # [nc, N, 1, 1]
    o = torch.empty(nc, n, c, vd, dtype=q.dtype, device=q.device)
    for i in range(nc):                                                   # in place: no temporaries
        ui = u[i].baddbmm_(w[i], state, alpha=-1)                         # u0 - w S0 [N, c, V]
        torch.bmm(qg[i], state, out=o[i]).baddbmm_(p[i], ui)
        state.mul_(last[i]).baddbmm_(kg[i].transpose(1, 2), ui)
    _write_chunks(o, out)


def _write_chunks(o: torch.Tensor, out: torch.Tensor) -> None:
    """o [nc, N, c, V] (chunk-major, padded) into out [B, H, T, V] (N = B H): one strided copy, no reshape."""
    b, h, t, vd = out.shape
    nc, _, c, _ = o.shape
    o = o.view(nc, b, h, c, vd)
    full = t // c
    out[:, :, :full * c].unflatten(2, (full, c)).copy_(o[:full].permute(1, 2, 0, 3, 4))
    if full < nc:
        out[:, :, full * c:].copy_(o[full, :, :, :t - full * c])


def _l2norm_qk(q: torch.Tensor, k: torch.Tensor, params) -> torch.Tensor:
    """q and k stacked: [B, 2, Hk, K] in the compute dtype, normalised when params ask."""
    qk = torch.cat([q, k], dim=1).to(_compute_dtype(q.dtype))
    return _l2norm(qk) if params.get("use_qk_l2norm", False) else qk


def _step(params, inputs, indices, outputs) -> None:
    """One token per sequence (T == 1, no cu_seqlens): q, k [B, 1, Hk, K]; v [B, 1, H, V]; g, beta [B, 1, H].

    Memory-bound on the state, so it reads it in one matmul for both q and k, from the state before the step:
    with d = exp(g), k^T S' = d k^T S and q^T S'' = d q^T S + (q.k) u where S'' = d S + k u^T; then updates it in
    place (two passes). The G = H / Hk value heads of a q/k head are broadcast against it ([B, Hk, G, ...]).
    """
    q, k, v, g, beta, initial = inputs[:6]
    b, _, hk, kd = q.shape
    h, vd = v.shape[2], v.shape[3]
    cd = _compute_dtype(q.dtype)
    if initial is None:
        state = q.new_zeros(b, h, kd, vd, dtype=cd)
    elif indices is None:
        state = initial.to(cd, copy=True)                                 # a copy: outputs[1] may alias it
    else:
        state = initial.index_select(0, indices).to(cd)                   # gathered rows: a new tensor
    s5 = state.view(b, hk, h // hk, kd, vd)
    qk = _l2norm_qk(q, k, params).transpose(1, 2).unsqueeze(2)           # [B, Hk, 1, 2, K]
    kb = qk[..., 1:, :]                                                   # [B, Hk, 1, 1, K]
    proj = qk @ s5                                                        # [B, Hk, G, 2, V]: q^T S, k^T S
    decay = g.to(cd).exp().reshape(b, hk, -1, 1, 1)
    u = (v.reshape(b, hk, -1, 1, vd) - decay * proj[..., 1:, :]).mul_(beta.reshape(b, hk, -1, 1, 1))
    o = torch.addcmul(decay * proj[..., :1, :], torch.linalg.vecdot(qk[..., :1, :], kb)[..., None], u)
    scale = params.get("scale")
    outputs[0].copy_(o.mul_(kd ** -0.5 if scale is None else scale).view(b, 1, h, vd))
    s5.mul_(decay).addcmul_(kb.transpose(-1, -2), u)
    _store(outputs, initial, indices, state)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride())


def _store(outputs, initial, indices, states, rows=None) -> None:
    """The final states [N, H, K, V] into outputs[1]; with indices, into the pool rows they name (``rows``: only
    those of these sequences, a host list)."""
    if len(outputs) < 2:
        return
    final = outputs[1]
    if indices is None:
        final.copy_(states)
        return
    if not _same_view(final, initial):
        final.copy_(initial)
    if rows is not None:
        keep = torch.tensor(rows, device=indices.device)
        indices, states = indices.index_select(0, keep), states.index_select(0, keep)
    final.index_put_((indices,), states.to(final.dtype))


def _run(scan, ctx, inputs, outputs) -> None:
    initial, cu_seqlens = inputs[5], inputs[6]
    indices = inputs[7] if len(inputs) > 7 else None
    if cu_seqlens is None and inputs[0].shape[1] == 1:
        _step(ctx.params, inputs, indices, outputs)
        return
    q, k, v, g, beta = _heads_first(inputs, ctx.params)                   # [B, H, T, *]
    b, h, t, kd = q.shape
    vd = v.shape[-1]
    chunk = ctx.params.get("chunk_size", 64)
    bounds = [0, t] if cu_seqlens is None else cu_seqlens.tolist()
    segments = list(zip(bounds[:-1], bounds[1:], strict=True))
    n = b if cu_seqlens is None else len(segments)
    if initial is None:
        states = q.new_zeros(n, h, kd, vd)
    elif indices is None:
        states = initial.to(q.dtype, copy=True)                           # a copy: outputs[1] may alias it
    else:
        states = initial.index_select(0, indices).to(q.dtype)
    dest = outputs[0].transpose(1, 2)                                     # [B, H, T, V], written per segment
    for i, (s, e) in enumerate(segments):
        if e == s:
            continue
        rows = slice(None) if cu_seqlens is None else slice(i, i + 1)     # varlen: batch row 0, state row i
        seg = [x[:, :, s:e].flatten(0, 1) for x in (q, k, v, g, beta)]
        state = states[rows].flatten(0, 1)                                 # a view: updated in place
        run = _recurrent if e - s == 1 else scan                           # one token: the plain step
        run(*seg, state, chunk, dest[:, :, s:e])
    skip = cu_seqlens is not None and any(s == e for s, e in segments)  # an empty segment's row stays untouched
    _store(outputs, initial, indices, states, [i for i, (s, e) in enumerate(segments) if e > s] if skip else None)


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


def decode_step_only(call: Call) -> str | None:
    """Accepts decode steps alone: one token per sequence, no cu_seqlens (decided on the call's shapes)."""
    if call.inputs is None:
        return "the decode step is chosen on the call's shapes (one token per sequence, no cu_seqlens)"
    if len(call.inputs) > 6 and call.inputs[6] is not None:
        return "cu_seqlens given: packed sequences, not a decode step"
    tokens = call.inputs[0].shape[1]
    return None if tokens == 1 else f"{tokens} tokens per sequence, not a decode step"


# The decode step alone, as its own candidate: it reads nothing on the host (the kernels above read cu_seqlens for
# packed prefills), so a captured decode step can bind it. Declared last: among equal priorities it wins.
@KERNELS.kernel("llm.gated_delta_net", FLOATS, provider="torch", priority=10, meta=KernelMeta(inplace=True),
                 check=decode_step_only, varies="decode steps only (one token per sequence, no cu_seqlens)")
def gated_delta_net_step(ctx, inputs, outputs) -> None:
    _step(ctx.params, inputs, inputs[7] if len(inputs) > 7 else None, outputs)
