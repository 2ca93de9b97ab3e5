"""Where a decode step of a real model goes, component by component (``step_overhead.py --profile``).

One sequence decodes after a 128-token prompt; each component is timed on its own, round-robin, medians:
- the step's kernels, each timed around its call, summed by kind: the weight products of the layers, the head (the
  product whose rows are the vocabulary), attention at one row (with the cache write), and the rest (norms, RoPE,
  activations, adds, the embedding);
- "kernel loop": the bare loop over the step's kernels less their own times (the Python between two kernels);
- "Runner.run": its run less the bare loop (feeds copied into their buffers, the logits copied out);
- "Executor.step": its step less Runner.run (the step's inputs built on the host);
- sampling: ``sample_step`` on the step's logits, greedy and sampled (temperature 0.8, top-k 40, top-p 0.95), the
  sampled one beside the reference it replaced (the full-vocabulary sort and torch.multinomial, in this file); then
  each of ``SETTINGS`` on the logits sharpened ``SHARPEN`` times (a random-weight model's logits are nearly flat, a
  trained one's nucleus is a few to a few thousand tokens), penalties over a 64-token output and the prompt;
- detokenizing: one token pushed into a sequence's stream decoder;
- "engine": ``LLM.generate`` per token less all of the above (scheduling, stop checks, deltas, sinks).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict

import torch

PROMPT = 128
KINDS = ("products (layers)", "head", "attention", "norms, rope, elementwise")
SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.95)
SHARPEN = 6.0
SETTINGS = {  # label -> SamplingParams fields, timed on the sharpened logits
    "T 0.8, top-k 40, top-p 0.95": SAMPLED,
    "T 0.8, top-p 0.95 (no top-k)": dict(temperature=0.8, top_p=0.95),
    "T 1.0, top-p 0.95 (no top-k)": dict(temperature=1.0, top_p=0.95),
    "T 1.0, min-p 0.05": dict(temperature=1.0, min_p=0.05),
    "T 0.8 alone": dict(temperature=0.8),
    "T 0.8, top-k 40, top-p 0.95, repetition 1.1, frequency 0.5, presence 0.5, logit_bias of 3":
        dict(SAMPLED, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5,
             logit_bias={11: 2.0, 12: -100.0, 13: 5.0}),
}


def kind(k, vocab: int) -> str:
    """The component a step kernel belongs to."""
    op = k.operator.op
    if op.startswith("matmul") or "linear" in op:
        outs = k.operator.outputs
        return "head" if outs and outs[0].shape[-1] == vocab else "products (layers)"
    if "attention" in op or op == "llm.reshape_and_cache":
        return "attention"
    return "norms, rope, elementwise"


def one_row_weights(llm) -> list[tuple[tuple, torch.Tensor]]:
    """Each GGUF-quantized 2-D weight of ``llm`` once, in the model's order: ((kind, layout, N, K), packed tensor),
    the kind being the weight's name without its layer number (what the products tables group by)."""
    import re

    seen, order = set(), []
    for name, w in llm.model.weights.items():
        if id(w) in seen or len(w.shape) != 2 or not str(w.layout).startswith("gguf."):
            continue
        seen.add(id(w))
        n, k = (int(d) for d in w.shape)
        order.append(((re.sub(r"(^|\.)\d+\.", r"\1", name), w.layout, n, k), next(iter(w.blobs.values())).tensor))
    return order


def reference_sample(logits: torch.Tensor, params, generator: torch.Generator) -> int:
    """The sampled draw as it was before ``engine/draw.py``: the whole vocabulary sorted for top-p, and
    torch.multinomial's serial exponential per token. logits: [V]."""
    x = logits.float() / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        x = x.masked_fill(x < torch.topk(x, params.top_k).values[-1], -math.inf)
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop[0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter_(0, order, drop), -math.inf)
    return int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=generator))


