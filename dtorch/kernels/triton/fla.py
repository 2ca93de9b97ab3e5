"""flash-linear-attention's gated delta rule as provider "fla" of ``llm.gated_delta_net`` on cuda.

fla (``pip install fla-core``: the kernels of ``flash-linear-attention``) has the op's layout and conventions:
q, k [B, T, Hk, K], v [B, T, H, V] with H a multiple of Hk, g the log decay and beta [B, T, H], states
[N, H, K, V] float32, ``cu_seqlens`` packing (B == 1). Its chunked kernels run prefill; its fused recurrent kernel
runs decode (one token per sequence, no cu_seqlens) and ``mode="recurrent"``. A state pool is gathered by
``state_indices`` before the call and the final rows scattered back after it (index_select / index_copy_ on the
device: no host read).

The candidate is declared whether or not fla is installed; its check declines with the reason when ``import fla``
fails, so ``explain`` shows why our own triton kernel runs instead. Not capture safe: fla allocates its outputs,
and its chunked varlen path reads cu_seqlens on the host.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from dtorch.dispatch.meta import Call, KernelMeta
from dtorch.kernels.triton.registry import FLOATS, KERNELS

MAX_HEAD_DIM = 256  # fla's gated delta rule kernels take K, V up to 256


@functools.cache
def _fla() -> tuple[ModuleType | None, str | None]:
    """(fla.ops.gated_delta_rule, None), or (None, why it cannot be used)."""
    try:
        return importlib.import_module("fla.ops.gated_delta_rule"), None
    except Exception as exc:  # not installed, or installed against another triton / torch
        return None, (f"flash-linear-attention not installed ({type(exc).__name__}: {exc}); "
                      "pip install fla-core (its kernels) or flash-linear-attention")


def _check(call: Call) -> str | None:
    """Declines when fla does not import, or a head dim above MAX_HEAD_DIM."""
    _, why = _fla()
    if why is not None:
        return why
    if call.inputs is not None:
        kd, vd = call.inputs[0].shape[-1], call.inputs[2].shape[-1]
        if max(kd, vd) > MAX_HEAD_DIM:
            return f"head dims K={kd}, V={vd}: fla's gated delta rule takes at most {MAX_HEAD_DIM}"
    return None


def _same_view(a, b) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride())


# inputs and outputs as the reference: q, k, v, g, beta, initial_state (or pool), cu_seqlens, state_indices;
# o [B, T, H, V], optionally the final state [N, H, K, V] (or the pool [S, H, K, V], which may alias the input).
@KERNELS.kernel("llm.gated_delta_net", FLOATS, provider="fla", meta=KernelMeta(inplace=True, capture_safe=False),
                 check=_check, varies="fla's fused recurrent kernel for decode and mode='recurrent', else chunked")
def gated_delta_net_fla(ctx, inputs, outputs) -> None:
    q, k, v, g, beta, h0, cu = inputs[:7]
    indices = inputs[7] if len(inputs) > 7 else None
    final = outputs[1] if len(outputs) > 1 else None
    ops, _ = _fla()
    p = ctx.params
    state = h0 if h0 is None or indices is None else h0.index_select(0, indices)  # [N, H, K, V], a new tensor
    if state is not None:
        state = state.float()  # fla's states are float32 (a float32 pool row is not copied again)
    recurrent = (cu is None and q.shape[1] == 1) or p.get("mode") == "recurrent"
    run = ops.fused_recurrent_gated_delta_rule if recurrent else ops.chunk_gated_delta_rule
    # g and beta by name: the fused recurrent form takes gk, gv (per-channel decays) between them
    o, ht = run(q, k, v, g=g, beta=beta, scale=p.get("scale"), initial_state=state,
                output_final_state=final is not None, use_qk_l2norm_in_kernel=bool(p.get("use_qk_l2norm", False)),
                cu_seqlens=None if cu is None else cu.long())
    outputs[0].copy_(o)
    if final is None:
        return
    if indices is None:
        final.copy_(ht)
        return
    if not _same_view(final, h0):
        final.copy_(h0)  # rows no sequence names keep the input pool's values
    final.index_copy_(0, indices.long(), ht.to(final.dtype))
