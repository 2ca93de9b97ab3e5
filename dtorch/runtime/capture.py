"""Recording a static Runner's kernels once and replaying them: CUDA graphs for the decode step.

A ``Recorder`` turns ``issue`` (a function that issues one run's device work, kernel after kernel, on the current
stream) into a ``Recording`` whose ``replay()`` issues the same work again in one call. ``CudaGraphRecorder``
records into a ``torch.cuda.CUDAGraph`` on a side stream; its recordings share one memory pool, so the temporaries
of every captured bucket of a model live in one pool (replays never overlap: one Runner runs at a time). Recording
requires every kernel to read no device value on the host (``KernelMeta.capture_safe``): the Runner binds only such
kernels when it is asked to capture, and says why it cannot when one is missing.

The capture state has one owner: ``Capture`` decides whether runs are recorded, with which recorder, or why not
(a model's Runners share one, hence one recorder and pool); each Runner keeps its ``RunCapture`` (why its own runs
are not recorded, or its recording). The Executor and the LLM ask them for their reports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from dtorch.core.device import Device
from dtorch.core.errors import ArgumentError


class Recording(Protocol):
    def replay(self) -> None: ...


class Recorder(Protocol):
    def record(self, issue: Callable[[], None]) -> Recording: ...


class CudaGraphRecorder:
    """Records on ``device`` (a cuda ``Device``) into CUDA graphs that share one memory pool."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.pool: Any = None  # the first graph's pool, handed to the later ones

    def record(self, issue: Callable[[], None]) -> Recording:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device.torch):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            # torch.cuda.graph synchronizes before and after recording and makes ``side`` current while ``issue``
            # runs, so every kernel (torch ops and triton launches alike) is recorded on it
            with torch.cuda.graph(graph, pool=self.pool, stream=side):
                issue()
            torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = graph.pool()
        return graph


def default_recorder(device: Device) -> Recorder | None:
    """The recorder for ``device``'s type, or None where there is nothing to record into (a CPU runs its kernels
    as they are issued; ``no_recorder`` says so)."""
    return CudaGraphRecorder(device) if device.type == "cuda" else None


def no_recorder(device: Device) -> str:
    """Why nothing records on ``device`` (where ``default_recorder`` is None)."""
    return f"nothing records kernels on {device.type} (CUDA graphs need a cuda device)"


NOT_ASKED = "capture was not asked for"


class Capture:
    """Whether runs are recorded and replayed, with which recorder, or why not (``off``).

    ``Capture(device)`` records on ``device`` with its default recorder (a CUDA graph on a GPU; nothing records on a
    CPU, and ``off`` says so); ``recorder`` replaces the default. ``Capture(off=reason)`` never records.
    """

    def __init__(self, device: Device | None = None, recorder: Recorder | None = None, *,
                 off: str | None = None) -> None:
        if off is None and recorder is None:
            if device is None:
                raise ArgumentError("Capture: give the device to record on, a recorder, or why capture is off")
            recorder = default_recorder(device)
            off = no_recorder(device) if recorder is None else None
        self.recorder = recorder if off is None else None
        self.off = off

    @classmethod
    def for_steps(cls, device: Device, mesh_size: int, *, asked: bool = True,
                  recorder: Recorder | None = None) -> Capture:
        """The capture of a model's steps on a mesh of ``mesh_size`` devices, ``device`` the first local one: off
        unless ``asked``, off on several devices (a recording holds one device's kernels, and no collective)."""
        if not asked:
            return cls(off=NOT_ASKED)
        if mesh_size > 1:
            return cls(off=f"capture records one device's steps; this model runs on a mesh of {mesh_size} devices")
        return cls(device, recorder)

    def runner(self, blocker: Callable[[], str | None]) -> RunCapture:
        """A Runner's own state under this capture; ``blocker()`` says why its program cannot be recorded (asked
        only when this capture is on)."""
        return RunCapture(self.recorder, self.off or blocker())

    def __repr__(self) -> str:
        return f"Capture({'on: ' + type(self.recorder).__name__ if self.off is None else 'off: ' + self.off})"


class RunCapture:
    """One Runner's capture: ``off`` (why its runs are not recorded; None: they are), and the recording that its
    runs replay once one run has gone uncaptured (``warm``: lazy initialization and compilation happen then)."""

    def __init__(self, recorder: Recorder | None, off: str | None) -> None:
        self.off = off
        self._recorder = recorder if off is None else None
        self._recording: Recording | None = None
        self.warm = False

    @property
    def captured(self) -> bool:
        """True once the runs are replays of a recording."""
        return self._recording is not None

    @property
    def replays(self) -> bool:
        """Whether the next run replays (recording first, the first time)."""
        return self._recorder is not None and self.warm

    def status(self) -> str:
        """"captured" (the runs replay a recording), "to capture" (the next run records) or why not."""
        return "captured" if self.captured else self.off or "to capture"

    def replay(self, issue: Callable[[], None]) -> None:
        """Replay the recording of ``issue`` (made now, the first time). A recording that fails leaves the runs
        uncaptured, ``off`` saying why, and issues this run's work as it is."""
        if self._recording is None:
            try:
                self._recording = self._recorder.record(issue)
            except Exception as exc:  # noqa: BLE001 - the Runner goes on uncaptured and says why
                self._recorder = None
                self.off = f"recording failed ({type(exc).__name__}: {exc}); the runs are not captured"
                issue()
                return
        self._recording.replay()
