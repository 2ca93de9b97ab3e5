"""Decode speed of the default model through the runtime, side by side, in one run (issue: models on the runtime).

    python bench/tp.py [--rounds 5] [--prompt 128] [--new 64] [--streams 16] [--send-delay-ms 2] [--smoke]

``--smoke``: one round of a short prompt and few tokens (what the tests run, so the bench cannot rot unseen).

Table 1, one stream, measured in alternating rounds in one process (medians; ratios from the same rounds):
- direct: today's single-device path before the runtime (``bench/_direct_model.py``, kept as the baseline),
  all cores (two threads on a 2-core machine);
- runtime tp=1: the same model as one graph per step on ``DeviceMesh.cpu(1)``, all cores;
- runtime tp=2: ``DeviceMesh.cpu(2)``, one thread per device;
- runtime pp=2: two pipeline stages on ``DeviceMesh.cpu(2, (2, 1), ("pp", "tp"))``, half the layers each, one thread
  per device (one stream is one micro-batch: the stages take turns, so this row shows the pipeline's overhead);
and the overlap of a tp=2 decode step: the share of communicate-stream busy time during which the same device's
compute stream was also busy (none since the collectives with nothing to overlap run on the compute streams).

Then issue #41's served target: one stream served across 2 gloo ranks under torchrun (rank 0 steps the engine and
tells each step's plan; one thread each), with the ranks talking through shared memory and through gloo only, and
``generate`` on every rank, each launch paired with a decode of tp=2 in one process (the same split) just before it.

Table 2, ``--streams`` concurrent streams (targets of issue #41): output tokens per second of the whole batch on one
device (one thread), tp=2 and pp=2 on ``cpu(2)`` (one thread per device; pp=2 keeps two micro-batches in flight),
alternating rounds after two untimed ones (every step shape built, the prompts' prefixes cached as in the timed
rounds), ratios from the same rounds; CPU seconds of all threads per 100 output tokens. Then the machine's own
ceiling for any split over two devices: the one-device batch in one process alone, then in two processes at once
(nothing shared, nothing sent): their summed tok/s over the one's. Then 2 gloo ranks (one thread each), tp=2 against
pp=2 decoding one stream, without and with ``--send-delay-ms`` of added latency before every message a rank sends
(send/recv, the collectives, the logits and token broadcasts: a network standing in for loopback).
"""

from __future__ import annotations

