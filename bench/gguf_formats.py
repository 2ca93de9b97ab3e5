"""GGUF files as users download them, dtorch against llama.cpp on each, side by side in one run (issue #21).

    python bench/gguf_formats.py [--files PATTERN ...] [--real] [--threads 1 2] [--repeats 3] [--rounds 1] [--quick]
                                 [--smoke] [--row-split claimed|static]
                                 [--agreement] [--kv-cache-dtype auto|bfloat16|float32] [--cache DIR]
                                 [--llamacpp-python PATH]

The files are made here, once, into ``--cache`` (default ``~/.cache/dtorch/bench-gguf``) and reused:
- ``smollm2-*``: the default model (SmolLM2-135M-Instruct Q4_1) dequantized to F32, then quantized again;
  ``smollm2-Q4_1`` is the shipped file itself;
- ``qwen3-0.6b-*``, ``qwen3-1.7b-*``: Qwen3-0.6B- and 1.7B-shaped F16 models with random weights (normal * 0.02,
  norms 1; the SmolLM2 tokenizer padded to Qwen3's vocab of 151936), written with gguf-py;
each quantized by llama.cpp's own quantizer (``llama_cpp.llama_model_quantize``, no imatrix) to Q4_K_M, Q5_K_M, Q6_K,
Q8_0 and IQ4_XS;
- the real small models' shapes (issue #39; ``--real`` picks these files): ``qwen2.5-0.5b``, ``qwen2.5-1.5b``,
  ``gemma3-270m``, ``gemma3-1b``, ``llama3.2-1b``, ``smollm2-360m`` (hidden sizes 896, 1536, 640, 1152, 2048, 960:
  most are no multiple of 256, so llama.cpp's Q4_K_M writes their projections in Q5_0, Q8_0 and Q6_K; tied heads of
  49k-262k tokens), random F16 weights as above, Q4_K_M and Q8_0.
A preset llama.cpp refuses is reported and skipped. ``--files`` takes names or shell patterns.

Each engine runs each file in its own subprocess per thread count (llama.cpp: llama-cpp-python 0.3.36 from the venv of
``../shared/tools/llamacpp-venv.sh``, default ``.venv-llamacpp``), greedy, the same prompt (a text, by the SmolLM2
tokenizer), a context of 1024 tokens in both (``n_ctx`` / ``max_model_len``), dtorch without prefix caching (a
repeated prompt must be computed again). Measured, medians of ``--repeats`` runs after a warm-up: prefill of 128 and
512 tokens, decode of 64 tokens after a 128-token prompt, and dtorch's engine throughput at 16 sequences (16 prompts
of 128 tokens, 64 new tokens each, through ``LLM.generate``; llama.cpp has no such engine in its Python binding:
dtorch only). "MiB" is the model's memory: peak RSS (VmHWM) above the RSS right after the imports, over the
single-sequence runs.

``--rounds N`` runs each (file, threads) pair of llama.cpp and dtorch N times in turn and reports the medians (the
ratios: medians of each round's ratio), so a neighbour's burst on this shared machine hits both alike.

Phases (issue #39; ``_phase.py``): on this shared 2-vCPU VM a neighbour's process or a busy host core slows a run,
at 2 threads above all (each product waits for its slowest thread). Around each engine's run the phase probe times a
fixed spin and a 64 MiB read on every CPU at once, and each worker records its busy threads' run-queue wait over its
decode runs. A run whose t-th fastest CPU (t its threads) spun over 1.15x the bench's fastest spin, or whose threads
waited over 3% of the run, is slow; the table's "phase" says how many rounds of a row had a slow run (either engine),
"x tg ok" is the decode ratio over the rounds where neither was slow, and a table after the main one shows each run's
probe, wait and (``--row-split claimed``) dtorch's rows per thread.

Products: after its runs, the dtorch worker times each one-row product of the model as a decode step calls it (x one
row, every layer's weights in the model's order, 3 passes after a warm-up, so each weight comes from memory: the
model is larger than the caches), grouped by weight kind and layout; printed as GB/s of weight bytes (including the
call) beside the machine's best plain read at that thread count (``bench/machine_limits.py``, measured at the start:
pinned threads, the fastest of 3 x 10 passes; 4 KiB and 2 MiB pages;
the model's weights sit in 2 MiB pages where the kernel gives them, ``dtorch.core.memory.huge_pages``).

Roofline (``_roofline.py``): per file and thread count, the bytes a decode step must read (the file's weights a token
passes through: all but the embedding's other rows, a tied head's embedding whole; and the keys and values before
it), the roof tok/s at the machine's best read at that thread count in 2 MiB pages, each engine's decode over the
roof, and 1.3x llama.cpp's over the roof: a row where that passes 1 cannot reach the target on this machine.

Checks that cost nothing: "greedy" is how many of the 64 decoded tokens of dtorch and llama.cpp agree before the first
difference; "follow" is the share of llama.cpp's 64 greedy tokens that dtorch ranks first in the same context (one
whole pass over llama.cpp's continuation), which one near-tie does not end as it ends "greedy". Per file: its tensor
types (gguf-py), the layouts dtorch keeps its 2-D weights in, and how many of them dtorch holds as float ("strided";
every 2-D tensor of these files is stored quantized) with their MiB.
``--agreement``: teacher-forced top-1 agreement with the float source over a 256-token text, one token per step as
decode runs (dtorch on the F32 / F16 source file is the reference), for the weights as stored and, to tell the
file's rounding from the kernels', dequantized to float32 at load. The smollm2 source is the shipped Q4_1 file
dequantized, so its re-quantized files carry a second rounding; random weights give nearly flat logits, so their
top-1 is mostly a matter of near-ties.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import _phase
import _roofline
import gguf_files as gf
from decode import _current_rss_mib, _llamacpp_python, _print, _run

PRESETS = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS")
SOURCES = ("smollm2", "qwen3-0.6b", "qwen3-1.7b")
# issue #39's table: the shapes of real small models, as users download them in Q4_K_M and Q8_0
REAL_SHAPES = {"qwen2.5-0.5b": gf.QWEN2_5_0_5B, "qwen2.5-1.5b": gf.QWEN2_5_1_5B, "gemma3-270m": gf.GEMMA3_270M,
               "gemma3-1b": gf.GEMMA3_1B, "llama3.2-1b": gf.LLAMA3_2_1B, "smollm2-360m": gf.SMOLLM2_360M}
REAL_PRESETS = ("Q4_K_M", "Q8_0")
REAL_FILES = tuple(f"{s}-{p}" for s in REAL_SHAPES for p in REAL_PRESETS)
FILES = ("smollm2-Q4_1",) + tuple(f"{s}-{p}" for s in SOURCES for p in PRESETS) + REAL_FILES
QUICK_FILES = ("smollm2-Q*", "qwen3-0.6b-Q4_K_M")
PREFILL, PROMPT, NEW, SEQS, CONTEXT = (128, 512), 128, 64, 16, 1024
TEXT = (
    "The lighthouse stood on a rock at the mouth of the harbour, and for two hundred years its keepers kept the lamp "
    "burning through every storm. The first tower was built of timber and burned down within a decade; the second, of "
    "granite brought by barge from a quarry upriver, still stands. Each keeper wrote in a logbook the weather, the "
    "ships that passed and the oil that the lamp consumed, and those books, kept today in the town library, tell the "
    "story of the coast better than any history. In the winter of the great flood the sea rose over the causeway and "
    "the keeper and his daughter lived for three weeks on biscuits and rainwater, trimming the wick every four hours. "
    "When the railway reached the town, the harbour lost its trade to the larger port in the south, and the fishing "
    "fleet shrank from sixty boats to a dozen. The lamp was converted to electricity after the war and the last keeper "
    "left in the spring of the year the light became automatic. Visitors now climb the hundred and twelve steps to "
    "the gallery, where on a clear day they can see the islands, the white cliffs to the east and the long beach "
    "where the seals come ashore in autumn. Schoolchildren learn the names of the keepers and the ships that were "
    "saved, and every summer the town holds a festival with music, boat races and a supper of grilled fish on the "
    "quay, which ends when the beam of the lighthouse sweeps for the first time across the water at nightfall."
)


# -- the files --------------------------------------------------------------------------------------------------

def make_files(names: list[str], cache: Path, python: str) -> dict[str, Path | str]:
    """name -> its path in ``cache`` (made when missing), or the reason it could not be made."""
    from dtorch.models.default import default_model_path

    shipped = default_model_path()
    sources = {"smollm2": lambda: gf.float_copy(shipped, cache / "smollm2-F32.gguf"),
               "qwen3-0.6b": lambda: gf.random_model(cache / "qwen3-0.6b-F16.gguf", gf.QWEN3_0_6B, shipped),
               "qwen3-1.7b": lambda: gf.random_model(cache / "qwen3-1.7b-F16.gguf", gf.QWEN3_1_7B, shipped)}
    for source, shape in REAL_SHAPES.items():
        sources[source] = lambda source=source, shape=shape: gf.random_model(cache / f"{source}-F16.gguf", shape,
                                                                              shipped)
    out: dict[str, Path | str] = {}
    for name in names:
        if name == "smollm2-Q4_1":
            out[name] = shipped
            continue
        source, _, preset = name.rpartition("-")
        print(f"  file {name} ...", file=sys.stderr, flush=True)
        try:
            out[name] = gf.quantize(sources[source](), cache / f"{name}.gguf", preset, Path(python), threads=2)
        except gf.QuantizeError as e:
            out[name] = str(e)
    return out


def source_of(name: str, cache: Path) -> Path:
    """The float file a quantized benchmark file was made from."""
    source = name.rpartition("-")[0]
    return cache / ("smollm2-F32.gguf" if source == "smollm2" else f"{source}-F16.gguf")


# -- the engines, each in its own subprocess -------------------------------------------------------------------

LLAMACPP_WORKER = r"""
import json, os, statistics, sys, time
model, threads, repeats, ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, sys.argv[9])
import _phase
import _roofline
ids = [int(i) for i in sys.argv[5].split(",")]
prefill_lens, prompt, new = json.loads(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8])
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
def peak():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024
import llama_cpp
base = rss()
llm = llama_cpp.Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=ctx, n_batch=512,
                      verbose=False)