def profile(path: str, threads: int, steps: int, repeats: int, cpu_time: bool = False
            ) -> tuple[dict[str, float], dict[str, float]]:
    """({component: median ms a token}, {extra measure: ms}) of decoding with the model at ``path``. ``cpu_time``:
    this thread's CPU time instead of wall time (one thread on a busy machine: other jobs' time slices do not count;
    with more threads the other threads' work would not count either)."""
    import dtorch
    from dtorch import SamplingParams
    from dtorch.engine.sampling import sample_step
    from dtorch.models.executor import StepPlan

    clock = time.thread_time if cpu_time else time.perf_counter
    torch.set_num_threads(threads)
    llm = dtorch.LLM(path, max_num_seqs=1, max_model_len=512, threads=threads)
    try:
        ex = llm.executor
        blocks = llm.engine.blocks.allocate(llm.engine.blocks.blocks_for(PROMPT + 8))
        prompt = [100 + i for i in range(PROMPT)]
        ex.step(StepPlan(prompt, [PROMPT], [0], [blocks]))
        decode = StepPlan([6], [1], [PROMPT], [blocks])
        logits = ex.step(decode)
        vocab = logits.shape[-1]
        bucket = next(b for b in ex.runners if b.decode)
        runner = ex.runners[bucket]
        feeds, calls = ex.feeds(decode, bucket), runner.program.calls
        kinds = [kind(c[0], vocab) for c in calls]
        greedy = SamplingParams(temperature=0.0)
        sampled = SamplingParams(seed=0, **SAMPLED)
        g_new, g_ref = sampled.generator(), sampled.generator()
        decoder = llm.tokenizer.stream_decoder(True)
        text_ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it runs away. " * 4)

        def timed_kernels() -> dict[str, float]:
            sums = dict.fromkeys(KINDS, 0.0)
            for (k, prepared, ctx, ins, outs), name in zip(calls, kinds, strict=True):
                t = clock()
                if prepared is None:
                    k.run()
                else:
                    prepared.fn(ctx, ins, outs)
                sums[name] += clock() - t
            return sums

        def bare() -> None:
            for k, prepared, ctx, ins, outs in calls:
                if prepared is None:
                    k.run()
                else:
                    prepared.fn(ctx, ins, outs)

        def detok() -> None:
            for t in text_ids:
                decoder.push(t)

        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        many = SamplingParams(temperature=0.0, max_tokens=1 + steps, ignore_eos=True)

        def per_token_generate() -> float:
            t0 = clock()
            llm.generate([prompt], one)
            t1 = clock()
            llm.generate([prompt], many)
            return ((clock() - t1) - (t1 - t0)) / steps

        sharp = logits * SHARPEN
        history = [[7 * i % vocab for i in range(64)]], [prompt]
        settings = {label: SamplingParams(seed=1, **kw) for label, kw in SETTINGS.items()}
        gens = {label: p.generator() for label, p in settings.items()}
        timers = {
            "run": lambda: runner.run(feeds),  # first: the step's inputs in its buffers for the bare loop after it
            "bare": bare,
            "step": lambda: ex.step(decode),
            "greedy": lambda: sample_step(logits, [greedy], [None], [[]], [[]]),
            "sampled": lambda: sample_step(logits, [sampled], [g_new], [[]], [[]]),
            "sampled (reference)": lambda: reference_sample(logits[0], sampled, g_ref),
            **{label: (lambda p=p, g=gens[label]: sample_step(sharp, [p], [g], *history))
               for label, p in settings.items()},
        }
        got: dict[str, list[float]] = defaultdict(list)
        llm.engine.blocks.free(blocks)
        per_token_generate()  # every shape built
        blocks = llm.engine.blocks.allocate(llm.engine.blocks.blocks_for(PROMPT + 8))
        ex.step(StepPlan(prompt, [PROMPT], [0], [blocks]))
        for fn in timers.values():  # warm: the sampler's one-time check against torch (draw.exact) runs here
            fn()
        for _ in range(repeats):
            runner.run(feeds)  # the step's inputs in its buffers (which other step shapes share)
            for name, ms in timed_kernels().items():
                got[name].append(ms)
            for name, fn in timers.items():
                t0 = clock()
                for _ in range(steps):
                    fn()
                got[name].append((clock() - t0) / steps)
            t0 = clock()
            detok()
            got["detokenize"].append((clock() - t0) / len(text_ids))
        llm.engine.blocks.free(blocks)
        for _ in range(max(1, repeats // 2)):
            got["generate"].append(per_token_generate())
        med = {name: statistics.median(v) * 1e3 for name, v in got.items()}
    finally:
        llm.close()
    rows = {name: med[name] for name in KINDS}
    rows["kernel loop (Python between kernels)"] = med["bare"] - sum(med[n] for n in KINDS)
    rows["Runner.run (feeds in, logits out)"] = med["run"] - med["bare"]
    rows["Executor.step (step inputs on the host)"] = med["step"] - med["run"]
    rows["sampling, greedy"] = med["greedy"]
    rows["detokenize"] = med["detokenize"]
    rows["engine (scheduling, stops, deltas)"] = med["generate"] - med["step"] - med["greedy"] - med["detokenize"]
    extra = {"LLM.generate, greedy": med["generate"], "Executor.step": med["step"], "sampled": med["sampled"],
             "sampled (reference)": med["sampled (reference)"], "vocab": vocab,
             **{f"setting: {label}": med[label] for label in SETTINGS}}
    return rows, extra


def print_profile(name: str, threads: int, rows: dict[str, float], extra: dict[str, float]) -> None:
    total = extra["LLM.generate, greedy"]
    print(f"\n{name}, {threads} thread(s), vocabulary {extra['vocab']:,}: LLM.generate {total:.2f} ms a token "
          f"(greedy), Executor.step {extra['Executor.step']:.2f} ms")
    print("| component | ms a token | share |\n|---|---|---|")
    for label, ms in rows.items():
        print(f"| {label} | {ms:.3f} | {ms / total:.1%} |")
    print(f"| sampling, {SAMPLED} (the reference: sort + torch.multinomial) | {extra['sampled']:.3f} "
          f"({extra['sampled (reference)']:.3f}) | {extra['sampled'] / total:.1%} |")
    for label in SETTINGS:
        ms = extra[f"setting: {label}"]
        print(f"| sampling, logits x{SHARPEN:g}: {label} | {ms:.3f} | {ms / total:.1%} |")
