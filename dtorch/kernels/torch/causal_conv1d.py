"""Depthwise causal 1-d convolution, the short conv in front of Mamba / Gated DeltaNet mixers.

``llm.causal_conv1d``: out[b, d, t] = act(bias[d] + sum_w weight[d, w] * xp[b, d, t + w]), where xp is x with
the W - 1 previous inputs (initial_states, or zeros) in front.
    inputs:  x [B, D, L]; weight [D, W]; bias [D] or None; initial_states [B, D, W-1] or None
    outputs: out [B, D, L]; optionally final_states [B, D, W-1] (the last W - 1 columns of xp)
``llm.causal_conv1d_update``: the decode step, Dao-AILab's ``causal_conv1d_update`` convention: the state
holds the last S >= W - 1 inputs (Qwen3-Next keeps S = W) and is shifted in place.
    inputs:  x [B, D, L] (L small, often 1) or [B, D] (L = 1); weight [D, W]; bias [D] or None; optionally
             conv_state itself as a 4th input (a graph names every tensor an op reads; it is outputs[1]) and
             state_indices [B] int32/int64 or None as a 5th
    outputs: out like x; conv_state [B, D, S], read and written (its old contents precede x); with state_indices
             a pool [P, D, S] whose row state_indices[b] batch row b reads and advances (no host reads)
``llm.causal_conv1d_varlen``: sequences packed along T (a serving engine's prefill), states in a pool.
    inputs:  x [T, D] token-major (may be a column view of a wider tensor); weight [D, W]; bias [D] or None;
             conv_states [P, D, S >= W-1] (also outputs[1]); cu_seqlens [N + 1]; state_indices [N]
    outputs: out [T, D]; conv_states: segment n (tokens cu[n]:cu[n+1]) is preceded by the last W-1 columns of
             row state_indices[n], and that row then holds the last S inputs of (row, segment); an empty
             segment leaves its row untouched. cu_seqlens is read on the host.
params: activation None or "silu". Low precision computes in float32 (float64 stays float64).

The reference kernels sum the W taps by hand; torch's grouped ``conv1d`` is registered over the full form and
over varlen (one conv over all segments laid end to end, each behind its state), and a "torch" update over the
reference one (fewer passes over the state's short rows, see ``causal_conv1d_update_torch``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtorch.dispatch.meta import KernelMeta
from dtorch.kernels.torch.registry import FLOATS, KERNELS


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _taps(xp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, length: int) -> torch.Tensor:
    """xp [B, D, W - 1 + length] -> [B, D, length]: sum over w of weight[:, w] * xp[..., w : w + length]."""
    width = weight.shape[1]
    out = xp[..., :length] * weight[:, 0, None]
    for w in range(1, width):
        out.addcmul_(xp[..., w:w + length], weight[:, w, None])
    if bias is not None:
        out += bias[:, None]
    return out


def _finish(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(out) if activation == "silu" else out


def _padded(inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """xp [B, D, W - 1 + L] in the compute dtype, with weight and bias in it too."""
    x, weight, bias, initial = inputs
    cd = _compute_dtype(x.dtype)
    head = (x.new_zeros(x.shape[0], x.shape[1], weight.shape[1] - 1, dtype=cd) if initial is None
            else initial.to(cd))
    return torch.cat([head, x.to(cd)], dim=-1), weight.to(cd), None if bias is None else bias.to(cd)


def _write(xp: torch.Tensor, out: torch.Tensor, width: int, outputs) -> None:
    outputs[0].copy_(out)
    if len(outputs) > 1:
        outputs[1].copy_(xp[..., xp.shape[-1] - (width - 1):])


@KERNELS.kernel("llm.causal_conv1d", FLOATS)
def causal_conv1d_reference(ctx, inputs, outputs) -> None:
    xp, weight, bias = _padded(inputs)
    out = _taps(xp, weight, bias, inputs[0].shape[-1])
    _write(xp, _finish(out, ctx.params.get("activation")), weight.shape[1], outputs)


@KERNELS.kernel("llm.causal_conv1d", FLOATS, provider="torch")
def causal_conv1d_torch(ctx, inputs, outputs) -> None:
    xp, weight, bias = _padded(inputs)
    if inputs[0].shape[-1] == 0:  # conv1d refuses an input shorter than its kernel
        out = xp[..., :0]
    else:
        out = F.conv1d(xp, weight.unsqueeze(1), bias, groups=weight.shape[0])
    _write(xp, _finish(out, ctx.params.get("activation")), weight.shape[1], outputs)


def _indices(inputs) -> torch.Tensor | None:
    return inputs[4] if len(inputs) > 4 else None


@KERNELS.kernel("llm.causal_conv1d_update", FLOATS, meta=KernelMeta(inplace=True))
def causal_conv1d_update_reference(ctx, inputs, outputs) -> None:
    x, weight, bias = inputs[:3]
    indices = _indices(inputs)
    out, pool = outputs
    if x.dim() == 2:  # [B, D]: one step
        x, out = x.unsqueeze(-1), out.unsqueeze(-1)
    cd = _compute_dtype(x.dtype)
    state = pool if indices is None else pool.index_select(0, indices)  # [B, D, S]
    width, keep, length = weight.shape[1], state.shape[-1], x.shape[-1]
    xs = torch.cat([state.to(cd), x.to(cd)], dim=-1)                     # [B, D, S + L], a new tensor
    y = _taps(xs[..., keep - (width - 1):], weight.to(cd), None if bias is None else bias.to(cd), length)
    if indices is None:
        pool.copy_(xs[..., length:])
    else:
        pool.index_put_((indices,), xs[..., length:].to(pool.dtype))
    out.copy_(_finish(y, ctx.params.get("activation")))


def _advanced(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The last S columns of (state || x): state [B, D, S] contiguous, x [B, D, L] -> a new [B, D, S] contiguous.

    Flat, a shift by L is one contiguous copy (each row's first L columns land in the previous row's tail), then x
    overwrites the last L columns: cpu runs these ~2x faster than a cat along a dim of 3-4 columns.
    """
    keep, length = state.shape[-1], x.shape[-1]
    if length >= keep:
        return x[..., length - keep:].to(state.dtype, memory_format=torch.contiguous_format)
    new = torch.empty_like(state, memory_format=torch.contiguous_format)
    new.view(-1)[:-length].copy_(state.view(-1)[length:])
    new[..., keep - length:].copy_(x)
    return new


