"""The benches' smoke modes, so that a bench cannot rot unseen (bench/tp.py once failed at its first row on an import
that had moved). Each runs as a user runs it, in a subprocess; its own agreement check is the assertion."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / name), *args], capture_output=True, text=True,
                          timeout=900, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_tp_bench_smoke():
    out = _bench("tp.py", "--smoke")
    # the direct baseline, the runtime at tp=1 and tp=2 and the pipeline at pp=2 decode the same greedy tokens
    assert "greedy tokens identical across engines: True" in out
    assert "2 gloo processes (torchrun)" in out  # the gloo row ran
