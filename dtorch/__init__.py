"""dtorch: a runtime for tensor programs on one or many devices, built on PyTorch tensors.

The public surface is what ``__all__`` lists; everything else may move.

- LLM inference, shaped like vLLM: ``LLM``, ``SamplingParams``, ``StructuredOutputsParams``, ``RequestOutput``,
  ``CompletionOutput``, ``ToolCall``.
- Ops: ``dtorch.ops.rms_norm(x, w, eps)`` and the rest, each dispatched to the best registered kernel.
- Kernels: ``dispatcher`` (``register``, ``explain``, ``table``, ``disabled``), keyed by ``KernelKey``;
  ``verify()`` runs the reference kernel beside the active one.
- Graphs on many devices: ``DeviceMesh``, placements ``Shard`` / ``Replicate`` / ``Partial``, ``LogicalGraph``,
  run by a ``Runner`` on one ``KernelStream`` per device and stream type; a ``Tracer`` records the timeline.
- Errors: every failure is a ``DtorchError`` subclass.
"""

from dtorch import ops as ops
from dtorch.core.device import Device as Device
from dtorch.core.errors import (
    ArgumentError as ArgumentError,
    CommunicationError as CommunicationError,
    ConfigError as ConfigError,
    ContextLengthError as ContextLengthError,
    DeviceError as DeviceError,
    DtorchError as DtorchError,
    DTypeError as DTypeError,
    EngineBusy as EngineBusy,
    GraphError as GraphError,
    KernelFailure as KernelFailure,
    KernelNotFound as KernelNotFound,
    LayoutError as LayoutError,
    ModelError as ModelError,
    RegistrationError as RegistrationError,
    SamplingError as SamplingError,
    ShapeError as ShapeError,
    SyncError as SyncError,
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
from dtorch.engine import (
    LLM as LLM,
    CompletionOutput as CompletionOutput,
    Logprob as Logprob,
    RequestOutput as RequestOutput,
    SamplingParams as SamplingParams,
    StructuredOutputsParams as StructuredOutputsParams,
    ToolCall as ToolCall,
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

__all__ = [
    "__version__", "ops",
    # core
    "Device", "MemoryKind", "WorkspaceArena", "allocate", "memory_stats",
    "ArgumentError", "CommunicationError", "ConfigError", "ContextLengthError", "DeviceError", "DtorchError",
    "DTypeError", "EngineBusy", "GraphError", "KernelFailure", "KernelNotFound", "LayoutError", "ModelError",
    "RegistrationError",
    "SamplingError", "ShapeError", "SyncError", "SyncTimeout", "VerifyError",
    # dispatch
    "Dispatcher", "KernelContext", "KernelKey", "KernelMeta", "KernelParams", "dispatcher", "verify", "verify_mode",
    # ops, graph, runtime, distributed
    "OperatorInitContext", "PreparedOperator", "RuntimeContext",
    "DeviceMesh", "LogicalGraph", "Operand", "Operator", "Partial", "Replicate", "Shard",
    "Blob", "DistTensor", "Kernel", "KernelStream", "Runner", "StreamManager", "StreamType", "Tracer",
    "InProcessCommunicator", "TorchDistCommunicator",
    # engine
    "LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "StructuredOutputsParams", "ToolCall",
]
