"""dtorch: a runtime for tensor programs on one or many devices, built on PyTorch tensors.

The public surface is what this module lists; everything else may move.
"""

from dtorch.core.device import Device as Device
from dtorch.core.errors import (
    ArgumentError as ArgumentError,
    CommunicationError as CommunicationError,
    DeviceError as DeviceError,
    DtorchError as DtorchError,
    DTypeError as DTypeError,
    GraphError as GraphError,
    KernelFailure as KernelFailure,
    KernelNotFound as KernelNotFound,
    LayoutError as LayoutError,
    ModelError as ModelError,
    RegistrationError as RegistrationError,
    SamplingError as SamplingError,
    ShapeError as ShapeError,
    SyncTimeout as SyncTimeout,
    VerifyError as VerifyError,
)
from dtorch.core.memory import MemoryKind as MemoryKind
from dtorch.core.memory import WorkspaceArena as WorkspaceArena
from dtorch.core.memory import allocate as allocate
from dtorch.core.memory import memory_stats as memory_stats
from dtorch.dispatch import Dispatcher as Dispatcher
from dtorch.dispatch import KernelContext as KernelContext
from dtorch.dispatch import KernelKey as KernelKey
from dtorch.dispatch import KernelMeta as KernelMeta
from dtorch.dispatch import KernelParams as KernelParams
from dtorch.dispatch import dispatcher as dispatcher
from dtorch.dispatch import verify as verify
from dtorch.dispatch import verify_mode as verify_mode
from dtorch import ops as ops
from dtorch.ops import OperatorInitContext as OperatorInitContext
from dtorch.ops import PreparedOperator as PreparedOperator
from dtorch.ops import RuntimeContext as RuntimeContext

__version__ = "0.1.0"
