"""The command line's kernel table and explain command."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import dtorch
from dtorch.cli import main


def test_kernels_matrix_shows_active_providers(capsys):
    assert main(["kernels", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines()[1:] if line.startswith(("unary.", "binary."))]
    rows = {line.split()[0]: line.split()[1:] for line in lines}
    header = out.splitlines()[0].split()
    col = header.index("cpu/f32") - 1
    assert rows["unary.silu"][col] == "torch"
    assert rows["binary.add"][col] == "reference"
    i64 = header.index("cpu/i64") - 1
    assert rows["unary.exp"][i64] == "-"  # not registered for integers
    active = {r.key.op for r in dtorch.dispatcher.table("cpu") if r.active}
    assert set(rows) == {op for op in active if op.startswith(("unary.", "binary."))}


def test_explain_names_candidates_and_the_choice(capsys):
    assert main(["explain", "unary.gelu", "--device", "cpu", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "unary.gelu/cpu/bfloat16" in out
    assert "* torch" in out and "reference" in out and "lower priority than torch" in out


def test_explain_unknown_op_is_a_clear_error(capsys):
    assert main(["explain", "unary.nope"]) == 2
    assert "'unary.nope' is not registered" in capsys.readouterr().err


def test_module_entry_point_runs():
    done = subprocess.run([sys.executable, "-m", "dtorch", "explain", "unary.exp", "--dtype", "float64"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "unary.exp/cpu/float64" in done.stdout
    assert torch.float64 in {k.dtype for k in dtorch.dispatcher.keys() if k.op == "unary.exp"}


def _cli(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "dtorch", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_version():
    done = _cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"dtorch {dtorch.__version__}" == "dtorch 0.1.0"


def test_explain_a_misspelled_op_suggests_the_name():
    done = _cli("explain", "llm.flash_attn")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "did you mean" in done.stderr and "'llm.flash_attention'" in done.stderr, done.stderr


def test_trace_without_matplotlib_names_the_extra(tmp_path):
    # sys.modules[name] = None makes `import name` raise ImportError, as when the package is not installed
    code = ("import sys; sys.modules['matplotlib'] = None; from dtorch.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    done = _cli("trace", str(tmp_path / "run.json"), "--png", str(tmp_path / "run.png"), code=code)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "pip install 'dtorch[plot]'" in done.stderr


def test_trace_to_an_unwritable_png_is_a_message(tmp_path):
    import json

    pytest.importorskip("matplotlib")
    trace = tmp_path / "run.json"
    trace.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "k", "cat": "compute", "pid": 0, "tid": 0,
                                                  "ts": 0, "dur": 5}]}))
    done = _cli("trace", str(trace), "--png", "/nonexistent/x.png")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "cannot write the picture /nonexistent/x.png" in done.stderr, done.stderr


def test_every_option_has_help_text():
    import argparse

    from dtorch.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        for action in parser._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help text"


def test_each_footnote_mark_in_the_kernel_table_has_its_own_text(capsys):
    """A marked cell ("native*2") points at the note of its own kernel: attention's and MoE's notes are theirs, not
    matmul's."""
    from dtorch.core.dtypes import dtype_name

    assert main(["kernels", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = out[0].split()[1:]
    notes = {}
    for line in out:
        if line.startswith("  ") and ": the path depends on the call: " in line:
            mark, text = line.strip().split(" ", 1)
            notes[mark] = text.split(": the path depends on the call: ", 1)[1]
    varies = {(r.key.op if r.key.layout == "strided" else f"{r.key.op} [{r.key.layout}]", dtype_name(r.key.dtype)):
              r.varies for r in dtorch.dispatcher.table("cpu") if r.active}
    names = {"f32": "float32", "f64": "float64", "bf16": "bfloat16", "f16": "float16", "i32": "int32", "i64": "int64"}
    checked = set()
    for line in out[1:]:
        if not line or line.startswith(" ") or "ops; each cell" in line:
            continue
        name, cells = line.split("  ", 1)[0], line.split("  ", 1)[1].split()
        for col, cell in zip(header, cells, strict=True):
            if "*" in cell:
                expected = varies[(name, names[col.split("/")[1]])]
                assert notes[cell] == expected, (name, col, cell)
                checked.add(cell)
    assert checked == set(notes) and len(set(notes.values())) == len(notes)  # one mark per text, each one used
