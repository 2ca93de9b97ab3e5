"""Decode and prefill of dtorch against llama.cpp on the same GGUF file, side by side in one run.

    python bench/decode.py [--model PATH.gguf] [--threads 1 2] [--runs 3] [--llamacpp-python PATH] [--smoke]

Engines, each in its own subprocess so its memory is its own, batch 1, greedy, a 128-token prompt and
64 new tokens, the median of ``--runs`` runs after a warm-up:
- llama.cpp: ``llama_cpp`` (llama-cpp-python) run by the Python of the venv that
  ``../shared/tools/llamacpp-venv.sh`` builds (``--llamacpp-python``, default ``$LLAMACPP_PYTHON`` or
  ``/work/venv-llamacpp/bin/python``); the column is left out when it cannot be imported;
- dtorch on the weights as stored (quantized, native kernels when they load) and dtorch with
  ``dequantize=True`` (float32, today's float path).
"model MiB" is peak RSS minus the RSS right after the imports (what the model costs); "floor tok/s"
is this machine's one-thread read bandwidth over the weight bytes one decoded token reads.
``--smoke`` (what CI runs): 1 thread, 1 run, a 16-token prompt and 8 new tokens, a 16 MiB bandwidth probe, no
``--dequantize`` row; a failed worker fails the run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

PROMPT, NEW = 128, 64
SMOKE_PROMPT, SMOKE_NEW = 16, 8


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _prompt(vocab: int, length: int) -> list[int]:
    import random

    rng = random.Random(length)
    return [rng.randrange(100, vocab - 100) for _ in range(length)]


def _worker_dtorch(model: str, threads: int, runs: int, dequantize: bool, prompt: int, new: int) -> dict:
    import torch

    from dtorch.engine.llm import LLM
    from dtorch.engine.sampling import SamplingParams

    torch.set_num_threads(threads)
    base = _current_rss_mib()
    llm = LLM(model, dequantize=dequantize)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    ids = _prompt(llm.config.vocab_size, prompt)
    prefill, decode = [], []
    for r in range(runs + 1):
        llm.generate([ids], params)
        if r:  # the first run warms up
            prefill.append(llm.stats.prefill_tps)
            decode.append(llm.stats.decode_tps)
    out = {"prefill": statistics.median(prefill), "decode": statistics.median(decode), "model_mib": _rss_mib() - base,
           "weight_bytes": llm.model.weight_bytes(), "linear": llm.model.linear_provider()}
    llm.close()
    return out


LLAMACPP_WORKER = r"""
import json, os, resource, statistics, sys, time
model = sys.argv[1]
threads, runs, prompt_len, new = (int(a) for a in sys.argv[2:6])
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
import llama_cpp
base = rss()
llm = llama_cpp.Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=512, n_batch=512,
                      verbose=False)
import random
rng = random.Random(prompt_len)
ids = [rng.randrange(100, llm.n_vocab() - 100) for _ in range(prompt_len)]
prefill, decode = [], []
for r in range(runs + 1):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    tok = llm.sample(top_k=1, temp=0.0)
    for _ in range(new):
        llm.eval([tok])
        tok = llm.sample(top_k=1, temp=0.0)
    t2 = time.perf_counter()
    if r:
        prefill.append(prompt_len / (t1 - t0))
        decode.append(new / (t2 - t1))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"prefill": statistics.median(prefill), "decode": statistics.median(decode),
                  "model_mib": peak - base, "version": llama_cpp.__version__}))
