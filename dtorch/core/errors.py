"""The error hierarchy: every failure dtorch raises is a ``DtorchError``."""

from __future__ import annotations


class DtorchError(Exception):
    """Root of every error dtorch raises on purpose."""


class KernelNotFound(DtorchError, LookupError):
    """No registered kernel for a key, or none whose capability check accepts the call."""


class RegistrationError(DtorchError):
    """A kernel registration conflicts with one already made."""


class ShapeError(DtorchError, ValueError):
    """A tensor has the wrong rank or shape for an op."""


class DTypeError(DtorchError, TypeError):
    """A tensor has a dtype the op does not accept, or dtypes disagree."""


class DeviceError(DtorchError):
    """A tensor is on the wrong device, or devices disagree."""


class ArgumentError(DtorchError, ValueError):
    """A non-tensor argument is missing or out of range."""


class LayoutError(DtorchError, ValueError):
    """A tensor's layout has no kernel (sparse, say), or a kernel needs dense tensors and got strided ones."""


class ConfigError(DtorchError, ValueError):
    """An environment setting (``DTORCH_*``) is unknown or malformed; the message lists what is allowed."""


class VerifyError(DtorchError, AssertionError):
    """Verify mode: the active kernel disagrees with the reference kernel."""


class KernelFailure(DtorchError, RuntimeError):
    """A kernel raised while running; names the op, the device and the stream."""


class SyncTimeout(DtorchError, TimeoutError):
    """A synchronization waited longer than its timeout; lists the kernels in flight."""


class SyncError(DtorchError, RuntimeError):
    """A host read of tensor values (``.tolist()``, ``.item()``, a boolean mask, ...) inside a region that forbids
    syncing with the host (``forbid_host_sync()``, ``DTORCH_FORBID_SYNC``); names the call and its caller."""


class CommunicationError(DtorchError, RuntimeError):
    """A collective failed or a peer was lost."""


class GraphError(DtorchError, ValueError):
    """A logical graph is malformed (unknown operand, bad placement, ...)."""


class ModelError(DtorchError, ValueError):
    """A model file, configuration or tensor is missing, corrupt or unsupported."""


class ContextLengthError(ModelError):
    """A prompt (with the tokens asked for after it) does not fit the model's context; ``tokens`` is its length (or a
    lower bound of it, ``at_least``), ``limit`` the context (max_model_len), ``requested`` the new tokens asked for
    (None: at least one)."""

    def __init__(self, message: str, *, tokens: int, limit: int, requested: int | None = None,
                 at_least: bool = False) -> None:
        super().__init__(message)
        self.tokens, self.limit, self.requested, self.at_least = tokens, limit, requested, at_least


class SamplingError(DtorchError, ValueError):
    """A sampling parameter is out of range."""


class EngineBusy(DtorchError, RuntimeError):
    """The engine's queue of waiting requests is full (a server answers 503), or the engine is shutting down."""
