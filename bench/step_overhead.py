"""Python overhead of one decode step on one CPU device: the stream path against the bare calls, in one run.

    python bench/step_overhead.py [--layers 30] [--steps 20] [--repeats 49] [--off onednn] [--smoke]

A tiny random Llama (hidden 64, ``--layers`` layers: 30, the default model's count, so the kernel count is real and
their compute is small) decodes one sequence, and each way of running its decode step is timed round-robin:
- kernels alone: the step's bound kernels called back to back from a list (``Program.calls``), nothing else: the
  floor any path pays;
- ``Runner.run``, each kernel through its stream item: what a run did before the bare calls (``_run_inline``:
  ``KernelStream.execute`` -> ``_execute`` -> ``Segment.execute`` -> ``Kernel.execute`` -> ``DispatchKernel.run``,
  then a synchronize that waits for a marker handed to the idle stream thread), still the path of a traced run or
  one under ``forbid_host_sync``;
- ``Runner.run``, bare calls: today's untraced one-device path (``Runner._call_kernels`` calls each kernel, and
  no synchronize follows when every stream is idle); "still synchronized" keeps the synchronize, to tell the two
  changes apart;
- the same two through ``Executor.step`` (the step's feeds built on the host, the logits out) and ``LLM.generate``
  (the engine's scheduling, sampling and detokenizing too), each repeat of ``--steps`` tokens.
"overhead" is a row's time less the kernels' own; "per kernel" divides it by the kernel count. Intra-op threads: 1
(the overhead is the host's, and one thread keeps the machine's other load out of it). ``--off``: providers disabled
(default onednn: its float32 mm costs ~80 us a call at these tiny shapes against ~4 us for blas, which would bury
the overhead in kernel time; ``--off`` with no name keeps every winner). Medians of ``--repeats``.
``--smoke`` (what CI runs): 2 layers, 10 steps, 1 repeat, then ``--profile`` of the default model, 2 steps.

    python bench/step_overhead.py --profile [GGUF ...] [--threads 1 2] [--cpu-time]

instead tells where a decode step of a real model goes, component by component (``_step_profile.py``): the kernels
by kind (products, head, attention, the rest), the Python between them, the Runner's and Executor's host work,
sampling (greedy, and sampled beside the reference it replaced), detokenizing and the engine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def tiny_llama(root: Path, layers: int) -> Path:
    """A random Llama of ``layers`` layers (hidden 64, 4 heads over 2 KV heads, vocabulary 256) saved at ``root``."""
    import transformers

    from dtorch.models.tiny import families, save_random

    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, max_position_embeddings=512)
    save_random(transformers, families(transformers, 4, 2, 256, 16, **sizes)["llama"](), root)
    return root


def kernels_alone(calls) -> None:
    for k, prepared, ctx, ins, outs in calls:
        if prepared is None:
            k.run()
        else:
            prepared.fn(ctx, ins, outs)


def stream_path(runner) -> None:
    """Make ``runner`` run as before the bare calls: each kernel through its stream item, then a synchronize that
    hands a marker to the (idle) stream thread and waits for it."""
    runner._call_kernels = runner._run_inline
    runner.manager.idle = lambda: False


def bare_path_synchronized(runner) -> None:
    """The bare calls, then the synchronize as before (the two changes apart)."""
    runner.__dict__.pop("_call_kernels", None)
    runner.manager.idle = lambda: False


def bare_path(runner) -> None:
    runner.__dict__.pop("_call_kernels", None)
    runner.manager.__dict__.pop("idle", None)


def measure(model: str | None, layers: int, steps: int, repeats: int, off: list[str]
            ) -> tuple[dict[str, float], int]:
    """({row: median seconds per step}, kernels per step) of ``model`` (None: the tiny Llama of ``layers`` layers)
    with the providers ``off`` disabled."""
    import dtorch

    torch.set_num_threads(1)
    with dtorch.dispatcher.disabled(*off), tempfile.TemporaryDirectory() as tmp:
        path = model or str(tiny_llama(Path(tmp), layers))
        llm = dtorch.LLM(path, max_num_seqs=1, max_model_len=512, threads=1)
        return _measure(llm, steps, repeats)


def _measure(llm, steps: int, repeats: int) -> tuple[dict[str, float], int]:
    from dtorch import SamplingParams
    from dtorch.models.executor import StepPlan

    try:
        ex = llm.executor
        blocks = llm.engine.blocks.allocate(llm.engine.blocks.blocks_for(16))
        ex.step(StepPlan([3, 4, 5], [3], [0], [blocks]))
        decode = StepPlan([6], [1], [3], [blocks])
        ex.step(decode)
        bucket = next(b for b in ex.runners if b.decode)
        runner, feeds = ex.runners[bucket], ex.feeds(decode, bucket)
        calls = runner.program.calls
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
        llm.generate([[1, 2, 3]], params)  # every bucket of the timed runs built

        def repeat(fn):
            def timed():
                for _ in range(steps):
                    fn()
            return timed

        def generate():
            llm.generate([[1, 2, 3]], params)

        rows = {
            "kernels alone": (None, repeat(lambda: kernels_alone(calls))),
            "Runner.run, through stream items (before)": (stream_path, repeat(lambda: runner.run(feeds))),
            "Runner.run, bare calls, still synchronized": (bare_path_synchronized, repeat(lambda: runner.run(feeds))),
            "Runner.run, bare calls (after)": (bare_path, repeat(lambda: runner.run(feeds))),
            "Executor.step, through stream items (before)": (stream_path, repeat(lambda: ex.step(decode))),
            "Executor.step, bare calls (after)": (bare_path, repeat(lambda: ex.step(decode))),
            "LLM.generate per token, through stream items (before)": (stream_path, generate),
            "LLM.generate per token, bare calls (after)": (bare_path, generate),
        }
        times: dict[str, list[float]] = {name: [] for name in rows}
        order = list(rows)
        for i in range(repeats):  # short rounds, each in another order: a burst of the machine's load hits every row
            for name in order[i % len(order):] + order[:i % len(order)]:
                path, fn = rows[name]
                for r in ex.runners.values():
                    (path or bare_path)(r)
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) / steps)
        for r in ex.runners.values():
            bare_path(r)
        llm.engine.blocks.free(blocks)
        return {name: statistics.median(v) for name, v in times.items()}, len(calls)
    finally:
        llm.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model to run instead of the tiny Llama (e.g. the default one's "
                   "GGUF file: its kernels' own time then dominates)")
    p.add_argument("--layers", type=int, default=30, help="decoder layers of the tiny Llama (default 30)")
    p.add_argument("--steps", type=int, default=20, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=49)
    p.add_argument("--off", nargs="*", default=["onednn"], help="providers to disable (default: onednn)")
    p.add_argument("--profile", nargs="*", default=None, metavar="GGUF",
                   help="instead: where a decode step of each model goes, component by component (_step_profile.py); "
                        "names of files in ~/.cache/dtorch/bench-gguf or paths (none: the default model)")
    p.add_argument("--threads", type=int, nargs="+", default=[1], help="intra-op threads of --profile (default 1)")
    p.add_argument("--cpu-time", action="store_true", help="--profile at 1 thread: CPU time, not wall")
    p.add_argument("--smoke", action="store_true", help="2 layers, 10 steps, 1 repeat (CI)")
    args = p.parse_args()
    if args.smoke:
        args.layers, args.steps, args.repeats = 2, 10, 1
    if args.profile is not None:
        return run_profile(args)
    t, kernels = measure(args.model, args.layers, args.steps, args.repeats, args.off)
    floor = t["kernels alone"]
    what = args.model or f"tiny Llama, {args.layers} layers, hidden 64"
    print(f"{what}: {kernels} kernels per decode step; 1 intra-op thread; "
          f"providers off: {', '.join(args.off) or 'none'}; medians of {args.repeats} x {args.steps} steps\n")
    head = ("path", "us/step", "overhead us", "per kernel us", "after / before")
    rows = []
    for name, s in t.items():
        before = t.get(name.replace("bare calls (after)", "through stream items (before)"))
        ratio = f"{s / before:.2f}" if name.endswith("(after)") and before else ""
        over = s - floor
        rows.append((name, f"{s * 1e6:,.1f}", f"{over * 1e6:,.1f}" if name != "kernels alone" else "",
                     f"{over / kernels * 1e6:.2f}" if name != "kernels alone" else "", ratio))
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    print("\noverhead: the row's time less the kernels' own; the Executor and LLM rows include the host work of a "
          "step (feeds, logits, sampling), which the Runner rows do not. Shared, noisy machine: compare within a run.")
    if args.smoke:  # the profile too, on the default model: 2 steps, 1 repeat
        args.profile, args.steps = [], 2
        run_profile(args)


def run_profile(args) -> None:
    from _step_profile import print_profile, profile

    from dtorch.models.default import default_model_path

    cache = Path.home() / ".cache" / "dtorch" / "bench-gguf"
    files = args.profile or [str(default_model_path())]
    repeats = args.repeats if args.repeats != 49 else 7  # (49 short rounds: the overhead table's default)
    clock = "CPU time of the thread at 1 thread, wall time above" if args.cpu_time else "wall time"
    print(f"decode after a 128-token prompt, one sequence; medians of {repeats} x {args.steps} steps; {clock}")
    for f in files:
        path = cache / f"{f}.gguf" if (cache / f"{f}.gguf").exists() else Path(f)
        for threads in args.threads:
            rows, extra = profile(str(path), threads, args.steps, repeats, args.cpu_time and threads == 1)
            print_profile(path.stem, threads, rows, extra)


if __name__ == "__main__":
    main()
