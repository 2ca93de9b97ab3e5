"""Start-up: how long ``dtorch.LLM(path)`` takes against llama.cpp's ``Llama(path)`` on the same file, cold (no packed
cache) and warm (its cache), and what ``dtorch info`` and ``dtorch serve`` cost before they answer (issue #39).

    python bench/startup.py [--repeats 3] [--threads 1] [--cache DIR] [--llamacpp-python PATH] [--smoke]

The file: a Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, FFN 4864, 14 heads / 2 KV heads of 64, a tied
151,936-token head; random F16 weights, normal * 0.02, the SmolLM2 tokenizer padded to the vocabulary) quantized to
Q4_K_M by llama.cpp's own quantizer (``llama_cpp.llama_model_quantize``): K = 896 is no multiple of 256, so its
projections are Q5_0 with some Q8_0 and Q6_K, and the head Q8_0, as a real Qwen2.5-0.5B-Instruct Q4_K_M is. Made
once into ``--cache`` (default ``~/.cache/dtorch/bench-gguf``).

Each measure runs in a fresh subprocess (the OS page cache is warm for all: the file was read just before), medians
of ``--repeats``:
- ``load``: ``Llama(path, n_ctx=1024)`` (llama.cpp, mmap) and ``LLM(path, max_model_len=1024)``: cold (the packed
  cache off: ``DTORCH_PACK_CACHE=0``, the file repacked) and warm (the cache entry there, made by the run before);
- ``info``: ``dtorch info PATH --json`` end to end (imports included);
- ``serve``: ``dtorch serve PATH --port 0`` from the start of the process to the first completion answered, and
  to ``/health`` saying ``ok`` (every step shape built); its banner's load and warm-up seconds are shown too.
``--smoke``: the shipped SmolLM2-135M Q4_1 file instead (no quantizer needed), one repeat, no serve; what CI runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import gguf_files as gf
import numpy as np
from decode import _llamacpp_python, _print

# Qwen2.5-0.5B's published sizes (config.json of Qwen/Qwen2.5-0.5B-Instruct)
QWEN2_5_0_5B = gf.Shape("qwen2", 896, 4864, 24, 14, 2, 64, 151936, context=32768)
CONTEXT = 1024


def qwen2_model(dst: Path, shape: gf.Shape, tokenizer_from: Path, seed: int = 0) -> Path:
    """``gf.random_model`` with Qwen2's q/k/v biases (F32, normal * ``shape.scale``)."""
    if dst.exists():
        return dst
    writer = gf.gguf.GGUFWriter(str(gf._atomic(dst)), shape.arch)
    writer.add_name(f"random {shape.arch} {shape.hidden}x{shape.layers}")
    gf._metadata(writer, shape)
    gf._tokenizer(writer, gf.gguf.GGUFReader(str(tokenizer_from)), shape.vocab)
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    names = gf._tensor_shapes(shape)
    for i in range(shape.layers):
        names += [(f"blk.{i}.attn_q.bias", (q,)), (f"blk.{i}.attn_k.bias", (kv,)), (f"blk.{i}.attn_v.bias", (kv,))]
    for name, dims in names:
        dt = np.dtype(np.float32 if len(dims) == 1 else np.float16)
        writer.add_tensor_info(name, dims, dt, int(np.prod(dims)) * dt.itemsize)

    def arrays():
        rng = np.random.default_rng(seed)
        for name, dims in names:
            if name.endswith(".bias"):
                yield (rng.standard_normal(dims, dtype=np.float32) * shape.scale).astype(np.float32)
            elif len(dims) == 1:
                yield np.ones(dims, dtype=np.float32)
            else:
                yield (rng.standard_normal(dims, dtype=np.float32) * shape.scale).astype(np.float16)

    gf._write(dst, writer, arrays())
    return dst


def make_file(cache: Path, python: str) -> Path:
    """The Qwen2.5-0.5B-shaped Q4_K_M file (made when missing)."""
    from dtorch.models.default import default_model_path

    src = qwen2_model(cache / "qwen2.5-0.5b-F16.gguf", QWEN2_5_0_5B, default_model_path())
    return gf.quantize(src, cache / "qwen2.5-0.5b-Q4_K_M.gguf", "Q4_K_M", Path(python), threads=2)


# -- the measures, each in a fresh subprocess --------------------------------------------------------------------------

LLAMACPP_LOAD = r"""
import json, sys, time
from llama_cpp import Llama
t0 = time.perf_counter()
llm = Llama(sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=int(sys.argv[3]), verbose=False)
print(json.dumps({"load_s": time.perf_counter() - t0}))
"""

DTORCH_LOAD = r"""
import json, sys, time
import dtorch
t0 = time.perf_counter()
llm = dtorch.LLM(sys.argv[1], max_model_len=int(sys.argv[2]), threads=int(sys.argv[3]))
seconds = time.perf_counter() - t0
status = llm.pack_cache.status if llm.pack_cache is not None else "off"
llm.pack_cache is not None and llm.pack_cache.wait()  # the entry written before the next run looks for it
print(json.dumps({"load_s": seconds, "cache": status}))
"""


