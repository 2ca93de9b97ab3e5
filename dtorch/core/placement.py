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
    """Device ``i`` holds the ``i``-th piece of the tensor along ``dim`` (uneven pieces allowed).

    ``blocks`` (sizes adding up to the dim): the ``i``-th piece of each block, side by side. ``unit``
    (one int, or one per block): pieces are whole multiples of it, so a dim of heads * head_dim split
    with ``unit=head_dim`` never cuts a head, even when the heads do not divide evenly.
    """

    dim: int
    blocks: tuple[int, ...] | None = None
    unit: int | tuple[int, ...] = 1

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise ArgumentError(f"Shard: 'dim' must be a non-negative int, got {self.dim!r}")
        if self.blocks is not None:
            blocks = tuple(self.blocks)
            if not blocks or any(not isinstance(b, int) or isinstance(b, bool) or b < 0 for b in blocks):
                raise ArgumentError(f"Shard: 'blocks' must be non-negative ints, got {self.blocks!r}")
            object.__setattr__(self, "blocks", blocks)
        unit = self.unit
        if isinstance(unit, (tuple, list)):
            unit = tuple(unit)
            if self.blocks is None or len(unit) != len(self.blocks):
                raise ArgumentError(f"Shard: a 'unit' per block needs one per block, got {unit} for {self.blocks}")
            if len(set(unit)) == 1:
                unit = unit[0]
        units = unit if isinstance(unit, tuple) else (unit,)
        if any(not isinstance(u, int) or isinstance(u, bool) or u < 1 for u in units):
            raise ArgumentError(f"Shard: 'unit' must be ints >= 1, got {self.unit!r}")
        object.__setattr__(self, "unit", unit)

    def runs(self, size: int) -> list[tuple[int, int]]:
        """(block size, unit) of each block of a dim of ``size``."""
        blocks = self.blocks if self.blocks is not None else (size,)
        units = self.unit if isinstance(self.unit, tuple) else (self.unit,) * len(blocks)
        return list(zip(blocks, units, strict=True))

    def check(self, size: int) -> str | None:
        """Why this shard cannot split a dim of ``size``, or None."""
        if self.blocks is not None and sum(self.blocks) != size:
            return f"blocks {list(self.blocks)} add up to {sum(self.blocks)}, not {size}"
        bad = [(b, u) for b, u in self.runs(size) if b % u]
        return f"block {bad[0][0]} is not a multiple of its unit {bad[0][1]}" if bad else None

    def sizes(self, size: int, n: int) -> list[int]:
        """The size each of ``n`` devices holds of a dim of ``size``."""
        per_block = [[u * s for s in shard_sizes(b // u, n)] for b, u in self.runs(size)]
        return [sum(p[r] for p in per_block) for r in range(n)]

    @property
    def plain(self) -> bool:
        return self.blocks is None and self.unit == 1

    def __str__(self) -> str:
        text = f"S({self.dim})"
        if self.blocks is not None:
            text += f"[{','.join(map(str, self.blocks))}]"
        if self.unit != 1:
            text += f"/{self.unit if isinstance(self.unit, int) else ','.join(map(str, self.unit))}"
        return text


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
    out, base = [], 0
    for b, u in shard.runs(size):
        out.append((base + u * shard_offsets(b // u, n)[rank], u * shard_sizes(b // u, n)[rank]))
        base += b
    return out


def local_shape(shape: tuple[int, ...], placement: Placement, rank: int, n: int) -> tuple[int, ...]:
    """The shape device ``rank`` of ``n`` holds of a tensor of global ``shape``."""
    if isinstance(placement, Shard):
        out = list(shape)
        out[placement.dim] = placement.sizes(shape[placement.dim], n)[rank]
        return tuple(out)
    return tuple(shape)
