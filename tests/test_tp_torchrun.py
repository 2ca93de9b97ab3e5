"""Tensor parallelism across processes: ``torchrun`` (``python -m torch.distributed.run``) with gloo, one device per
rank, started by the test and bounded in time (the whole process group is killed on a timeout).

- the default model, 3 ranks, through the CLI: the same greedy text as one process, printed once;
- a tiny random Llama (4 KV heads), 2 ranks: the same greedy ids as tp=1 in one process, for a batch of prompts,
  also with speculative decoding (the model drafting for itself: every rank takes rank 0's drafts and tokens);
- a rank that dies mid-generation: the survivor raises a dtorch error naming the collective and the peer;
- bad sizes: clear errors with exit code 2.

This file is also the script each rank runs (``python -m torch.distributed.run ... test_tp_torchrun.py MODE ...``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "What is the capital of France?"
BATCH = [[5, 9, 17, 3], [40, 2, 77, 31, 8, 90, 14, 60, 21, 7, 11], [99]]  # prompts of different lengths
DIE_AFTER = 3  # rank 1 exits ("die") or hangs ("stall") after this many decode steps


# -- what each rank runs -------------------------------------------------------------------------------------------

def _worker(mode: str, model: str) -> int:
    """One rank: "greedy" prints the batch's greedy ids as JSON (rank 0), "speculative" too with the model as its own
    draft model; "die" / "stall" lose rank 1 mid-generation (it exits / hangs) and report the survivor's error on
    stderr (exit 3)."""
    from dtorch.core.errors import DtorchError
    from dtorch.engine.llm import LLM
    from dtorch.engine.sampling import SamplingParams
    from dtorch.models.executor import Executor

    rank = int(os.environ["RANK"])
    params = SamplingParams(temperature=0.0, max_tokens=10 if mode in ("greedy", "speculative") else 40,
                            ignore_eos=True)
    spec = {"model": model, "num_speculative_tokens": 2} if mode == "speculative" else None
    llm, t0 = None, time.monotonic()
    try:
        llm = LLM(model, tensor_parallel_size=int(os.environ["WORLD_SIZE"]), max_num_seqs=4, speculative_config=spec)
        if mode in ("die", "stall") and rank == 1:
            step, steps = Executor.step, []

            def dying_step(self: Executor, plan, *args, **kwargs):  # (the engine passes borrow=)
                steps.append(1)
                if len(steps) > 1 + DIE_AFTER:  # the prefill, then DIE_AFTER decode steps
                    if mode == "stall":
                        time.sleep(3600)
                    os._exit(1)
                return step(self, plan, *args, **kwargs)

            Executor.step = dying_step
        outs = llm.generate(BATCH, params)
        if rank == 0:
            print(json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
            if spec is not None:
                print(f"accepted {llm.engine.stats().spec_accepted_tokens}", flush=True)
        return 0
    except DtorchError as exc:
        print(f"rank {rank}: {type(exc).__name__} after {time.monotonic() - t0:.1f}s: {exc}", file=sys.stderr,
              flush=True)
        return 3
    finally:
        if llm is not None:
            llm.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# -- launching -----------------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"} | extra


def one_process_greedy_ids(model) -> list[list[int]]:
    """``BATCH``'s greedy ids (10 tokens each) from one process: what every split across ranks must equal."""
    from dtorch.engine.llm import LLM
    from dtorch.engine.sampling import SamplingParams

    llm = LLM(str(model), max_num_seqs=4)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(BATCH, params)]
    finally:
        llm.close()


def _run(args: list[str], timeout: float, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``args`` in its own process group; on a timeout kill the whole group (torchrun and every rank)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(args, cwd=ROOT, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(args)} ran past {timeout}s and was killed\nstdout:\n{out}\nstderr:\n{err}")
    finally:
        try:  # nothing of the group may outlive the test
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(args, proc.returncode, out, err), time.monotonic() - t0


def _torchrun(n: int, *args: str, monitor: float = 0.1) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port",
            str(_free_port()), "--monitor-interval", str(monitor), *args]


