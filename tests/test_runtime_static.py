"""``Runner(static=True)``: every buffer planned at build and reused each run, against the same graph run with
per-run allocation and against torch; buffers shared by liveness, communicate-stream buffers included."""

from __future__ import annotations

import pytest
import torch

from dtorch import DeviceMesh, LogicalGraph, Replicate, Runner, Shard


def _mlp_microbatches(n: int, mbs: int, rows: int = 8, d: int = 32, h: int = 64):
    """Four tensor-parallel MLP layers on ``mbs`` micro-batches, each layer's all-reduce beside the next
    micro-batch's matmuls; returns (graph, weights)."""
    torch.manual_seed(0)
    g = LogicalGraph(DeviceMesh.cpu(n))
    ws = [(torch.randn(d, h) / d ** 0.5, torch.randn(h, d) / h ** 0.5) for _ in range(4)]
    params = [(g.param(f"w1.{i}", a, Shard(1)), g.param(f"w2.{i}", b, Shard(0))) for i, (a, b) in enumerate(ws)]
    for m in range(mbs):
        x = g.input(f"x{m}", (rows, d))
        for w1, w2 in params:
            x = g.redistribute(((x @ w1).relu() @ w2), Replicate()) + x
        g.output(f"y{m}", x)
    return g, ws


def _reference(x: torch.Tensor, ws) -> torch.Tensor:
    for a, b in ws:
        x = torch.relu(x @ a) @ b + x
    return x


@pytest.mark.parametrize("n", [1, 2, 3])
def test_static_plan_matches_torch_run_after_run(n):
    g, ws = _mlp_microbatches(n, mbs=3)
    with Runner(g, static=True) as static, Runner(g) as dynamic:
        for _ in range(3):  # buffers are reused: every run must still see its own inputs
            feeds = {f"x{m}": torch.randn(8, 32) for m in range(3)}
            got, want = static.run(feeds), dynamic.run(feeds)
            for m in range(3):
                torch.testing.assert_close(got[f"y{m}"], _reference(feeds[f"x{m}"], ws), rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(got[f"y{m}"], want[f"y{m}"])
        # outputs are copies: the next run does not change what a caller kept
        kept = static.run(feeds)["y0"]
        static.run({f"x{m}": torch.zeros(8, 32) for m in range(3)})
        torch.testing.assert_close(kept, _reference(feeds["x0"], ws), rtol=1e-4, atol=1e-4)


def test_static_buffers_are_shared_by_liveness():
    # 3 micro-batches x 4 layers x (mm, relu, mm, all-reduce, add) on 2 devices: without sharing every
    # tensor would hold its own buffer; the plan recycles compute and communicate buffers alike
    g, _ = _mlp_microbatches(2, mbs=3)
    per_device_all = sum(max(x.local_shapes[i] and torch.Size(x.local_shapes[i]).numel() * 4 for i in (0, 1))
                         for x in g.operands if x.producer is not None)
    with Runner(g, static=True) as r:
        assert 0 < r.buffer_bytes < 0.5 * 2 * per_device_all


def test_outputs_reuse_a_dropped_copy_and_never_one_still_held():
    # a static run hands out copies of its outputs; the next copy goes into the previous one once the caller has let
    # go of it and of every view of it (no fresh pages each step), never into one that is still held
    g, ws = _mlp_microbatches(1, mbs=1)
    with Runner(g, static=True) as r:
        feeds = [{"x0": torch.randn(8, 32)} for _ in range(5)]
        first = r.run(feeds[0])["y0"]
        ptr = first.data_ptr()
        del first
        blocker = torch.empty(8, 32)  # where a fresh copy could land if the dropped one were freed
        second = r.run(feeds[1])["y0"]
        assert second.data_ptr() == ptr != blocker.data_ptr()  # reused
        torch.testing.assert_close(second, _reference(feeds[1]["x0"], ws), rtol=1e-4, atol=1e-4)
        third = r.run(feeds[2])["y0"]  # second still held: a new tensor
        assert third.data_ptr() != second.data_ptr()
        torch.testing.assert_close(second, _reference(feeds[1]["x0"], ws), rtol=1e-4, atol=1e-4)
        row = third[3]  # a view outlives its tensor
        del third
        fourth = r.run(feeds[3])["y0"]
        assert fourth.data_ptr() != row.data_ptr() - 3 * 32 * 4
        torch.testing.assert_close(row, _reference(feeds[2]["x0"], ws)[3], rtol=1e-4, atol=1e-4)
        array = fourth.numpy()  # and so does a numpy array of it
        del fourth
        r.run(feeds[4])
        np_ref = _reference(feeds[3]["x0"], ws)
        torch.testing.assert_close(torch.from_numpy(array), np_ref, rtol=1e-4, atol=1e-4)


def test_a_caller_holding_one_output_while_the_next_is_copied_out_takes_turns_in_two_copies():
    # a pipeline's engine holds micro-batch k's logits while its last stage copies out k + 1's: two kept copies take
    # turns (no fresh pages each step), and the held one keeps its values
    g, ws = _mlp_microbatches(1, mbs=1)
    with Runner(g, static=True) as r:
        feeds = [{"x0": torch.randn(8, 32)} for _ in range(6)]
        held = r.run(feeds[0])["y0"]
        ptrs, blockers = {held.data_ptr()}, []
        for i in range(1, 6):
            nxt = r.run(feeds[i])["y0"]
            torch.testing.assert_close(held, _reference(feeds[i - 1]["x0"], ws), rtol=1e-4, atol=1e-4)
            ptrs.add(nxt.data_ptr())
            held = nxt
            blockers.append(torch.empty(8, 32))  # where a copy dropped now would be allocated again
        assert len(ptrs) == 2


def test_a_borrowed_output_is_the_buffer_itself_on_one_cpu_and_a_copy_on_several_devices():
    # borrow=True (the engine, which samples a step's logits before the next step): one CPU hands out the output
    # buffer itself, the same storage every run, with the run's values; the next run writes over it. Several devices
    # still copy (their output is gathered)
    g, ws = _mlp_microbatches(1, mbs=1)
    with Runner(g, static=True) as r:
        feeds = [{"x0": torch.randn(8, 32)} for _ in range(3)]
        first = r.run(feeds[0], borrow=True)["y0"]
        ptr = first.data_ptr()
        torch.testing.assert_close(first, _reference(feeds[0]["x0"], ws), rtol=1e-4, atol=1e-4)
        copied = r.run(feeds[1])["y0"]  # not borrowed: a copy, held while the buffer is written again
        assert copied.data_ptr() != ptr
        second = r.run(feeds[2], borrow=True)["y0"]
        assert second.data_ptr() == ptr
        torch.testing.assert_close(first, _reference(feeds[2]["x0"], ws), rtol=1e-4, atol=1e-4)  # written over
        torch.testing.assert_close(copied, _reference(feeds[1]["x0"], ws), rtol=1e-4, atol=1e-4)
    g, ws = _mlp_microbatches(2, mbs=1)
    with Runner(g, static=True) as r:
        feeds = [{"x0": torch.randn(8, 32)} for _ in range(2)]
        first = r.run(feeds[0], borrow=True)["y0"]
        r.run(feeds[1], borrow=True)
        torch.testing.assert_close(first, _reference(feeds[0]["x0"], ws), rtol=1e-4, atol=1e-4)
