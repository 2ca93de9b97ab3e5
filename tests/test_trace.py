"""Tracing: Chrome JSON, a designed case where communication overlaps computation, the CLI picture."""

from __future__ import annotations

import json

import torch

from dtorch import cli
from dtorch.graph import DeviceMesh, LogicalGraph, Partial, Replicate
from dtorch.runtime import Runner


def overlap_graph(n: int = 2, chain: int = 6, size: int = 192, comm_numel: int = 1 << 21) -> LogicalGraph:
    """An all-reduce of a large independent tensor beside a chain of matmuls: nothing orders one after the other."""
    g = LogicalGraph(DeviceMesh.cpu(n))
    grads = g.input("grads", (comm_numel,), placement=Partial())  # [comm_numel], partial sums per device
    h = g.input("x", (size, size))
    w = g.param("w", torch.randn(size, size) / size**0.5)
    for _ in range(chain):
        h = (h @ w).tanh()
    g.output("h", h)
    g.output("grads", g.redistribute(grads, Replicate()))
    return g


def _overlapping(intervals: dict, device: str) -> float:
    comp = intervals.get((device, "compute"), [])
    comm = intervals.get((device, "communicate"), [])
    return sum(max(0.0, min(b1, b2) - max(a1, a2)) for _, a1, b1 in comp for _, a2, b2 in comm)


def test_communication_overlaps_computation_in_the_trace(tmp_path):
    g = overlap_graph()
    x, grads = torch.randn(192, 192), torch.randn(1 << 21)
    with Runner(g, trace=True) as r:
        r.run({"x": x, "grads": grads})  # warm-up
        r.tracer.clear()
        best = 0.0
        for _ in range(3):
            out = r.run({"x": x, "grads": grads})
            best = max(best, _overlapping(r.tracer.intervals(), "cpu:0"))
            if best > 0:
                break
        torch.testing.assert_close(out["grads"], grads)  # device 0 holds grads, device 1 zeros
        path = r.tracer.write(tmp_path / "trace.json")
    assert best > 0, "no communicate kernel ran while a compute kernel ran"
    data = json.loads(open(path).read())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in spans} == {"compute", "communicate"}
    assert any(e["name"].startswith("all_reduce") for e in spans)
    assert all(e["dur"] >= 0 for e in spans)


def test_trace_cli_draws_a_png(tmp_path, capsys):
    g = LogicalGraph(DeviceMesh.cpu(2))
    g.output("y", g.redistribute(g.redistribute(g.input("x", (8, 4)).exp(), Partial()), Replicate()))
    with Runner(g, trace=True) as r:
        r.run({"x": torch.randn(8, 4)})
        path = r.tracer.write(tmp_path / "t.json")
    png = tmp_path / "t.png"
    assert cli.main(["trace", str(path), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in capsys.readouterr().out


def test_trace_cli_rejects_a_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli.main(["trace", str(bad), "--png", str(tmp_path / "x.png")]) == 2
    assert "cannot read Chrome trace" in capsys.readouterr().err


def test_trace_env_flag(monkeypatch):
    monkeypatch.setenv("DTORCH_TRACE", "1")
    g = LogicalGraph(DeviceMesh.cpu(1))
    g.output("y", g.input("x", (2,)).relu())
    with Runner(g) as r:
        r.run({"x": torch.randn(2)})
        assert [label for *_, label, _, _ in r.tracer.events] == ["unary.relu#0 on cpu:0"]


def test_trace_png_of_one_stream_draws_its_row(tmp_path):
    """A one-stream trace gets a figure tall enough for its row: the bars are there, tens of pixels high."""
    import numpy as np
    import pytest

    image = pytest.importorskip("matplotlib.image")
    g = LogicalGraph(DeviceMesh.cpu(1))
    g.output("y", g.input("x", (8, 4)).exp().relu())
    with Runner(g, trace=True) as r:
        r.run({"x": torch.randn(8, 4)})
        path = r.tracer.write(tmp_path / "one.json")
    png = tmp_path / "one.png"
    assert cli.main(["trace", str(path), "--png", str(png)]) == 0
    pixels = image.imread(png)[..., :3]
    blue = np.array([0x1F, 0x77, 0xB4]) / 255  # matplotlib's tab:blue, the compute bars' color
    rows = np.abs(pixels - blue).sum(-1).min(1) < 0.05  # image rows holding a compute bar
    assert 20 <= rows.sum() <= 0.8 * pixels.shape[0], f"bars {rows.sum()} px high in a {pixels.shape[0]} px image"