"""


def _read_bandwidth(side: int = 8192) -> float:
    """Bytes per second one thread reads: the better of summing a float32 tensor of ``side**2`` (256 MiB) and a
    float32 GEMV over it as a ``[side, side]`` matrix (MKL's GEMV prefetches better than a reduction), medians of 5."""
    import torch

    torch.set_num_threads(1)
    x = torch.ones(side * side, dtype=torch.float32)
    w, v = x.view(side, side), torch.ones(side)
    best = 0.0
    for fn in (lambda: x.sum(), lambda: torch.mv(w, v)):
        fn()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        best = max(best, x.numel() * 4 / statistics.median(times))
    return best


def _run(cmd: list[str]) -> dict | None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        print(f"  ({' '.join(cmd[:3])} ... failed: {proc.stderr.strip().splitlines()[-1:]})", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _llamacpp_python(arg: str | None) -> str | None:
    for candidate in (arg, os.environ.get("LLAMACPP_PYTHON"), "/work/venv-llamacpp/bin/python"):
        if candidate and os.path.exists(candidate):
            ok = subprocess.run([candidate, "-c", "import llama_cpp"], capture_output=True).returncode == 0
            if ok:
                return candidate
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--llamacpp-python", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 1 thread, 1 run; a failed worker fails (CI)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from dtorch.models.default import default_model_path
        args.model = str(default_model_path())
    prompt, new = (SMOKE_PROMPT, SMOKE_NEW) if args.smoke else (PROMPT, NEW)
    if args.smoke:
        args.threads, args.runs = [1], 1
    if args.worker:
        kind, threads = args.worker.split(":")
        print(json.dumps(_worker_dtorch(args.model, int(threads), args.runs, kind == "dequantize", prompt, new)))
        return

    lcpp = _llamacpp_python(args.llamacpp_python)
    bw = _read_bandwidth(2048 if args.smoke else 8192)
    print(f"model {os.path.basename(args.model)}; batch 1, greedy, {prompt}-token prompt, {new} new tokens; "
          f"median of {args.runs} runs after a warm-up; read bandwidth {bw / 1e9:.1f} GB/s (1 thread)")
    if lcpp is None:
        print("llama.cpp: llama_cpp cannot be imported (build it with ../shared/tools/llamacpp-venv.sh); "
              "its column is left out")
    head = ["threads", "engine", "prefill tok/s", "x llama.cpp", "decode tok/s", "x llama.cpp", "floor tok/s",
            "x floor", "model MiB", "x llama.cpp", "linear kernel"]
    rows, failed = [], []
    for t in args.threads:
        ref = None
        if lcpp:
            ref = _run([lcpp, "-c", LLAMACPP_WORKER, args.model, str(t), str(args.runs), str(prompt), str(new)])
            if ref:
                rows.append([t, f"llama.cpp {ref['version']}", ref["prefill"], None, ref["decode"], None, None, None,
                             ref["model_mib"], None, "ggml"])
        for kind in ("native",) if args.smoke else ("native", "dequantize"):
            r = _run([sys.executable, __file__, "--worker", f"{kind}:{t}", "--model", args.model,
                      "--runs", str(args.runs)] + (["--smoke"] if args.smoke else []))
            if r is None:
                failed.append(f"{kind}:{t}")
                continue
            floor = bw / r["weight_bytes"]
            name = "dtorch (weights as stored)" if kind == "native" else "dtorch --dequantize (float32)"
            ratios = {key: r[key] / ref[key] if ref else None for key in ("prefill", "decode", "model_mib")}
            rows.append([t, name, r["prefill"], ratios["prefill"], r["decode"], ratios["decode"], floor,
                         floor / r["decode"], r["model_mib"], ratios["model_mib"], r["linear"]])
    _print(head, rows)
    print("\ntargets (issue #9): decode >= 1.5x llama.cpp, prefill >= 2x, model memory <= 1.5x llama.cpp's, "
          "float models within 1.3x of the floor (x floor = time per token / floor time). Shared, noisy machine.")
    if failed and args.smoke:
        sys.exit(f"decode bench: the dtorch worker(s) {', '.join(failed)} failed (their stderr is above)")


def _print(head: list[str], rows: list[list]) -> None:
    def fmt(v) -> str:
        if v is None:
            return "-"
        return f"{v:.2f}" if isinstance(v, float) and v < 10 else (f"{v:.1f}" if isinstance(v, float) else str(v))
    cells = [head] + [[fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    for i, row in enumerate(cells):
        print("  ".join(c.ljust(w) if j < 2 or j == len(head) - 1 else c.rjust(w)
                        for j, (c, w) in enumerate(zip(row, widths, strict=True))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    main()
