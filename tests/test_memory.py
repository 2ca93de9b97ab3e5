"""Memory kinds: allocation tags tensors and accounts live and peak bytes per kind and device."""

from __future__ import annotations

import gc

import pytest
import torch

import dtorch
from dtorch.core.memory import MemoryTracker, adopt, allocate, memory


def test_allocate_tags_and_accounts_until_freed():
    before = memory.live_bytes(dtorch.MemoryKind.KV_CACHE, "cpu:3")
    t = allocate((4, 8), torch.float32, "cpu:3", dtorch.MemoryKind.KV_CACHE)
    assert memory.kind_of(t) is dtorch.MemoryKind.KV_CACHE
    assert memory.live_bytes(dtorch.MemoryKind.KV_CACHE, "cpu:3") - before == 4 * 8 * 4
    peak = memory.peak_bytes(dtorch.MemoryKind.KV_CACHE, "cpu:3")
    del t
    gc.collect()
    assert memory.live_bytes(dtorch.MemoryKind.KV_CACHE, "cpu:3") == before
    assert memory.peak_bytes(dtorch.MemoryKind.KV_CACHE, "cpu:3") == peak


def test_kinds_and_devices_are_separate():
    tracker = MemoryTracker()
    a = tracker.track(torch.empty(10, dtype=torch.float64), dtorch.MemoryKind.PERSISTENT, dtorch.Device("cpu", 0))
    b = tracker.track(torch.empty(5, dtype=torch.int32), dtorch.MemoryKind.WORKSPACE, dtorch.Device("cpu", 1))
    stats = {(s.kind, str(s.device)): s for s in tracker.stats()}
    assert stats[(dtorch.MemoryKind.PERSISTENT, "cpu:0")].live_bytes == 80
    assert stats[(dtorch.MemoryKind.WORKSPACE, "cpu:1")].live_bytes == 20
    assert tracker.live_bytes() == 100
    del a, b


def test_adopt_counts_an_existing_tensor():
    w = torch.randn(16, 16)
    before = memory.live_bytes(dtorch.MemoryKind.PERSISTENT)
    adopt(w, dtorch.MemoryKind.PERSISTENT)
    assert memory.live_bytes(dtorch.MemoryKind.PERSISTENT) - before == w.nbytes


def test_workspace_arena_reuses_its_buffer():
    arena = dtorch.WorkspaceArena("cpu")
    a = arena.view((4, 4), torch.float32)
    grows = arena.grows
    for _ in range(10):  # same or smaller requests across steps: no new allocation
        b = arena.view((2, 4), torch.float32)
        assert b.data_ptr() == a.data_ptr()
    assert arena.grows == grows
    arena.view((64, 64), torch.float32)
    assert arena.grows == grows + 1 and arena.capacity >= 64 * 64 * 4


def test_bad_allocations():
    with pytest.raises(dtorch.ArgumentError):
        allocate((-1, 2), torch.float32)
    with pytest.raises(dtorch.DeviceError):
        allocate((1,), torch.float32, "tpu:0")
    with pytest.raises(dtorch.ArgumentError):
        dtorch.WorkspaceArena().get(-5)


def test_a_kernel_declaring_workspace_gets_a_reused_arena():
    """A kernel declares its scratch bytes in KernelMeta and finds an arena in ctx.workspace."""
    from dtorch.dispatch import KernelKey, KernelMeta

    key = KernelKey(dtorch.dispatcher.define("test.scratch_square"), "cpu", torch.float32)
    seen = []

    def square_via_scratch(ctx, inputs, outputs):
        x = inputs[0]
        scratch = ctx.workspace.view(x.shape, x.dtype)  # [*x.shape] from the arena, no allocation
        torch.mul(x, x, out=scratch)
        outputs[0].copy_(scratch)
        seen.append(scratch.data_ptr())

    meta = KernelMeta(workspace=lambda inputs, params: inputs[0].numel() * inputs[0].element_size())
    dtorch.dispatcher.register(key, square_via_scratch, provider="reference", meta=meta)
    try:
        _run_scratch_square(key, seen)
    finally:  # the global registry must not keep a test op (test_op_table checks every registered cpu kernel)
        dtorch.dispatcher.unregister(key, "reference")


def _run_scratch_square(key, seen) -> None:
    from dtorch.ops import OperatorInitContext, PreparedOperator

    class Square(PreparedOperator):
        op = "test.scratch_square"

        def forward_out(self, x, *, out, ctx=None):
            self._run((x,), (out,), ctx)
            return out

    x = torch.randn(4, 8)
    assert dtorch.dispatcher.lookup_meta(key).workspace_bytes([x]) == 4 * 8 * 4
    op = Square().prepare(OperatorInitContext("cpu", torch.float32))
    for _ in range(3):
        torch.testing.assert_close(op.forward_out(x, out=torch.empty(4, 8)), x * x)
        out = torch.empty(4, 8)
        dtorch.ops.invoke("test.scratch_square", [x], [out])
        torch.testing.assert_close(out, x * x)
    assert len(set(seen)) == 1  # one arena buffer, reused across steps and across both paths
    arena = dtorch.WorkspaceArena("cpu")
    op.forward_out(x, out=torch.empty(4, 8), ctx=dtorch.RuntimeContext("cpu", workspace=arena))
    assert seen[-1] == arena.get(1).data_ptr()  # a caller's own arena is used when given
