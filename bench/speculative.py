"""Speculative decoding against plain decoding, side by side in one run (issue #23).

    python bench/speculative.py [--threads 1] [--repeats 3] [--k 12] [--forced 2 4 8 12] [--no-draft-model]
                                [--cache DIR] [--vocabs 49152 151936 262144] [--draw-repeats 40] [--smoke]

The default model (SmolLM2-135M-Instruct Q4_1), greedy, one request at a time, on three chat tasks: repeating a
paragraph, fixing the typos of a paragraph, and an open question. Each task runs plain and with prompt lookup
(``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}``) on one loaded
model (the speculator is switched on and off between runs, which alternate, so drift in the machine's speed hits both
alike): tok/s is the answer's tokens over the whole generate call (prefill included), the median of ``--repeats`` runs
after a warm-up; "decode tok/s" (plain -> speculative) counts the decode steps only, the tokens after the first over
their time (what ``dtorch generate``'s speed line and llama.cpp's speculative example report); "acceptance" is
accepted over drafted tokens; "same" says whether the answers are equal id for id; "ms/step" is the mean time of the
engine's steps, plain then speculative (a speculative step verifies up to k + 1 rows). The adaptive k picks how many
of the ``--k`` drafts a step verifies from what rows cost on the device; the "forced" rows price rows at nothing, so
every step drafts ``--forced`` tokens where it can (the copy task).

The profile behind the speed-ups: what one ``matmul.linear`` of the default model costs on x of 1..k+1 rows against
one row (the native kernels' integer products, the median of 40 calls), for a layer's gate/up projection and for
the LM head: a verify step of k + 1 rows pays this on every product.

Then one draft-model row: the Qwen3-0.6B-shaped random GGUF of bench/gguf_formats.py (Q4_K_M, made in ``--cache``
when missing) as the target, drafted by a tiny random Qwen3 of the same vocabulary (2 layers, hidden 256, written
there too), on the copy task's prompt as raw text. Random weights (tied embeddings, small projections) mostly repeat
their last token, the target and the draft alike, so the drafts are kept: the row shows what the draft model's steps
and the verification cost, not what a trained pair accepts. The machine is shared and noisy; compare the ratios of one
run.

Then the sampled path's draws (``--vocabs``, random logits peaked as a model's, medians of ``--draw-repeats`` calls),
per verified row: kept sets (``verify._sampled_run`` and the draft model's ``Kept``, one uniform through the inverse
CDF over the kept tokens) against the whole vocabulary as the definitions read (``filter_logits``, a softmax over all
V tokens, ``torch.multinomial``): the bonus token (every draft kept), a residual draw after a refused prompt-lookup
draft and after a refused draft-model draft (p - q), and one draft-model draw. A sampled row of the copy task (prompt
lookup, temperature 0.8, top-k 40, top-p 0.95, seeded) joins the table above ("same": n/a, the draws differ).

``--smoke`` (what CI runs): the copy task only, 24 new tokens, one run, k 4, forced 4; the draft-model row drafts the
default model by the tiny random Qwen3 given the default model's vocabulary, written to a temporary folder (no
llama.cpp quantizer needed); the draws at one vocabulary of 49152, 5 calls each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

PARAGRAPH = (
    "The lighthouse stood on a rock at the mouth of the harbour, and for two hundred years its keepers kept the lamp "
    "burning through every storm. The first tower was built of timber and burned down within a decade; the second, of "
    "granite brought by barge from a quarry upriver, still stands. Each keeper wrote in a logbook the weather, the "
    "ships that passed and the oil that the lamp consumed, and those books, kept today in the town library, tell the "
    "story of the coast better than any history.")
TYPOS = (
    "The lighthouse stod on a rock at the mouth of the harbour, and for two hundred years its keepers kept the lamp "
    "burnin through every storm. The first tower was bilt of timber and burned down within a decade; the secnd, of "
    "granite brought by barge from a quarry upriver, still stands. Each keeper wrote in a logbok the weather, the "
    "ships that pased and the oil that the lamp consumed, and those books, kept today in the town library, tell the "
    "story of the coast beter than any history.")
TASKS = {
    "copy": ("Repeat this paragraph exactly, without any comment:\n\n" + PARAGRAPH, 160),
    "fix typos": ("Fix the spelling mistakes in this paragraph and write it out in full, without any comment:\n\n"
                  + TYPOS, 160),
    "open question": ("Why do cities grow near rivers? Answer in two paragraphs.", 160),
}
TINY_DRAFT = dict(hidden=256, intermediate=768, layers=2, heads=4, kv_heads=2, head_dim=64)


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def measure(llm, prompt, params, repeats: int) -> dict:
    """Plain and speculative runs of one prompt, alternating: medians of tok/s, the acceptance, the mean step time,
    whether the two answers are equal."""
    spec = llm.engine.speculator
    tps: dict[str, list[float]] = {"plain": [], "spec": []}
    dps: dict[str, list[float]] = {"plain": [], "spec": []}  # decode steps only: no prefill, no first token
    steps = {"plain": [0, 0.0], "spec": [0, 0.0]}
    answers, drafted, accepted = {}, 0, 0
    for r in range(repeats + 1):
        for name in ("plain", "spec"):
            llm.engine.speculator = spec if name == "spec" else None
            before = llm.engine.stats()
            t0 = time.perf_counter()
            out = llm.generate([prompt], params)[0].outputs[0]
            seconds, after = time.perf_counter() - t0, llm.engine.stats()
            answers[name] = out.token_ids
            if r:  # the first round warms up (and builds the step shapes)
                tps[name].append(len(out.token_ids) / seconds)
                dps[name].append((after.decode_tokens - before.decode_tokens) /
                                 (after.decode_seconds - before.decode_seconds))
                steps[name][0] += after.steps - before.steps
                steps[name][1] += after.prefill_seconds + after.decode_seconds - before.prefill_seconds - \
                    before.decode_seconds
                drafted += after.spec_draft_tokens - before.spec_draft_tokens
                accepted += after.spec_accepted_tokens - before.spec_accepted_tokens
    llm.engine.speculator = spec
    plain, fast = statistics.median(tps["plain"]), statistics.median(tps["spec"])
    dplain, dfast = statistics.median(dps["plain"]), statistics.median(dps["spec"])
    ms = {name: 1e3 * t / n for name, (n, t) in steps.items()}
    return {"tokens": len(answers["plain"]), "plain": plain, "spec": fast, "speedup": fast / plain,
            "decode": f"{dplain:.0f} -> {dfast:.0f}", "decode_speedup": dfast / dplain,
            "acceptance": accepted / drafted if drafted else 0.0, "same": answers["plain"] == answers["spec"],
            "ms": f"{ms['plain']:.1f} -> {ms['spec']:.1f}"}


def row_costs(llm, rows: int) -> list[list]:
    """matmul.linear's cost on 1..rows rows of x against one row, for a gate/up projection and the LM head."""
    import torch

    from dtorch.kernels.native import ops

    out = []
    for name in ("layers.0.gate_up", "lm_head" if "lm_head" in llm.model.weights else "embed"):
        w = llm.model.weights[name]
        packed = next(iter(w.blobs.values())).tensor
        times = []
        for m in range(1, rows + 1):
            x = torch.randn(m, w.shape[1])
            for _ in range(3):
                ops.qlinear(x, packed, w.layout)
            samples = []
            for _ in range(40):
                t0 = time.perf_counter()
                ops.qlinear(x, packed, w.layout)
                samples.append(time.perf_counter() - t0)
            times.append(statistics.median(samples))
        out.append([f"{name} {w.layout} {list(w.shape)}", f"{times[0] * 1e6:.0f}"] + [t / times[0] for t in times[1:]])
    return out


