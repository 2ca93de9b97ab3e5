"""The triton paged attention (``llm.flash_attention_with_kvcache``) against the torch reference, on CPU tensors
through triton's interpreter; the tests marked cuda rerun the soft-capped cases compiled on a GPU
(``scripts/device-check.sh`` sets TRITON_INTERPRET=0)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # chosen when @triton.jit runs, so before the kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dtorch.core.device import Device  # noqa: E402
from dtorch.dispatch.context import KernelContext, KernelParams  # noqa: E402
from dtorch.kernels.torch.kv_cache import flash_attention_with_kvcache_reference  # noqa: E402
from dtorch.kernels.triton.attention import flash_attention_with_kvcache_triton  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
INTERPRETED = os.environ["TRITON_INTERPRET"] == "1"
ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED,
                             reason="needs a CUDA device, TRITON_INTERPRET=0")


def _ctx(causal: bool, d: int) -> KernelContext:
    return KernelContext(Device("cpu"), None, None, KernelParams(causal=causal, scale=d ** -0.5))


def _inputs(queries: list[int], keys: list[int], *, h: int = 4, hkv: int = 2, d: int = 64, block_size: int = 16,
            dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Sequence i has queries[i] queries and keys[i] cached keys, in blocks handed out in a shuffled order; every
    cache row no sequence owns holds NaN, so a read outside the table shows."""
    g = torch.Generator().manual_seed(seed)
    used = [-(-s // block_size) for s in keys]
    max_blocks = max(max(used), 1)
    num_blocks = sum(used) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(keys), max_blocks), num_blocks - 1, dtype=torch.int32)  # past-used entries: any block
    kc = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
    vc = torch.full_like(kc, float("nan"))
    for i, (s, u) in enumerate(zip(keys, used, strict=True)):
        table[i, :u] = torch.tensor(order[:u], dtype=torch.int32)
        order = order[u:]
        rows = torch.tensor([int(table[i, j // block_size]) * block_size + j % block_size for j in range(s)],
                            dtype=torch.long)
        kc.view(-1, hkv, d)[rows] = torch.randn(s, hkv, d, generator=g).to(dtype)
        vc.view(-1, hkv, d)[rows] = torch.randn(s, hkv, d, generator=g).to(dtype)
    cu_q = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(queries), h, d, generator=g).to(dtype)
    return q, kc, vc, cu_q, torch.tensor(keys, dtype=torch.int32), table


def _both(inputs: tuple[torch.Tensor, ...], causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    q = inputs[0]
    ctx = _ctx(causal, q.shape[-1])
    got, want = torch.full_like(q, 7.0), torch.full_like(q, 7.0)
    flash_attention_with_kvcache_triton(ctx, inputs, (got,))
    flash_attention_with_kvcache_reference(ctx, inputs, (want,))
    return got, want


CASES = {  # name: (queries per sequence, keys per sequence, head dim, cache block size)
    "decode": ([1, 1, 1, 1], [5, 37, 16, 1], 64, 16),
    "decode_empty_sequence": ([1, 1, 1], [0, 20, 33], 64, 32),
    "chunked_prefill": ([3, 5, 1, 4], [3, 21, 40, 36], 64, 16),
    "idle_sequences": ([0, 6, 0, 2], [9, 6, 0, 19], 64, 16),
    "head_dim_128": ([2, 1], [34, 7], 128, 32),
    "head_dim_40_masked_tail": ([2, 1], [18, 7], 40, 16),
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_float32(case, causal):
    queries, keys, d, block_size = CASES[case]
    got, want = _both(_inputs(queries, keys, d=d, block_size=block_size), causal)
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


# Known gap: triton 3.9's interpreter multiplies bfloat16 tiles in tl.dot as raw bits (a 16x16 bf16 dot is off by
# ~1e10 there), so bfloat16 is checked on a GPU only; the kernel itself is dtype-generic.
BF16_INTERPRETER = pytest.mark.xfail(reason="triton's interpreter computes tl.dot on bfloat16 wrongly", strict=False)


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=BF16_INTERPRETER)], ids=str)
def test_matches_reference_half(dtype):
    got, want = _both(_inputs([1, 3, 2], [17, 30, 2], dtype=dtype, seed=1))
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_float32_queries_over_a_half_cache(cache_dtype):
    """LLM(kv_cache_dtype=...): the keys and values are widened to q's float32 as they are read."""
    q, kc, vc, *rest = _inputs([1, 3, 2], [17, 30, 2], seed=4)
    got, want = _both((q, kc.to(cache_dtype), vc.to(cache_dtype), *rest))
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_multi_query_heads_per_kv_head_and_more_rows_than_a_tile():
    # G = 4 query heads per kv head; 20 queries x 4 heads = 80 rows: two 64-row tiles for the sequence
    got, want = _both(_inputs([20, 1], [25, 3], h=8, hkv=2, seed=2))
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_rows_that_see_no_key_are_zero():
    got, want = _both(_inputs([4, 2], [2, 0], seed=3))  # more queries than keys: the first rows see nothing
    assert torch.equal(got[:2], torch.zeros_like(got[:2])) and torch.equal(got[4:], torch.zeros_like(got[4:]))
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy: inf * 0
@pytest.mark.parametrize("where", ["q", "k_seen", "v_seen", "kv_last", "inf_k_seen"])
def test_non_finite_input_follows_the_reference(where):
    q, kc, vc, cu_q, lens, table = _inputs([3, 1], [10, 4], seed=4)
    first = int(table[0, 0]) * kc.shape[1]  # flat row of sequence 0's first key (seen by all its queries)
    last = first + 9  # its last key, seen only by its last query (causal)
    flat = {"k": kc.view(-1, *kc.shape[2:]), "v": vc.view(-1, *vc.shape[2:])}
    if where == "q":
        q[1, 2, 5] = float("nan")
    elif where == "kv_last":
        flat["k"][last, 0, 3] = float("nan")
        flat["v"][last, 1, 3] = float("inf")
    else:
        cache = "v" if where == "v_seen" else "k"
        flat[cache][first, 1, 3] = float("inf") if where.startswith("inf") else float("nan")
    got, want = _both((q, kc, vc, cu_q, lens, table))
    if where == "kv_last":  # the first two queries do not see the last key: its NaN/inf must not leak into them
        assert got[:2].isfinite().all() and got[2].isnan().any()
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32], equal_nan=True)