def _generate(*args: str) -> list[str]:
    return ["-m", "dtorch", "generate", *args]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A random Llama with 8 heads and 4 KV heads, saved as a Hugging Face directory."""
    transformers = pytest.importorskip("transformers")
    from tests.tiny_models import families, save_random

    path = tmp_path_factory.mktemp("tiny_llama")
    save_random(transformers, families(transformers, heads=8, kv_heads=4, vocab=128, qwen3_head_dim=16)["llama"](),
                path)
    return path


# -- the tests -----------------------------------------------------------------------------------------------------

def test_default_model_three_ranks_print_one_processs_text():
    # float weights: the greedy text of 3 ranks equals one process's up to summation order (on int8-quantized
    # activations a near tie may break the other way; tests/test_quantized_model.py covers that path)
    one, _ = _run([sys.executable, *_generate("--dequantize", "--max-tokens", "12", PROMPT)], timeout=300)
    assert one.returncode == 0, one.stderr
    many, seconds = _run(_torchrun(3, *_generate("--dequantize", "-tp", "3", "--max-tokens", "12", PROMPT)),
                         timeout=400)
    assert many.returncode == 0, many.stderr
    assert many.stdout == one.stdout and one.stdout.strip()  # rank 0's text only, once
    assert many.stderr.count("prefill:") == 1, many.stderr  # one speed line
    assert "error" not in many.stderr.lower(), many.stderr
    print(f"3 ranks: {seconds:.1f}s")


@pytest.mark.parametrize("mode", ["greedy", "speculative"])
def test_tiny_llama_two_ranks_greedy_ids_equal_one_process(tiny_llama, mode):
    want = one_process_greedy_ids(tiny_llama)
    proc, _ = _run(_torchrun(2, __file__, mode, str(tiny_llama)), timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    assert len(lines) == 1, proc.stdout  # rank 0 only
    assert json.loads(lines[0]) == want
    if mode == "speculative":  # the drafts were kept (a model agrees with itself)
        assert int(proc.stdout.split("accepted ")[1].split()[0]) > 0, proc.stdout


@pytest.mark.parametrize(("mode", "group_timeout", "why"), [
    ("die", 20, "was lost: its connection closed"),  # rank 1 exits: gloo sees the closed connection at once
    ("stall", 6, "did not answer within 6s"),  # rank 1 hangs: the collective gives up after the group's timeout
])
def test_lost_rank_mid_generation_is_an_error_on_the_survivor(tiny_llama, mode, group_timeout, why):
    # the agent polls its ranks every 5 s, so it does not kill the survivor before the survivor reports
    proc, seconds = _run(_torchrun(2, __file__, mode, str(tiny_llama), monitor=5), timeout=200,
                         DTORCH_SYNC_TIMEOUT=str(group_timeout))
    assert proc.returncode != 0
    survivor = [ln for ln in proc.stderr.splitlines() if ln.startswith("rank 0:")]
    assert survivor, proc.stderr
    line = survivor[0]
    # a CommunicationError naming the collective and the peer, not the step's SyncTimeout (its sync waits longer)
    assert line.startswith("rank 0: CommunicationError") and why in line, line
    assert "rank 1" in line and any(op in line for op in ("all_reduce", "all_gather", "broadcast")), line
    took = float(line.split(" after ")[1].split("s:")[0])
    assert took < (5 if mode == "die" else group_timeout + 10), line
    assert seconds < 150


def test_tensor_parallel_size_above_kv_heads_is_a_clean_error():
    proc, _ = _run([sys.executable, *_generate("-tp", "4", "--max-tokens", "2", PROMPT)], timeout=200)
    assert proc.returncode == 2, proc.stderr
    assert "dtorch: error: tensor_parallel_size 4 exceeds the model's 3 KV heads" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_tensor_parallel_size_unlike_world_size_is_a_clean_error():
    proc, _ = _run(_torchrun(2, *_generate("-tp", "3", "--max-tokens", "2", PROMPT)), timeout=200)
    assert proc.returncode != 0
    assert "dtorch: error: rank 0 of 2: LLM: torch.distributed has 2 ranks but tensor_parallel_size is 3" \
        in proc.stderr, proc.stderr
    assert "exitcode  : 2" in proc.stderr  # torchrun's summary: the rank's own exit code


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], sys.argv[2]))