def _json(cmd: list[str], env: dict[str, str]) -> dict | None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if proc.returncode:
        print(f"  ({' '.join(cmd[:3])} ... failed: {proc.stderr.strip().splitlines()[-1:]})", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(runs: list[float]) -> float | None:
    return statistics.median(runs) if runs else None


def measure_loads(path: Path, threads: int, repeats: int, llamacpp: str | None, env: dict[str, str]) -> dict:
    """Median load seconds: llama.cpp, dtorch cold (cache off) and warm (cache entry there), alternated per repeat."""
    out: dict[str, list[float]] = {"llamacpp": [], "cold": [], "warm": []}
    args = [str(path), str(CONTEXT), str(threads)]
    first = _json([sys.executable, "-c", DTORCH_LOAD, *args], env)  # makes the cache entry (a miss)
    statuses = [first["cache"]] if first else []
    for _ in range(repeats):
        if llamacpp:
            r = _json([llamacpp, "-c", LLAMACPP_LOAD, *args], env)
            if r:
                out["llamacpp"].append(r["load_s"])
        r = _json([sys.executable, "-c", DTORCH_LOAD, *args], env | {"DTORCH_PACK_CACHE": "0"})
        if r:
            out["cold"].append(r["load_s"])
        r = _json([sys.executable, "-c", DTORCH_LOAD, *args], env)
        if r:
            out["warm"].append(r["load_s"])
            statuses.append(r["cache"])
    return {k: _median(v) for k, v in out.items()} | {"statuses": statuses}


def measure_info(path: Path, repeats: int, env: dict[str, str]) -> float | None:
    """Median seconds of ``dtorch info PATH --json`` end to end (a fresh interpreter: imports included)."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "dtorch", "info", str(path), "--json"], capture_output=True,
                              text=True, timeout=600, env=env)
        if proc.returncode == 0:
            runs.append(time.perf_counter() - t0)
        else:
            print(f"  (info failed: {proc.stderr.strip().splitlines()[-1:]})", file=sys.stderr)
    return _median(runs)


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _health(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read() or b"{}").get("status", "")
    except (OSError, ValueError):
        return ""


def measure_serve(path: Path, threads: int, env: dict[str, str]) -> dict:
    """``dtorch serve PATH --port 0``: seconds from the process's start to its first completion answered and to
    ``/health`` saying ok; the banner's lines."""
    import threading

    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "dtorch", "serve", "--model", str(path), "--port", "0",
                             "--max-model-len", str(CONTEXT), "--threads", str(threads), "--log-stats-interval", "0"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    url: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line.rstrip())
            if line.startswith("dtorch serve: ") and " on http" in line:
                url.append(line.rsplit(" on ", 1)[1].strip())
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    out: dict = {}
    try:
        ready.wait(600)
        if not url:
            raise RuntimeError("the server printed no banner: " + " | ".join(lines[-3:]))
        base = url[0]
        _post(base + "/completions", {"model": path.stem, "prompt": "Hi", "max_tokens": 8, "temperature": 0})
        out["first_answer_s"] = time.perf_counter() - t0
        root = base.removesuffix("/v1")
        while _health(root + "/health") != "ok":
            if time.perf_counter() - t0 > 900:
                break
            time.sleep(0.2)
        else:
            out["health_ok_s"] = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(60)
    out["banner"] = [ln for ln in lines if ln.startswith(("dtorch serve:", "  ")) or "step shapes" in ln][:6]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "dtorch" / "bench-gguf")
    ap.add_argument("--llamacpp-python", default=None)
    ap.add_argument("--smoke", action="store_true", help="the shipped SmolLM2 file, one repeat, no serve (CI)")
    ap.add_argument("--no-serve", action="store_true")
    args = ap.parse_args()

    llamacpp = _llamacpp_python(args.llamacpp_python or str(gf.LLAMACPP_PYTHON))
    if args.smoke:
        from dtorch.models.default import default_model_path

        path, repeats = Path(default_model_path()), 1
    else:
        if llamacpp is None:
            sys.exit("bench/startup.py: llama.cpp's Python binding is needed to make the file (--llamacpp-python)")
        path, repeats = make_file(args.cache, llamacpp), args.repeats
    root = str(Path(__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory(prefix="dtorch-startup-") as folder:
        env = {**os.environ, "DTORCH_PACK_CACHE_DIR": folder, "OMP_NUM_THREADS": str(args.threads),
               "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.pop("DTORCH_PACK_CACHE", None)
        Path(path).read_bytes()  # the file in the OS page cache for every engine alike
        loads = measure_loads(path, args.threads, repeats, llamacpp, env)
        info = measure_info(path, repeats, env)
        serve = {} if args.smoke or args.no_serve else measure_serve(path, args.threads, env)
    base = loads["llamacpp"]

    def ratio(v: float | None) -> str:
        return f"{v / base:.1f}x" if v is not None and base else "-"

    print(f"\n{Path(path).name} ({Path(path).stat().st_size / 2**20:.0f} MiB), {args.threads} thread(s), medians of "
          f"{repeats}; the pack cache: {' '.join(loads['statuses'])}")
    rows = [["LLM(path) / Llama(path), cold: no pack cache", base, loads["cold"], ratio(loads["cold"])],
            ["LLM(path) / Llama(path), warm: pack cache", base, loads["warm"], ratio(loads["warm"])],
            ["dtorch info PATH --json (imports included)", None, info, "-"]]
    if serve:
        rows += [["serve: first completion answered, from the start", None, serve.get("first_answer_s"), "-"],
                 ["serve: /health ok (every step shape built)", None, serve.get("health_ok_s"), "-"]]
    _print(["measure (seconds)", "llama.cpp", "dtorch", "ratio"], rows)
    for line in serve.get("banner", []):
        print(f"  | {line}")


if __name__ == "__main__":
    main()
