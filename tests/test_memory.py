"""Memory kinds: allocation tags tensors and accounts live and peak bytes per kind and device."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

import dtorch
from dtorch.core.memory import MemoryTracker, adopt, allocate, memory
from tests.smaps import mapping


def test_allocate_tags_and_accounts_until_freed():
    gc.collect()  # a KV cache an earlier test in this process left as garbage must not be freed mid-test
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
    gc.collect()  # no earlier test's garbage freed between the two readings
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


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of this process's mapping that holds ``address``."""
    return mapping(address)[2]["AnonHugePages"]


def _thp_fallbacks() -> int:
    """Page faults of MADV_HUGEPAGE memory the kernel served in 4 KiB pages (no free 2 MiB page), so far."""
    with open("/proc/vmstat") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("thp_fault_fallback "))


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
def test_a_huge_page_arena_puts_small_tensors_in_2_mib_pages_and_unmaps_when_they_go():
    from dtorch.core.memory import HUGE_PAGE, HugePageArena

    if not HugePageArena.usable():
        pytest.skip("transparent huge pages are off here")
    arena, fallbacks = HugePageArena(), _thp_fallbacks()
    sizes = [(1000,), (300, 1024), (5, 7), (3 << 20,)]  # bytes: 4000, 1.2 MiB, 140, 12 MiB
    ts = [arena.empty(s, torch.float32) for s in sizes]
    for i, t in enumerate(ts):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + i)
    for i, (s, t) in enumerate(zip(sizes, ts, strict=True)):
        assert t.shape == s and t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes  # counted alone
        assert torch.equal(t, torch.arange(t.numel(), dtype=torch.float32).view(s) + i)  # none overlaps another
    assert arena.bytes == sum(t.nbytes for t in ts) and not arena.refused
    if _thp_fallbacks() == fallbacks:  # (else the kernel had no free 2 MiB page: 4 KiB ones, as it may)
        # ts[1], 1.2 MiB: a mapping of its own would be in 4 KiB pages; every page the four touch is a 2 MiB one
        assert _anon_huge_kib(ts[1].data_ptr()) * 1024 >= -(-sum(t.nbytes for t in ts) // HUGE_PAGE) * HUGE_PAGE
    slab = weakref.ref(arena._slabs[0][0])
    arena.close()  # the rest of the last 2 MiB page given back: none of the tensors' bytes
    for i, (s, t) in enumerate(zip(sizes, ts, strict=True)):
        assert torch.equal(t, torch.arange(t.numel(), dtype=torch.float32).view(s) + i)
    assert arena.refused and not arena._slabs  # closed: plain memory from now on
    del arena, t
    gc.collect()
    assert slab() is not None  # the tensors keep their slab mapped
    ts.clear()
    gc.collect()
    assert slab() is None  # the last one gone: unmapped


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
def test_huge_pages_reports_the_small_tensors_of_an_arena_as_the_kernel_maps_them():
    """Tensors under 4 MiB each (none holds a whole 2 MiB page of its own) from a closed arena: ``huge_pages``
    counts their bytes in the slab's 2 MiB pages, which is what /proc/self/smaps says the slab holds in huge pages;
    the last page, given back in part by ``close``, counts as 4 KiB pages; a small tensor of the heap counts 0."""
    from dtorch.core.memory import HUGE_PAGE, HugePageArena, huge_pages

    if not HugePageArena.usable():
        pytest.skip("transparent huge pages are off here")
    arena = HugePageArena()
    ts = [arena.empty((3 << 18,), torch.float32).fill_(i) for i in range(5)]  # 3 MiB each: 15 MiB, 7.5 pages
    arena.close()
    plain = torch.ones(1000)
    done = huge_pages([*ts, ts[2][5:], plain])  # a storage given twice counts once
    lo, hi, fields = mapping(ts[0].data_ptr())  # the slab's 2 MiB pages: one mapping, advised MADV_HUGEPAGE
    if fields["AnonHugePages"] == 0:
        pytest.skip("the kernel gave the slab no huge page, at its faults or by madvise(MADV_COLLAPSE)")
    assert lo == ts[0].data_ptr() and hi >= ts[0].data_ptr() + 7 * HUGE_PAGE
    assert done == fields["AnonHugePages"] * 1024 == 7 * HUGE_PAGE  # the whole pages, none of the last one
    assert mapping(ts[-1].data_ptr() + ts[-1].nbytes - 1)[2]["AnonHugePages"] == 0  # the last page: 4 KiB ones
    assert huge_pages([plain]) == 0 and all((t == i).all() for i, t in enumerate(ts))


def test_empty_in_huge_pages_marks_whole_pages_unless_told_not_to(monkeypatch):
    """The whole 2 MiB pages inside a new tensor are advised MADV_HUGEPAGE (a read into it then faults them in as huge
    pages); none under ``DTORCH_NO_HUGE_PAGES``, as every weight's memory."""
    import importlib

    mem = importlib.import_module("dtorch.core.memory")
    calls = []
    monkeypatch.setattr(mem, "libc_function", lambda name: (lambda *a: calls.append(a) or 0) if name == "madvise"
                        else None)
    t = mem.empty_in_huge_pages((5 << 20,), torch.uint8)
    ((addr, size, advice),) = calls
    page = mem.HUGE_PAGE
    lo, hi = -(-t.data_ptr() // page) * page, (t.data_ptr() + t.numel()) // page * page  # the whole pages inside
    assert advice == mem.MADV_HUGEPAGE and (addr.value, size.value) == (lo, hi - lo) and hi - lo >= mem.HUGE_PAGE
    monkeypatch.setenv("DTORCH_NO_HUGE_PAGES", "1")
    assert mem.empty_in_huge_pages((5 << 20,), torch.uint8).shape == (5 << 20,) and len(calls) == 1


def test_a_huge_page_arena_opens_a_slab_when_one_is_full(monkeypatch):
    import importlib

    mem = importlib.import_module("dtorch.core.memory")
    if not mem.HugePageArena.usable():
        pytest.skip("transparent huge pages are off here")
    monkeypatch.setattr(mem, "ARENA_SLAB", 4 << 20)
    arena = mem.HugePageArena()
    a = arena.empty(((4 << 20) - 4096,), torch.uint8).fill_(1)  # the first slab, all but 4 KiB
    b = arena.empty((8192,), torch.uint8).fill_(2)  # does not fit: a second slab
    c = arena.empty((4000,), torch.uint8).fill_(3)  # fits the first one's last 4 KiB
    assert len(arena._slabs) == 2 and c.data_ptr() == a.data_ptr() + a.numel()
    assert (a == 1).all() and (b == 2).all() and (c == 3).all()


def test_a_huge_page_arena_falls_back_to_plain_memory(monkeypatch):
    """Where madvise refuses (a kernel without transparent huge pages), ``DTORCH_NO_HUGE_PAGES`` is set or THP is
    "never", weights get plain memory; the values are the same."""
    import importlib

    mem = importlib.import_module("dtorch.core.memory")  # (the package's "memory" is the tracker)
    monkeypatch.setattr(mem, "libc_function", lambda name: (lambda *a: -1) if name == "madvise" else None)
    monkeypatch.setattr(mem, "thp_mode", lambda: "madvise")
    arena = mem.HugePageArena()
    t = arena.empty((64, 33), torch.int16).copy_(torch.arange(64 * 33).view(64, 33))
    assert arena.refused and not arena._slabs and torch.equal(t, torch.arange(64 * 33, dtype=torch.int16).view(64, 33))

    def no_room(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")  # strict overcommit refusing the slab's reservation

    with monkeypatch.context() as m:
        m.setattr(mem.mmap, "mmap", no_room)
        arena = mem.HugePageArena()
        assert arena.empty((7,), torch.float64).shape == (7,) and arena.refused
    for setting in ("env", "never"):
        monkeypatch.setattr(mem, "libc_function", lambda name: (lambda *a: 0) if name == "madvise" else None)
        if setting == "env":
            monkeypatch.setenv("DTORCH_NO_HUGE_PAGES", "1")
        else:
            monkeypatch.delenv("DTORCH_NO_HUGE_PAGES", raising=False)
            monkeypatch.setattr(mem, "thp_mode", lambda: "never")
        with mem.weight_arena() as arena:
            assert arena is None and mem.current_weight_arena() is None
            w = mem.empty_weight((3, 5), torch.float32)
            assert w.shape == (3, 5) and w.untyped_storage().nbytes() == w.nbytes
    monkeypatch.setattr(mem, "thp_mode", lambda: "madvise")
    monkeypatch.delenv("DTORCH_NO_HUGE_PAGES", raising=False)
    with mem.weight_arena() as arena:  # madvise answers 0: an arena, and the weights come from it
        assert arena is not None and mem.current_weight_arena() is arena
        mem.empty_weight((3, 5), torch.float32)
        assert arena.bytes == 60
    assert mem.current_weight_arena() is None
