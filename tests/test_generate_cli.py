"""``python -m dtorch generate`` in a subprocess, with the default model."""

from __future__ import annotations

import os
import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    return subprocess.run([sys.executable, "-m", "dtorch", "generate", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_generate_streams_an_answer_and_reports_speed():
    proc = _run("What is the capital of France?", "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "prefill" in proc.stderr and "decode" in proc.stderr and "tok/s" in proc.stderr


def test_generate_bad_sampling_value_is_a_clean_error():
    proc = _run("hi", "--top-p", "1.5", "--max-tokens", "2")
    assert proc.returncode == 2
    assert "top_p" in proc.stderr and "Traceback" not in proc.stderr
