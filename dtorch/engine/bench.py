"""``dtorch bench``: prefill and decode speed of a model on the engine, as llama-bench measures them.

For each tensor-parallel size and thread count (``-tp``, ``-t``: the model is loaded for each pair), each batch size
``-b`` and each test, a warm-up run builds the step graphs, then ``-r`` timed runs give the median tokens per second:

- ``pp{P}`` (``-p P``): ``b`` random prompts of P tokens prefilled together (in steps of at most 512 tokens, as the
  engine chunks them), one token sampled each; tok/s = prompt tokens / the prefill steps' seconds;
- ``tg{N}`` (``-n N``): ``b`` one-token prompts, each then making N tokens (end-of-sequence ignored); tok/s = the
  tokens of the steps that computed no prompt token (N - 1 per sequence: the first comes with the prompt's step) /
  those steps' seconds.

The seconds are the engine's own step times (``Engine.stats``), so tokenization and Python around the engine are
left out, as llama-bench times its decode calls. Each row also shows the model's load (``LLM(...)``, seconds, and
whether its packed weights came from the pack cache: "hit", or "miss" / "stale" / "corrupt" when they were made, "off"
when the cache is off or nothing is packed) and the wall time of its test's warm-up run (the step graphs it builds).
Prefix caching is off, so a repeat prefills every token again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dtorch.core.dtypes import as_dtype, dtype_name
from dtorch.core.errors import ArgumentError
from dtorch.engine.options import add_model_arguments, at_least, check_device, slow_dtype, speculative_config

SEED = 0


def int_list(minimum: int):
    """An argparse ``type``: comma-separated ints >= ``minimum`` ("128,256"); the flag may also repeat."""

    one = at_least(minimum)

    def parse(text: str) -> list[int]:
        return [one(v.strip()) for v in text.split(",")]

    return parse


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``dtorch bench`` (llama-bench's letters; lists are comma-separated or repeated)."""
    add_model_arguments(parser, threads=False)
    parser.add_argument("--dequantize", action="store_true", help="as generate --dequantize: every weight in --dtype")
    parser.add_argument("-p", "--n-prompt", type=int_list(0), action="extend", default=None, metavar="P,..",
                        help="prompt lengths of the prefill tests (0: none; default: 512)")
    parser.add_argument("-n", "--n-gen", type=int_list(0), action="extend", default=None, metavar="N,..",
                        help="tokens each sequence decodes in the decode tests, at least 2 (0: none; default: 128)")
    parser.add_argument("-b", "--batch-size", type=int_list(1), action="extend", default=None, metavar="B,..",
                        help="sequences run together (default: 1)")
    parser.add_argument("-t", "--threads", type=int_list(1), action="extend", default=None, metavar="T,..",
                        help="intra-op CPU threads (default: DTORCH_THREADS, else torch's, one per physical core)")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int_list(1), action="extend", default=None,
                        metavar="N,..", help="devices of this process to split the model over (default: 1)")
    parser.add_argument("-r", "--repetitions", type=at_least(1), default=5, metavar="R",
                        help="timed runs of each test, after one warm-up run; the table shows their median")
    parser.add_argument("--json", action="store_true", help="print the results as a JSON list instead of a table")


def run_bench(args: argparse.Namespace) -> int:
    """Measure every combination; print the table (each row as it is measured) or the JSON list."""
    from dtorch.core import env

    check_device(args.device)
    dtype = as_dtype(args.dtype)
    slow = slow_dtype(args.device, dtype)
    if slow:
        print(f"dtorch: warning: {slow}", file=sys.stderr, flush=True)
    prompts = [p for p in args.n_prompt or [512] if p]
    gens = [n for n in args.n_gen or [128] if n]
    if any(n < 2 for n in prompts + gens):
        raise ArgumentError("-p/-n: a test's length is 0 (no such test) or at least 2 tokens")
    if not prompts and not gens:
        raise ArgumentError("bench: -p 0 and -n 0 leave no test to run")
    batches = args.batch_size or [1]
    threads = args.threads or [env.threads() or torch.get_num_threads()]
    sizes = args.tensor_parallel_size or [1]
    repeats = args.repetitions
    need = max([p + 1 for p in prompts] + [n + 1 for n in gens])  # positions a sequence takes at most
    rows: list[dict[str, Any]] = []
    for tp in sizes:
        for t in threads:
            started = time.perf_counter()
            llm = _load(args, dtype, tp, t, max(batches), need)
            loaded = time.perf_counter() - started  # the file's opening included
            try:
                for b in batches:
                    for test, length in [("pp", p) for p in prompts] + [("tg", n) for n in gens]:
                        row = _measure(llm, test, length, b, repeats)
                        row.update(threads=t, tp=tp, load_s=loaded)
                        rows.append(_describe(llm, row))
                        if not args.json:
                            _print_row(rows[-1], first=len(rows) == 1)
            finally:
                llm.close()
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