out = {"version": llama_cpp.__version__}
for n in prefill_lens:
    times = []
    for r in range(repeats + 1):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids[:n])
        if r:
            times.append(time.perf_counter() - t0)
    out[f"prefill{n}"] = n / statistics.median(times)
times, waits = [], []
for r in range(repeats + 1):
    llm.reset()
    llm.eval(ids[:prompt])
    tokens = [llm.sample(top_k=1, temp=0.0)]
    s0, t0 = _phase.sched(), time.perf_counter()
    for _ in range(new):
        llm.eval([tokens[-1]])
        tokens.append(llm.sample(top_k=1, temp=0.0))
    if r:
        times.append(time.perf_counter() - t0)
        waits.append(_phase.waited(s0, _phase.sched(), times[-1]))
out["decode"] = new / statistics.median(times)
out["waited"] = max(waits)
out["tokens"] = tokens[:new]
out["model_mib"] = peak() - base
print(json.dumps(out))
"""


def _peak_mib() -> float:
    """This process's peak RSS (VmHWM). Not ``ru_maxrss``: Linux carries that across fork and exec, so a worker
    would report its parent's peak whenever that is the larger."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _llm(path: str, threads: int, dequantize: bool = False, kv_cache_dtype: str = "auto"):
    from dtorch.engine.llm import LLM

    return LLM(path, threads=threads, max_model_len=CONTEXT, max_num_seqs=SEQS, enable_prefix_caching=False,
               dequantize=dequantize, kv_cache_dtype=kv_cache_dtype)


