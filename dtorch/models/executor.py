"""``Executor``: runs model steps on the runtime, one ``Runner`` per step-shape bucket.

A step is described on the host (``StepPlan``: each sequence's blocks, first position and new tokens); the
executor pads it to its bucket (``bucket_for``), builds the bucket's graph once (``Transformer.graph``) and
runs it with ``Runner(static=True)``: every bucket graph shares the placed weights, the KV cache, the
communicator, the stream threads and its step buffers (``SharedBuffers``: steps run one at a time), so a new bucket
costs one graph build, and buffers only when it needs more than every bucket before it.
Padding rows form one extra sequence with no keys (its rows attend to nothing and write no cache slot, and
its gated delta net states live in the state cache's scratch row).

With ``capture=True`` the decode buckets (one row per sequence: the steps that repeat every token) are captured, where
``Capture.for_steps`` allows (one GPU): their Runners share one ``Capture``, bind capture-safe kernels only and replay
one recording per bucket (a CUDA graph on a GPU, all in one memory pool); ``capture_report()`` says which buckets
replay and why the others do not.

A pipelined model (``Transformer.stages``) runs a bucket as one Runner per stage (``StageRunners``), each on its
stage's tp group with a communicator for that group (``Communicator.group``): a stage's last op sends the residual
stream to the next stage's devices on its communicate streams, where the next stage's first op receives it. Each local
stage runs on a host thread of its own (``StageWorkers``), so ``submit`` may put up to ``depth`` (the number of stages)
steps in flight: stage s runs step m while stage s + 1 runs step m - 1; ``Pending.result`` waits for one.

``mirror`` (None but on rank 0 of a model served across ranks, ``dtorch.engine.ranks``) is told of each call that runs
collectives or builds a graph (``submit``, ``runner`` of a new bucket, ``capture_now``) before it runs, so the other
ranks make the same call: a method that runs collectives must tell it too. A pipeline across processes also tells
each ``Pending.result`` (the last stage's logits are broadcast to every rank then), so micro-batches stay in flight
when served: the other ranks submit each step as it is told and take its result when that is told.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtorch.core.errors import ModelError
from dtorch.models.bucket import Bucket, bucket_for
from dtorch.models.kv_cache import KVCache
from dtorch.models.model import Transformer
from dtorch.models.pipeline import Flight, StageWorkers
from dtorch.runtime.capture import NOT_ASKED, Capture, Recorder, RunCapture
from dtorch.runtime.comm import Communicator
from dtorch.runtime.plan import SharedBuffers
from dtorch.runtime.runner import Runner
from dtorch.runtime.stream import StreamManager


class StageRunners:
    """A pipelined bucket: the Runners of its stages (this process's), run in stage order on the same feeds (each
    takes the ones its graph has); the last stage's outputs are the step's. Never captured (one recording holds one
    device's stream)."""

    def __init__(self, runners: list[Runner]) -> None:
        self.runners = runners
        self.capture = RunCapture(None, "a pipelined step runs one Runner per stage, on several devices")
        self.capture_off = self.capture.status()
        self.captured = False

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        try:
            for r in self.runners:
                out = r.run({k: v for k, v in feeds.items() if k in r.graph.inputs})
        except BaseException:  # a stage failed: what an earlier one sent must not reach the next step's recv
            for r in self.runners:
                r.comm.drop_messages()
            raise
        return out


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step on the host: sequence i has ``counts[i]`` new tokens at positions ``starts[i]``.., its keys in the
    cache blocks ``blocks[i]`` (enough for ``starts[i] + counts[i]`` tokens; -1 for a block freed behind a sliding
    window, which no layer reads) and, for a model with gated delta net
    layers, its state in row ``state_slots[i]``; ``ids`` are all new tokens, sequence after sequence. ``logits``: how
    many of its last rows each sequence wants logits of (a speculative step: its last token and each draft; empty:
    one each). ``long``: every prompt in the step has ``COARSE_PROMPT_ROWS`` tokens or more (``long_prompts``), so
    its rows may be coarse."""

    ids: Sequence[int]
    counts: Sequence[int]
    starts: Sequence[int]
    blocks: Sequence[Sequence[int]]
    state_slots: Sequence[int] = ()
    logits: Sequence[int] = ()
    long: bool = False

    @classmethod
    def chunks(cls, plan: Sequence[tuple[Any, int]], state: bool,
               drafts: Sequence[Sequence[int]] | None = None, long: bool = False) -> StepPlan:
        """The step of ``plan``: (item, n) pairs, each item (a running sequence, an embedding job) with ``ids``,
        ``computed``, ``blocks`` and ``state_slot``, stepping its next n tokens; state slots where ``state``.
        ``drafts``: per pair, draft tokens that follow its n tokens (their blocks held), each wanting logits.
        ``long``: as StepPlan's."""
        if drafts is None:
            return cls([t for s, n in plan for t in s.ids[s.computed:s.computed + n]], [n for _, n in plan],
                       [s.computed for s, _ in plan], [s.blocks for s, _ in plan],
                       [s.state_slot for s, _ in plan] if state else (), long=long)
        return cls([t for (s, n), d in zip(plan, drafts, strict=True) for t in (*s.ids[s.computed:s.computed + n], *d)],
                   [n + len(d) for (_, n), d in zip(plan, drafts, strict=True)], [s.computed for s, _ in plan],
                   [s.blocks for s, _ in plan], [s.state_slot for s, _ in plan] if state else (),
                   [1 + len(d) for d in drafts])


class Pending:
    """A step submitted to an ``Executor``; ``result()`` is ``Executor.step``'s return (a pipelined step's, once its
    last stage ends). Call ``result`` on every pending step, in the order they were submitted (under torchrun the
    last stage's logits reach the other ranks then, by a collective)."""

    __slots__ = ("executor", "bucket", "flight", "out", "take", "want")

    def __init__(self, executor: Executor, bucket: Bucket, flight: Flight | None, out: dict | None, take: int,
                 want: str) -> None:
        self.executor, self.bucket, self.flight, self.out, self.take, self.want = \
            executor, bucket, flight, out, take, want

    def result(self) -> torch.Tensor:
        ex = self.executor
        if ex.mirror is not None and ex.logits_from is not None:  # the other ranks join the logits' broadcast
            ex.mirror.tell("result")
        try:
            out = self.out if self.flight is None else self.flight.wait(ex.timeout * (len(ex.model.stages) + 1))
            logits = out.get(self.want)
            if ex.logits_from is not None:
                logits = ex._from_last_stage(logits, self.bucket)
        except BaseException as exc:
            ex.told_failed(exc)
            raise
        logits = logits[:self.take]
        return logits if logits.dtype == torch.float32 else logits.float()


class Executor:
    """Runs steps of ``model`` on its mesh; ``cache`` must be set (``use_cache``) before the first step. ``streams``:
    another executor's stream threads to run on (a draft model's: one OpenMP team per device, not two); its owner
    shuts them down."""

    def __init__(self, model: Transformer, communicator: Communicator, local_ids: tuple[int, ...],
                 timeout: float, trace: bool = False, capture: bool = False, recorder: Recorder | None = None,
                 streams: StreamManager | None = None) -> None:
        self.model = model
        self.comm = communicator
        self.local_ids = local_ids
        self.timeout = timeout
        self.streams = streams if streams is not None else StreamManager(len(local_ids))
        # a dropped model leaves no threads
        self._finalizer = weakref.finalize(self, self.streams.shutdown if streams is None else lambda: None)
        self.tracer = None
        if trace:
            self.set_trace(True)
        self.cache: KVCache | None = None
        self._has_state: bool | None = None  # _state_feed
        self._tables: dict[str, tuple[torch.Tensor, Any]] = {}  # _numpy: RoPE tables' numpy views
        self.mirror: Any = None  # rank 0 of a served model: tells every rank each call (``ranks.Teller``)
        self.runners: dict[Bucket, Runner] = {}
        # the buckets' step buffers, shared: one step runs at a time and its logits are copied out, so a device holds
        # what its largest bucket needs rather than the sum over every bucket built
        self.buffers = {i: SharedBuffers(model.mesh.device(i)) for i in local_ids}
        # one capture (one recorder) for every decode bucket, so the recordings share one memory pool
        self.capture = Capture.for_steps(model.mesh.device(local_ids[0]), model.mesh.size, asked=capture,
                                         recorder=recorder)
        # each stage's communicator (its tp group's collectives), made by every process for every stage in order (a
        # process group's sub-groups are made collectively); the stages this process runs
        self.stage_comms = [communicator.group(st.mesh.ids) for st in model.stages] if len(model.stages) > 1 else []
        self.local_stages = [st for st in model.stages if set(st.mesh.ids) & set(local_ids)]
        # under torchrun, the last stage's first rank gives every rank the step's logits (each samples them)
        self.logits_from = None if len(self.local_stages) == len(model.stages) else model.stages[-1].mesh.ids[0]
        # steps a pipeline keeps in flight at most: one per stage (1: each step ends before the next starts)
        self.depth = len(model.stages)
        self.workers = StageWorkers(len(self.local_stages), timeout, self.local_stages[0].index) \
            if self.depth > 1 else None
        if self.workers is not None:  # a dropped model leaves no stage threads either
            weakref.finalize(self, self.workers.close)

    def set_trace(self, on: bool) -> None:
        """Record every kernel's start and end on its stream (``self.tracer``), or stop."""
        from dtorch.runtime.tracing import Tracer

        self.tracer = Tracer() if on else None
        self.streams.set_tracer(self.tracer)

    def use_cache(self, cache: KVCache) -> None:
        """Run later steps on ``cache``; the bucket graphs, which name the old cache, are dropped."""
        if cache is not self.cache:
            self.runners.clear()
            self.cache = cache

    def runner(self, bucket: Bucket) -> Runner | StageRunners:
        """The Runner of ``bucket`` (a pipeline's: its ``StageRunners``), built on first use."""
        r = self.runners.get(bucket)
        if r is None:
            if self.mirror is not None:
                self.mirror.tell("runner", bucket)
            stages = self.model.stages
            if len(stages) == 1:
                g = self.model.graph(bucket, self.cache.tensors, self.cache.max_blocks_per_seq)
                r = Runner(g, self.comm, timeout=self.timeout, streams=self.streams, static=True,
                           capture=self._capture(bucket), buffers=self.buffers)
            else:
                r = StageRunners([Runner(self.model.graph(bucket, self.cache.tensors, self.cache.max_blocks_per_seq,
                                                          st.index),
                                         self.stage_comms[st.index], timeout=self.timeout, streams=self.streams,
                                         static=True, buffers=self.buffers)
                                  for st in self.local_stages])
            self.runners[bucket] = r
        return r

    def _capture(self, bucket: Bucket) -> Capture:
        """Decode buckets are captured (prefill shapes vary); where nothing is, every bucket says why."""
        return self.capture if bucket.decode or self.capture.off is not None else Capture(off=NOT_ASKED)

    def capture_now(self, bucket: Bucket) -> bool:
        """Record ``bucket`` now, where it is to be captured: two runs of padding rows alone (they write no cache
        slot, and gated delta net layers give them the state cache's scratch row), the uncaptured first run and the
        recording. Returns whether the bucket replays a recording afterwards."""
        r = self.runner(bucket)
        if r.capture_off is not None:
            return False
        if self.mirror is not None:
            self.mirror.tell("capture_now", bucket)
        idle = self.feeds(StepPlan((), (), (), ()), bucket)
        while not r.captured and r.capture_off is None:
            r.run(idle)
        return r.captured

    def capture_report(self) -> dict[Bucket, str]:
        """Each built bucket: "captured" (its runs replay a recording), "to capture" (its next run records) or why
        it runs uncaptured."""
        return {b: r.capture.status() for b, r in self.runners.items()}

    def step(self, plan: StepPlan, all_logits: bool = False, hidden: bool = False,
             borrow: bool = False) -> torch.Tensor:
        """Run one step; returns float32 logits [N, V] of each sequence's last token (``plan.logits``: [sum of it, V],
        each sequence's last rows in order; ``all_logits``: [T, V]; with ``hidden``: the final norm's output of every
        token, [T, H], instead). ``borrow``: on one CPU, a view of the step's own output buffer (no copy; the next
        step writes over it), for a caller done with it by then (``Runner.run``)."""
        if self.cache is None:
            raise ModelError("Executor.step: no KV cache (call use_cache first)")
        return self.submit(plan, all_logits, hidden, borrow).result()

    def submit(self, plan: StepPlan, all_logits: bool = False, hidden: bool = False, borrow: bool = False) -> Pending:
        """Start ``plan`` (as ``step``); a pipeline returns while the step is in its stages (at most ``depth`` steps
        should be in flight: a stage holds the others back), a model of one stage once the step has run."""
        if self.cache is None:
            raise ModelError("Executor.submit: no KV cache (call use_cache first)")
        counts = list(plan.counts)
        n, t = len(counts), sum(counts)
        rows = sum(plan.logits) if plan.logits else n
        bucket = bucket_for(t, n, all_logits, hidden, rows, plan.long)
        built = self.runners.get(bucket)
        into = built.feed_buffers() if isinstance(built, Runner) and self.workers is None else None
        feeds = self.feeds(plan, bucket, into)
        r = self.runner(bucket)
        take, want = (t if all_logits or hidden else rows), ("hidden" if hidden else "logits")
        if self.mirror is not None:
            self.mirror.tell("submit", plan, all_logits, hidden)
        try:
            if self.workers is None:
                return Pending(self, bucket, None, r.run(feeds, borrow=borrow), take, want)
            return Pending(self, bucket, self.workers.submit(r.runners, feeds), None, take, want)
        except BaseException as exc:  # the other ranks ran the step, or fail in it: the ranks may be out of step
            self.told_failed(exc)
            raise

    def told_failed(self, exc: BaseException) -> None:
        """A step that was told to the other ranks (``mirror``) failed here: they may be out of step."""
        if self.mirror is not None:
            self.mirror.failed(exc)

    def _from_last_stage(self, out: torch.Tensor | None, bucket: Bucket) -> torch.Tensor:
        """A pipeline across processes: the last stage's output (None on the other ranks), broadcast from its first
        rank to every rank: [T, H] with ``bucket.hidden``, else [T or rows or N, V] logits (``Transformer.graph``)."""
        c = self.model.config
        if out is None:
            rows = bucket.tokens if bucket.all_logits else bucket.rows or bucket.seqs
            shape = (bucket.tokens, c.hidden_size) if bucket.hidden else (rows, c.vocab_size)
            out = torch.empty(shape, dtype=self.model.dtype, device=self.model.mesh.device(self.local_ids[0]).torch)
        self.comm.broadcast(self.local_ids[0], out, out, src=self.logits_from)
        return out

    def feeds(self, plan: StepPlan, bucket: Bucket, into: dict[str, tuple[torch.Tensor, Any]] | None = None
              ) -> dict[str, torch.Tensor]:
        """The step's padded inputs (host tensors; the Runner places them on each device). Built from Python lists
        into two host tensors (int64: ids, slot rows, state slots, last rows; int32: cu_seqlens_q, seqlens_k and the
        block table) whose slices are the feeds: a decode step's inputs cost a few torch calls, not one per feed.
        ``into`` (the bucket's ``Runner.feed_buffers()``): the values are written straight into those buffers with
        numpy, and the feeds are the buffers themselves (no torch call at all)."""
        T, N = bucket.tokens, bucket.seqs
        counts, starts = list(plan.counts), list(plan.starts)
        t, n = sum(counts), len(counts)
        bs = self.cache.block_size
        pad = T - t
        positions = list(itertools.chain.from_iterable(range(s, s + c) for s, c in zip(starts, counts, strict=True)))
        rows = [blocks[p // bs] * bs + p % bs
                for blocks, s, c in zip(plan.blocks, starts, counts, strict=True) for p in range(s, s + c)]
        seq_counts = counts + ([pad] if pad else [])
        seq_counts += [0] * (N - len(seq_counts))
        cu = list(itertools.accumulate(seq_counts, initial=0))
        self.model.rope_reach(max(positions) if positions else 0)  # past the loaded maximum: ModelError
        # int64 [T ids | T slot rows | N state slots? | rows last rows?]
        longs = list(plan.ids) + [0] * pad + rows + [-1] * pad  # padding rows write no cache row
        state = self._has_state if self._has_state is not None else self._state_feed()
        if state:  # padding sequences read and write the scratch row of the state cache
            longs += list(plan.state_slots) + [self.cache.scratch] * (N - n)
        last_n = 0
        if not bucket.all_logits and (T != N or bucket.rows):
            wanted = plan.logits or [1] * n
            last = [r for i, w in enumerate(wanted) for r in range(cu[i + 1] - w, cu[i + 1])]
            last_n = bucket.rows or N
            longs += last + [0] * (last_n - len(last))
        # int32 [N + 1 cu_seqlens_q | N seqlens_k | N x M block table]: zeros, then the values from one host tensor of
        # the first two and the blocks each sequence holds (M, a sequence's blocks at most, may be thousands)
        M = self.cache.max_blocks_per_seq
        if any(len(blocks) > M for blocks in plan.blocks):
            raise ModelError(f"Executor.feeds: a sequence holds more than the cache's {M} blocks a sequence")
        head = cu + [s + c for s, c in zip(starts, counts, strict=True)] + [0] * (N - n)
        if into is not None:
            written = self._write_feeds(into, longs, head, plan.blocks, positions, pad, T, N, state, last_n)
            if written is not None:
                return written
        values = torch.tensor(head + [b for blocks in plan.blocks for b in blocks], dtype=torch.int32)
        if any(min(blocks) < 0 for blocks in plan.blocks if blocks):
            values[len(head):].clamp_(min=0)  # a block freed behind a sliding window (-1) is never read: any will do
        i32 = torch.zeros(len(head) + N * M, dtype=torch.int32)
        first = len(plan.blocks[0]) if n else 0
        i32[:len(head) + first] = values[:len(head) + first]  # the head and the first sequence's blocks, in one
        at = len(head) + first
        for i, blocks in enumerate(plan.blocks[1:], 1):
            if blocks:
                i32[len(head) + i * M:len(head) + i * M + len(blocks)] = values[at:at + len(blocks)]
                at += len(blocks)
        i64 = torch.tensor(longs, dtype=torch.int64)
        feeds = {
            "ids": i64[:T],
            "slot_mapping": i64[T:2 * T],
            "cu_seqlens_q": i32[:N + 1],
            "seqlens_k": i32[N + 1:2 * N + 1],
            "block_table": i32[2 * N + 1:].view(N, M),
        }
        feeds["cos"], feeds["sin"] = self._rope(self.model.rope_table, positions, pad, n)
        if self.model.rope_local_table is not None:  # the sliding layers' own RoPE base
            feeds["cos_local"], feeds["sin_local"] = self._rope(self.model.rope_local_table, positions, pad, n)
        if state:
            feeds["state_slots"] = i64[2 * T:2 * T + N]
        if last_n:
            feeds["last_rows"] = i64[len(longs) - last_n:]
        return feeds

    def _write_feeds(self, into: dict[str, tuple[torch.Tensor, Any]], longs: list[int], head: list[int],
                     blocks: Sequence[Sequence[int]], positions: list[int], pad: int, T: int, N: int, state: bool,
                     last_n: int) -> dict[str, torch.Tensor] | None:
        """``feeds``' values (its lists ``longs`` and ``head``, the sequences' blocks, the RoPE rows of
        ``positions`` and ``pad`` padding rows) written into the buffers ``into`` ({name: (tensor, numpy view)}); the
        feeds {name: buffer}, or None where the graph's inputs are not the ones written here."""
        tables = {"cos": ("global", 0), "sin": ("global", 1)}
        if self.model.rope_local_table is not None:
            tables.update(cos_local=("local", 0), sin_local=("local", 1))
        ints = {"ids": longs[:T], "slot_mapping": longs[T:2 * T], "cu_seqlens_q": head[:N + 1],
                "seqlens_k": head[N + 1:]}
        if state:
            ints["state_slots"] = longs[2 * T:2 * T + N]
        if last_n:
            ints["last_rows"] = longs[len(longs) - last_n:]
        if set(into) != set(ints) | set(tables) | {"block_table"}:
            return None
        for name, values in ints.items():
            into[name][1][:] = values
        table = into["block_table"][1]  # [N, M]
        table.fill(0)
        for i, held in enumerate(blocks):
            if held:  # a block freed behind a sliding window (-1) is never read: any will do
                table[i, :len(held)] = held if min(held) >= 0 else [max(b, 0) for b in held]
        rows = slice(positions[0], positions[-1] + 1) if len(blocks) == 1 and not pad else positions + [0] * pad
        for name, (which, half) in tables.items():
            into[name][1][:] = self._numpy(which)[rows, half]
        return {name: t for name, (t, _) in into.items()}

    def _numpy(self, which: str) -> Any:
        """A numpy view of the model's RoPE table ``which`` ("global" or "local") [P, 2, D / 2], made once per table
        and made again when the table has grown (``Transformer.rope_reach`` replaces it; the old one is let go)."""
        table = self.model.rope_table if which == "global" else self.model.rope_local_table
        view = self._tables.get(which)
        if view is None or view[0] is not table:
            view = self._tables[which] = (table, table.numpy())
        return view[1]

    @staticmethod
    def _rope(table: torch.Tensor, positions: list[int], pad: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D / 2] of ``positions`` then ``pad`` padding rows (position 0: they attend to nothing, any
        position in the table does); one sequence with no padding takes a view of its rows of ``table``."""
        if n == 1 and not pad:
            cs = table[positions[0]:positions[-1] + 1]  # [T, 2, D / 2]
        else:
            cs = table[torch.tensor(positions + [0] * pad, dtype=torch.int64)]
        return cs.unbind(1)

    def _state_feed(self) -> bool:
        """Whether the model has gated delta net layers (their state slots are a feed); asked once."""
        self._has_state = bool(self.model.config.linear_layers)
        return self._has_state

    def close(self) -> None:
        """Stop the stage and stream threads."""
        if self.workers is not None:
            self.workers.close()
        self.runners.clear()
        self._finalizer()
