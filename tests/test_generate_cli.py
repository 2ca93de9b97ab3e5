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


def test_generate_tensor_parallel_in_one_process_records_its_trace(tmp_path):
    # -tp 3 in one process: cpu:0..2 (SmolLM2 has 3 KV heads), the same greedy text as one device, and a trace
    # with a row per stream: the all-reduces on the communicate streams, the kernels on the compute streams
    import json

    one = _run("--max-tokens", "8", "What is 2 + 2?")
    trace = tmp_path / "run.json"
    three = _run("-tp", "3", "--max-tokens", "8", "--trace", str(trace), "What is 2 + 2?")
    assert one.returncode == 0 and three.returncode == 0, three.stderr
    assert three.stdout == one.stdout and three.stdout.strip()
    events = json.loads(trace.read_text())["traceEvents"]
    rows = {(e["pid"], e["tid"]) for e in events if e["ph"] == "X"}
    assert len(rows) == 6  # 3 devices x (compute, communicate)
    by_kind = {e["cat"]: set() for e in events if e["ph"] == "X"}
    for e in events:
        if e["ph"] == "X":
            by_kind[e["cat"]].add(e["name"].split("#")[0])
    assert by_kind["communicate"] == {"all_reduce", "all_gather"}
    assert {"matmul.linear", "llm.flash_attention_with_kvcache"} <= by_kind["compute"]  # on weights as stored


def test_threads_option_sets_the_intra_op_threads_and_is_checked():
    code = ("import sys, torch, dtorch.cli; dtorch.cli.main(['generate', '--threads', '1', '--max-tokens', '2', 'hi']);"
            " print('threads', torch.get_num_threads(), file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr
    assert "threads 1" in proc.stderr  # the run used (and left) the thread count it was given
    bad = _run("hi", "--threads", "0")
    assert bad.returncode == 2 and "--threads must be >= 1, got 0" in bad.stderr and "Traceback" not in bad.stderr
