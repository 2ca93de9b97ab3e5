"""Where a model's memory goes: RSS at each phase of ``dtorch.LLM(...)`` and a 64-token generation, and what holds it.

    python bench/memory.py [--model PATH.gguf] [--prompt 128] [--new 64] [--max-model-len N] [--json] [--smoke]

"model MiB" is peak RSS (VmHWM) minus the RSS right after the imports, as ``bench/decode.py`` and issue #21 count it.
The phases are measured by wrapping the loader, the KV cache and the executor's runner factory (this script only);
the table of holders comes from the objects themselves: weights by layout (packed, 16-bit, float copies), the RoPE
table, the KV cache (reserved and resident: its blocks are touched only as sequences fill them), each bucket's step
buffers, and what nothing in dtorch accounts for (the tokenizer, torch's and the allocator's own).
``--smoke`` (what CI runs): the default model, a 16-token prompt and 8 new tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def _status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _resident(t) -> int:
    """Bytes of tensor ``t``'s storage that are resident (mincore over its pages); CPU tensors only."""
    import ctypes
    import ctypes.util

    if t.device.type != "cpu" or t.numel() == 0:
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    start = t.untyped_storage().data_ptr()
    nbytes = t.untyped_storage().nbytes()
    lo, hi = start // PAGE * PAGE, -(-(start + nbytes) // PAGE) * PAGE
    pages = (hi - lo) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) != 0:
        return nbytes
    return sum(v & 1 for v in vec) * PAGE


