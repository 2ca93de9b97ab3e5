"""``python -m dtorch generate`` in a subprocess, with the default model: prompts, flags, threads, clean exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # one intra-op thread a process, as conftest's
COMMAND = [sys.executable, "-m", "dtorch", "generate"]


def _run(*args: str, stdin: str | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=300, input=stdin,
                          env={**ENV, **env})


def _clean_error(proc: subprocess.CompletedProcess, *phrases: str, status: int = 2) -> None:
    assert proc.returncode == status, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for phrase in phrases:
        assert phrase in proc.stderr, proc.stderr


def test_generate_streams_an_answer_and_reports_speed():
    proc = _run("What is the capital of France?", "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "prefill" in proc.stderr and "decode" in proc.stderr and "tok/s" in proc.stderr


def test_generate_reads_the_prompt_from_stdin_or_a_file(tmp_path):
    prompt = "What is 2 + 2?"
    given = _run(prompt, "--max-tokens", "8")
    piped = _run("-", "--max-tokens", "8", stdin=prompt + "\n")
    path = tmp_path / "prompt.txt"
    path.write_text(prompt + "\n")
    filed = _run("--file", str(path), "--max-tokens", "8")
    assert given.returncode == piped.returncode == filed.returncode == 0, piped.stderr + filed.stderr
    assert given.stdout.strip() and piped.stdout == given.stdout == filed.stdout  # greedy: the same answer
    _clean_error(_run("--max-tokens", "8"), "give the prompt as an argument, - to read it from stdin, or --file")
    _clean_error(_run("--file", str(tmp_path / "missing.txt")), "--file: cannot read", "missing.txt")
    _clean_error(_run("-", stdin=""), "the prompt read from stdin is empty")


@pytest.mark.parametrize("args, message", [
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be in [0.0001, 10000]"),
    (["--presence-penalty", "3"], "--presence-penalty must be in [-2, 2]"),
    (["--min-tokens", "9", "--max-tokens", "4"], "--min-tokens must be in 0..--max-tokens"),
    (["--max-tokens", "0"], "--max-tokens: must be >= 1, got 0"),
    (["--threads", "0"], "--threads: must be >= 1, got 0"),
    (["--device", "meta"], "--device meta: dtorch runs models on cpu or cuda"),
])
def test_bad_flag_values_are_clean_errors_naming_the_flag(args, message):
    proc = _run("hi", *args)
    _clean_error(proc, message)
    assert "SamplingParams" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a torch without CUDA")
def test_cuda_without_cuda_says_so():
    _clean_error(_run("hi", "--device", "cuda"), "--device cuda: this torch", "no usable CUDA device",
                 "use --device cpu")


def test_debug_setting_shows_the_traceback():
    proc = _run("hi", "--top-p", "1.5", DTORCH_DEBUG="1")
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "SamplingError" in proc.stderr


def test_penalty_and_min_tokens_flags_reach_sampling():
    base = _run("Count: one, two, three,", "--raw", "--max-tokens", "12")
    penalized = _run("Count: one, two, three,", "--raw", "--max-tokens", "12", "--repetition-penalty", "1.8",
                     "--presence-penalty", "1", "--frequency-penalty", "1", "--min-tokens", "12")
    assert base.returncode == 0 and penalized.returncode == 0, penalized.stderr
    assert "decode: 11 tokens" in penalized.stderr  # min_tokens = max_tokens: no early end (1 prefill + 11 decode)
    assert penalized.stdout != base.stdout


def test_help_shows_every_flag_with_text_and_defaults():
    proc = subprocess.run([*COMMAND, "--help"], capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for phrase in ("--max-tokens N new tokens at most (default: 256)", "--top-p TOP_P", "(default: 1.0)",
                   "--device DEVICE cpu or cuda", "--threads N intra-op CPU threads", "DTORCH_THREADS",
                   "--repetition-penalty", "--presence-penalty", "--frequency-penalty", "--min-tokens", "--file PATH"):
        assert phrase in text, phrase


def test_threads_option_sets_the_intra_op_threads():
    code = ("import sys, torch, dtorch.cli; dtorch.cli.main(['generate', '--threads', '1', '--max-tokens', '2', 'hi']);"
            " print('threads', torch.get_num_threads(), file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**ENV, "OMP_NUM_THREADS": "2"})  # not the 1 asked for, so the option is what sets it
    assert proc.returncode == 0, proc.stderr
    assert "threads 1" in proc.stderr  # the run used (and left) the thread count it was given


def test_threads_setting_is_the_default_and_is_checked():
    code = "import torch, dtorch; dtorch.LLM(); print('threads', torch.get_num_threads())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**ENV, "OMP_NUM_THREADS": "2", "DTORCH_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "threads 1" in proc.stdout
    bad = _run("hi", DTORCH_THREADS="two")  # read while dtorch is imported, before the CLI starts: still one line
    assert bad.returncode == 2 and "DTORCH_THREADS='two' is not valid; expected an int >= 0" in bad.stderr
    assert "Traceback" not in bad.stderr


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*COMMAND, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)


@pytest.mark.usefixtures("sigint_default")  # SIGINT not ignored in the process started
def test_ctrl_c_stops_with_status_130_and_the_speed_so_far():
    proc = _start("Tell me a long story.", "--max-tokens", "100000", "--ignore-eos")
    try:
        assert proc.stdout.read(20)  # the answer is streaming
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = err.decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "decode:" in err and "tok/s" in err


def test_a_closed_pipe_exits_quietly():
    proc = _start("Tell me a long story.", "--max-tokens", "200", "--ignore-eos")
    try:
        assert len(proc.stdout.read(30)) == 30  # like `| head -c 30`
        proc.stdout.close()
        err = proc.stderr.read().decode()
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 141, err  # 128 + SIGPIPE, as a shell reports a writer whose reader left
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_generate_tensor_parallel_in_one_process_records_its_trace(tmp_path):
    # -tp 3 in one process: cpu:0..2 (SmolLM2 has 3 KV heads), the same greedy text as one device, and a trace
    # with a row per stream: the kernels and (nothing to overlap them with) the collectives on the compute streams
    import json

    one = _run("--max-tokens", "8", "What is 2 + 2?")
    trace = tmp_path / "run.json"
    three = _run("-tp", "3", "--max-tokens", "8", "--trace", str(trace), "What is 2 + 2?")
    assert one.returncode == 0 and three.returncode == 0, three.stderr
    assert three.stdout == one.stdout and three.stdout.strip()
    events = json.loads(trace.read_text())["traceEvents"]
    rows = {(e["pid"], e["tid"]) for e in events if e["ph"] == "X"}
    assert len(rows) == 3  # 3 devices x compute
    by_kind = {e["cat"]: set() for e in events if e["ph"] == "X"}
    for e in events:
        if e["ph"] == "X":
            by_kind[e["cat"]].add(e["name"].split("#")[0])
    assert set(by_kind) == {"compute"} and {"all_reduce", "all_gather"} <= by_kind["compute"]
    assert {"matmul.linear", "llm.flash_attention_with_kvcache"} <= by_kind["compute"]  # on weights as stored


def test_generate_follows_a_json_schema(tmp_path):
    import json

    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]},
                                               "people": {"type": "integer", "minimum": 0, "maximum": 10 ** 8}},
              "required": ["city", "people"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    proc = _run("The biggest city of France, as JSON.", "--json-schema", str(tmp_path / "schema.json"),
                "--max-tokens", "40")
    assert proc.returncode == 0, proc.stderr
    jsonschema.validate(json.loads(proc.stdout), schema)


@pytest.mark.parametrize("args, message", [
    (["--json-schema", "{nope"], "--json-schema: not a JSON schema"),
    (["--grammar", "/no/such.lark"], "--grammar: cannot read /no/such.lark"),
    (["--chat-template-kwargs", "[1]"], "--chat-template-kwargs: expected a JSON object"),
])
def test_bad_constraint_flags_are_clean_errors(args, message):
    _clean_error(_run("hi", *args), message)


def test_float16_on_a_cpu_without_float16_arithmetic_warns_naming_bfloat16(capsys):
    from dtorch.cli import main
    from dtorch.core import cpu
    from dtorch.engine.options import slow_dtype

    args = ("hi", "--dtype", "float16", "--model", "/nonexistent.gguf")  # warned before the load, which then fails
    without = _run(*args, DTORCH_CPU_FEATURES="-avx512_fp16,-amx_fp16")  # forced by the environment
    _clean_error(without, "dtorch: warning: --dtype float16", "use --dtype bfloat16", "/nonexistent.gguf")
    with cpu.forced(avx512_fp16=True, amx_fp16=False):  # forced in the process
        assert main(["generate", *args]) == 2
    err = capsys.readouterr().err
    assert "/nonexistent.gguf" in err and "warning" not in err
    with cpu.forced(avx512_fp16=False, amx_fp16=False):
        assert slow_dtype("cpu", torch.float16) and slow_dtype("cpu:0", torch.float16)
        assert slow_dtype("cpu", torch.bfloat16) is slow_dtype("cuda", torch.float16) is None
    with cpu.forced(avx512_fp16=False, amx_fp16=True):
        assert slow_dtype("cpu", torch.float16) is None
