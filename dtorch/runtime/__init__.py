"""Runtime: ``Blob``, ``DistTensor``, ``Kernel``, ``KernelStream`` / ``StreamManager``, ``Runner``, tracing."""

from dtorch.runtime.blob import Blob, DistTensor
from dtorch.runtime.comm import Communicator
from dtorch.runtime.kernel import CollectiveKernel, DispatchKernel, Kernel, LocalKernel, PythonKernel, RunState
from dtorch.runtime.runner import Runner
from dtorch.runtime.stream import CudaKernelStream, Event, KernelStream, StreamManager, StreamType
from dtorch.runtime.tracing import Tracer, plot_chrome_trace

__all__ = ["Blob", "CollectiveKernel", "Communicator", "CudaKernelStream", "DispatchKernel", "DistTensor", "Event",
           "Kernel", "KernelStream", "LocalKernel", "PythonKernel", "RunState", "Runner", "StreamManager", "StreamType",
           "Tracer", "plot_chrome_trace"]
