"""Decode speed of the default model through the runtime, side by side, in one run (issue: models on the runtime).

    python bench/tp.py [--rounds 5] [--prompt 128] [--new 64] [--smoke]

``--smoke``: one round of a short prompt and few tokens (what the tests run, so the bench cannot rot unseen).

Rows, measured in alternating rounds in one process (medians; ratios from the same rounds):
- direct: today's single-device path before the runtime (``bench/_direct_model.py``, kept as the baseline),
  all cores (two threads on a 2-core machine);
- runtime tp=1: the same model as one graph per step on ``DeviceMesh.cpu(1)``, all cores;
- runtime tp=2: ``DeviceMesh.cpu(2)``, one thread per device;
- runtime pp=2: two pipeline stages on ``DeviceMesh.cpu(2, (2, 1), ("pp", "tp"))``, half the layers each, one thread
  per device (one stream: the stages take turns, so this row shows the pipeline's overhead, not its gain);
then 2 gloo processes under torchrun (one device and one thread each), and the overlap of a tp=2 decode step:
the share of communicate-stream busy time during which the same device's compute stream was also busy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _prompt(n: int) -> list[int]:
    return [(17 * i + 100) % 40000 + 50 for i in range(n)]


class Direct:
    """Today's direct path (prepared ops on one device) with a greedy decode loop."""

    def __init__(self) -> None:
        from _direct_model import Transformer

        from dtorch.models.default import default_model_path
        from dtorch.models.loaders import load_checkpoint

        ck = load_checkpoint(default_model_path())
        self.model = Transformer(ck.config, ck.tensors)
        self.cache = self.model.new_cache(1, 512)

    @torch.no_grad()
    def decode(self, prompt: list[int], new: int) -> tuple[float, list[int]]:
        from _direct_model import Step

        cpu = torch.device("cpu")
        c = self.cache
        c.reset()
        slot = c.alloc()
        c.reserve(slot, len(prompt))
        logits = self.model.forward(torch.tensor(prompt), Step.build([len(prompt)], [0], [slot], cpu), c)
        toks = [int(logits[0].argmax())]
        t0 = time.perf_counter()
        for _ in range(new - 1):
            s = c.reserve(slot, 1)
            logits = self.model.forward(torch.tensor(toks[-1:]), Step.build([1], [s], [slot], cpu), c)
            toks.append(int(logits[0].argmax()))
        return (new - 1) / (time.perf_counter() - t0), toks


class Runtime:
    def __init__(self, tp: int, pp: int = 1) -> None:
        from dtorch.engine.llm import LLM

        self.llm = LLM(tensor_parallel_size=tp, pipeline_parallel_size=pp)

    def decode(self, prompt: list[int], new: int) -> tuple[float, list[int]]:
        from dtorch.engine.sampling import SamplingParams

        out = self.llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))[0]
        return self.llm.stats.decode_tps, out.outputs[0].token_ids


def decode_step_trace(llm, prompt: list[int]):
    """The Tracer of one decode step after ``prompt`` (prefilled first, untraced), on blocks the engine's block
    manager hands out (and takes back), so no cached prefix is overwritten."""
    from dtorch.models.executor import StepPlan

    ex, bm = llm.executor, llm.engine.blocks
    blocks = bm.allocate(bm.blocks_for(len(prompt) + 2))
    try:
        n = len(prompt)
        tok = int(ex.step(StepPlan(prompt, [n], [0], [blocks]))[0].argmax())
        ex.step(StepPlan([tok], [1], [n], [blocks]))  # warm the decode bucket
        ex.set_trace(True)
        ex.step(StepPlan([tok], [1], [n + 1], [blocks]))
        tracer = ex.tracer
        ex.set_trace(False)
    finally:
        bm.free(blocks)
    return tracer


def overlap(tracer) -> tuple[float, float]:
    """(overlap fraction, communicate share of the step) of a traced step: the share of communicate-stream busy
    time during which the same device's compute stream was busy too, and of the step spent communicating."""
    rows = tracer.intervals()
    both = busy = 0.0
    t0 = min(a for spans in rows.values() for _, a, _ in spans)
    t1 = max(b for spans in rows.values() for _, _, b in spans)
    for (device, kind), spans in rows.items():
        if kind != "communicate":
            continue
        compute = rows.get((device, "compute"), [])
        for _, a, b in spans:
            busy += b - a
            both += sum(max(0.0, min(b, d) - max(a, c)) for _, c, d in compute)
    devices = len({d for d, _ in rows})
    return (both / busy if busy else 0.0), (busy / devices / (t1 - t0))


