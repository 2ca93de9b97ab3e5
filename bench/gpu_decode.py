"""Decode on one GPU: dtorch captured and eager against transformers, on a random Qwen3-0.6B-shaped checkpoint.

    python bench/gpu_decode.py [--tokens 128] [--batches 1 32] [--repeats 3]

One run writes a random bfloat16 checkpoint with Qwen3-0.6B's shapes (28 layers, hidden 1024, 16 query and 8 KV
heads of 128, MLP 3072, vocabulary 151936, tied embeddings), loads it into transformers (eager: no torch.compile,
its default SDPA attention) and into dtorch twice (``LLM(enforce_eager=True)`` and captured), and prints per batch
size the decode tok/s of each (median of ``--repeats``; decode = the time of ``tokens`` new tokens minus the time of
one, so the prompt's prefill is left out), the ratios the issue's targets name, the peak GPU memory of each engine,
and the host syncs counted in one decode step (``torch.cuda.set_sync_debug_mode``) of each dtorch mode.
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
PROMPT = 16


def write_checkpoint(path: Path) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**QWEN3_0_6B)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    hf.save_pretrained(path)


def prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(3, 1000, (batch, PROMPT), generator=g).tolist()


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def decode_tps(run, batch: int, tokens: int, repeats: int) -> float:
    """batch * (tokens - 1) new tokens over (time of ``tokens`` - time of one): decode only, median of repeats."""
    run(batch, 2)  # warm-up: kernels compiled, graphs captured
    run(batch, tokens)
    rates = []
    for _ in range(repeats):
        full, one = timed(lambda: run(batch, tokens)), timed(lambda: run(batch, 1))
        rates.append(batch * (tokens - 1) / max(full - one, 1e-9))
    return statistics.median(rates)


def transformers_engine(path: Path):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()

    @torch.no_grad()
    def run(batch: int, tokens: int) -> None:
        ids = torch.tensor(prompts(batch), device="cuda")
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                    do_sample=False, pad_token_id=0)
    return hf, run


def dtorch_engine(path: Path, eager: bool, max_batch: int):
    from dtorch import LLM, SamplingParams

    llm = LLM(str(path), device="cuda", dtype=torch.bfloat16, max_num_seqs=max_batch, max_model_len=1024,
              enforce_eager=eager, max_num_batched_tokens=max(512, max_batch * PROMPT))

    def run(batch: int, tokens: int) -> None:
        llm.generate(prompts(batch), SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    return llm, run


def count_syncs(llm, batch: int) -> int:
    """Host syncs that torch reports in one decode step of the model (``Executor.step``; sampling reads the tokens
    once per step after it, by design), at batch ``batch``."""
    from dtorch import SamplingParams

    ex = llm.executor
    step, counts = ex.step, []

    def counted(plan, all_logits=False):
        if not all(c == 1 for c in plan.counts):
            return step(plan, all_logits)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = step(plan, all_logits)
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
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        if name == "transformers":
            engine, run = transformers_engine(path)
        else:
            engine, run = dtorch_engine(path, name == "dtorch eager", max(batches))
        results[name] = {b: decode_tps(run, b, tokens, repeats) for b in batches}
        memory[name] = torch.cuda.max_memory_allocated() / 2**20
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_decode: no CUDA device; nothing to measure here")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_checkpoint(path)
        rows, info = measure(path, args.tokens, args.batches, args.repeats)
    print(f"decode tok/s, Qwen3-0.6B shapes, bfloat16, {torch.cuda.get_device_name(0)}, {args.tokens} new tokens, "
          f"median of {args.repeats}")
    print(f"{'batch':>5} {'transformers':>13} {'dtorch eager':>13} {'dtorch captured':>16} {'capt/hf':>8} "
          f"{'capt/eager':>10}")
    for b, hf, eager, cap, r1, r2 in rows:
        print(f"{b:>5} {hf:>13.1f} {eager:>13.1f} {cap:>16.1f} {r1:>8.2f} {r2:>10.2f}")
    print("peak GPU memory (MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in info["memory"].items()))
    print("host syncs in one decode step: " + ", ".join(f"{k} {v}" for k, v in info["syncs"].items()))
    for name, rep in info["capture"].items():
        print(f"{name} capture: " + "; ".join(f"{k}: {v}" for k, v in rep.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
