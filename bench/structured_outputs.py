"""The cost of a constrained row: decode steps of the default model with and without a JSON schema, side by side.

For each batch size, three runs of the same prompts: every row unconstrained, every row under a JSON schema, and a
mixed batch (half and half). A decode step's time is the engine's decode seconds over its decode steps; the mask
time is what ``Grammars.masks`` takes per constrained row (llguidance filling the bitmask, then unpacking it), the
sampling time what the sampler takes per step (the masking is in it). Each number is the median of ``--repeats``
runs; "cost/row" is a constrained row's mask time and share of the extra sampling time over the unconstrained
decode step, which does not depend on how busy the machine was between two runs.

    python bench/structured_outputs.py                 # batch 1 and 8, 64 tokens, 5 repeats
    python bench/structured_outputs.py --batch 1 4 16 --tokens 96
    python bench/structured_outputs.py --smoke         # CI: batch 1 and 2, 8 tokens, 1 repeat, 1 thread, no warm-up
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dtorch
from dtorch.engine import sampling
from dtorch.engine.structured import StructuredOutputsParams

# long enough never to finish within the tokens asked for: a list of records with strings, numbers, enums
SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "role": {"enum": ["admin", "user", "guest"]}, "active": {"type": "boolean"}},
    "required": ["name", "age", "role", "active"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False}


class Timer:
    """Wraps a function and adds up the seconds spent in it and how many rows it handled."""

    def __init__(self, fn, rows) -> None:
        self.fn, self.rows, self.seconds, self.count = fn, rows, 0.0, 0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.seconds += time.perf_counter() - t0
        self.count += self.rows(*args, **kwargs)
        return out


def run(llm, prompts, constrained: list[bool], tokens: int) -> dict[str, float]:
    """One generate of the prompts; ms per decode step, ms of mask per constrained row, ms of sampling per step."""
    so = StructuredOutputsParams(json=SCHEMA)
    params = [dtorch.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                                    structured_outputs=so if c else None) for c in constrained]
    g = llm.engine.grammars
    masks = g.masks = Timer(type(g).masks.__get__(g), lambda matchers: len(matchers))
    step = sampling.sample_step
    sample = Timer(step, lambda *a, **k: 1)
    llm.engine.__class__._accept.__globals__["sample_step"] = sample  # the engine's own reference
    try:
        before = llm.engine.stats()
        outs = llm.generate(prompts, params)
        after = llm.engine.stats()
    finally:
        llm.engine.__class__._accept.__globals__["sample_step"] = step
        del g.masks
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs), "a row ended early: raise minItems"
    steps = (after.decode_tokens - before.decode_tokens) / len(prompts)
    return {"step": 1e3 * (after.decode_seconds - before.decode_seconds) / steps,
            "mask": 1e3 * masks.seconds / masks.count if masks.count else 0.0,
            "sample": 1e3 * sample.seconds / sample.count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--smoke", action="store_true", help="batch 1 and 2, 8 tokens, 1 repeat, no warm-up (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.tokens, args.repeats, args.threads = [1, 2], 8, 1, 1
    llm = dtorch.LLM(threads=args.threads, max_num_seqs=max(args.batch))
    if not args.smoke:  # every step shape built before the timings (the smoke's figures mean nothing anyway)
        llm.engine.warmup()
    prompt = llm.chat_prompt([{"role": "user", "content": "List the staff records as JSON."}])
    run(llm, [prompt], [True], 8)  # compile the grammar once, outside the timings
    print(f"default model, {args.tokens} decode tokens per row, median of {args.repeats} runs (each repeat runs the "
          f"batch's variants one after another), {torch.get_num_threads()} threads\n")
    head = ("batch", "rows masked", "step ms", "mask ms/row", "sampling ms/step", "cost/row", "step vs none")
    print("  ".join(f"{h:>16}" for h in head))
    for b in args.batch:
        variants = (0, b // 2, b) if b > 1 else (0, 1)
        results: dict[int, list[dict[str, float]]] = {m: [] for m in variants}
        for _ in range(args.repeats):  # interleaved, so a change in the machine's load falls on every variant
            for masked in variants:
                results[masked].append(run(llm, [prompt] * b, [i < masked for i in range(b)], args.tokens))
        med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
        base = med[0]
        for masked in variants:
            m = med[masked]
            # what one constrained row adds to a step: its mask, and its share of the sampler's extra work
            cost = m["mask"] + (m["sample"] - base["sample"]) / masked if masked else 0.0
            cells = (b, masked, f"{m['step']:.2f}", f"{m['mask']:.3f}" if masked else "-", f"{m['sample']:.3f}",
                     f"{100 * cost / base['step']:.1f}%" if masked else "-",
                     f"{100 * (m['step'] / base['step'] - 1):+.1f}%")
            print("  ".join(f"{c:>16}" for c in cells), flush=True)
    print("\ncost/row: a constrained row's mask time plus its share of the extra sampling time, over the "
          "unconstrained decode step; step vs none: the whole step against the unconstrained batch's")


if __name__ == "__main__":
    main()