def gloo(tp: int, prompt: int, new: int, repeats: int = 3) -> float | None:
    """Decode tok/s of ``tp`` gloo processes under torchrun (rank 0's figure), or None if the run failed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-port", "29533",
           os.path.abspath(__file__), "--worker", "--prompt", str(prompt), "--new", str(new), "--tp", str(tp),
           "--rounds", str(repeats)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    for line in res.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)["decode_tps"]
    print(res.stdout[-2000:], res.stderr[-2000:], file=sys.stderr)
    return None


def worker(args: argparse.Namespace) -> None:
    from dtorch.engine.llm import LLM
    from dtorch.engine.sampling import SamplingParams

    llm = LLM(tensor_parallel_size=args.tp)
    p = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    tps = []
    for _ in range(args.rounds):
        llm.generate([_prompt(args.prompt)], p)
        tps.append(llm.stats.decode_tps)
    if llm.rank == 0:
        print(json.dumps({"decode_tps": statistics.median(tps)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="one round, 8-token prompt, 4 new tokens")
    ap.add_argument("--trace-png", default=None, help="also draw the traced tp=2 decode step to this PNG")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.prompt, args.new = 1, 8, 4
    if args.worker:
        worker(args)
        return
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    engines = {"direct (baseline)": Direct(), "runtime tp=1": Runtime(1), "runtime tp=2, cpu(2)": Runtime(2),
               "runtime pp=2, cpu(2)": Runtime(1, 2)}
    prompt = _prompt(args.prompt)
    tps: dict[str, list[float]] = {k: [] for k in engines}
    ratios: dict[str, list[float]] = {k: [] for k in engines}
    tokens = {}
    for _ in range(args.rounds):
        got = {name: e.decode(prompt, args.new) for name, e in engines.items()}
        for name, (t, toks) in got.items():
            tps[name].append(t)
            ratios[name].append(t / got["runtime tp=1"][0])
            tokens[name] = toks
    same = len({tuple(t) for t in tokens.values()}) == 1
    rows = [(name, statistics.median(tps[name]), statistics.median(ratios[name])) for name in engines]
    g = gloo(2, args.prompt, args.new, 1 if args.smoke else 3)
    tracer = decode_step_trace(engines["runtime tp=2, cpu(2)"].llm, prompt)
    frac, share = overlap(tracer)
    if args.trace_png:
        from dtorch.runtime.tracing import plot_chrome_trace

        plot_chrome_trace(tracer.write(args.trace_png.removesuffix(".png") + ".json"), args.trace_png)
    print(f"SmolLM2-135M-Instruct (float32), {args.prompt}-token prompt, {args.new} new tokens, greedy; "
          f"{cores} cores; medians of {args.rounds} alternating rounds")
    print(f"{'engine':28s} {'threads':>12s} {'decode tok/s':>13s} {'vs tp=1':>8s}")
    threads = {"direct (baseline)": f"{cores}", "runtime tp=1": f"{cores}", "runtime tp=2, cpu(2)": "1 per device",
               "runtime pp=2, cpu(2)": "1 per device"}
    for name, t, r in rows:
        print(f"{name:28s} {threads[name]:>12s} {t:13.1f} {r:8.2f}")
    if g is not None:
        print(f"{'2 gloo processes (torchrun)':28s} {'1 per rank':>12s} {g:13.1f} {g / rows[1][1]:8.2f}  "
              "(ratio vs the median above, not the same rounds)")
    paired = zip(tps["runtime tp=1"], tps["direct (baseline)"], strict=True)
    print(f"runtime tp=1 / direct: {statistics.median(r / d for r, d in paired):.3f} (median of per-round ratios)")
    print(f"tp=2 decode step: communicate streams busy {share:.0%} of the step; {frac:.0%} of that time overlaps "
          "compute on the same device")
    print(f"greedy tokens identical across engines: {same}")


if __name__ == "__main__":
    main()
