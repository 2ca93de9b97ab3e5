"""What ``dtorch serve`` tells its operator: the start banner, one line per request, and while the engine is busy a
throughput line every few seconds (vLLM's "Avg prompt throughput ..." line).

Everything goes to the ``dtorch.serve`` logger; ``setup_logging`` gives the ``dtorch`` loggers a handler on stderr at
``--log-level``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import traceback
from collections import Counter
from typing import Any

log = logging.getLogger("dtorch.serve")

MAX_LOGGED_FRAMES = 40  # of a traceback in the log: the innermost (a RecursionError's ran to 200 KB a request)
MAX_LOGGED_TRACEBACK = 20_000  # characters of one logged traceback at most (its end kept)


def setup_logging(level: str) -> None:
    """The ``dtorch`` loggers at ``level`` ("info", ...) on stderr, one line each with the time, repeats held back
    (``RepeatFilter``); asyncio's lines (a failing ``accept``) go the same way."""
    root = logging.getLogger("dtorch")
    root.setLevel(level.upper())
    if not any(getattr(h, "dtorch_serve", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(BriefFormatter("%(levelname)-8s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S"))
        handler.dtorch_serve = True
        handler.addFilter(RepeatFilter(handler))
        root.addHandler(handler)
        logging.getLogger("asyncio").addHandler(handler)
        logging.getLogger("asyncio").propagate = False
    root.propagate = False


def hold_back_repeats(*names: str) -> None:
    """Give each handler of the loggers ``names`` (uvicorn's, once it configured them) a ``RepeatFilter``."""
    for name in names:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RepeatFilter) for f in handler.filters):
                handler.addFilter(RepeatFilter(handler))


class BriefFormatter(logging.Formatter):
    """A formatter whose tracebacks keep their innermost ``MAX_LOGGED_FRAMES`` frames and at most
    ``MAX_LOGGED_TRACEBACK`` characters: a request that fails deep in a recursion logs a few KB, not a flood."""

    def formatException(self, ei) -> str:  # noqa: N802 - logging's name
        text = "".join(traceback.format_exception(ei[0], ei[1], ei[2], limit=-MAX_LOGGED_FRAMES)).rstrip("\n")
        if len(text) > MAX_LOGGED_TRACEBACK:
            text = f"[{len(text) - MAX_LOGGED_TRACEBACK} characters left out]\n" + text[-MAX_LOGGED_TRACEBACK:]
        return text


class RepeatFilter(logging.Filter):
    """A handler's filter that lets one of a run of identical lines through (same logger, level and message), then
    the 10th, 100th, 1000th ... with "(repeated N times)", and when the run ends a line saying how long it was: a
    fault that repeats a million times (a full file table) writes a few lines, not a million. A run ends at another
    line, or after ``window`` seconds."""

    def __init__(self, handler: logging.Handler, window: float = 60.0) -> None:
        super().__init__()
        self.handler, self.window = handler, window
        self._last: tuple | None = None
        self._count, self._since = 0, 0.0
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        now = time.monotonic()
        with self._lock:
            if key == self._last and now - self._since < self.window:
                self._count += 1
                if str(self._count).rstrip("0") != "1":  # the 10th, 100th, 1000th ... pass
                    return False
                record.msg, record.args = f"{record.getMessage()} (repeated {self._count} times)", None
                return True
            ended = (self._last, self._count) if self._count > 1 else None
            self._last, self._count, self._since = key, 1, now
        if ended is not None:
            (name, level, message), count = ended
            summary = logging.LogRecord(name, level, __file__, 0, "the line before repeated %d times in all: %.200s",
                                        (count, message), None)
            with self.handler.lock:  # as Handler.handle does (this filter runs before it takes the lock)
                self.handler.emit(summary)
        return True