def _step_taps(state: torch.Tensor, new: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One step's taps: the window is the last W columns of (state || x), of which ``new`` [B, D, S] holds the
    last min(W, S) and ``state`` the rest. weight [D, W] in the compute dtype -> [B, D, 1].

    A product and a matrix-vector sum against ones: cpu runs a reduction over a last dim of 3-4 ~2x slower.
    """
    (b, d, keep), width = state.shape, weight.shape[1]
    m = min(width, keep)
    prod = new[..., keep - m:].to(weight.dtype) * weight[:, width - m:]    # [B, D, m], contiguous
    y = torch.mv(prod.view(-1, m), prod.new_ones(m)).view(b, d, 1)
    for c in range(width - m):  # the window's oldest inputs (S = W - 1), which the step dropped from the state
        y.addcmul_(state[..., keep + 1 - width + c, None].to(weight.dtype), weight[:, c, None])
    return y


@KERNELS.kernel("llm.causal_conv1d_update", FLOATS, provider="torch", meta=KernelMeta(inplace=True))
def causal_conv1d_update_torch(ctx, inputs, outputs) -> None:
    # The same step in fewer whole-tensor passes, no host read: the rows gathered once, the new state built on
    # flat rows and copied back contiguous (index_copy_ from a strided source is ~4x slower), no cat for one step.
    x, weight, bias = inputs[:3]
    indices = _indices(inputs)
    out, pool = outputs
    if x.dim() == 2:  # [B, D]: one step
        x, out = x.unsqueeze(-1), out.unsqueeze(-1)
    cd = _compute_dtype(x.dtype)
    state = pool.contiguous() if indices is None else pool.index_select(0, indices)  # [B, D, S]
    keep, width, length = state.shape[-1], weight.shape[1], x.shape[-1]
    new = _advanced(state, x)
    bias = None if bias is None else bias.to(cd)
    if length == 1:
        y = _step_taps(state, new, weight.to(cd))
        y = y if bias is None else y.add_(bias[:, None])
    else:
        xs = torch.cat([state[..., keep - (width - 1):], x], -1).to(cd)  # [B, D, W - 1 + L]
        y = _taps(xs, weight.to(cd), bias, length)
    if indices is None:
        pool.copy_(new)
    else:
        pool.index_copy_(0, indices.long(), new)  # index_copy_ takes int64 only
    out.copy_(_finish(y, ctx.params.get("activation")))


# -- varlen ------------------------------------------------------------------------------------------
# inputs (x [T, D], weight [D, W], bias [D]?, conv_states [P, D, S], cu_seqlens [N + 1], state_indices [N]);
# outputs (out [T, D], conv_states).

def _segments(cu_seqlens: torch.Tensor) -> list[tuple[int, int, int]]:
    """(segment, start, end) of each non-empty segment: cu_seqlens read on the host (prefill)."""
    cu = cu_seqlens.tolist()
    return [(n, s, e) for n, (s, e) in enumerate(zip(cu[:-1], cu[1:], strict=True)) if e > s]


@KERNELS.kernel("llm.causal_conv1d_varlen", FLOATS, meta=KernelMeta(inplace=True, capture_safe=False))
def causal_conv1d_varlen_reference(ctx, inputs, outputs) -> None:
    x, weight, bias, _, cu_seqlens, indices = inputs
    out, pool = outputs
    cd = _compute_dtype(x.dtype)
    weight, bias = weight.to(cd), None if bias is None else bias.to(cd)
    width, keep = weight.shape[1], pool.shape[-1]
    for n, s, e in _segments(cu_seqlens):
        row = indices[n:n + 1]
        xs = torch.cat([pool.index_select(0, row).to(cd), x[s:e].t().to(cd)[None]], dim=-1)  # [1, D, S + L]
        y = _taps(xs[..., keep - (width - 1):], weight, bias, e - s)
        out[s:e].copy_(_finish(y, ctx.params.get("activation"))[0].t())
        pool.index_put_((row,), xs[..., e - s:].to(pool.dtype))


@KERNELS.kernel("llm.causal_conv1d_varlen", FLOATS, provider="torch",
                meta=KernelMeta(inplace=True, capture_safe=False))
def causal_conv1d_varlen_torch(ctx, inputs, outputs) -> None:
    # The M non-empty segments end to end in one xp [D, T + M S], each behind its state's S columns: segment i
    # (starting at token s_i) takes columns s_i + i S .. s_i + (i + 1) S + L_i. One grouped conv1d over xp; then
    # the outputs at the tokens' columns, and each segment's last S columns (its new state) back to the pool.
    x, weight, bias, _, cu_seqlens, indices = inputs
    out, pool = outputs
    segs = _segments(cu_seqlens)
    if not segs:
        return
    cd = _compute_dtype(x.dtype)
    (t, d), width, keep, m = x.shape, weight.shape[1], pool.shape[-1], len(segs)
    lengths = torch.tensor([e - s for _, s, e in segs])                   # index maths on the host, then moved
    token_cols = torch.arange(t) + keep * torch.repeat_interleave(torch.arange(1, m + 1), lengths)   # [T]
    state_cols = (torch.tensor([s for _, s, _ in segs]) + keep * torch.arange(m))[:, None] + torch.arange(keep)
    token_cols, state_cols, new_cols = (c.to(x.device) for c in (token_cols, state_cols, state_cols + lengths[:, None]))
    rows = indices if m == len(indices) else indices.index_select(0, torch.tensor([n for n, _, _ in segs],
                                                                                  device=indices.device))
    xp = x.new_empty(d, t + m * keep, dtype=cd)
    xp.index_copy_(1, state_cols.flatten(), pool.index_select(0, rows).to(cd).transpose(0, 1).reshape(d, -1))
    xp.index_copy_(1, token_cols, x.t().to(cd))
    y = F.conv1d(xp[None], weight.to(cd).unsqueeze(1), None if bias is None else bias.to(cd), groups=d)[0]
    out.copy_(_finish(y.index_select(1, token_cols - (width - 1)), ctx.params.get("activation")).t())
    pool.index_put_((rows,), xp[:, new_cols].transpose(0, 1).to(pool.dtype))
