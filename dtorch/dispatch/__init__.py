"""Kernel registration and dispatch: keys, contexts, meta, the Dispatcher and prepared kernels."""

from dtorch.core import cpu as _cpu, env as _env
from dtorch.dispatch.context import NO_PARAMS, KernelContext, KernelParams
from dtorch.dispatch.key import KernelKey
from dtorch.dispatch.meta import Call, KernelMeta
from dtorch.dispatch.prepared import PreparedKernel
from dtorch.dispatch.registration import KernelSet
from dtorch.dispatch.registry import Candidate, Choice, Dispatcher, Explanation, KernelFn, TableRow
from dtorch.dispatch.verification import verify, verify_mode

_env.check_or_exit()  # a misspelled or malformed DTORCH_* setting is an error, not a silent no-op
_cpu.check_env()
dispatcher = Dispatcher()
"""The process-wide registry; backends register into it lazily on their first lookup."""

__all__ = [
    "NO_PARAMS", "Call", "Candidate", "Choice", "Dispatcher", "Explanation", "KernelContext", "KernelFn",
    "KernelKey", "KernelMeta", "KernelParams", "KernelSet", "PreparedKernel", "TableRow", "dispatcher", "verify",
    "verify_mode",
]