def _weights_kept(llm) -> dict:
    """The layouts of the model's 2-D weights (each tensor once: a tied head is the embedding) and those held as
    float ("strided"): their count, names (a few) and MiB."""
    seen, layouts, floats, float_bytes = set(), Counter(), [], 0
    for name, w in llm.model.weights.items():
        if id(w) in seen or len(w.shape) != 2:
            continue
        seen.add(id(w))
        layouts[w.layout] += 1
        if w.layout == "strided":
            floats.append(name)
            float_bytes += sum(b.tensor.numel() * b.tensor.element_size() for b in w.blobs.values())
    return {"layouts": dict(layouts), "floats": floats, "float_mib": float_bytes / 2**20}


def products(llm, passes: int = 3) -> list[dict]:
    """GB/s of each one-row product of the model as a decode step calls it (``dtorch.kernels.native.qlinear``, one
    row of x): every packed 2-D weight in the model's order, ``passes`` times after a warm-up, each call timed,
    grouped by kind (the name without its layer), layout and shape. The model outgrows the caches, so each weight
    comes from memory as in decode. x has two levels, or one under ``DTORCH_ONE_LEVEL=1`` (as a decode step's calls).
    Returns one dict per group: kind, layout, n, k, count (weights), mib (all of them), us (per call, median over
    passes of the group's mean), gbs (bytes / time of all its calls)."""
    import time

    import torch

    from dtorch.core import env
    from dtorch.kernels import layouts
    from dtorch.kernels.native import loader

    lib = loader._mod or loader.load()
    from _step_profile import one_row_weights

    order = [(key, t, layouts.format_code(key[1])) for key, t in one_row_weights(llm)]
    xs = {key[3]: torch.randn(1, key[3]) for key, _, _ in order}
    ys = {key[2]: torch.empty(1, key[2]) for key, _, _ in order}
    times: dict[tuple, list[float]] = {key: [] for key, _, _ in order}
    one_level = 2 if env.one_level() else 0  # (products.py's _one_level for a lone decode row)
    for p in range(passes + 1):
        spent: dict[tuple, float] = {}
        for key, t, code in order:
            x, y = xs[key[3]], ys[key[2]]
            t0 = time.perf_counter()
            lib.qlinear(x, t, code, None, y, one_level)
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0
        if p:
            for key, v in spent.items():
                times[key].append(v)
    out = []
    for key, ts in times.items():
        ws = [t for k2, t, _ in order if k2 == key]
        nbytes = sum(t.numel() for t in ws)
        spent = statistics.median(ts)
        out.append({"kind": key[0], "layout": key[1], "n": key[2], "k": key[3], "count": len(ws),
                    "mib": nbytes / 2**20, "us": 1e6 * spent / len(ws), "gbs": nbytes / spent / 1e9})
    return out


