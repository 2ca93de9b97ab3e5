"""The command line's kernel table and explain command."""

from __future__ import annotations

import subprocess
import sys

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
