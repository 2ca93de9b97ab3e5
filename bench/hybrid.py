"""dtorch against Hugging Face transformers on a hybrid Qwen3-Next checkpoint on CPU, side by side in one run.

    python bench/hybrid.py [--model DIR] [--engines hf,dtorch] [--threads N] [--new 32] [--repeat 3] [--smoke]

The checkpoint: random weights (seeded) of realistic proportions, hidden 1024, 12 layers of which 3 of every 4
are linear attention (gated delta rule) and every 4th full attention, 32 experts with top-4 plus a shared expert,
saved in bfloat16 with ``save_pretrained`` to ``--model`` (default ``~/.cache/dtorch-bench/qwen3-next-1024``;
made once, reused when present).

Each engine runs in its own subprocess (this script with ``--worker``), bfloat16, greedy:
- prefill tok/s: one prompt of 2048 random token ids, the time to its first logits, measured once;
- decode tok/s at batch 1 and 8: prompts of 64 tokens, ``--new`` new tokens; the decode rate counts the
  batch * (new - 1) tokens after the one that prefill makes; the median of ``--repeat`` runs after a warm-up;
- memory: peak RSS over the whole run minus the RSS right after the imports (what the model costs).
transformers times each decode step with a LogitsProcessor that records when it is called; dtorch reports
``LLM.stats``. On CPU transformers runs its torch reference for the delta rule and the short convolution
(flash-linear-attention and causal_conv1d are CUDA-only).

``--smoke`` (what CI runs): a tiny checkpoint of the same layout (hidden 64, 4 layers, 4 experts) written to a
temporary folder, a 32-token prefill, batches 1 and 2 of 8-token prompts, 4 new tokens, 1 run; a failed engine
fails the run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _timing import table  # noqa: E402

DEFAULT_DIR = Path.home() / ".cache" / "dtorch-bench" / "qwen3-next-1024"
PREFILL_LEN, DECODE_LEN, BATCHES, SEED = 2048, 64, (1, 8), 0
TARGET_DECODE_B1 = 3.0  # the issue's target: dtorch decode at batch 1 >= 3x transformers'
ENGINES = {"hf": "transformers", "dtorch": "dtorch"}

CONFIG = dict(
    hidden_size=1024, num_hidden_layers=12, full_attention_interval=4,  # 3 linear layers, then 1 full
    num_attention_heads=8, num_key_value_heads=2, head_dim=128,  # partial_rotary_factor: the default, 0.25
    linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    intermediate_size=2048, decoder_sparse_step=1, norm_topk_prob=True, vocab_size=32000,
    max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.02,
)
# --smoke: the same layout (3 linear layers then 1 full, MoE with a shared expert) at toy sizes
SMOKE_CONFIG = dict(
    CONFIG, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    intermediate_size=64, vocab_size=512, max_position_embeddings=256,
)


def use_smoke_sizes() -> None:
    """Shrink the module's sizes for ``--smoke``, in the parent and in each worker (both read these globals)."""
    global CONFIG, PREFILL_LEN, DECODE_LEN, BATCHES
    CONFIG, PREFILL_LEN, DECODE_LEN, BATCHES = SMOKE_CONFIG, 32, 8, (1, 2)


# ---- the checkpoint ------------------------------------------------------------------------------------------


