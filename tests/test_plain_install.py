"""A plain install (``pip install dtorch``, no ``serve`` extra): every command but ``serve`` works, and ``serve``
says in one line what to install. The packages of the extra are hidden from a subprocess (``sys.modules[name] =
None`` makes ``import name`` fail as when it is not installed); ``.ci/plain-install`` runs the commands in a real
venv without them."""

from __future__ import annotations

import json
import subprocess
import sys

SERVE_EXTRA = ("fastapi", "uvicorn", "starlette", "pydantic", "prometheus_client", "llguidance")

# runs each argv of sys.argv[1] (JSON) through the CLI in this process, the extra hidden; prints
# [[status, stdout, stderr], ...] and which of the extra's modules got imported
RUN = f"""
import contextlib, io, json, sys
for m in {SERVE_EXTRA!r}:
    sys.modules[m] = None
from dtorch.cli import main
done = []
for args in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(args)
        except SystemExit as e:  # --help
            status = e.code
    done.append([status, out.getvalue(), err.getvalue()])
print(json.dumps([done, [m for m in sys.modules if m.startswith("dtorch.serve.app")]]))
"""


def test_commands_run_without_the_serve_extra_and_serve_names_it():
    commands = [["kernels", "--op", "rms_norm"], ["explain", "matmul.linear", "--layout", "gguf.q4_1"],
                ["serve", "--help"], ["serve"]]
    proc = subprocess.run([sys.executable, "-c", RUN, json.dumps(commands)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    (kernels, explain, help_, serve), server_modules = json.loads(proc.stdout)
    assert kernels[0] == 0 and "llm.rms_norm" in kernels[1], kernels
    assert explain[0] == 0 and "matmul.linear/cpu/float32/gguf.q4_1" in explain[1], explain
    assert help_[0] == 0 and "--max-model-len" in help_[1], help_
    assert server_modules == []  # the parser and these commands never import the server
    status, _, err = serve
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert "pip install 'dtorch[serve]'" in err and "Traceback" not in err


def test_every_native_source_is_package_data():
    # an installed package builds its kernels from the csrc files it ships: one left out of pyproject's package-data
    # (a new folder under csrc/) fails every command of a plain install, not the tests of a checkout
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["dtorch"]
    csrc = root / "dtorch" / "kernels" / "native" / "csrc"
    shipped = [p.relative_to(root / "dtorch").as_posix() for p in csrc.rglob("*") if p.is_file()]
    # setuptools' "*" does not cross a "/": each file must match a glob of its own folder
    missing = [f for f in shipped if not any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/") for g in globs)]
    assert shipped and not missing, f"add to [tool.setuptools.package-data] in pyproject.toml: {missing}"