# -- the cache write ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cache_write_matches_the_reference(dtype):
    """Rows go to their slots (any block, any offset), padding rows (slot -1) go nowhere, and a key that is a
    token-strided view of a fused projection is read in place; the caches equal the torch reference's bit for bit."""
    from dtorch.kernels.torch.kv_cache import reshape_and_cache_reference
    from dtorch.kernels.triton.attention import reshape_and_cache_triton

    g = torch.Generator().manual_seed(1)
    hkv, d, t = 2, 24, 7
    fused = torch.randn(t, 3 * hkv, d, generator=g).to(dtype)  # q | k | v heads of one projection
    key, value = fused[:, hkv:2 * hkv], fused[:, 2 * hkv:]
    slots = torch.tensor([5, -1, 17, 0, -1, 31, 8], dtype=torch.int64)
    kc0 = torch.randn(4, 8, hkv, d, generator=g).to(dtype)
    vc0 = torch.randn(4, 8, hkv, d, generator=g).to(dtype)
    want_k, want_v, got_k, got_v = kc0.clone(), vc0.clone(), kc0.clone(), vc0.clone()
    ctx = KernelContext(Device("cpu"), None, None, KernelParams())
    reshape_and_cache_reference(ctx, (key, value, want_k, want_v, slots), (want_k, want_v))
    reshape_and_cache_triton(ctx, (key, value, got_k, got_v, slots), (got_k, got_v))
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert not torch.equal(got_k, kc0)  # something was written
    assert torch.equal(got_k.flatten(0, 1)[[1, 2, 3]], kc0.flatten(0, 1)[[1, 2, 3]])  # slots no row names: as before


# triton 3.x's interpreter truncates float32 to bfloat16 in .to() (a GPU rounds to nearest even, as torch does)
BF16_ROUNDING = pytest.mark.xfail(reason="triton's interpreter truncates float32 -> bfloat16", strict=False)


@pytest.mark.parametrize("cache_dtype", [pytest.param(torch.bfloat16, marks=BF16_ROUNDING), torch.float16], ids=str)
def test_cache_write_rounds_float32_rows_into_a_half_cache(cache_dtype):
    from dtorch.kernels.torch.kv_cache import reshape_and_cache_reference
    from dtorch.kernels.triton.attention import reshape_and_cache_triton

    g = torch.Generator().manual_seed(2)
    key, value = torch.randn(5, 2, 32, generator=g), torch.randn(5, 2, 32, generator=g)
    slots = torch.tensor([3, 11, -1, 0, 30])
    got = (torch.zeros(4, 8, 2, 32, dtype=cache_dtype), torch.zeros(4, 8, 2, 32, dtype=cache_dtype))
    want = (got[0].clone(), got[1].clone())
    ctx = KernelContext(Device("cpu"), None, None, KernelParams())
    reshape_and_cache_reference(ctx, (key, value, *want, slots), want)
    reshape_and_cache_triton(ctx, (key, value, *got, slots), got)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0].flatten(0, 1)[slots[slots >= 0]], key[slots >= 0].to(cache_dtype))


def test_cache_write_declares_capture_safe_in_place_for_cuda():
    from dtorch.kernels.triton.registry import KERNELS

    (entry,) = [e for e in KERNELS.entries if e.op == "llm.reshape_and_cache"]
    assert entry.provider == "triton" and entry.devices == ("cuda",)
    assert entry.meta.capture_safe and entry.meta.inplace