def make_checkpoint(path: Path) -> None:
    """Random Qwen3-Next weights (seeded) in bfloat16, written to ``path`` (through a temporary folder)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    print(f"making the checkpoint in {path} ...", file=sys.stderr, flush=True)
    torch.manual_seed(SEED)
    model = Qwen3NextForCausalLM._from_config(Qwen3NextConfig(**CONFIG), dtype=torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tmp.rename(path)


def checkpoint_summary(path: Path) -> tuple[int, int]:
    """(parameters, bytes) of the safetensors files in ``path``, read from their headers."""
    params = size = 0
    for f in sorted(path.glob("*.safetensors")):
        size += f.stat().st_size
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, meta in header.items():
            if name != "__metadata__":
                n = 1
                for d in meta["shape"]:
                    n *= d
                params += n
    return params, size


# ---- the workers ---------------------------------------------------------------------------------------------


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # ru_maxrss: KiB on Linux


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS line in /proc/self/status (this benchmark measures memory on Linux only)")


def _prompts(vocab: int) -> tuple[list[int], list[list[int]]]:
    """The PREFILL_LEN-token prefill prompt and max(BATCHES) different DECODE_LEN-token decode prompts, seeded."""
    rng = random.Random(SEED)
    long = [rng.randrange(vocab) for _ in range(PREFILL_LEN)]
    short = [[rng.randrange(vocab) for _ in range(DECODE_LEN)] for _ in range(max(BATCHES))]
    return long, short


def _log(engine: str, msg: str) -> None:
    print(f"[{engine}] {msg}", file=sys.stderr, flush=True)


def worker_hf(model: str, new: int, repeat: int) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    base = _rss_mib()
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    loaded = _peak_rss_mib() - base
    long, short = _prompts(m.config.vocab_size)

    class StepTimes(LogitsProcessor):
        """Called once per generated token, right after that step's forward: the times of the steps."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def generate(prompts: list[list[int]], n: int) -> float:
        """Decode tok/s of one greedy ``generate``: the n - 1 steps after prefill's token."""
        ids = torch.tensor(prompts)
        steps = StepTimes()
        with torch.inference_mode():
            m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([steps]))
        if len(steps.times) != n:
            raise RuntimeError(f"transformers generate: {len(steps.times)} steps for {n} new tokens; the decode rate "
                               "needs one LogitsProcessor call per token")
        return len(prompts) * (n - 1) / (steps.times[-1] - steps.times[0])

    _log("hf", "warm-up")  # a short prompt: a first 2048-token call would cost as much as the measurement
    generate(short[:1], 4)
    generate(short, 4)
    _log("hf", f"prefill of {PREFILL_LEN} tokens (once)")
    with torch.inference_mode():
        t0 = time.perf_counter()
        m(torch.tensor([long]), use_cache=True, logits_to_keep=1)  # as generate's prefill: the last logits only
        prefill = PREFILL_LEN / (time.perf_counter() - t0)
    out = {"prefill_tps": prefill}
    for b in BATCHES:
        runs = []
        for r in range(repeat):
            _log("hf", f"decode batch {b}, run {r + 1}/{repeat}")
            runs.append(generate(short[:b], new))
        out[f"decode_tps_b{b}"] = statistics.median(runs)
        out[f"decode_runs_b{b}"] = runs
    out["model_mib"] = _peak_rss_mib() - base
    out["version"] = transformers.__version__
    out["detail"] = (f"peak after loading {loaded:.0f} MiB; experts={m.config._experts_implementation}, "
                     f"attention={m.config._attn_implementation}, delta rule and conv: torch reference")
    return out


def worker_dtorch(model: str, new: int, repeat: int) -> dict:
    import torch

    import dtorch
    from dtorch.engine.llm import LLM
    from dtorch.engine.sampling import SamplingParams

    base = _rss_mib()
    llm = LLM(model, dtype=torch.bfloat16, max_num_seqs=max(BATCHES))
    loaded = _peak_rss_mib() - base
    long, short = _prompts(llm.config.vocab_size)

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    _log("dtorch", "warm-up")
    llm.generate([short[0]], params(4))
    llm.generate(short, params(4))
    _log("dtorch", f"prefill of {PREFILL_LEN} tokens (once)")
    llm.generate([long], params(1))
    out = {"prefill_tps": llm.stats.prefill_tps}
    for b in BATCHES:
        runs = []
        for r in range(repeat):
            _log("dtorch", f"decode batch {b}, run {r + 1}/{repeat}")
            llm.generate(short[:b], params(new))
            if llm.stats.decode_tokens != b * (new - 1):
                raise RuntimeError(f"dtorch LLM.stats: {llm.stats.decode_tokens} decode tokens for batch {b} and "
                                   f"{new} new tokens, expected {b * (new - 1)} (all but the token prefill makes)")
            runs.append(llm.stats.decode_tps)
        out[f"decode_tps_b{b}"] = statistics.median(runs)
        out[f"decode_runs_b{b}"] = runs
    out["model_mib"] = _peak_rss_mib() - base
    out["version"] = dtorch.__version__
    out["detail"] = f"peak after loading {loaded:.0f} MiB; linear kernel: {llm.model.linear_provider()}"
    llm.close()
    return out


WORKERS = {"hf": worker_hf, "dtorch": worker_dtorch}


def run_worker(engine: str, args: argparse.Namespace) -> dict:
    """One engine's results from its own subprocess, or {"error": ...} when it failed."""
    cmd = [sys.executable, __file__, "--worker", engine, "--model", str(args.model), "--threads", str(args.threads),
           "--new", str(args.new), "--repeat", str(args.repeat)] + (["--smoke"] if args.smoke else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # stderr: the worker's progress, passed through
    _log(engine, f"done in {time.perf_counter() - t0:.0f} s")
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"worker exited with status {proc.returncode} and no result (its stderr is above)"}


