"""Shared test set-up: deterministic seeds, one intra-op thread per test process (and per process a test starts,
through OMP_NUM_THREADS; the ``two_threads`` fixture for the tests of a split among threads), triton's interpreter (the
triton kernels run on CPU tensors; it is chosen when a kernel is decorated, so before any of them is imported;
a GPU run sets TRITON_INTERPRET=0 to compile them), the packed-weight cache of the GGUF files tests make in a
folder of this run's own (not the user's cache), and the ``isa`` fixture of the native kernels' tests."""

from __future__ import annotations

import os
import signal
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread a test process: the suite runs in two xdist workers on a 2-core machine, and two threads each
# (four on two cores) made a decode step cost 3-6x its CPU time. The processes tests start inherit it (a test that
# wants more says so in its own environment).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DTORCH_PACK_CACHE_DIR", tempfile.mkdtemp(prefix="dtorch-pack-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402

from dtorch.kernels.native.loader import ISAS  # noqa: E402

torch.set_num_threads(1)


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
def two_threads():
    """Two intra-op threads while the test runs (then the count before): for the tests of a split among threads
    (the native kernels' row splits, a stream's share of the threads), which one thread would not exercise. Two even
    on a one-core machine: the threads then take turns, and the split is still the one under test."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


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
