"""The server's state behind the HTTP routes (``app.build_app``): the model and its engine, the worker pool that runs
templates, tokenizers and grammars off the event loop, the requests waiting on the engine, and the calls a route makes
to add engine requests and prompt passes, wait for their deltas and abort them when the client hangs up."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request

from dtorch.core.errors import ArgumentError, ContextLengthError, DtorchError, EngineBusy, ModelError, SamplingError
from dtorch.engine.infill import fim_prompt
from dtorch.engine.request import Delta
from dtorch.serve.errors import ApiError, ClientGone, bad_request, context_exceeded
from dtorch.serve.logs import RequestLog
from dtorch.serve.metrics import ServerMetrics
from dtorch.serve.responses import (
    Echo,
)

log = logging.getLogger("dtorch.serve")
POLL_S = 0.25  # how often a non-streamed request checks whether its client is still there
WORKERS = 2  # threads that render templates and run tokenizers (which release the GIL) and grammar compilers
# after the shutdown's grace: how long the engine's aborts may take to reach the requests still waiting before those
# end with a 503 on their own (the aborts wait for the step in flight; uvicorn's backstop would cut them with a
# plain-text 500)
LATE_ABORT_S = 1.0


class Server:
    """The app's state: the model, its engine, the metrics, the worker pool, and how a request runs."""

    def __init__(self, llm: Any, served_model_name: str, workers: int) -> None:
        self.llm, self.engine, self.name = llm, llm.engine, served_model_name
        self.metrics = ServerMetrics(self.engine)
        self.created = int(time.time())
        self.serving = False
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="dtorch-tokenize")
        self.token_bytes = functools.lru_cache(maxsize=65536)(self._token_bytes)
        # a model served across ranks: why one was lost (then every request is refused), the event loop and what the
        # requests in flight wait on (their delta queues, embedding futures), which ``lose`` ends with an error
        self.lost: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.waiting: set[Any] = set()

    def lost_error(self) -> ApiError:
        return ApiError(503, f"the model's ranks are no longer complete: {self.lost}", "ServiceUnavailableError",
                        None, "rank_lost")

    def lose(self, why: str) -> None:
        """A rank of the model was lost (any thread): /health answers 503, new requests are refused and those in
        flight end with that error, before any delta the engine sends them after."""
        self.lost = why
        self._end_waiting(self.lost_error())

    def grace_ended(self) -> None:
        """The shutdown's grace is over (any thread; ``EngineLoop.at_grace_end``): the requests still waiting
        ``LATE_ABORT_S`` later, their engine aborts held up behind a long step, end with a 503."""
        self._end_waiting(ApiError(503, "the server shut down before the request was done (its --shutdown-grace "
                                        "ended)", "ServiceUnavailableError", None, "shutting_down"), LATE_ABORT_S)

    def _end_waiting(self, error: ApiError, after: float = 0.0) -> None:
        """In ``after`` seconds, end every request in flight (any thread) with ``error``: its delta queue gets it, a
        pass's future raises it."""
        loop = self.loop
        if loop is None:
            return

        def fail_all() -> None:
            for w in list(self.waiting):
                if isinstance(w, asyncio.Queue):
                    w.put_nowait(error)
                elif not w.done():
                    w.set_exception(error)

        try:  # at once: the same hop as the engine's deltas (``sink``), so the error is queued before any delta the
            # engine sends after this call ("abort" for a lost rank's requests); ``call_later(0)`` would run it one
            # loop iteration later, behind those deltas, and the stream would end as if finished
            if after > 0:
                loop.call_soon_threadsafe(loop.call_later, after, fail_all)
            else:
                loop.call_soon_threadsafe(fail_all)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass

    def check_ranks(self) -> None:
        """The 503 of a lost rank."""
        if self.lost is not None:
            raise self.lost_error()

    async def off_loop(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the worker pool: templates, tokenizers, grammars, large answers' text."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    def _token_bytes(self, token_id: int) -> bytes:
        tok = self.llm.tokenizer
        return tok.token_bytes(token_id) if tok is not None else str(token_id).encode()

    def token_text(self, token_id: int) -> str:
        """A token as OpenAI shows it: its text, or ``\\xNN`` escapes for bytes that are part of a UTF-8 character."""
        return self.token_bytes(token_id).decode("utf-8", "backslashreplace")

    def encode(self, prompts: Sequence[str | Sequence[int]], what: str,
               max_total: int | None = None) -> list[list[int]]:
        """Each prompt's token ids (texts encoded), checked against the context; a text that cannot fit is refused
        from its length before it is encoded. ``max_total``: the prompts' tokens together at most (refused from
        their lengths' lower bounds before anything is encoded, then counted). Run it on the worker pool."""
        out, tok = [], self.llm.tokenizer
        if max_total is not None:
            least = sum(len(p) if not isinstance(p, str) else tok.min_tokens(p) if tok is not None else 0
                        for p in prompts)
            _check_total(least, max_total, what, at_least=True)
        for i, p in enumerate(prompts):
            name = what if len(prompts) == 1 else f"{what}[{i}]"
            if isinstance(p, str):
                if tok is None:
                    try:
                        self.llm.need_tokenizer("text prompts")  # raises, saying what is missing and why
                    except ModelError as exc:
                        raise ApiError(400, str(exc), param=what) from None
                self.engine.check_length(tok.min_tokens(p), name, at_least=True)
                p = tok.encode(p)
            out.append(self.engine.check_prompt(p, name))
        if max_total is not None:
            _check_total(sum(len(t) for t in out), max_total, what)
        return out

    def infill(self, prompts: Sequence[str | Sequence[int]], suffix: str) -> tuple[list[list[int]], tuple[int, ...]]:
        """Fill-in-the-middle prompts (``engine.infill``) of text prompts before ``suffix``, checked against the
        context, and the stop token ids that end a middle. Run it on the worker pool."""
        tok, out, ends = self.llm.tokenizer, [], ()
        if tok is None or not all(isinstance(p, str) for p in prompts):
            raise ApiError(400, "suffix (fill-in-the-middle) needs text prompts and a model with a tokenizer",
                           param="suffix")
        for i, p in enumerate(prompts):
            self.engine.check_length(tok.min_tokens(p) + tok.min_tokens(suffix), "prompt", at_least=True)
            ids, ends = fim_prompt(tok, p, suffix)
            out.append(self.engine.check_prompt(ids, "prompt" if len(prompts) == 1 else f"prompt[{i}]"))
        return out, ends

    async def echoes(self, rid: str, prompts: list[str | list[int]], ids: list[list[int]], logprobs: int | None,
                     request: Request) -> list[Echo]:
        """The echoed prompts of a completion and, with ``logprobs``, their tokens' logprobs: each prompt scored on
        the engine (``Engine.add_scoring``: in chunks, beside other work, aborted when the client leaves)."""
        scores = [None] * len(ids)
        if logprobs is not None:
            scores = await self.passes(rid, len(ids), lambda job, sink: self.engine.add_scoring(
                job, ids[int(job.rsplit("-", 1)[1])], logprobs, sink, group=rid), request, "prompt")
        return await self.off_loop(self._echoes, prompts, ids, scores)

    def _echoes(self, prompts: list[str | list[int]], ids: list[list[int]], scores: list[Any]) -> list[Echo]:
        out = []
        for p, t, score in zip(prompts, ids, scores, strict=True):
            text = p if isinstance(p, str) else self.llm.tokenizer.decode(t, skip_special_tokens=False) \
                if self.llm.tokenizer is not None else ""
            out.append(Echo(text, None if score is None else self._prompt_logprobs(t, score)))
        return out

    def _prompt_logprobs(self, ids: list[int], score: Any) -> dict[str, Any]:
        """Completions' logprobs of a scored prompt (``prompt_pass.PromptLogprobs``), the first token's null."""
        # most likely first: where two tokens have one text, the entry keeps the likelier's logprob
        tops = [None] + [dict(reversed([(self.token_text(i), v) for i, v in top])) for top in score.top]
        tokens = [self.token_text(t) for t in ids]
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
        return {"tokens": tokens, "token_logprobs": [None, *score.values], "top_logprobs": tops,
                "text_offset": offsets}

    async def passes(self, rid: str, count: int, add: Callable[[str, Any], None], request: Request | None,
                     param: str) -> list[Any]:
        """Queue ``count`` prompt passes of group ``rid`` (``add(job_id, sink)`` for job ids ``rid-0`` ..) and
        their results in order. With ``request``, its client is polled: ClientGone when it left. However this ends,
        unfinished passes are aborted."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(count)]

        def sink(job_id: str, result: Any) -> None:  # on the engine's thread
            f = futures[int(job_id.rsplit("-", 1)[1])]
            try:
                loop.call_soon_threadsafe(lambda: f.done() or f.set_result(result))
            except RuntimeError:  # the event loop is closed: the server is gone
                pass

        self.check_ranks()
        self.waiting.update(futures)  # a lost rank fails them (``lose``)
        try:
            try:
                for i in range(count):
                    add(f"{rid}-{i}", sink)
            except EngineBusy as exc:
                raise ApiError(503, str(exc), "ServiceUnavailableError", None, "engine_busy") from None
            except (ArgumentError, ModelError) as exc:
                raise bad_request(exc, param) from None
            pending = set(futures)
            while pending:
                _, pending = await asyncio.wait(pending, timeout=POLL_S)
                if pending and request is not None and await request.is_disconnected():
                    raise ClientGone()
        finally:
            self.waiting.difference_update(futures)
            if not all(f.done() for f in futures):
                self.engine.abort(rid)
        results = [f.result() for f in futures]
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    def check_model(self, model: str | None) -> None:
        if model and model != self.name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.name}`.",
                           param="model", code="model_not_found")

    async def compile(self, params: Any, origin: str | None) -> None:
        """Compile the request's grammar off the event loop (the engine then only copies it); a 400 naming
        ``origin`` (response_format, structured_outputs, tool_choice) when the library cannot."""
        if params.structured_outputs is None:
            return
        try:
            await self.off_loop(self.engine.grammars.compile, params.structured_outputs)
        except DtorchError as exc:
            raise ApiError(400, str(exc), param=origin) from None

    def submit(self, rid: str, prompts: list[list[int]], params: Any, param: str) -> asyncio.Queue[Delta]:
        """Add one engine request per prompt (ids ``rid-0``, ``rid-1``, ...); their deltas arrive on the queue."""
        self.check_ranks()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delta] = asyncio.Queue()

        def sink(delta: Delta) -> None:  # on the engine's thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, delta)
            except RuntimeError:  # the event loop is closed: the server is gone
                pass

        limit = params.max_tokens
        for ids in prompts:
            if limit is not None and len(ids) < self.llm.max_len < len(ids) + limit:  # alone too long: engine says
                raise context_exceeded(ContextLengthError(
                    f"the prompt has {len(ids)} tokens and max_tokens asks for {limit} more",
                    tokens=len(ids), limit=self.llm.max_len, requested=limit), "max_tokens", param)
        added: list[str] = []
        try:
            for p, ids in enumerate(prompts):
                self.engine.add_request(f"{rid}-{p}", ids, params, sink)
                added.append(f"{rid}-{p}")
        except BaseException as exc:
            for a in added:
                self.engine.abort(a)
            if isinstance(exc, EngineBusy):
                raise ApiError(503, str(exc), "ServiceUnavailableError", None, "engine_busy") from None
            if isinstance(exc, (ArgumentError, ModelError, SamplingError)):
                raise bad_request(exc, param) from None
            raise
        self.waiting.add(queue)
        return queue

    async def deltas(self, rid: str, prompts: int, n: int, queue: asyncio.Queue[Delta],
                     request: Request | None) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) until every choice has finished. With ``request`` (non-streamed), its client is
        polled, and ClientGone raised when it left. However this ends, the unfinished engine requests are aborted.
        """
        left = {f"{rid}-{p}": n for p in range(prompts)}
        record = RequestLog(rid)
        start, first = time.monotonic(), True
        checked = start
        try:
            while left:
                if request is None:
                    d = await queue.get()
                else:
                    try:
                        d = await asyncio.wait_for(queue.get(), POLL_S)
                    except TimeoutError:
                        d = None
                    if time.monotonic() - checked >= POLL_S:
                        checked = time.monotonic()
                        if await request.is_disconnected():
                            raise ClientGone()
                    if d is None:
                        continue
                if isinstance(d, ApiError):  # a lost rank (``lose``)
                    raise d
                record.add(d)
                if d.token_ids:
                    if first:
                        self.metrics.ttft.observe(time.monotonic() - start)
                        first = False
                    self.metrics.tokens(len(d.token_ids))
                if d.finish_reason is not None:
                    self.metrics.finished.labels(d.finish_reason).inc()
                    left[d.request_id] -= 1
                    if not left[d.request_id]:
                        del left[d.request_id]
                yield int(d.request_id.rsplit("-", 1)[1]) * n + d.index, d
        finally:
            self.waiting.discard(queue)
            for r, choices in left.items():  # their "abort" deltas come after this generator is gone
                self.engine.abort(r)
                self.metrics.finished.labels("abort").inc(choices)
            log.info("%s", record.line(unfinished=sum(left.values())))


def _check_total(tokens: int, limit: int, what: str, at_least: bool = False) -> None:
    if tokens > limit:
        raise ApiError(400, f"{what}: the inputs have {'at least ' if at_least else ''}{tokens} tokens together; a "
                            f"request takes at most {limit}: send them in several requests", param=what,
                       code="too_many_tokens")