# ---- the report ----------------------------------------------------------------------------------------------


def row_keys() -> list[tuple[str, str]]:
    """(label, result key) of each table row, for the sizes in use."""
    return [(f"prefill tok/s @{PREFILL_LEN}", "prefill_tps"),
            *((f"decode tok/s @ batch {b}", f"decode_tps_b{b}") for b in BATCHES),
            ("peak memory MiB (model cost)", "model_mib")]


def report(results: dict[str, dict]) -> str:
    head = ["", *(ENGINES[e] for e in results)]
    both = set(results) == set(ENGINES) and not any("error" in r for r in results.values())
    if both:
        head.append("dtorch / transformers")
    rows = []
    for label, key in row_keys():
        row: list[object] = [label]
        row += ["failed" if "error" in r else r[key] for r in results.values()]
        if both:
            row.append(results["dtorch"][key] / results["hf"][key])
        rows.append(row)
    lines = [table(head, rows)]
    for e, r in results.items():
        if "error" in r:
            info = f"FAILED: {r['error']}"
        else:
            spread = "; ".join(f"batch {b} runs " + " ".join(f"{x:.1f}" for x in r[f"decode_runs_b{b}"])
                               for b in BATCHES)
            info = f"{r['version']}, {r['detail']}; decode tok/s {spread}"
        lines.append(f"{ENGINES[e]}: {info}")
    if both:
        ratio = results["dtorch"]["decode_tps_b1"] / results["hf"]["decode_tps_b1"]
        verdict = "met" if ratio >= TARGET_DECODE_B1 else "not met"
        lines.append(f"target: decode @ batch 1 >= {TARGET_DECODE_B1:g}x transformers: {ratio:.2f}x, {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_DIR, help="the checkpoint folder (made when absent)")
    p.add_argument("--engines", default="hf,dtorch", help="comma-separated, from: hf, dtorch")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--new", type=int, default=32, help="new tokens per sequence in the decode runs")
    p.add_argument("--repeat", type=int, default=3, help="runs of each decode measurement (the median is shown)")
    p.add_argument("--smoke", action="store_true", help="a tiny checkpoint in a temporary folder, 1 short run (CI)")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        use_smoke_sizes()
        args.new, args.repeat = 4, 1
    if args.new < 2:
        p.error(f"--new must be >= 2 (the decode rate counts the tokens after the first), got {args.new}")
    if args.repeat < 1:
        p.error(f"--repeat must be >= 1, got {args.repeat}")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or set(engines) - set(ENGINES):
        p.error(f"--engines: expected a comma-separated subset of {', '.join(ENGINES)}, got {args.engines!r}")

    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        try:
            out = WORKERS[args.worker](str(args.model), args.new, args.repeat)
        except Exception as e:  # reported in the table's place, with the traceback on stderr
            traceback.print_exc()
            out = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
        print(json.dumps(out))
        sys.exit("error" in out)

    if args.smoke and args.model == DEFAULT_DIR:
        with tempfile.TemporaryDirectory() as tmp:
            args.model = Path(tmp) / "qwen3-next-smoke"
            compare(args, engines)
    else:
        compare(args, engines)


def compare(args: argparse.Namespace, engines: list[str]) -> None:
    """Make the checkpoint when absent, run each engine's worker and print the table."""
    if not args.model.exists():
        make_checkpoint(args.model)
    params, size = checkpoint_summary(args.model)
    import torch

    print(f"checkpoint {args.model}: {params / 1e6:.0f}M parameters, {size / 2**20:.0f} MiB (bfloat16); "
          f"hidden {CONFIG['hidden_size']}, {CONFIG['num_hidden_layers']} layers (3 of 4 linear attention), "
          f"{CONFIG['num_experts']} experts top-{CONFIG['num_experts_per_tok']}")
    print(f"torch {torch.__version__}, {args.threads} threads of {os.cpu_count()} cores; greedy, bfloat16; "
          f"prefill {PREFILL_LEN} tokens once; decode {DECODE_LEN}-token prompts + {args.new} new tokens, "
          f"median of {args.repeat}")
    load = os.getloadavg()[0]
    results = {e: run_worker(e, args) for e in ENGINES if e in engines}
    print(report(results))
    print(f"load average (1 min) {load:.1f} before, {os.getloadavg()[0]:.1f} after: on a shared machine, other "
          "processes slow both engines")
    failed = [e for e, r in results.items() if "error" in r]
    if args.smoke and failed:
        sys.exit(f"hybrid bench: the {', '.join(failed)} worker(s) failed (their stderr is above)")


if __name__ == "__main__":
    main()
