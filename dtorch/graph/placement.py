"""Placements of a distributed tensor over the devices of a 1-D mesh: ``Replicate()``, ``Shard(dim)``,
``Partial(op)``; frozen, with the short forms ``R``, ``S(0)``, ``P``. Uneven shards follow
``torch.tensor_split``: the first ``size % n`` devices hold one row more.

A blocked shard ``Shard(dim, blocks=(a, b, ...))`` splits each block of the dim on its own and gives
device ``r`` the ``r``-th piece of every block, side by side: a fused ``[q | k | v]`` projection split
this way leaves each device ``[q_r | k_r | v_r]``, its own heads of each part (Megatron's layout).
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
    """Device ``i`` holds the ``i``-th piece of the tensor along ``dim`` (uneven pieces allowed); with
    ``blocks`` (sizes adding up to the dim), the ``i``-th piece of each block, concatenated."""

    dim: int
    blocks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise ArgumentError(f"Shard: 'dim' must be a non-negative int, got {self.dim!r}")
        if self.blocks is not None:
            blocks = tuple(self.blocks)
            if not blocks or any(not isinstance(b, int) or isinstance(b, bool) or b < 0 for b in blocks):
                raise ArgumentError(f"Shard: 'blocks' must be non-negative ints, got {self.blocks!r}")
            object.__setattr__(self, "blocks", blocks)

    def sizes(self, size: int, n: int) -> list[int]:
        """The size each of ``n`` devices holds of a dim of ``size``."""
        if self.blocks is None:
            return shard_sizes(size, n)
        per_block = [shard_sizes(b, n) for b in self.blocks]
        return [sum(p[r] for p in per_block) for r in range(n)]

    def __str__(self) -> str:
        if self.blocks is None:
            return f"S({self.dim})"
        return f"S({self.dim})[{','.join(map(str, self.blocks))}]"


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


def piece_ranges(shard: Shard, size: int, rank: int, n: int) -> list[tuple[int, int]]:
    """(start, length) of each run of the dim that device ``rank`` of ``n`` holds (one run, or one per block)."""
    blocks = shard.blocks if shard.blocks is not None else (size,)
    out, base = [], 0
    for b in blocks:
        out.append((base + shard_offsets(b, n)[rank], shard_sizes(b, n)[rank]))
        base += b
    return out


def local_shape(shape: tuple[int, ...], placement: Placement, rank: int, n: int) -> tuple[int, ...]:
    """The shape device ``rank`` of ``n`` holds of a tensor of global ``shape``."""
    if isinstance(placement, Shard):
        out = list(shape)
        out[placement.dim] = placement.sizes(shape[placement.dim], n)[rank]
        return tuple(out)
    return tuple(shape)