def tiny_draft(dst: Path, vocab: int) -> Path:
    """The tiny random Qwen3 (``TINY_DRAFT``) of ``vocab`` tokens, the default model's tokenizer fitted to it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gguf_files as gf

    from dtorch.models.default import default_model_path

    s = TINY_DRAFT
    shape = gf.Shape("qwen3", s["hidden"], s["intermediate"], s["layers"], s["heads"], s["kv_heads"], s["head_dim"],
                     vocab)
    return gf.random_model(dst, shape, default_model_path())


def draft_files(cache: Path) -> tuple[Path, Path]:
    """The Qwen3-0.6B-shaped Q4_K_M target and the tiny random Qwen3 draft of its vocabulary (made when missing)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gguf_files as gf
    from gguf_formats import make_files

    cache.mkdir(parents=True, exist_ok=True)
    made = make_files(["qwen3-0.6b-Q4_K_M"], cache, str(gf.LLAMACPP_PYTHON))["qwen3-0.6b-Q4_K_M"]
    if isinstance(made, str):
        raise SystemExit(f"bench/speculative.py: cannot make the 0.6B target: {made}")
    return made, tiny_draft(cache / "qwen3-tiny-F16.gguf", gf.QWEN3_0_6B.vocab)


def draft_row(target: Path, draft: Path, args: argparse.Namespace, new: int) -> list:
    """The copy task's prompt as raw text on ``target`` drafted by ``draft``, ``new`` tokens, eos held off."""
    from dtorch import LLM, SamplingParams

    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.k}
    llm = LLM(str(target), max_model_len=1024, threads=args.threads, speculative_config=config)
    m = measure(llm, llm.tokenizer.encode(TASKS["copy"][0]),
                SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True), args.repeats)
    llm.close()
    return row(f"copy, {target.stem} drafted by {draft.stem}", f"<= {args.k}", m)


