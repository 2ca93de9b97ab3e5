"""Graphs: ``DeviceMesh``, placements, ``Operand`` / ``Operator`` and ``LogicalGraph`` (metadata only)."""

from dtorch.core.placement import Partial, Placement, Replicate, Shard, as_placement, shard_sizes
from dtorch.graph.logical import LogicalGraph
from dtorch.graph.mesh import DeviceMesh
from dtorch.graph.operand import COMMUNICATE, COMPUTE, Operand, Operator

__all__ = ["COMMUNICATE", "COMPUTE", "DeviceMesh", "LogicalGraph", "Operand", "Operator", "Partial", "Placement",
           "Replicate", "Shard", "as_placement", "shard_sizes"]