import argparse
import bisect
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
    def __init__(self, tp: int, pp: int = 1, threads: int | None = None, max_num_seqs: int = 16) -> None:
        from dtorch.engine.llm import LLM

        self.threads = threads or torch.get_num_threads()
        self.llm = LLM(tensor_parallel_size=tp, pipeline_parallel_size=pp, threads=self.threads,
                       max_num_seqs=max_num_seqs)

    def streams(self, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
        """Output tokens per second of ``prompts`` generated together (prefill included), and their greedy ids. The
        caller's intra-op threads are this engine's while it runs (a one-device step runs on the caller's thread)."""
        from dtorch.engine.sampling import SamplingParams

        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            t0, c0 = time.perf_counter(), time.process_time()
            outs = self.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
            seconds, self.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        finally:
            torch.set_num_threads(before)
        return len(prompts) * new / seconds, [o.outputs[0].token_ids for o in outs]

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


def gloo(tp: int, prompt: int, new: int, repeats: int = 3, pp: int = 1, delay_ms: float = 0.0,
         streams: int = 1, served: bool = False, shm: bool = True) -> float | None:
    """Decode tok/s of one stream on ``tp`` x ``pp`` gloo processes under torchrun (rank 0's figure; ``delay_ms``
    before every message each rank sends; ``streams`` > 1: output tok/s of that many streams together), or None if
    the run failed. ``served``: as ``dtorch serve`` runs across ranks (rank 0 steps the engine and tells each step's
    plan, the others follow), without the HTTP layer; ``shm``: ranks of this host talk through shared memory."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp * pp), "--master-port", "29533",
           os.path.abspath(__file__), "--worker", "--prompt", str(prompt), "--new", str(new), "--tp", str(tp),
           "--pp", str(pp), "--rounds", str(repeats), "--send-delay-ms", str(delay_ms), "--streams", str(streams)]
    cmd += ["--served"] if served else []
    env = dict(os.environ, OMP_NUM_THREADS="1", DTORCH_SHM_COMM="1" if shm else "0")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    for line in res.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)["decode_tps"]
    print(res.stdout[-2000:], res.stderr[-2000:], file=sys.stderr)
    return None


def delay_messages(seconds: float) -> None:
    """Every message a rank sends waits ``seconds`` first (a network's latency instead of loopback's): send, the
    collectives, the logits' and the sampled tokens' broadcasts."""
    from dtorch.distributed.torchdist import TorchDistCommunicator

    def late(fn):
        def call(*args, **kwargs):
            time.sleep(seconds)
            return fn(*args, **kwargs)
        return call

    for name in ("send", "all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        setattr(TorchDistCommunicator, name, late(getattr(TorchDistCommunicator, name)))


def worker(args: argparse.Namespace) -> None:
    from dtorch.engine.llm import LLM
    from dtorch.engine.sampling import SamplingParams

    if args.send_delay_ms:
        delay_messages(args.send_delay_ms / 1e3)
    llm = LLM(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, max_num_seqs=max(16, args.streams))
    ranks = None
    if args.served:  # as serve's cli does: rank 0 leads, the others follow its told calls until its stop
        from dtorch.engine.ranks import Leader, Ranks, follow

        ranks = Ranks(llm, 30.0)
        if llm.rank != 0:
            follow(ranks)
            return
        ranks.leader = Leader(ranks)
    p = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    prompts = [_prompt(args.prompt + i)[i:] for i in range(args.streams)]
    tps = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        llm.generate(prompts, p)
        tps.append(llm.stats.decode_tps if args.streams == 1 else args.streams * args.new / (time.perf_counter() - t0))
    if ranks is not None:
        ranks.leader.stop()
    if llm.rank == 0:
        print(json.dumps({"decode_tps": statistics.median(tps)}), flush=True)


def alone(args: argparse.Namespace) -> None:
    """``--alone``: the one-device batch of table 2 (one thread), two untimed rounds then ``--rounds``; prints the
    median output tok/s as JSON."""
    torch.set_num_threads(1)
    e = Runtime(1, threads=1, max_num_seqs=max(16, args.streams))
    prompts = [_prompt(args.prompt + i)[i:] for i in range(args.streams)]
    for _ in range(2):
        e.streams(prompts, args.new)
    tps = [e.streams(prompts, args.new)[0] for _ in range(args.rounds)]
    print(json.dumps({"tps": statistics.median(tps)}), flush=True)


def two_at_once(args: argparse.Namespace) -> tuple[float, float] | None:
    """(tok/s of one ``--alone`` process, summed tok/s of two run at once), or None if a run failed."""
    cmd = [sys.executable, os.path.abspath(__file__), "--alone", "--prompt", str(args.prompt), "--new", str(args.new),
           "--rounds", str(args.rounds), "--streams", str(args.streams)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    got = []
    for n in (1, 2):
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for _ in range(n)]
        outs = [p.communicate(timeout=600) for p in procs]
        tps = [json.loads(ln)["tps"] for out, _ in outs for ln in out.splitlines() if ln.startswith("{")]
        if len(tps) != n:
            print("\n".join(err[-2000:] for _, err in outs), file=sys.stderr)
            return None
        got.append(sum(tps))
    return got[0], got[1]


def stage_overlap(pp2: Runtime, prompts: list[list[int]], new: int, png: str | None) -> float:
    """The share of stage 0's compute-stream busy time during which stage 1's was busy too, in a traced generation
    of ``prompts`` at pp=2 (drawn to ``png``'s "-pp2" sibling when given)."""
    ex = pp2.llm.executor
    ex.set_trace(True)
    pp2.streams(prompts, new)
    tracer = ex.tracer
    ex.set_trace(False)
    rows = tracer.intervals()
    first, second = rows.get(("cpu:0", "compute"), []), sorted(rows.get(("cpu:1", "compute"), []), key=lambda r: r[1])
    starts = [a for _, a, _ in second]
    both = 0.0
    for _, a, b in first:  # the intervals of one stream do not overlap each other: a sorted sweep
        i = max(0, bisect.bisect_left(starts, a) - 1)
        while i < len(second) and second[i][1] < b:
            both += max(0.0, min(b, second[i][2]) - max(a, second[i][1]))
            i += 1
    busy = sum(b - a for _, a, b in first)
    if png:
        from dtorch.runtime.tracing import plot_chrome_trace

        stem = png.removesuffix(".png") + "-pp2"
        plot_chrome_trace(tracer.write(stem + ".json"), stem + ".png")
    return both / busy if busy else 0.0


def streams_table(args: argparse.Namespace, cores: int, tp2: Runtime, pp2: Runtime) -> None:
    """Table 2: ``args.streams`` concurrent streams on one device, tp=2 and pp=2 (``tp2``, ``pp2``: table 1's engines,
    one thread per device; alternating rounds), the overlap of pp=2's stages in a traced run, then tp=2 against pp=2
    on 2 gloo ranks without and with the added latency."""
    engines = {"one device": Runtime(1, threads=1, max_num_seqs=max(16, args.streams)), "tp=2, cpu(2)": tp2,
               "pp=2, cpu(2)": pp2}
    prompts = [_prompt(args.prompt + i)[i:] for i in range(args.streams)]  # different prompts of the same length
    tps: dict[str, list[float]] = {k: [] for k in engines}
    cpu: dict[str, list[float]] = {k: [] for k in engines}  # CPU seconds (all threads) per 100 output tokens
    tokens = {}
    for e in engines.values():  # every step shape built, and the prefixes cached as the timed rounds find them
        for _ in range(2):
            e.streams(prompts, 2)
    for _ in range(args.rounds):
        for name, e in engines.items():
            t, toks = e.streams(prompts, args.new)
            tps[name].append(t)
            cpu[name].append(e.cpu_seconds * 100 / (len(prompts) * args.new))
            tokens[name] = toks
    base = tps["one device"]
    load = os.getloadavg()[0]
    print(f"\n{args.streams} concurrent streams, {args.prompt}-token prompts, {args.new} new tokens each, greedy; "
          f"medians of {args.rounds} alternating rounds; load average {load:.1f} on {cores} cores")
    print(f"{'engine':16s} {'threads':>13s} {'tok/s':>8s} {'vs one device':>14s} {'vs tp=2':>8s} "
          f"{'CPU s/100 tok':>14s}")
    threads = {"one device": "1", "tp=2, cpu(2)": "1 per device", "pp=2, cpu(2)": "1 per device"}
    for name in engines:
        r1 = statistics.median(a / b for a, b in zip(tps[name], base, strict=True))
        r2 = statistics.median(a / b for a, b in zip(tps[name], tps["tp=2, cpu(2)"], strict=True))
        print(f"{name:16s} {threads[name]:>13s} {statistics.median(tps[name]):8.1f} {r1:14.2f} {r2:8.2f} "
              f"{statistics.median(cpu[name]):14.2f}")
    one = tokens["one device"]
    same = ", ".join(f"{name} {sum(a == b for a, b in zip(tokens[name], one, strict=True))}/{len(one)}"
                     for name in engines if name != "one device")
    print(f"streams whose greedy tokens equal one device's: {same} (where not all, a near tie broke the other way: "
          "the sums taken in another order)")
    frac = stage_overlap(pp2, prompts, args.new, args.trace_png)
    print(f"pp=2 traced: stage 1's compute stream busy during {frac:.0%} of stage 0's compute (micro-batches in "
          "flight)")
    for e in engines.values():
        e.llm.close()
    both = two_at_once(args)
    if both is not None:
        print(f"this machine's ceiling for two devices: the one-device batch in one process {both[0]:.1f} tok/s, "
              f"in two processes at once {both[1]:.1f} tok/s in all: {both[1] / both[0]:.2f}x (nothing shared or sent)")
    repeats = 1 if args.smoke else 3
    delays = [args.send_delay_ms] if args.smoke else [0.0, args.send_delay_ms]
    print(f"\n2 gloo ranks (torchrun, 1 thread each), {args.prompt}-token prompts, {args.new} new tokens; median of "
          f"{repeats} runs each; one stream: decode tok/s, {args.streams} streams: output tok/s")
    print(f"{'streams, added latency per message':36s} {'tp=2 tok/s':>11s} {'pp=2 tok/s':>11s} {'pp / tp':>8s}")
    rows = [(1, d) for d in delays] + ([] if args.smoke else [(args.streams, args.send_delay_ms)])
    for n, d in rows:  # (--smoke: the pipeline's row only; table 1 ran the tp=2 worker)
        t = None if args.smoke else gloo(2, args.prompt, args.new, repeats, 1, d, n)
        p = gloo(1, args.prompt, args.new, repeats, 2, d, n)
        ratio = f"{p / t:8.2f}" if t and p else f"{'-':>8s}"
        print(f"{f'{n}, {d:g} ms':36s} {t or float('nan'):11.1f} {p or float('nan'):11.1f} {ratio}")


def served_table(args: argparse.Namespace, tp2: Runtime, prompt: list[int]) -> None:
    """Issue #41's target: one stream's decode served across 2 gloo ranks (rank 0 leads, the other follows, as
    ``dtorch serve`` runs; one thread each) against the same split in one process (``tp2``: cpu(2), one thread per
    device); each launch paired with a decode in one process just before it, the ratio the median of the pairs'."""
    runs = {"served, shared memory": {"served": True, "shm": True}, "served, gloo only": {"served": True, "shm": False},
            "generate on every rank, shared memory": {"served": False, "shm": True}}
    if args.smoke:
        runs = {"served, shared memory": runs["served, shared memory"]}
    pairs: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    for _ in range(1 if args.smoke else 3):
        for name, how in runs.items():
            one = tp2.decode(prompt, args.new)[0]
            got = gloo(2, args.prompt, args.new, 1, **how)
            if got is not None:
                pairs[name].append((got, one))
    print(f"\none stream on 2 gloo ranks (torchrun, 1 thread each) against tp=2 in one process (cpu(2), 1 thread per "
          f"device); {args.prompt}-token prompt, {args.new} new tokens; medians of {1 if args.smoke else 3} pairs")
    print(f"{'2 ranks':40s} {'decode tok/s':>13s} {'one process':>12s} {'ranks / one process':>20s}")
    for name, got in pairs.items():
        if not got:
            print(f"FAILED: {name.replace(',', ';')} (its log is above)")
            continue
        ratio = statistics.median(a / b for a, b in got)
        print(f"{name:40s} {statistics.median(a for a, _ in got):13.1f} {statistics.median(b for _, b in got):12.1f} "
              f"{ratio:20.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--alone", action="store_true", help="(internal) the one-device batch of table 2, in its process")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--streams", type=int, default=16, help="concurrent streams of table 2")
    ap.add_argument("--send-delay-ms", type=float, default=2.0,
                    help="added latency before every message a gloo rank sends, in table 2's last rows")
    ap.add_argument("--smoke", action="store_true", help="one round, 8-token prompt, 4 new tokens, 4 streams")
    ap.add_argument("--served", action="store_true", help="(worker) rank 0 leads, the others follow, as serve runs")
    ap.add_argument("--trace-png", default=None, help="also draw the traced tp=2 decode step to this PNG")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.prompt, args.new, args.streams = 1, 8, 4, 4
    if args.worker:
        worker(args)
        return
    if args.alone:
        alone(args)
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
    paired = zip(tps["runtime tp=1"], tps["direct (baseline)"], strict=True)
    print(f"runtime tp=1 / direct: {statistics.median(r / d for r, d in paired):.3f} (median of per-round ratios)")
    if share:
        print(f"tp=2 decode step: communicate streams busy {share:.0%} of the step; {frac:.0%} of that time overlaps "
              "compute on the same device")
    else:
        print("tp=2 decode step: the collectives run on the compute streams (none has a kernel to overlap)")
    print(f"greedy tokens identical across engines: {same}")
    engines["runtime tp=1"].llm.close()
    served_table(args, engines["runtime tp=2, cpu(2)"], prompt)
    streams_table(args, cores, engines["runtime tp=2, cpu(2)"], engines["runtime pp=2, cpu(2)"])


if __name__ == "__main__":
    main()
