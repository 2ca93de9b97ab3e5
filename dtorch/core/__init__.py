"""Core: devices, dtypes, placements, errors and memory accounting (imports nothing else of dtorch)."""

from dtorch.core.device import Device, as_device, device_of
from dtorch.core.dtypes import ALL_DTYPES, FLOAT_DTYPES, INT_DTYPES, as_dtype, dtype_name, tolerance
from dtorch.core.errors import (
    ArgumentError,
    CommunicationError,
    ConfigError,
    DeviceError,
    DtorchError,
    DTypeError,
    EngineBusy,
    GraphError,
    KernelFailure,
    KernelNotFound,
    LayoutError,
    ModelError,
    RegistrationError,
    SamplingError,
    ShapeError,
    SyncError,
    SyncTimeout,
    VerifyError,
)
from dtorch.core.memory import MemoryKind, WorkspaceArena, adopt, allocate, memory, memory_stats

__all__ = [
    "ALL_DTYPES", "FLOAT_DTYPES", "INT_DTYPES", "ArgumentError", "CommunicationError", "ConfigError", "DTypeError",
    "Device", "DeviceError", "DtorchError", "EngineBusy", "GraphError", "KernelFailure", "KernelNotFound",
    "LayoutError", "MemoryKind", "ModelError", "RegistrationError", "SamplingError", "ShapeError", "SyncError",
    "SyncTimeout", "VerifyError", "WorkspaceArena", "adopt", "allocate", "as_device", "as_dtype", "device_of",
    "dtype_name", "memory", "memory_stats", "tolerance",
]
