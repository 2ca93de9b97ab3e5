"""Decode on one GPU: dtorch captured and eager against transformers, on a random Qwen3-0.6B-shaped checkpoint.

    python bench/gpu_decode.py [--tokens 128] [--batches 1 32] [--repeats 3] [--dry-run] [--out DIR]

One run writes a random bfloat16 checkpoint with Qwen3-0.6B's shapes (28 layers, hidden 1024, 16 query and 8 KV
heads of 128, MLP 3072, vocabulary 151936, tied embeddings), loads it into transformers (eager: no torch.compile,
its default SDPA attention) and into dtorch twice (``LLM(enforce_eager=True)`` and captured), and prints per batch
size the decode tok/s of each (median of ``--repeats``; decode = the time of ``tokens`` new tokens minus the time of
one, so the prompt's prefill is left out), the ratios the issue's targets name, the peak GPU memory of each engine,
and the host syncs counted in one decode step (``torch.cuda.set_sync_debug_mode``) of each dtorch mode.

``--dry-run`` does all of it on the CPU with a tiny Qwen3 (no syncs counted, no GPU memory, nothing captured), so a
broken line fails CI and not the GPU's minutes; ``--out DIR`` also writes the table to ``DIR/gpu_decode.txt``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
TINY = QWEN3_0_6B | dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
PROMPT = 16
DEV = "cuda"  # "cpu" in the dry run


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def write_checkpoint(path: Path, shapes: dict) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**shapes)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    hf.save_pretrained(path)


def prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(3, 1000, (batch, PROMPT), generator=g).tolist()


def timed(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def decode_tps(run, batch: int, tokens: int, repeats: int) -> float:
    """batch * (tokens - 1) new tokens over (time of ``tokens`` - time of one): decode only, median of repeats."""
    run(batch, 2)  # warm-up: kernels compiled, graphs captured
    run(batch, tokens)
    rates = []
    for _ in range(repeats):
        full, one = timed(lambda: run(batch, tokens)), timed(lambda: run(batch, 1))
        rates.append(batch * (tokens - 1) / (full - one) if full > one else float("nan"))  # nan: lost in the noise
    return statistics.median(rates)


def transformers_engine(path: Path):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEV).eval()

    @torch.no_grad()
    def run(batch: int, tokens: int) -> None:
        ids = torch.tensor(prompts(batch), device=DEV)
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                    do_sample=False, pad_token_id=0)
    return hf, run


def dtorch_engine(path: Path, eager: bool, max_batch: int):
    from dtorch import LLM, SamplingParams

    llm = LLM(str(path), device=DEV, dtype=torch.bfloat16, max_num_seqs=max_batch,
              max_model_len=1024 if DEV == "cuda" else 256,  # the dry run's Qwen3 has 256 positions
              enforce_eager=eager, max_num_batched_tokens=max(512, max_batch * PROMPT))

    def run(batch: int, tokens: int) -> None:
        llm.generate(prompts(batch), SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    return llm, run


def count_syncs(llm, batch: int) -> int:
    """Host syncs that torch reports in one decode step of the model (``Executor.step``; sampling reads the tokens
    once per step after it, by design), at batch ``batch``; -1 on the CPU (torch counts only CUDA syncs)."""
    from dtorch import SamplingParams

    ex = llm.executor
    step, counts = ex.step, []

    def counted(plan, all_logits=False, **kw):
        if DEV != "cuda" or not all(c == 1 for c in plan.counts):
            return step(plan, all_logits, **kw)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = step(plan, all_logits, **kw)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in seen))
        return out
    ex.step = counted
    try:
        llm.generate(prompts(batch), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    finally:
        ex.step = step
    return max(counts) if counts else -1


def measure(path: Path, tokens: int, batches: list[int], repeats: int) -> tuple[list[tuple], dict]:
    results: dict[str, dict[int, float]] = {}
    memory: dict[str, float] = {}
    syncs: dict[str, int] = {}
    report: dict[str, dict] = {}
    for name in ("transformers", "dtorch eager", "dtorch captured"):
        gc.collect()
        if DEV == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if name == "transformers":
            engine, run = transformers_engine(path)
        else:
            engine, run = dtorch_engine(path, name == "dtorch eager", max(batches))
        results[name] = {b: decode_tps(run, b, tokens, repeats) for b in batches}
        print(f"{name}: " + ", ".join(f"batch {b} {r:.1f} tok/s" for b, r in results[name].items()), flush=True)
        memory[name] = torch.cuda.max_memory_allocated() / 2**20 if DEV == "cuda" else float("nan")
        if name != "transformers":
            syncs[name] = count_syncs(engine, batches[0])
            report[name] = engine.capture_report()
            engine.close()
        del engine, run
    rows = []
    for b in batches:
        hf, eager, cap = (results[n][b] for n in ("transformers", "dtorch eager", "dtorch captured"))
        rows.append((b, hf, eager, cap, cap / hf, cap / eager))
    return rows, {"memory": memory, "syncs": syncs, "capture": report}


def main(argv: list[str] | None = None) -> int:
    global DEV
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true", help="on the CPU: a tiny Qwen3, 4 tokens, batch 2")
    ap.add_argument("--out", type=Path, help="also write the table to OUT/gpu_decode.txt")
    args = ap.parse_args(argv)
    if args.dry_run:
        DEV, shapes, args.tokens, args.batches, args.repeats, what = "cpu", TINY, 4, [2], 1, "tiny Qwen3 (dry run)"
    else:
        shapes, what = QWEN3_0_6B, "Qwen3-0.6B shapes"
        if not torch.cuda.is_available():
            print("gpu_decode: no CUDA device; nothing to measure here (--dry-run runs it on the CPU)")
            return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_checkpoint(path, shapes)
        rows, info = measure(path, args.tokens, args.batches, args.repeats)
    where = torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu"
    lines = [f"decode tok/s, {what}, bfloat16, {where}, {args.tokens} new tokens, median of {args.repeats}",
             f"{'batch':>5} {'transformers':>13} {'dtorch eager':>13} {'dtorch captured':>16} {'capt/hf':>8} "
             f"{'capt/eager':>10}"]
    for b, hf, eager, cap, r1, r2 in rows:
        lines.append(f"{b:>5} {hf:>13.1f} {eager:>13.1f} {cap:>16.1f} {r1:>8.2f} {r2:>10.2f}")
    lines.append("peak GPU memory (MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in info["memory"].items()))
    lines.append("host syncs in one decode step: " + ", ".join(f"{k} {v}" for k, v in info["syncs"].items()))
    for name, rep in info["capture"].items():
        lines.append(f"{name} capture: " + "; ".join(f"{k}: {v}" for k, v in rep.items()))
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_decode.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
