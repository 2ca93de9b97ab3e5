"""Where a model's weights sit in memory, and what a decode step pays for it: the weights in the load's arena of 2 MiB
pages (``dtorch.core.memory.HugePageArena``, small ones too) against each weight in memory of its own as loads gave
them before (``empty_in_huge_pages``: a weight under 4 MiB in 4 KiB pages), in one process, alternating (issue #39).

    python bench/weight_pages.py [GGUF ...] [--threads 1 2] [--rounds 8] [--kv] [--smoke]

A GGUF file is a path or a name in ~/.cache/dtorch/bench-gguf (``bench/gguf_formats.py --real`` makes them; none:
the default model). Each (file, threads): one sequence decodes after a 128-token prompt; the step's kernels are timed
by kind as ``step_overhead.py --profile`` times them (products of the layers, the head, attention, the rest), with
every packed weight's storage swapped in place (``Tensor.set_``, the same bytes: the logits are checked equal) between
- "own memory": a copy of each weight made as before, and
- "arena": the weights as this load made them;
- with ``--kv``, "arena + KV": the KV cache copied into 2 MiB pages too (attention's key and value reads; a cache in
  2 MiB pages holds up to 2 MiB more per layer's keys and values than it has written, so LLM keeps it in 4 KiB pages).
Then each one-row product alone (every layer's weight in the model's order, from memory as in decode), grouped by
kind and layout: GB/s of weight bytes either way. Medians of ``--rounds`` rounds of 10 steps (products: passes).
``--smoke`` (what CI runs): the default model, 1 thread, 2 rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from _step_profile import KINDS, kind, one_row_weights  # noqa: E402
from _timing import table  # noqa: E402

PROMPT = 128
CACHE = Path("~/.cache/dtorch/bench-gguf").expanduser()


def swap_to(tensors: list[torch.Tensor], storages: list) -> None:
    """Point each tensor at its storage in ``storages`` (same shape and bytes), in place: every kernel bound to the
    tensor reads the new memory."""
    for t, s in zip(tensors, storages, strict=True):
        t.set_(s, 0, t.shape, t.stride())


def packed_weights(llm) -> list[torch.Tensor]:
    """Every packed weight tensor of the model, once."""
    seen, out = set(), []
    for w in llm.model.weights.values():
        for b in w.blobs.values():
            if str(w.layout).startswith("gguf.") and id(b.tensor) not in seen:
                seen.add(id(b.tensor))
                out.append(b.tensor)
    return out


def step_components(llm, rounds: int, kv: bool) -> dict[str, dict[str, float]]:
    """{placement: {component: median ms a step}} of one decode step, the placements alternated each round."""
    from dtorch.core.memory import HugePageArena, empty_in_huge_pages
    from dtorch.models.executor import StepPlan

    ex = llm.executor
    blocks = llm.engine.blocks.allocate(llm.engine.blocks.blocks_for(PROMPT + 8))
    ex.step(StepPlan([100 + i for i in range(PROMPT)], [PROMPT], [0], [blocks]))
    decode = StepPlan([6], [1], [PROMPT], [blocks])
    want = ex.step(decode).clone()
    bucket = next(b for b in ex.runners if b.decode)
    runner = ex.runners[bucket]
    feeds, calls = ex.feeds(decode, bucket), runner.program.calls
    kinds = [kind(c[0], want.shape[-1]) for c in calls]
    weights = packed_weights(llm)
    caches = [b.tensor for name, t in llm.cache.tensors.items() if name.startswith(("k_cache.", "v_cache."))
              for b in t.blobs.values()]
    arena = HugePageArena()
    placements = {  # (weights' storages, caches' storages)
        "own memory": ([empty_in_huge_pages(t.shape, t.dtype).copy_(t).untyped_storage() for t in weights],
                       [t.untyped_storage() for t in caches]),
        "arena": ([t.untyped_storage() for t in weights], [t.untyped_storage() for t in caches]),
    }
    if kv:
        placements["arena + KV"] = (placements["arena"][0],
                                    [arena.empty(t.shape, t.dtype).copy_(t).untyped_storage() for t in caches])
    for ws, cs in placements.values():  # the same bytes: the same logits
        swap_to(weights, ws)
        swap_to(caches, cs)
        runner.run(feeds)
        assert torch.equal(ex.step(decode), want)
    got: dict[tuple[str, str], list[float]] = {}
    names = list(placements)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            swap_to(weights, placements[name][0])
            swap_to(caches, placements[name][1])
            runner.run(feeds)  # the step's inputs in its buffers
            for _ in range(10):
                sums = dict.fromkeys(KINDS, 0.0)
                for (k, prepared, ctx, ins, outs), what in zip(calls, kinds, strict=True):
                    t0 = time.perf_counter()
                    if prepared is None:
                        k.run()
                    else:
                        prepared.fn(ctx, ins, outs)
                    sums[what] += time.perf_counter() - t0
                sums["step (kernels)"] = sum(sums.values())
                for what, s in sums.items():
                    got.setdefault((name, what), []).append(s)
    swap_to(weights, placements["arena"][0])
    swap_to(caches, placements["arena"][1])
    llm.engine.blocks.free(blocks)
    return {name: {what: 1e3 * statistics.median(v) for (n, what), v in got.items() if n == name} for name in names}


def product_rates(llm, passes: int) -> list[list]:
    """Rows [kind, layout, N x K, MiB each, GB/s own memory, GB/s arena, ratio] of each group of one-row products,
    every weight in the model's order, passes alternating the two placements."""
    from dtorch.core.memory import empty_in_huge_pages
    from dtorch.kernels import layouts
    from dtorch.kernels.native import loader

    lib = loader._mod or loader.load()
    order = one_row_weights(llm)
    own = {key: [] for key, _ in order}
    for key, t in order:
        own[key].append(empty_in_huge_pages(t.shape, t.dtype).copy_(t))
    xs = {key[3]: torch.randn(1, key[3]) for key, _ in order}
    ys = {key[2]: torch.empty(1, key[2]) for key, _ in order}
    spent: dict[tuple, list[float]] = {}
    for p in range(2 * passes + 2):  # a warm-up pass of each first
        tag = "own" if p % 2 else "arena"
        seen_key: dict[tuple, int] = {}
        total: dict[tuple, float] = {}
        for key, t in order:
            j = seen_key.get(key, 0)
            seen_key[key] = j + 1
            w = own[key][j] if tag == "own" else t
            t0 = time.perf_counter()
            lib.qlinear(xs[key[3]], w, layouts.format_code(key[1]), None, ys[key[2]], False)
            total[key] = total.get(key, 0.0) + time.perf_counter() - t0
        if p >= 2:
            for key, s in total.items():
                spent.setdefault((tag, key), []).append(s)
    rows = []
    for key in dict.fromkeys(k for k, _ in order):
        nbytes = sum(t.nbytes for k, t in order if k == key)
        a, b = (nbytes / statistics.median(spent[(tag, key)]) / 1e9 for tag in ("own", "arena"))
        rows.append([key[0], key[1].removeprefix("gguf."), f"{key[2]} x {key[3]}",
                     f"{nbytes / len(own[key]) / 2**20:.2f}", f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}x"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help="GGUF paths or names in ~/.cache/dtorch/bench-gguf (default: the "
                    "default model)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--kv", action="store_true", help="also the KV cache in 2 MiB pages")
    ap.add_argument("--smoke", action="store_true", help="the default model, 1 thread, 2 rounds (CI)")
    a = ap.parse_args()
    import dtorch
    from dtorch.core.memory import HugePageArena, thp_mode
    from dtorch.models.default import default_model_path

    if a.smoke:
        a.files, a.threads, a.rounds = [], [1], 2
    files = [f if Path(f).exists() else str(CACHE / (f if f.endswith(".gguf") else f + ".gguf")) for f in a.files]
    files = files or [str(default_model_path())]
    print(f"transparent huge pages: {thp_mode()}; the load's arena is {'used' if HugePageArena.usable() else 'OFF'}; "
          f"load average {open('/proc/loadavg').read().split()[0]}")
    for path in files:
        for threads in a.threads:
            torch.set_num_threads(threads)
            llm = dtorch.LLM(path, max_num_seqs=1, max_model_len=PROMPT + 64, threads=threads)
            try:
                steps = step_components(llm, a.rounds, a.kv)
                products = product_rates(llm, max(1, a.rounds // 2))
            finally:
                llm.close()
            names = list(steps)
            base = steps["own memory"]
            rows = [[what, *(f"{steps[n][what]:.3f}" for n in names),
                     *(f"{base[what] / steps[n][what]:.3f}x" for n in names[1:])] for what in base]
            print(f"\n{Path(path).name}, {threads} thread(s): ms a decode step by kind (medians of {a.rounds} x 10)")
            print(table(["component", *names, *(f"{n} speed-up" for n in names[1:])], rows))
            print(f"\none-row products, GB/s of weight bytes (medians of {max(1, a.rounds // 2)} passes)")
            print(table(["weight", "layout", "N x K", "MiB each", "own memory", "arena", "speed-up"], products))


if __name__ == "__main__":
    main()
