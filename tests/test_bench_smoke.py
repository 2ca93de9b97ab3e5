"""Every ``bench/`` script runs in its ``--smoke`` mode and prints its comparison table (STYLE.md 14: a bench cannot
rot unseen). Each runs as ``python bench/X.py --smoke`` in a subprocess of this interpreter with this checkout first
on the path; the test asserts exit status 0 and the lines of its table's header. The smoke modes use tiny shapes,
one repeat and the shipped default model or tiny random ones; llama.cpp's columns are skipped where its venv is
absent. Its figures mean nothing: speed and memory are read from the full runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"

# script -> (smoke arguments, strings its output must hold: its table's header and, where it names one, a row); the
# scripts whose default is a thread a core get one, as every test process (conftest)
SMOKE = {
    "attention_decode.py": (["--smoke"], ["native hot", "torch sdpa", "Qwen2.5-0.5B"]),
    "decode.py": (["--smoke"], ["prefill tok/s", "decode tok/s", "dtorch (weights as stored)"]),
    "dispatch.py": (["--smoke"], ["torch out=", "+prepared", "+functional", "linear [1,576]x[1536,576]"]),
    "gated_delta_net.py": (["--smoke"], ["recurrent", "chunked speed-up", "max |diff|"]),
    "gguf_formats.py": (["--smoke"], ["dtorch pp128", "x tg", "one-row products as a decode step calls them",
                                      "the machine during each decode run",
                                      "the roofline of decode", "dtorch / roof"]),
    "hybrid.py": (["--smoke", "--threads", "1"], ["transformers", "dtorch / transformers", "decode tok/s @ batch 2"]),
    "llamacpp_fixtures.py": (["--smoke"], ["| file | KiB | tensor types |", "llama-576-F16.gguf"]),
    "llm_ops.py": (["--smoke"], ["reference", "speedup", "prepared op", "overhead"]),
    "machine_limits.py": (["--smoke"], ["| threads | read GB/s"]),
    "memory.py": (["--smoke"], ["phase", "weights loaded", "held by", "model MiB"]),
    "moe.py": (["--smoke"], ["experts", "reference", "speed-up", "max diff"]),
    "native_kernels.py": (["--smoke"], ["us/call", "GB/s weights", "q4_1"]),
    "native_rows.py": (["--smoke"], ["torch / native", "softmax_last_dim [2, 64]", "add_rms_norm"]),
    "native_build.py": (["--smoke"], ["| build | objects compiled | seconds |", "one op added as its own group"]),
    "qlinear_fixed.py": (["--smoke"], ["fixed us", "product GB/s", "q8_0"]),
    "runtime.py": (["--smoke"], ["measure", "overlap fraction", "peak activation memory"]),
    "serve.py": (["--smoke", "--threads", "1"], ["out tok/s", "TTFT p50 ms", "dtorch scaling"]),
    "speculative.py": (["--smoke"], ["spec tok/s", "acceptance", "drafted by", "1 row us"]),
    "startup.py": (["--smoke"], ["measure (seconds)", "llama.cpp", "dtorch", "ratio"]),
    "step_overhead.py": (["--smoke"], ["overhead us", "Runner.run, bare calls (after)", "kernels alone",
                                       "| component | ms a token | share |", "| head |", "sampling, greedy"]),
    # the direct baseline, the runtime at tp=1 / tp=2 and the pipeline at pp=2 decode the same greedy tokens, and the
    # row served across two gloo ranks ran; the concurrent streams' table, the pipeline's traced overlap, the gloo pp=2
    # row with the added latency, and the machine's two-process ceiling
    "tp.py": (["--smoke"], ["greedy tokens identical across engines: True", "served, shared memory",
                            "concurrent streams", "micro-batches in", "ceiling for two devices", "2 gloo ranks"]),
    "structured_outputs.py": (["--smoke"], ["rows masked", "mask ms/row", "step vs none"]),
    "weight_pages.py": (["--smoke"], ["own memory", "arena speed-up", "products (layers)", "one-row products"]),
}

# scripts without a smoke run here, each with the reason; a script must be in SMOKE or here
EXCEPTIONS = {
    # helper modules: no __main__, imported by the scripts above
    "gguf_files.py": "GGUF writers for gguf_formats/llamacpp_fixtures/speculative; runs in their smoke modes",
    "device_check_llm.py": "the LLM rows of device_check.py; imported by it",
    # GPU checks: .ci/run runs their CPU rehearsal (scripts/device-check.sh --dry-run), so they are not run twice
    "device_check.py": "CI runs --dry-run through scripts/device-check.sh --dry-run",
    "gpu_decode.py": "CI runs --dry-run through scripts/device-check.sh --dry-run",
}


def test_every_bench_script_is_covered():
    """Each runnable bench/*.py (not a _helper) is smoke-run or an explained exception, and no entry is stale."""
    scripts = {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")}
    missing = sorted(scripts - SMOKE.keys() - EXCEPTIONS.keys())
    assert not missing, (f"bench scripts with no smoke run: {missing}; give each a --smoke mode (tiny sizes, one "
                         "repeat, its table printed) and add it to SMOKE in tests/test_bench_smoke.py, or add it to "
                         "EXCEPTIONS there with the reason")
    stale = sorted((SMOKE.keys() | EXCEPTIONS.keys()) - scripts)
    assert not stale, f"tests/test_bench_smoke.py names bench scripts that do not exist: {stale}"
    both = sorted(SMOKE.keys() & EXCEPTIONS.keys())
    assert not both, f"in both SMOKE and EXCEPTIONS of tests/test_bench_smoke.py: {both}"


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_bench_smoke(script: str):
    args, expected = SMOKE[script]
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]  # this checkout first
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"bench/{script} {' '.join(args)} exited {proc.returncode}:\n{out[-4000:]}"
    absent = [s for s in expected if s not in proc.stdout]
    assert not absent, f"bench/{script} {' '.join(args)} printed no {absent}; its output:\n{out[-4000:]}"
