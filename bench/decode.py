"""Prefill and decode speed of dtorch against transformers on the same model, side by side in one run.

    python bench/decode.py [--model PATH.gguf] [--threads N] [--runs 3]

Each engine runs in its own subprocess (same torch, same thread count) so that its peak memory is its
own: transformers float32, dtorch float32, dtorch bfloat16. Per engine, batch 1, greedy:
prefill tokens/s of a 512-token prompt and decode tokens/s of 128 new tokens after a 128-token
prompt; the median of ``--runs`` runs after one warm-up. The memory floor of decode is the bytes of
weights one token reads divided by this machine's read bandwidth (measured here with a large
reduction); "x floor" is the measured time per token over that floor (1.0 would be perfect).
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

import torch

PREFILL_LEN, DECODE_PROMPT, DECODE_NEW = 512, 128, 128


def _prompt(n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _read_bandwidth() -> float:
    """Bytes per second of summing a 512 MiB float32 tensor (median of 5), with torch's threads."""
    x = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times)


def _worker_dtorch(model: str, dtype: str, runs: int) -> dict:
    from dtorch.models.llm import LLM
    from dtorch.models.sampling import SamplingParams

    base = _rss_mib()
    llm = LLM(model, dtype=dtype)
    vocab = llm.config.vocab_size
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=DECODE_NEW, ignore_eos=True)
    prefill, decode = [], []
    for r in range(runs + 1):
        llm.generate([_prompt(PREFILL_LEN, vocab)], one)
        p = llm.stats.prefill_tps
        llm.generate([_prompt(DECODE_PROMPT, vocab)], many)
        if r:  # the first run warms up
            prefill.append(p)
            decode.append(llm.stats.decode_tps)
    return {"prefill": statistics.median(prefill), "decode": statistics.median(decode),
            "weight_bytes": llm.model.weight_bytes(), "peak_mib": _rss_mib(), "model_mib": _rss_mib() - base,
            "mm_provider": llm.model.layers[0].qkv.mm.provider}


def _worker_hf(model: str, runs: int) -> dict:
    import logging

    import transformers

    logging.disable(logging.WARNING)
    transformers.logging.set_verbosity_error()
    base = _rss_mib()
    hf = load_transformers_gguf(model)
    vocab = hf.config.vocab_size
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def timed(ids: list[int], new: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, **kw)
        assert out.shape[1] == len(ids) + new
        return time.perf_counter() - t

    prefill, decode = [], []
    for r in range(runs + 1):
        t_prefill = timed(_prompt(PREFILL_LEN, vocab), 1)
        short = _prompt(DECODE_PROMPT, vocab)
        t_first = timed(short, 1)
        t_all = timed(short, DECODE_NEW)
        if r:
            prefill.append(PREFILL_LEN / t_prefill)
            decode.append((DECODE_NEW - 1) / (t_all - t_first))
    return {"prefill": statistics.median(prefill), "decode": statistics.median(decode), "peak_mib": _rss_mib(),
            "model_mib": _rss_mib() - base}


def load_transformers_gguf(path: str):
    """transformers' model of a GGUF file, float32, with the weights its own GGUF reader dequantizes.

    ``from_pretrained(..., gguf_file=)`` needs ``accelerate``; its tensor reader does not.
    """
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = transformers.AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    with torch.device("meta"):
        meta_model = transformers.AutoModelForCausalLM.from_config(cfg)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=meta_model)["tensors"]
    hf = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    missing, _ = hf.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    assert not [m for m in missing if m != "lm_head.weight"], missing
    hf.tie_weights()
    return hf.eval()


def _run_worker(kind: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--model", args.model, "--threads", str(args.threads),
           "--runs", str(args.runs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"worker {kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from dtorch.models.default import default_model_path
        args.model = str(default_model_path())
    if args.worker:
        res = _worker_hf(args.model, args.runs) if args.worker == "hf" else \
            _worker_dtorch(args.model, args.worker.split(":")[1], args.runs)
        print(json.dumps(res))
        return

    print(f"model {os.path.basename(args.model)}, {args.threads} threads, median of {args.runs} runs "
          f"(after a warm-up); prefill {PREFILL_LEN} tokens, decode {DECODE_NEW} after {DECODE_PROMPT}")
    bw = _read_bandwidth()
    hf = _run_worker("hf", args)
    rows = [("transformers float32", hf, None)]
    for dt in ("float32", "bfloat16"):
        r = _run_worker(f"dtorch:{dt}", args)
        floor_s = r["weight_bytes"] / bw
        rows.append((f"dtorch {dt}", r, floor_s))
    head = f"{'engine':<22}{'prefill tok/s':>14}{'x hf':>7}{'decode tok/s':>14}{'x hf':>7}{'floor tok/s':>13}" \
           f"{'x floor':>9}{'peak RSS MiB':>14}{'model MiB':>11}"
    print(f"read bandwidth {bw / 1e9:.1f} GB/s")
    print(head)
    print("-" * len(head))
    for name, r, floor_s in rows:
        floor = f"{1 / floor_s:>13.1f}{(1 / r['decode']) / floor_s:>9.2f}" if floor_s else f"{'':>13}{'':>9}"
        print(f"{name:<22}{r['prefill']:>14.1f}{r['prefill'] / hf['prefill']:>7.2f}{r['decode']:>14.1f}"
              f"{r['decode'] / hf['decode']:>7.2f}{floor}{r['peak_mib']:>14.0f}{r['model_mib']:>11.0f}")
    print("matmul.mm providers bound: " + ", ".join(f"{name}: {r['mm_provider']}" for name, r, _ in rows[1:]))
    print("x hf: dtorch / transformers (targets: decode >= 3, prefill >= 1.5); x floor: time per decoded token over "
          "weight bytes / read bandwidth (target <= 1.5). The machine may be shared: numbers are noisy.")


if __name__ == "__main__":
    main()