def _load(args: argparse.Namespace, dtype: torch.dtype, tp: int, threads: int, seqs: int, need: int) -> Any:
    """The model for one (tp, threads) pair, with a cache that holds ``seqs`` sequences of ``need`` tokens."""
    from dtorch.engine.info import kv_cache_bytes
    from dtorch.engine.llm import LLM
    from dtorch.models.kv_cache import cache_dtype
    from dtorch.models.loaders import open_checkpoint

    ckpt = open_checkpoint(args.model if args.model is not None else _default(), dtype)  # LLM takes it: one parse
    config = ckpt.config
    if need > config.max_position_embeddings:
        ckpt.close()
        raise ArgumentError(f"bench: -p/-n need {need} positions, more than the model's "
                            f"{config.max_position_embeddings}")
    need = min(-(-need // 16) * 16, config.max_position_embeddings)  # whole cache blocks for every sequence
    kv = kv_cache_bytes(config, dtype, need, kv_dtype=cache_dtype(args.kv_cache_dtype, dtype))[0] * seqs
    return LLM(ckpt, device=args.device, dtype=dtype, dequantize=args.dequantize, tensor_parallel_size=tp,
               threads=threads, max_num_seqs=seqs, max_model_len=need, enable_prefix_caching=False,
               kv_cache_memory_bytes=max(kv, 1), enforce_eager=args.enforce_eager,
               speculative_config=speculative_config(args), kv_cache_dtype=args.kv_cache_dtype)


def _default() -> str:
    from dtorch.models.default import default_model_path

    return str(default_model_path())


def _measure(llm: Any, test: str, length: int, batch: int, repeats: int) -> dict[str, Any]:
    """One warm-up run, then ``repeats`` timed runs of test ``test`` ("pp" or "tg") at ``length`` tokens."""
    from dtorch.engine.sampling import SamplingParams

    gen = torch.Generator().manual_seed(SEED)
    vocab = llm.config.vocab_size
    if test == "pp":
        params, prompt_len = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), length
    else:
        params, prompt_len = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True), 1
    tokens, seconds = [], []
    for run in range(repeats + 1):
        prompts = torch.randint(0, vocab, (batch, prompt_len), generator=gen).tolist()
        before = llm.engine.stats()
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        after = llm.engine.stats()
        if run == 0:  # the warm-up builds the step graphs
            warmup = time.perf_counter() - t0
            continue
        if test == "pp":
            tokens.append(after.prompt_tokens - before.prompt_tokens)
            seconds.append(after.prefill_seconds - before.prefill_seconds)
        else:
            tokens.append(after.decode_tokens - before.decode_tokens)
            seconds.append(after.decode_seconds - before.decode_seconds)
    tps = [n / s if s > 0 else 0.0 for n, s in zip(tokens, seconds, strict=True)]
    return {"test": f"{test}{length}", "n_prompt": length if test == "pp" else 0,
            "n_gen": length if test == "tg" else 0, "batch": batch, "tokens": tokens, "seconds": seconds,
            "tps": tps, "tps_median": statistics.median(tps), "warmup_s": warmup}


def _describe(llm: Any, row: dict[str, Any]) -> dict[str, Any]:
    from dtorch.engine.info import weight_formats

    formats = weight_formats(llm.model)
    return {"model": Path(llm.source).name, "formats": list(formats),
            "weight_bytes": sum(f["bytes"] for f in formats.values()),
            "params": sum(f["params"] for f in formats.values()), "device": llm.device.type,
            "dtype": dtype_name(llm.model.dtype),
            "pack_cache": llm.pack_cache.status if llm.pack_cache is not None else "off"} | row


COLUMNS = ("model", "size", "params", "device", "dtype", "threads", "tp", "batch", "test", "t/s (median)",
           "min - max", "load s", "warm-up s")


def _cells(r: dict[str, Any]) -> list[str]:
    from dtorch.engine.info import mib, params_text

    return [r["model"], mib(r["weight_bytes"]), params_text(r["params"]), r["device"], r["dtype"],
            str(r["threads"]), str(r["tp"]), str(r["batch"]), r["test"], f"{r['tps_median']:.2f}",
            f"{min(r['tps']):.2f} - {max(r['tps']):.2f}", f"{r['load_s']:.2f} ({r['pack_cache']})",
            f"{r['warmup_s']:.2f}"]


def _print_row(r: dict[str, Any], first: bool) -> None:
    """A Markdown table row (the header before the first), printed as soon as it is measured."""
    if first:
        print("| " + " | ".join(COLUMNS) + " |")
        print("|" + "|".join("---:" if c in ("threads", "tp", "batch", "t/s (median)", "warm-up s") else "---"
                             for c in COLUMNS)
              + "|")
    print("| " + " | ".join(_cells(r)) + " |", flush=True)
