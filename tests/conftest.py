"""Shared test set-up: deterministic seeds, one intra-op thread per test process, triton's interpreter (the
triton kernels run on CPU tensors; it is chosen when a kernel is decorated, so before any of them is imported;
a GPU run sets TRITON_INTERPRET=0 to compile them), the packed-weight cache of the GGUF files tests make in a
folder of this run's own (not the user's cache), and the ``isa`` fixture of the native kernels' tests."""

from __future__ import annotations

import os
import signal
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("DTORCH_PACK_CACHE_DIR", tempfile.mkdtemp(prefix="dtorch-pack-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402

from dtorch.kernels.native.loader import ISAS  # noqa: E402

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(params=ISAS)
def isa(request):
    """Each ISA path of the native kernels in turn (forced), skipped with the reason when the native kernels cannot
    load here or this CPU lacks the path's instructions."""
    import dtorch.kernels.native as nk

    reason = nk.unavailable_reason()
    if reason is not None:
        pytest.skip(f"native kernels unavailable: {reason}")
    if request.param not in nk.available_isas():
        pytest.skip(f"this CPU lacks the instructions of the {request.param} path")
    with nk.use_isa(request.param):
        yield request.param


@pytest.fixture
def sigint_default():
    """While the test runs, SIGINT raises KeyboardInterrupt in this process instead of being ignored, so that the
    processes the test starts get SIGINT's default at exec (a caught signal's is reset there) and Python's
    KeyboardInterrupt. A suite started as a background job of a non-interactive shell (``pytest ... &``) inherits
    SIGINT ignored, as does every process it starts (Python keeps an ignored SIGINT ignored): a ``dtorch generate``
    sent SIGINT then streamed on for 120 s (session 51's suite)."""
    before = signal.getsignal(signal.SIGINT)
    if before == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
