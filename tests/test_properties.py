"""Hypothesis properties: broadcasting agrees with torch (or fails exactly when torch refuses), and
one-dim reductions agree with torch for random shapes, dims and keepdim."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import dtorch
from dtorch import ops

SETTINGS = settings(max_examples=60, deadline=None)
dims = st.integers(min_value=0, max_value=4)
shapes = st.lists(dims, min_size=0, max_size=4).map(tuple)


@st.composite
def shape_pairs(draw) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two shapes, usually broadcastable (each dim of b equal to a's, 1, or missing), sometimes not."""
    a = draw(shapes)
    b = []
    for size in a[draw(st.integers(0, len(a))):]:
        b.append(draw(st.sampled_from([size, 1, size, draw(dims)])))
    lead = draw(st.lists(st.sampled_from([1, 2, 3]), max_size=2))
    b = tuple(lead + b)
    return (a, b) if draw(st.booleans()) else (b, a)


def _torch_broadcasts(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    try:
        torch.broadcast_shapes(a, b)
    except RuntimeError:
        return False
    return True


@SETTINGS
@given(pair=shape_pairs(), name=st.sampled_from(["add", "sub", "mul", "maximum", "minimum"]),
       dtype=st.sampled_from([torch.float32, torch.int64]))
def test_broadcasting_matches_torch(pair, name, dtype) -> None:
    sa, sb = pair
    a = torch.randn(sa).to(dtype) if dtype.is_floating_point else torch.randint(-5, 6, sa)
    b = torch.randn(sb).to(dtype) if dtype.is_floating_point else torch.randint(-5, 6, sb)
    if not _torch_broadcasts(sa, sb):
        with pytest.raises(dtorch.ShapeError, match="do not broadcast"):
            getattr(ops, name)(a, b)
        return
    want = getattr(torch, name)(a, b)
    got = getattr(ops, name)(a, b)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)
    out = torch.empty(want.shape, dtype=dtype)
    getattr(ops, f"{name}_out")(a, b, out=out)
    torch.testing.assert_close(out, want)


@SETTINGS
@given(pair=shape_pairs())
def test_broadcast_shape_inference_on_meta(pair) -> None:
    sa, sb = pair
    a, b = torch.empty(sa, device="meta"), torch.empty(sb, device="meta")
    if _torch_broadcasts(sa, sb):
        assert ops.add(a, b).shape == torch.broadcast_shapes(sa, sb)
    else:
        with pytest.raises(dtorch.ShapeError):
            ops.add(a, b)


TORCH_REDUCE = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin, "argmax": torch.argmax}


@st.composite
def reductions(draw):
    shape = draw(shapes)
    name = draw(st.sampled_from(sorted(TORCH_REDUCE)))
    rank = len(shape)
    dim = draw(st.integers(-rank, rank - 1)) if rank else draw(st.sampled_from([0, -1]))
    return name, shape, dim, draw(st.booleans())


@SETTINGS
@given(spec=reductions(), dtype=st.sampled_from([torch.float32, torch.float64, torch.int32, torch.int64]))
def test_reductions_match_torch(spec, dtype) -> None:
    name, shape, dim, keepdim = spec
    if name == "mean" and not dtype.is_floating_point:
        dtype = torch.float32
    x = torch.randn(shape, dtype=dtype) if dtype.is_floating_point else torch.randint(-9, 10, shape, dtype=dtype)
    d = dim % len(shape) if shape else 0
    if shape and shape[d] == 0 and name in ("max", "min", "argmax"):
        with pytest.raises(dtorch.ShapeError, match="size 0"):
            getattr(ops, name)(x, dim, keepdim)
        return
    want = TORCH_REDUCE[name](x, dim, keepdim=keepdim)
    if name != "argmax":
        want = want.to(dtype)  # dtorch keeps integer dtypes (torch sums ints to int64)
    got = getattr(ops, name)(x, dim, keepdim)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, equal_nan=True)
    meta = getattr(ops, name)(torch.empty(shape, dtype=dtype, device="meta"), dim, keepdim)
    assert meta.shape == want.shape and meta.dtype == want.dtype


@SETTINGS
@given(shape=shapes.filter(lambda s: len(s) > 0), data=st.data())
def test_out_of_range_dim_is_an_argument_error(shape, data) -> None:
    rank = len(shape)
    dim = data.draw(st.one_of(st.integers(rank, rank + 3), st.integers(-rank - 3, -rank - 1)))
    with pytest.raises(dtorch.ArgumentError, match="out of range"):
        ops.sum(torch.zeros(shape), dim)
