"""Op wrappers: validation first, then dispatch.

Every op has a functional form that allocates its output (``dtorch.ops.add(a, b)``) and an
``*_out`` form that writes a caller-allocated one (``dtorch.ops.add_out(a, b, out=o)``);
``invoke`` runs any registered op by name. Prepared operators live beside their family, and so does each op's
graph declaration (``declare``: its graph binding and placement rule, ``dtorch.ops.graph_op``).
"""

import sys as _sys

from dtorch.ops._invoke import invoke
from dtorch.ops.attention import *  # noqa: F403
from dtorch.ops.binary import *  # noqa: F403
from dtorch.ops.causal_conv1d import *  # noqa: F403
from dtorch.ops.context import OperatorInitContext, RuntimeContext
from dtorch.ops.conv import *  # noqa: F403
from dtorch.ops.copy import *  # noqa: F403
from dtorch.ops.creation import *  # noqa: F403
from dtorch.ops.gated_delta_net import *  # noqa: F403
from dtorch.ops.gdn_gates import *  # noqa: F403
from dtorch.ops.glu import *  # noqa: F403
from dtorch.ops.graph_op import GraphOp, Strategy, declare, declared, undeclare
from dtorch.ops.kv_cache import *  # noqa: F403
from dtorch.ops.llm import *  # noqa: F403
from dtorch.ops.matmul import *  # noqa: F403
from dtorch.ops.moe import *  # noqa: F403
from dtorch.ops.prepared import PreparedOperator
from dtorch.ops.reduce import *  # noqa: F403
from dtorch.ops.unary import *  # noqa: F403

# Modules looked up by name: a family may export a function named like its module (``copy``, ``causal_conv1d``),
# which the star imports above bind over the module's name here.
_FAMILIES = ("attention", "binary", "causal_conv1d", "conv", "copy", "creation", "gated_delta_net", "gdn_gates", "glu",
             "kv_cache", "llm", "matmul", "moe", "reduce", "unary")
__all__ = ["GraphOp", "OperatorInitContext", "PreparedOperator", "RuntimeContext", "Strategy", "declare", "declared",
           "invoke", "undeclare"] + [
    name for fam in _FAMILIES for name in _sys.modules[f"dtorch.ops.{fam}"].__all__]