def worker_dtorch(path: str, threads: int, repeats: int, prefill: tuple[int, ...], ids: list[int],
                  follow: list[int], kv_cache_dtype: str = "auto", row_split: str | None = None) -> dict:
    """Prefill, decode and model memory of one sequence, then the 16-sequence decode throughput, and the share of
    ``follow`` (llama.cpp's greedy tokens after the prompt) that dtorch ranks first in the same context. Also, over
    the decode runs, the largest run-queue wait of a thread (``_phase.waited``) and the rows each thread computed in
    claimed splits. ``row_split``: the products' ("claimed" or "static"; None: the library's default)."""
    import time

    from dtorch.engine.sampling import SamplingParams
    from dtorch.kernels.native import loader

    if row_split:
        loader.load().set_row_split(row_split)
    base = _current_rss_mib()
    llm = _llm(path, threads, kv_cache_dtype=kv_cache_dtype)
    if llm.pack_cache is not None:  # a missing or stale entry is written on an idle thread: not during the timings
        llm.pack_cache.wait()
    out: dict = {"kept": _weights_kept(llm)}
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for n in prefill:
        tps = []
        for r in range(repeats + 1):
            llm.generate([ids[:n]], one)
            if r:
                tps.append(llm.stats.prefill_tps)
        out[f"prefill{n}"] = statistics.median(tps)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    tps, waits = [], []
    loader.row_counts(reset=True)
    for r in range(repeats + 1):
        s0, t0 = _phase.sched(), time.perf_counter()
        res = llm.generate([ids[:PROMPT]], params)
        if r:
            tps.append(llm.stats.decode_tps)
            waits.append(_phase.waited(s0, _phase.sched(), time.perf_counter() - t0))
    out["decode"] = statistics.median(tps)
    out["waited"] = max(waits)
    out["rows"] = loader.row_counts(reset=True)[:threads]  # all zero under the static split
    out["tokens"] = res[0].outputs[0].token_ids
    out["model_mib"] = _peak_mib() - base
    if follow:  # position PROMPT - 1 + i predicts follow[i]
        top = llm.logits(ids[:PROMPT] + follow[:-1])[PROMPT - 1:].argmax(-1).tolist()
        out["follow"] = sum(a == b for a, b in zip(top, follow, strict=True)) / len(follow)
    rng = random.Random(SEQS)
    prompts = [[rng.choice(ids) for _ in range(PROMPT)] for _ in range(SEQS)]
    tps = []
    for r in range(repeats + 1):
        llm.generate(prompts, params)
        if r:
            tps.append(llm.stats.decode_tps)
    out["decode16"] = statistics.median(tps)
    out["products"] = products(llm)
    llm.close()
    return out


def _stepwise_argmax(llm, ids: list[int]) -> list[int]:
    """The argmax next token after each prefix of ``ids``, computed one token per step (the decode path)."""
    from dtorch.models.executor import StepPlan

    blocks = llm.engine.blocks.allocate(llm.engine.blocks.blocks_for(len(ids)))
    try:
        return [int(llm.executor.step(StepPlan([t], [1], [i], [blocks]), all_logits=True).argmax(-1))
                for i, t in enumerate(ids)]
    finally:
        llm.engine.blocks.free(blocks)


def worker_agreement(path: str, threads: int, reference: str | None, dequantize: bool) -> dict:
    """With ``reference`` None: the float file's argmax after each prefix of the text (one whole-text pass).
    Otherwise the share of one-token steps whose argmax equals the reference's (a JSON list in that file), on the
    weights as stored or (``dequantize``) as float32."""
    llm = _llm(path, threads, dequantize)
    ids = llm.tokenizer.encode(TEXT)[:256]
    if len(ids) < 256:
        raise SystemExit(f"the text is {len(ids)} tokens, fewer than 256")
    if reference is None:
        out = {"argmax": llm.logits(ids).argmax(-1).tolist()}
    else:
        want = json.loads(Path(reference).read_text())
        got = _stepwise_argmax(llm, ids)
        out = {"agreement": sum(a == b for a, b in zip(got, want, strict=True)) / len(want)}
    llm.close()
    return out


# -- the run ------------------------------------------------------------------------------------------------------