def _mib(n: float) -> str:
    return f"{n / 2**20:8.1f}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the bundled SmolLM2 Q4_1)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--new", type=int, default=64, help="generated tokens")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--seqs", type=int, default=1, help="sequences generated together (prompts of varied lengths)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON too")
    ap.add_argument("--smoke", action="store_true", help="a 16-token prompt, 8 new tokens (CI)")
    ap.add_argument("--tied-gemma3-270m", action="store_true",
                    help="a Gemma 3 270M-shaped float32 Hugging Face checkpoint with a tied head (random weights, "
                         "written by transformers into --cache once) instead of --model")
    ap.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "dtorch", "bench-hf"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompt, args.new = 16, 8
    if args.tied_gemma3_270m:
        args.model = str(_tied_gemma3(args.cache))

    import torch

    import dtorch  # noqa: F401
    from dtorch.core.memory import MemoryKind, memory
    from dtorch.engine import llm as llm_module
    from dtorch.engine.sampling import SamplingParams
    from dtorch.models import executor as executor_module, kv_cache as kv_module, model as model_module

    torch.set_num_threads(args.threads)
    base = _status()
    phases: list[tuple[str, dict[str, int]]] = [("imports", base)]

    def probe(owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def wrapped(*a, **k):
            out = fn(*a, **k)
            if not any(p == label for p, _ in phases):
                phases.append((label, _status()))
            return out
        setattr(owner, name, wrapped)

    probe(llm_module, "open_checkpoint", "checkpoint opened (tokenizer, metadata)")
    probe(model_module.Transformer, "load", "weights loaded")
    probe(kv_module.KVCache, "__init__", "KV cache reserved")
    probe(executor_module.Executor, "runner", "first step graph built")

    t0 = time.perf_counter()
    llm = llm_module.LLM(args.model, max_model_len=args.max_model_len)
    phases.append(("LLM(...) returned", _status()))
    rng = random.Random(0)
    lengths = [args.prompt] + [rng.randrange(8, 2 * args.prompt) for _ in range(args.seqs - 1)]
    prompts = [[rng.randrange(100, llm.config.vocab_size - 100) for _ in range(n)] for n in lengths]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True))
    phases.append((f"generated {args.new} tokens" + (f" x {args.seqs}" if args.seqs > 1 else ""), _status()))
    seconds = time.perf_counter() - t0

    # -- what holds it
    holders: list[tuple[str, int, int]] = []  # (what, bytes reserved, bytes resident)
    by_layout: dict[str, list[int]] = {}
    seen: set[int] = set()
    for w in llm.model.weights.values():
        for b in w.blobs.values():
            if id(b.tensor) in seen:
                continue
            seen.add(id(b.tensor))
            t = b.tensor
            key = w.layout if w.layout != "strided" else f"float {str(t.dtype)[6:]}"
            acc = by_layout.setdefault(key, [0, 0, 0])
            acc[0] += t.numel() * t.element_size()
            acc[1] += _resident(t)
            acc[2] += 1
    for key, (n, res, count) in sorted(by_layout.items()):
        holders.append((f"weights {key} ({count} tensors)", n, res))
    for label, rope in (("RoPE table", llm.model.rope_table),  # (Gemma 3: a second one for its sliding layers)
                        ("RoPE table, sliding layers", getattr(llm.model, "rope_local_table", None))):
        if rope is not None:
            holders.append((f"{label} {list(rope.shape)}", rope.numel() * rope.element_size(), _resident(rope)))
    cache = llm.cache
    kv = [b.tensor for t in cache.tensors.values() for b in t.blobs.values()]
    holders.append((f"KV cache ({cache.num_blocks} blocks of {cache.block_size}, max_len {cache.max_len})",
                    cache.nbytes, sum(_resident(t) for t in kv)))
    runners = llm.executor.runners
    shared = getattr(llm.executor, "buffers", None)  # SharedBuffers per device: every bucket carves from them
    if shared is not None:
        slabs = [t for b in shared.values() for t in b.slabs]
        reserved, resident = sum(t.numel() for t in slabs), sum(_resident(t) for t in slabs)
    else:  # each bucket its own buffers
        reserved = resident = sum(r.buffer_bytes for r in runners.values())
    holders.append((f"step buffers ({len(runners)} buckets: "
                    f"{', '.join(sorted(f'{b.tokens}x{b.seqs}' for b in runners))})", reserved, resident))
    live = {k.value: memory.live_bytes(k) for k in MemoryKind}
    end = phases[-1][1]
    peak = end["VmHWM"] - base["VmRSS"]
    accounted = sum(res for _, _, res in holders)
    holders.append(("not held by these (tokenizer, torch, allocator slack, file pages)", 0,
                    end["VmRSS"] - base["VmRSS"] - accounted))

    print(f"model: {llm.source}\nthreads {args.threads}, prompt {args.prompt}, new {args.new}, seqs {args.seqs}, "
          f"max_model_len {llm.max_len}, {seconds:.1f} s\n")
    print(f"{'phase':<44} {'RSS MiB':>8} {'+ base':>8} {'peak':>8} {'anon':>8} {'file':>8}")
    for label, s in phases:
        print(f"{label:<44} {_mib(s['VmRSS'])} {_mib(s['VmRSS'] - base['VmRSS'])} "
              f"{_mib(s['VmHWM'] - base['VmRSS'])} {_mib(s['RssAnon'])} {_mib(s['RssFile'])}")
    print(f"\nmodel MiB (peak RSS - RSS after imports): {peak / 2**20:.1f}\n")
    weights = sum(n for what, n, _ in holders if what.startswith("weights "))
    loaded = next(st for label, st in phases if label == "LLM(...) returned")
    held, top = loaded["VmRSS"] - base["VmRSS"], loaded["VmHWM"] - base["VmRSS"]
    print(f"weights {weights / 2**20:.1f} MiB; after the load the process holds {held / 2**20:.1f} MiB above its "
          f"imports = {held / weights:.3f}x the weights, its peak during the load {top / weights:.3f}x\n")
    print(f"{'held by':<80} {'reserved':>8} {'resident':>8}")
    for what, n, res in holders:
        print(f"{what[:80]:<80} {_mib(n)} {_mib(res)}")
    print("\ndtorch's accounting (dtorch.core.memory), live MiB: " +
          ", ".join(f"{k} {v / 2**20:.1f}" for k, v in live.items()))
    result = {"model_mib": peak / 2**20, "phases": {k: v for k, v in phases},
              "holders": {w: {"reserved": n, "resident": r} for w, n, r in holders}}
    if args.json:
        print(json.dumps(result, indent=1))
    llm.close()
    return result


GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                   sliding_window=512, query_pre_attn_scalar=256, tie_word_embeddings=True)  # google/gemma-3-270m


def _tied_gemma3(cache: str) -> str:
    """A Gemma 3 270M-shaped float32 checkpoint (random weights, tie_word_embeddings) written by transformers, made
    once into ``cache``."""
    path = os.path.join(cache, "gemma3-270m-f32-tied")
    if not os.path.exists(os.path.join(path, "config.json")):
        import torch
        import transformers

        torch.manual_seed(0)
        config = transformers.Gemma3TextConfig(**GEMMA3_270M)
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        hf.save_pretrained(path + ".part")
        os.replace(path + ".part", path)
        del hf
    return path


if __name__ == "__main__":
    main(sys.argv[1:])
