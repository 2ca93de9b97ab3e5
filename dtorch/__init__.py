"""dtorch: a runtime for tensor programs on one or many devices, built on PyTorch tensors.

The public surface is what this module lists; everything else may move.
"""

from dtorch import ops as ops
from dtorch.core.device import Device as Device
from dtorch.core.errors import (
    ArgumentError as ArgumentError,
    CommunicationError as CommunicationError,
    ConfigError as ConfigError,
    DeviceError as DeviceError,
    DtorchError as DtorchError,
    EngineBusy as EngineBusy,
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
from dtorch.core.memory import (
    MemoryKind as MemoryKind,
    WorkspaceArena as WorkspaceArena,
    allocate as allocate,
    memory_stats as memory_stats,
)
from dtorch.dispatch import (
    Dispatcher as Dispatcher,
    KernelContext as KernelContext,
    KernelKey as KernelKey,
    KernelMeta as KernelMeta,
    KernelParams as KernelParams,
    dispatcher as dispatcher,
    verify as verify,
    verify_mode as verify_mode,
)
from dtorch.distributed import (
    InProcessCommunicator as InProcessCommunicator,
    TorchDistCommunicator as TorchDistCommunicator,
)
from dtorch.graph import (
    DeviceMesh as DeviceMesh,
    LogicalGraph as LogicalGraph,
    Operand as Operand,
    Operator as Operator,
    Partial as Partial,
    Replicate as Replicate,
    Shard as Shard,
)
from dtorch.engine import LLM as LLM, RequestOutput as RequestOutput, SamplingParams as SamplingParams
from dtorch.ops import (
    OperatorInitContext as OperatorInitContext,
    PreparedOperator as PreparedOperator,
    RuntimeContext as RuntimeContext,
)
from dtorch.runtime import (
    Blob as Blob,
    DistTensor as DistTensor,
    Kernel as Kernel,
    KernelStream as KernelStream,
    Runner as Runner,
    StreamManager as StreamManager,
    StreamType as StreamType,
    Tracer as Tracer,
)

__version__ = "0.1.0"