def banner(llm: Any, name: str, url: str, load_seconds: float, listening_seconds: float | None = None,
           ranks: list[Any] | None = None) -> str:
    """The start banner: what is served and where, what was loaded (its weights' formats, the threads; ``dtorch
    info``'s line), how long the start took (the load, then until the server listened) and how the step shapes are
    being built, and the memory the KV cache and the process hold; served across ranks (``ranks``: each one's
    ``ranks.RankInfo``), a line per rank: its host, process, device, layers and shard, and bytes held."""
    from dtorch.engine.info import describe_loaded, mib

    rss = _rss()
    cache, engine = llm.cache, llm.engine
    started = f"  listening {listening_seconds:.1f} s after the start; " if listening_seconds is not None else "  "
    shapes = (f"{started}step shapes: {engine.warm_built} of {engine.warm_total} built, the rest as requests need "
              "them and between requests (/health says warming until all are)" if not engine.warm else
              f"{started}step shapes: all {engine.warm_total} built")
    return "\n".join([f"dtorch serve: {name} on {url}", f"  {describe_loaded(llm, load_seconds)}", shapes,
                      f"  KV cache {mib(cache.nbytes)} reserved for {cache.num_blocks * cache.block_size} tokens" +
                      (f"; the process holds {mib(rss)} now" if rss else "") +
                      f"; at most {llm.max_num_seqs} sequences a step"] + _rank_lines(llm, ranks))


def _rank_lines(llm: Any, ranks: list[Any] | None) -> list[str]:
    if not ranks:
        return []
    import torch.distributed as dist

    return [f"  {len(ranks)} ranks ({llm.mesh.pp_size} pipeline stages x {llm.mesh.tp_size} tensor-parallel, "
            f"{dist.get_backend()}); rank 0 runs the server and the scheduler, every rank each step:",
            *(f"    {r.line()}" for r in ranks)]


def _rss() -> int | None:
    """Resident bytes of this process (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class RequestLog:
    """One HTTP request's log line, kept from its engine deltas: prompt and completion tokens, time to the first
    token, the decode rate after it, and how its choices finished."""

    def __init__(self, request_id: str) -> None:
        self.id = request_id
        self.start = time.monotonic()
        self.first: float | None = None
        self.prompt: dict[str, int] = {}  # engine request id -> its prompt tokens
        self.completion: dict[tuple[str, int], int] = {}  # (engine request id, choice) -> tokens so far
        self.finish: Counter[str] = Counter()

    def add(self, d: Any) -> None:
        if d.token_ids and self.first is None:
            self.first = time.monotonic()
        self.prompt[d.request_id] = d.prompt_tokens
        self.completion[(d.request_id, d.index)] = d.completion_tokens
        if d.finish_reason is not None:
            self.finish[d.finish_reason] += 1

    def line(self, unfinished: int = 0) -> str:
        tokens = sum(self.completion.values())
        end = time.monotonic()
        ttft = f"{self.first - self.start:.3f} s" if self.first is not None else "-"
        after = tokens - len(self.completion)  # the tokens after each choice's first
        rate = f"{after / (end - self.first):.1f} tok/s" if self.first is not None and after > 0 and end > self.first \
            else "- tok/s"
        finish = dict(self.finish)
        if unfinished:
            finish["abort"] = finish.get("abort", 0) + unfinished
        reasons = ", ".join(r if n == 1 else f"{r} x{n}" for r, n in finish.items()) or "-"
        return (f"{self.id}: prompt {sum(self.prompt.values())} tokens, completion {tokens} tokens, first token "
                f"{ttft}, {rate}, {end - self.start:.2f} s, finish {reasons}")


async def log_throughput(engine: Any, interval: float) -> None:
    """Every ``interval`` seconds while the engine works: prompt and generation tokens per second since the last line,
    requests running and waiting, and the KV cache's use (until cancelled)."""
    before, then = engine.stats(), time.monotonic()
    while True:
        await asyncio.sleep(interval)
        now, at = engine.stats(), time.monotonic()
        prompt, generated = now.prompt_tokens - before.prompt_tokens, now.generation_tokens - before.generation_tokens
        if prompt or generated or now.running or now.waiting:
            span = at - then
            log.info("throughput: prompt %.1f tok/s, generation %.1f tok/s; %d requests running, %d waiting; "
                     "KV cache %.1f%% used", prompt / span, generated / span, now.running, now.waiting,
                     100 * now.kv_usage)
        before, then = now, at