def _ids(n: int) -> list[int]:
    """The first ``n`` tokens of TEXT (repeated as needed) by the SmolLM2 tokenizer, which every file here has (the
    Qwen3 shapes pad it): a real text, so that the greedy continuations of a trained model are not a coin toss."""
    from dtorch.models.default import default_model_path
    from dtorch.models.loaders.gguf import load_gguf_tokenizer

    ids = load_gguf_tokenizer(default_model_path()).encode(TEXT)
    return (ids * (n // len(ids) + 1))[:n]


def _dtorch(kind: str, path: Path, threads: int, repeats: int, extra: tuple[str, ...] = ()) -> dict | None:
    return _run([sys.executable, __file__, "--worker", kind, "--path", str(path), "--threads", str(threads),
                 "--repeats", str(repeats), *extra])


def _greedy_match(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=gf.ROOT, capture_output=True, text=True).stdout.strip()
    dirty = git("status", "--porcelain", "--untracked-files=no", "dtorch")
    return git("rev-parse", "--short", "HEAD") + (" + uncommitted changes under dtorch/" if dirty else "")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def main() -> None:
    global PREFILL, PROMPT, NEW, SEQS  # --smoke makes them small
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", nargs="+", default=None, help=f"names or patterns among: {' '.join(FILES)}")
    ap.add_argument("--threads", type=int, nargs="+", default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run each (file, threads) pair of llama.cpp and dtorch this many times in turn; medians")
    ap.add_argument("--real", action="store_true",
                    help=f"the real small models' shapes of issue #39: {' '.join(REAL_FILES)} (with --files: both)")
    ap.add_argument("--quick", action="store_true",
                    help=f"1 thread, 1 repeat, prefill of {PREFILL[0]} only; files {' '.join(QUICK_FILES)} unless "
                         "--files says otherwise")
    ap.add_argument("--smoke", action="store_true",
                    help="--quick on the shipped smollm2-Q4_1 file alone (no quantizer needed); llama.cpp's columns "
                         "only where its venv is there (CI)")
    ap.add_argument("--agreement", action="store_true", help="top-1 agreement with the float source (slow)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="dtorch's KV cache (LLM's kv_cache_dtype; llama.cpp keeps float16 keys): the speed and "
                         "memory runs only, the agreement runs keep the activations' float32")
    ap.add_argument("--row-split", default=None, choices=("claimed", "static"),
                    help="how dtorch's products share their rows among threads (default: the library's)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "dtorch" / "bench-gguf")
    ap.add_argument("--llamacpp-python", default=str(gf.LLAMACPP_PYTHON))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--reference", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--follow", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dequantize", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:  # the script's every step on tiny sizes: the figures mean nothing
        PREFILL, PROMPT, NEW, SEQS = (16,), 16, 8, 4
        args.quick, args.files, args.real = True, ["smollm2-Q4_1"], False
    prefill = PREFILL[:1] if args.quick else PREFILL
    threads = args.threads or ([1] if args.quick else [1, 2])
    repeats = args.repeats or (1 if args.quick else 3)
    if args.worker:
        if args.worker == "dtorch":
            follow = [int(i) for i in args.follow.split(",")] if args.follow else []
            out = worker_dtorch(args.path, threads[0], repeats, prefill, _ids(max(prefill)), follow,
                                args.kv_cache_dtype, args.row_split)
        else:
            out = worker_agreement(args.path, threads[0], args.reference, args.dequantize)
        print(json.dumps(out))
        return

    patterns = tuple(args.files or ()) + (REAL_FILES if args.real else ())
    patterns = patterns or (QUICK_FILES if args.quick else FILES)
    names = [f for f in FILES if any(fnmatch.fnmatch(f, p) for p in patterns)]
    if not names:
        raise SystemExit(f"--files {' '.join(patterns)} matches none of {' '.join(FILES)}")
    lcpp = _llamacpp_python(args.llamacpp_python)
    if lcpp is None and args.smoke:
        print(f"  (smoke: llama_cpp cannot be imported by {args.llamacpp_python}; its columns are left empty)",
              file=sys.stderr)
    elif lcpp is None:
        raise SystemExit(f"llama_cpp cannot be imported by {args.llamacpp_python}: build it with "
                         "../shared/tools/llamacpp-venv.sh .venv-llamacpp (its quantizer makes the files)")
    files = make_files(names, args.cache, lcpp or "")
    load = os.getloadavg()[0]
    _warn_oversubscribed(load, threads)
    limits = _machine_limits(threads, args.smoke)
    probe = _phase_probe()
    ids = _ids(max(prefill))
    quick = ("--quick",) + (("--smoke",) if args.smoke else ()) if args.quick else ()
    head = ["file", "thr", "lcpp pp128", "pp512", "tg64", "MiB", "dtorch pp128", "pp512", "tg64", "MiB",
            "x pp128", "x pp512", "x tg", "x MiB", "16-seq tg", "16/1", "greedy", "follow", "phase", "x tg ok"]
    rows, notes, prods, phases = [], {}, [], []
    for name in names:
        path = files[name]
        if isinstance(path, str):
            notes[name] = {"skipped": path}
            continue
        notes[name] = {"types": dict(gf.tensor_types(path)), "step": _roofline.step_bytes(path, PROMPT + NEW / 2)}
        for t in threads:
            refs, gots = [], []
            split = ("--row-split", args.row_split) if args.row_split else ()
            for k in range(args.rounds):  # llama.cpp, then dtorch, in turn, the phase probe before, between, after
                before = _phase.probe(probe)
                ref = lcpp and _run([lcpp, "-c", LLAMACPP_WORKER, str(path), str(t), str(repeats), str(CONTEXT),
                            ",".join(map(str, ids)), json.dumps(list(prefill)), str(PROMPT), str(NEW),
                            str(Path(__file__).parent)])
                between = _phase.probe(probe)
                follow = ("--follow", ",".join(map(str, ref["tokens"]))) if ref else ()
                got = _dtorch("dtorch", path, t, repeats,
                              quick + follow + split + ("--kv-cache-dtype", args.kv_cache_dtype))
                after = _phase.probe(probe)
                refs.append(ref or {})
                gots.append(got or {})
                phases += [[name, t, k, "llama.cpp", (ref or {}).get("decode"), before, between,
                            (ref or {}).get("waited"), None],
                           [name, t, k, "dtorch", (got or {}).get("decode"), between, after, (got or {}).get("waited"),
                            (got or {}).get("rows")]]
            ref, got = _medians(refs), _medians(gots)
            notes[name].update(kept=got.get("kept"), llamacpp=ref.get("version"))
            pp = [(ref.get(f"prefill{n}"), got.get(f"prefill{n}")) for n in (128, 512)]
            rows.append([name, t, pp[0][0], pp[1][0], ref.get("decode"), ref.get("model_mib"),
                         pp[0][1], pp[1][1], got.get("decode"), got.get("model_mib"),
                         _ratios(refs, gots, "prefill128"), _ratios(refs, gots, "prefill512"),
                         _ratios(refs, gots, "decode"), _ratio(got.get("model_mib"), ref.get("model_mib")),
                         got.get("decode16"), _ratio(got.get("decode16"), got.get("decode")),
                         f"{_greedy_match(got['tokens'], ref['tokens'])}/{NEW}" if got.get("tokens") and
                         ref.get("tokens") else None,
                         f"{100 * got['follow']:.0f}%" if "follow" in got else None, None, None])
            rows[-1][-2:] = _phase_cells(phases[-2 * args.rounds:], refs, gots)
            prods += [[name, t, p["kind"], p["layout"][5:], f"{p['n']}x{p['k']}", p["count"], p["mib"], p["us"],
                       p["gbs"]] for p in got.get("products", [])]
            print("  " + " | ".join(f"{h} {v:.4g}" if isinstance(v, float) else f"{h} {v}"
                                    for h, v in zip(head, rows[-1], strict=True)), file=sys.stderr, flush=True)
    if args.agreement:
        _agreement(names, files, args.cache, max(threads), notes)

    version = next((n["llamacpp"] for n in notes.values() if n.get("llamacpp")), "?")
    print(f"\ndtorch {_commit()} against llama.cpp (llama-cpp-python {version}); greedy, context {CONTEXT}; "
          f"prefill of {' and '.join(map(str, prefill))} tokens, decode of {NEW} after {PROMPT}; 16-seq: {SEQS} "
          f"prompts of {PROMPT}, {NEW} new tokens each (dtorch only); dtorch's KV cache {args.kv_cache_dtype}; "
          f"medians of {repeats} after a warm-up; load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at "
          f"the end ({os.cpu_count()} CPUs); tok/s; x = dtorch / llama.cpp (memory: lower is better)\n")
    _print(head, rows)
    agree = " | top-1 agreement with the float source, 256 one-token steps: as stored / dequantized at load"
    print("\nper file: tensor types in the file | dtorch's layouts of its 2-D weights | held as float (strided): "
          "count, MiB, first names" + (agree if args.agreement else ""))
    for name, n in notes.items():
        if "skipped" in n:
            print(f"  {name}: skipped: {n['skipped']}")
            continue
        types = ", ".join(f"{k} {v}" for k, v in sorted(n["types"].items()))
        kept = n.get("kept")
        line = f"  {name}: {types}"
        if kept:
            layouts = ", ".join(f"{k} {v}" for k, v in sorted(kept["layouts"].items()))
            line += f" | {layouts} | {len(kept['floats'])}, {kept['float_mib']:.0f} MiB {kept['floats'][:3]}"
        if "agreement" in n:
            line += f" | {n['agreement']}"
        print(line)
    _print_phases(phases)
    _print_roofline(rows, notes, limits)
    _print_products(prods, limits)
    print("\ntargets (issue #21): decode >= 1.5x, prefill >= 2x (4x with AMX), memory <= 1.1x, 16-seq >= 5x one "
          "sequence on qwen3-0.6b-Q4_K_M, top-1 agreement >= 99%; (issue #39) on the real shapes (--real) decode >= "
          "1.3x at 1 and 2 threads, each one-row product of a weight larger than the cache at >= 80% of the read "
          "rate. Shared, noisy machine.")


def _medians(runs: list[dict]) -> dict:
    """One run's dict with each number the median over ``runs`` (the rest from the first run that has it)."""
    out: dict = {}
    for r in runs:
        for key, v in r.items():
            out.setdefault(key, v)
    for key in out:
        values = [r[key] for r in runs if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)]
        if values and isinstance(out[key], int | float):
            out[key] = statistics.median(values)
    if any("products" in r for r in runs):  # each group's GB/s and time per call: medians over the rounds
        groups = [r["products"] for r in runs if "products" in r]
        out["products"] = [dict(g[0], us=statistics.median(x["us"] for x in g),
                                gbs=statistics.median(x["gbs"] for x in g)) for g in zip(*groups, strict=True)]
    return out


def _ratios(refs: list[dict], gots: list[dict], key: str) -> float | None:
    """The median over the rounds of dtorch's ``key`` / llama.cpp's in the same round."""
    values = [_ratio(g.get(key), r.get(key)) for r, g in zip(refs, gots, strict=True)]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _warn_oversubscribed(load: float, threads: list[int]) -> None:
    """Say when the machine is too busy for the thread counts asked: both engines split each product among their
    threads and wait for all of them at its end (OpenMP's barrier, llama.cpp's), so a thread the scheduler parks
    holds the others: with the cores taken by other work a 2-thread run crawls (a 2-thread dtorch worker took 9+
    minutes at load ~10 on 2 cores, still advancing, its two threads sampled in libgomp's barrier every time; see
    bench/real_shapes.md)."""
    cpus, most = os.cpu_count() or 1, max(threads)
    if load + most <= cpus + 0.5:
        return
    what = ("every figure is slowed by that work: read the same-run ratios" if most == 1 else
            f"runs at {most} threads share cores with it, and their figures mostly measure the wait for parked threads")
    print(f"  (load average {load:.1f} on {cpus} CPUs: {what})", file=sys.stderr)


def _phase_probe():
    """A ``machine_limits.PhaseProbe``, or None where it cannot run (the reason printed)."""
    import machine_limits

    try:
        return machine_limits.PhaseProbe()
    except (machine_limits.LimitsUnavailable, subprocess.CalledProcessError) as e:
        print(f"  (phase probe: {e}; rows are not checked for slow phases)", file=sys.stderr)
        return None


def _fastest(phases: list[list]) -> float:
    """The fastest spin of any CPU in any probe so far (ms): the vCPU's speed when whole."""
    return min((c["spin_ms"] for p in phases for probes in p[5:7] for c in probes or ()), default=0.0)


def _phase_cells(phases: list[list], refs: list[dict], gots: list[dict]) -> tuple[str, float | None]:
    """A row's "phase" cell ("ok", or "slow k/n": k of its n rounds had a slow CPU or a waiting thread in either
    engine's run) and the median decode ratio over its rounds where neither run was slow (None if none)."""
    fastest = _fastest(phases)
    slow = [bool(_phase.flags(p[5:7], p[7], fastest, p[1])) for p in phases]
    bad = [a or b for a, b in zip(slow[::2], slow[1::2], strict=True)]  # per round: llama.cpp's run or dtorch's
    good = [_ratio(g.get("decode"), r.get("decode")) for r, g, b in zip(refs, gots, bad, strict=True) if not b]
    good = [v for v in good if v is not None]
    cell = f"slow {sum(bad)}/{len(bad)}" if any(bad) else "ok"
    return cell, statistics.median(good) if good else None


def _print_phases(phases: list[list]) -> None:
    """Each engine's decode run beside the phase probe before and after it (per CPU: spin ms / read GB/s), its
    threads' largest run-queue wait and dtorch's rows per thread: what made a row "slow"."""
    if not phases:
        return
    fastest = _fastest(phases)
    print(f"\nthe machine during each decode run (bench/_phase.py): per CPU, spin ms / read GB/s of the phase probe "
          f"before and after the run (fastest spin {fastest:.1f} ms; slow: over {_phase.SLOW_SPIN}x), the largest "
          f"run-queue wait of the engine's busy threads (slow: over {100 * _phase.SLOW_WAIT:.0f}% of the run), "
          "dtorch's rows per thread in claimed splits\n")
    head = ["file", "thr", "round", "engine", "tg64", "probe before", "after", "waited", "rows", "slow because"]
    rows = [[name, t, k, engine, tps, _phase.cells(a), _phase.cells(b),
             f"{100 * w:.1f}%" if w is not None else None,
             "/".join(f"{100 * r / sum(counts):.0f}%" for r in counts) if counts and sum(counts) else None,
             ", ".join(_phase.flags([a, b], w, fastest, t)) or None]
            for name, t, k, engine, tps, a, b, w, counts in phases]
    _print(head, rows)


def _machine_limits(threads: list[int], smoke: bool = False) -> dict[int, dict[str, float]]:
    """threads -> {"read": GB/s in 4 KiB pages, "read2m": in 2 MiB pages}: the machine's best (the fastest pass of 3
    runs; ``smoke``: one short run), empty where the probes cannot run (their reason is printed)."""
    import machine_limits

    try:
        got = machine_limits.measure(threads, *((1, 32, 1_000_000, 2) if smoke else (3,)))
    except (machine_limits.LimitsUnavailable, subprocess.CalledProcessError) as e:
        print(f"  (machine_limits: {e}; products and the roofline shown without the read rate)", file=sys.stderr)
        return {}
    return {t: {k: max(v) for k, v in values.items() if v} for t, values in got.items()}


def _print_roofline(rows: list[list], notes: dict, limits: dict[int, dict[str, float]]) -> None:
    """Per file and thread count: the bytes a decode step reads, the tok/s the machine's best read in 2 MiB pages
    allows at most, and each engine's share of it (``_roofline.py``)."""
    if not rows:
        return
    print(f"\nthe roofline of decode (bench/_roofline.py): MB a step reads (the file's weights a token passes "
          f"through, and in brackets the keys and values of {PROMPT + NEW // 2} positions, 2 bytes each), the "
          "machine's best read at the thread count in 2 MiB pages (bench/machine_limits.py at the start), roof "
          f"tok/s = read / MB a step, each engine's tg{NEW} over the roof (llama.cpp's also over the roof at the read "
          f"in 4 KiB pages, its mmap's); {_roofline.TARGET}x lcpp / roof over 1: the target is above the roof\n")
    _print(_roofline.COLUMNS, [_roofline.row(r[0], r[1], notes[r[0]].get("step"), limits.get(r[1], {}).get("read2m"),
                                             r[4], r[8], limits.get(r[1], {}).get("read")) for r in rows])


def _print_products(prods: list[list], limits: dict[int, dict[str, float]]) -> None:
    if not prods:
        return
    from dtorch.core import env

    levels = "x at one level (DTORCH_ONE_LEVEL=1)" if env.one_level() else "x at two levels"
    print(f"\none-row products as a decode step calls them (every layer's weight in turn, from memory; {levels}): "
          "GB/s of weight bytes per call, and that over the machine's plain read at the same thread count "
          "(bench/machine_limits.py at the start: " +
          "; ".join(f"{t} thread(s) {v.get('read', 0):.1f} GB/s in 4 KiB pages, {v.get('read2m', 0):.1f} in 2 MiB"
                    for t, v in limits.items()) + ")\n")
    head = ["file", "thr", "weight", "layout", "N x K", "count", "MiB", "us/call", "GB/s", "x read", "x read 2M"]
    rows = []
    for name, t, kind, layout, shape, count, mib, us, gbs in prods:
        lim = limits.get(t, {})
        rows.append([name, t, kind, layout, shape, count, mib, us, gbs, _ratio(gbs, lim.get("read")),
                     _ratio(gbs, lim.get("read2m"))])
    _print(head, rows)


def _agreement(names: list[str], files: dict, cache: Path, threads: int, notes: dict) -> None:
    """notes[name]["agreement"]: "97.3% / 97.7%" (or why not) for each quantized file against its float source: its
    weights as stored, then dequantized to float32 at load (what the file's rounding costs, whatever the kernels)."""
    references: dict[str, str | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            if isinstance(files[name], str):
                continue
            source = source_of(name, cache)
            if name == "smollm2-Q4_1" and not source.exists():
                source = gf.float_copy(files[name], source)
            if str(source) not in references:
                got = _dtorch("agree", source, threads, 1)
                references[str(source)] = None
                if got:
                    references[str(source)] = os.path.join(tmp, f"{source.stem}.json")
                    Path(references[str(source)]).write_text(json.dumps(got["argmax"]))
            ref = references[str(source)]
            if ref is None:
                notes[name]["agreement"] = f"no reference ({source.name} failed)"
                continue
            got = [_dtorch("agree", files[name], threads, 1, ("--reference", ref, *deq))
                   for deq in ((), ("--dequantize",))]
            notes[name]["agreement"] = " / ".join(f"{100 * g['agreement']:.1f}%" if g else "failed" for g in got)


if __name__ == "__main__":
    main()