def row(label: str, k: str, m: dict, sampled: bool = False) -> list:
    return [label, k, m["tokens"], m["plain"], m["spec"], m["speedup"], m["decode"], m["decode_speedup"],
            f"{m['acceptance']:.0%}", m["ms"],
            "n/a" if sampled else "yes" if m["same"] else "NO"]


SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.95)  # the sampled rows' settings
DRAW_SETTINGS = {"T 0.8, top-k 40, top-p 0.95": SAMPLED, "T 1.0, every token": dict(temperature=1.0)}


def median_us(fn, repeats: int) -> float:
    fn()  # warm-up (buffers, first-call costs)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def draw_costs(vocab: int, repeats: int) -> list[list]:
    """Per setting of ``DRAW_SETTINGS``: [vocab, setting, draw, kept sets us, whole vocabulary us, ratio] of a bonus
    draw, a residual draw after a refused prompt-lookup draft and after a refused draft-model draft, and a
    draft-model draw."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, vocab, generator=g) * 2.5  # [0]: the target's row, [1]: the draft model's
    x[:, :6] += torch.tensor([6.0, 5.5, 5.0, 4.5, 4.0, 3.0])
    t = int(torch.argmin(x[0]))  # a draft the target all but never keeps: the draft model's favourite
    x[1, t] = float(x[1].max()) + 2.0
    out = []
    for name, kw in DRAW_SETTINGS.items():
        for case, fast, slow in draw_cases(x, t, kw, g):
            a, b = median_us(fast, repeats), median_us(slow, repeats)
            out.append([f"{vocab}", name, case, f"{a:.0f}", f"{b:.0f}", b / a])
    return out


def draw_cases(x, t: int, kw: dict, g) -> list[tuple]:
    """(case, the kept sets' call, the whole vocabulary's call) for rows x [2, V] (the target's, the draft's) and a
    draft t the target refuses."""
    from types import SimpleNamespace

    import torch

    from dtorch.engine.kept import Kept, uniform
    from dtorch.engine.sampling import SamplingParams, filter_logits
    from dtorch.engine.verify import _sampled_run

    params = SamplingParams(**kw)
    s = SimpleNamespace(params=params, generator=g, request_id="bench")

    def q_of() -> Kept:
        return Kept.of(x[1], params.temperature, params.top_k, params.top_p, params.min_p)

    q, qdense = q_of(), torch.softmax(filter_logits(x[1], params), -1)

    def whole(row: int, minus: int | None = None) -> int:  # the definitions over all V tokens
        p = torch.softmax(filter_logits(x[row], params), -1)
        if minus is not None:
            p[minus] = 0.0
        return int(torch.multinomial(p, 1, generator=g))

    def whole_q() -> int:
        p = torch.softmax(filter_logits(x[0], params), -1)
        return int(torch.multinomial((p - qdense).clamp_(min=0.0), 1, generator=g))

    return [("bonus token", lambda: _sampled_run(x[:1], 0, s, [], None, {}, [0]), lambda: whole(0)),
            ("residual, prompt lookup", lambda: _sampled_run(x[:1], 0, s, [t], None, {}, [0]), lambda: whole(0, t)),
            ("residual, draft model", lambda: _sampled_run(x[:1], 0, s, [t], [q], {}, [0]), whole_q),
            ("draft model's draw", lambda: q_of().draw(uniform(g)), lambda: whole(1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=12, help="num_speculative_tokens")
    ap.add_argument("--forced", type=int, nargs="*", default=[2, 4, 8, 12],
                    help="k drafted at every step, whatever they cost, on the copy task (the profile)")
    ap.add_argument("--no-draft-model", action="store_true", help="leave out the draft-model row")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "dtorch" / "bench-gguf")
    ap.add_argument("--vocabs", type=int, nargs="*", default=[49152, 151936, 262144],
                    help="vocabulary sizes of the sampled draws' costs")
    ap.add_argument("--draw-repeats", type=int, default=40)
    ap.add_argument("--smoke", action="store_true", help="the copy task, 24 tokens, 1 run, a tiny draft (CI)")
    args = ap.parse_args()
    tasks = TASKS
    if args.smoke:
        args.repeats, args.k, args.forced = 1, 4, [4]
        tasks = {"copy": (TASKS["copy"][0], 24)}
        args.vocabs, args.draw_repeats = [49152], 5

    from _timing import table

    from dtorch import LLM, SamplingParams
    from dtorch.engine.speculative import SpeculativeConfig, Speculator
    from dtorch.models.default import default_model_path

    head = ["task", "k", "tokens", "plain tok/s", "spec tok/s", "speed-up", "decode tok/s", "decode speed-up",
            "acceptance", "ms/step", "same"]
    rows = []

    def add(r: list) -> None:
        rows.append(r)
        print(table(head, [r]), file=sys.stderr, flush=True)  # each row as it is measured

    llm = LLM(max_model_len=1024, threads=args.threads, speculative_config=ngram(args.k))
    prompts = {task: (llm.chat_prompt([{"role": "user", "content": text}]), new) for task, (text, new) in tasks.items()}
    for task, (prompt, new) in prompts.items():
        add(row(f"{task} (ngram)", f"<= {args.k}", measure(llm, prompt, SamplingParams(temperature=0.0,
                                                                                        max_tokens=new), args.repeats)))
    prompt, new = prompts["copy"]
    add(row("copy (ngram, sampled)", f"<= {args.k}", measure(llm, prompt, SamplingParams(
        **SAMPLED, seed=1, max_tokens=new, ignore_eos=True), args.repeats), sampled=True))
    for k in args.forced:  # rows priced at nothing: the adaptive k drafts k wherever drafts are kept
        llm.engine.speculator = Speculator(SpeculativeConfig.from_dict(ngram(k)), (0.0, 0.0))
        add(row("copy (ngram, forced)", str(k), measure(llm, prompt, SamplingParams(temperature=0.0, max_tokens=new),
                                                        args.repeats)))
    costs = row_costs(llm, max([args.k, *args.forced]) + 1)
    vocab = llm.config.vocab_size
    llm.close()
    if args.no_draft_model:
        pass
    elif args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            add(draft_row(default_model_path(), tiny_draft(Path(tmp) / "qwen3-tiny-F16.gguf", vocab), args, 16))
    else:
        add(draft_row(*draft_files(args.cache), args, 64))
    print(f"\nspeculative decoding, {args.threads} thread(s), greedy, one request, medians of {args.repeats} runs "
          "(whole generate calls)")
    print(table(head, rows))
    print(f"\nmatmul.linear on x of m rows against one row ({args.threads} thread(s))")
    print(table(["weight", "1 row us"] + [f"{m} rows" for m in range(2, len(costs[0]))], costs))
    import torch

    torch.set_num_threads(args.threads)
    draws = [r for v in args.vocabs for r in draw_costs(v, args.draw_repeats)]
    print(f"\nsampled verification's draws per row ({args.threads} thread(s)), medians of {args.draw_repeats} calls: "
          "kept sets against the whole vocabulary (filter_logits, softmax, torch.multinomial)")
    print(table(["vocab", "sampling", "draw", "kept sets us", "whole vocabulary us", "ratio"], draws))


if __name__ == "__main__":
    main()