@pytest.mark.parametrize(("queries", "keys", "block_size", "window"), [
    ([1, 3], [9, 5], 4, 1),  # a window of one key
    ([1, 4], [37, 20], 16, 5),  # shorter than a block: decode and chunked prefill rows
    ([6, 1], [30, 23], 4, 11),  # spanning several blocks
], ids=["window_1", "inside_a_block", "over_blocks"])
def test_sliding_window_matches_reference(queries, keys, block_size, window):
    """Keys older than the window are masked; blocks every row's window has left point at a NaN block (freed), and
    stay unread."""
    q, kc, vc, cu_q, lens, table = _inputs(queries, keys, block_size=block_size, seed=5)
    for s, (nq, n) in enumerate(zip(queries, keys, strict=True)):
        table[s, :max(0, n - nq - window + 1) // block_size] = kc.shape[0] - 1  # an unowned block: NaN
    ctx = KernelContext(Device("cpu"), None, None, KernelParams(causal=True, scale=q.shape[-1] ** -0.5, window=window))
    got, want = torch.full_like(q, 7.0), torch.full_like(q, 7.0)
    flash_attention_with_kvcache_triton(ctx, (q, kc, vc, cu_q, lens, table), (got,))
    flash_attention_with_kvcache_reference(ctx, (q, kc, vc, cu_q, lens, table), (want,))
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


SOFTCAP_CASES = {"decode": ([1, 1, 1], [19, 5, 33], 0), "prefill_sliding": ([4, 1], [21, 9], 6)}


def _softcap_case(case: str, device: str, dtype: torch.dtype) -> None:
    """Gemma 2's capped scores: softmax(cap * tanh(q k^T * scale / cap)) v, computed here in plain float64 torch from
    each sequence's keys as the table lists them. The queries are scaled so that most scores pass the cap (without it
    the output differs by far more than the tolerance)."""
    queries, keys, window = SOFTCAP_CASES[case]
    q, kc, vc, cu_q, lens, table = _inputs(queries, keys, block_size=8, dtype=dtype, seed=6)
    q = (q.float() * 6.0).to(dtype)
    h, hkv, d = q.shape[1], kc.shape[2], q.shape[2]
    scale, cap = d ** -0.5, 5.0
    want = torch.zeros(q.shape, dtype=torch.float64)
    for s, (nq, n) in enumerate(zip(queries, keys, strict=True)):
        rows = [int(table[s, j // 8]) * 8 + j % 8 for j in range(n)]
        k = kc.view(-1, hkv, d)[rows].double().repeat_interleave(h // hkv, 1)  # [n, H, D]
        v = vc.view(-1, hkv, d)[rows].double().repeat_interleave(h // hkv, 1)
        qs = q[int(cu_q[s]):int(cu_q[s + 1])].double()  # [nq, H, D]
        scores = cap * torch.tanh(torch.einsum("thd,nhd->htn", qs, k) * scale / cap)  # [H, nq, n]
        pos = torch.arange(n - nq, n)[:, None]  # each query's position; bottom-right causal
        hidden = torch.arange(n)[None, :] > pos
        if window:
            hidden |= torch.arange(n)[None, :] <= pos - window
        probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        want[int(cu_q[s]):int(cu_q[s + 1])] = torch.einsum("htn,nhd->thd", probs, v)
    inputs = tuple(t.to(device) for t in (q, kc, vc, cu_q, lens, table))
    got, plain = torch.full_like(inputs[0], 7.0), torch.full_like(inputs[0], 7.0)
    capped = KernelParams(causal=True, scale=scale, window=window, softcap=cap)
    flash_attention_with_kvcache_triton(KernelContext(Device(device), None, None, capped), inputs, (got,))
    uncapped = KernelParams(causal=True, scale=scale, window=window)
    flash_attention_with_kvcache_triton(KernelContext(Device(device), None, None, uncapped), inputs, (plain,))
    tol = 5e-5 if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol)
    assert (plain.double().cpu() - want).abs().max() > 0.1


@pytest.mark.parametrize("case", SOFTCAP_CASES)
def test_softcap_matches_the_math(case):
    _softcap_case(case, "cpu", torch.float32)


@pytest.mark.cuda
@ON_CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", SOFTCAP_CASES)
def test_softcap_matches_the_math_on_cuda(case, dtype):
    _softcap_case(case, "cuda", dtype)


def test_softcap_is_served_by_triton_on_cuda():
    """The triton candidate no longer declines a capped call (Gemma 2 on a GPU ran the torch reference)."""
    from dtorch.dispatch.meta import Call
    from dtorch.kernels.triton.attention import _check

    call = Call(Device("cuda"), torch.bfloat16, KernelParams(causal=True, scale=0.0625, softcap=50.0, head_dim=256))
    assert _check(call) is None
