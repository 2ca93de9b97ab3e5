"""Placements of a distributed tensor over the devices of a 1-D mesh: ``Replicate()``, ``Shard(dim)``,
``Partial(op)``; frozen, with the short forms ``R``, ``S(0)``, ``P``. Uneven shards follow
``torch.tensor_split``: the first ``size % n`` devices hold one row more.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtorch.core.errors import ArgumentError

PARTIAL_OPS = ("sum", "max")


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every device holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Shard:
    """Device ``i`` holds the ``i``-th piece of the tensor along ``dim`` (uneven pieces allowed)."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise ArgumentError(f"Shard: 'dim' must be a non-negative int, got {self.dim!r}")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Partial:
    """Every device holds a full-shaped tensor; the value is their reduction with ``op`` ("sum" or "max")."""

    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in PARTIAL_OPS:
            raise ArgumentError(f"Partial: 'op' must be one of {PARTIAL_OPS}, got {self.op!r}")

    def __str__(self) -> str:
        return "P" if self.op == "sum" else f"P({self.op})"


Placement = Replicate | Shard | Partial


def as_placement(p: object, what: str = "placement") -> Placement:
    """Accept a placement object or its short form ("R", "S(1)", "P")."""
    if isinstance(p, (Replicate, Shard, Partial)):
        return p
    if isinstance(p, str):
        s = p.strip()
        if s == "R":
            return Replicate()
        if s == "P":
            return Partial()
        if s.startswith("S(") and s.endswith(")") and s[2:-1].isdigit():
            return Shard(int(s[2:-1]))
        if s.startswith("P(") and s.endswith(")"):
            return Partial(s[2:-1])
    raise ArgumentError(f"{what} must be Replicate(), Shard(dim), Partial(op) or 'R'/'S(d)'/'P', got {p!r}")


def shard_sizes(size: int, n: int) -> list[int]:
    """Sizes of ``n`` pieces of a dim of ``size``, the first ``size % n`` one larger (``torch.tensor_split``)."""
    base, extra = divmod(size, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def shard_offsets(size: int, n: int) -> list[int]:
    """Start index of each piece of ``shard_sizes(size, n)``."""
    out, acc = [], 0
    for s in shard_sizes(size, n):
        out.append(acc)
        acc += s
    return out


def local_shape(shape: tuple[int, ...], placement: Placement, rank: int, n: int) -> tuple[int, ...]:
    """The shape device ``rank`` of ``n`` holds of a tensor of global ``shape``."""
    if isinstance(placement, Shard):
        out = list(shape)
        out[placement.dim] = shard_sizes(shape[placement.dim], n)[rank]
        return tuple(out)
    return tuple(shape)
