"""The OpenAI-compatible HTTP layer: a FastAPI app over an engine that runs on its own thread.

``build_app(llm, served_model_name)`` takes anything with ``tokenizer``, ``chat_prompt``, ``max_len`` and
``engine`` (``add_request``, ``abort``, ``stats``). Each HTTP request adds one engine request per prompt; the
engine calls a sink on its thread after each step, which hands the ``Delta`` to this request's asyncio queue.
A client that hangs up has its engine requests aborted, which frees their cache blocks. Embeddings and a completion's
echoed prompt logprobs are prompt passes on the engine (``engine.prompt_pass``: in chunks, beside other work), aborted
the same way; a request takes at most ``MAX_INPUTS`` of them and ``MAX_PASS_TOKENS`` tokens.

Faults: a bad request is a 400 naming its field (OpenAI's error JSON), an unknown model a 404, a full queue a 503,
anything else a 500; none of them stops the server (``serve.errors``). Chat templates, tokenizers and grammars run on
a small worker pool of the server's, never on the event loop, and a text that cannot fit the context is refused before
it is encoded; the event loop only parses and answers. In front of the app (``serve.guard``): CORS, the API key, the
body limit. Each request ends with a line in the log; a throughput line comes every ``log_interval`` seconds while the
engine works (``serve.logs``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse

from dtorch.core.errors import ArgumentError, ContextLengthError, DtorchError, EngineBusy, ModelError, SamplingError
from dtorch.engine.infill import fim_prompt
from dtorch.engine.request import Delta
from dtorch.serve.cli import MAX_BODY_BYTES
from dtorch.serve.errors import ApiError, ClientGone, Json, add_error_handlers, bad_request, context_exceeded, error_of
from dtorch.serve.guard import ApiKey, BodyLimit
from dtorch.serve.logs import RequestLog, log_throughput
from dtorch.serve.metrics import CONTENT_TYPE, ServerMetrics
from dtorch.serve.protocol import (
    MAX_PASS_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    hide_paths,
)
from dtorch.serve.responses import (
    Answer,
    Echo,
    chat_events,
    chat_response,
    completion_events,
    completion_response,
    scored_events,
    scored_response,
    sse,
)
from dtorch.serve.utility import add_utility_routes

log = logging.getLogger("dtorch.serve")
POLL_S = 0.25  # how often a non-streamed request checks whether its client is still there
WORKERS = 2  # threads that render templates and run tokenizers (which release the GIL) and grammar compilers


class _Server:
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
        loop = self.loop
        if loop is None:
            return
        error = self.lost_error()

        def fail(w: Any) -> None:
            if isinstance(w, asyncio.Queue):
                w.put_nowait(error)
            elif not w.done():
                w.set_exception(error)

        for w in list(self.waiting):
            try:
                loop.call_soon_threadsafe(fail, w)
            except RuntimeError:  # the event loop is closed: the server is gone
                return

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


def model_paths(llm: Any) -> list[str]:
    """The files and folders of ``llm``'s model on this server (its checkpoint, tokenizer and template files, and the
    folders they are in), which no error message may show a client."""
    tok = getattr(llm, "tokenizer", None)
    names = [getattr(llm, "source", None), getattr(tok, "source", None), getattr(tok, "template_source", None)]
    paths = []
    for name in names:
        if isinstance(name, str) and name:
            path = name.split(" (")[0]  # "model.gguf (tokenizer.chat_template)": the file
            paths.append(path)
            parent = os.path.dirname(os.path.abspath(path))
            if os.path.isabs(path) or os.sep in path:
                paths.append(parent)
            paths.append(os.path.abspath(path))
    return [p for p in paths if p not in ("", os.sep)]


def build_app(llm: Any, served_model_name: str, *, engine_loop: Any = None, pooling: str = "last",
              api_key: str | None = None, allowed_origins: Sequence[str] = (), max_body_bytes: int = MAX_BODY_BYTES,
              log_interval: float = 10.0, workers: int = WORKERS) -> FastAPI:
    """The FastAPI app serving ``llm`` as ``served_model_name``.

    engine_loop: what steps the engine (``stop(grace)``), run by the caller (``dtorch serve`` runs it on its main
    thread, where the model was loaded; see ``EngineLoop``). None: the app starts an ``EngineLoop`` on a thread of its
    own. Either way the app stops it at shutdown, after uvicorn's graceful shutdown has let requests in flight
    finish, with no grace of its own: what is left is aborted. pooling: how ``/v1/embeddings`` pools the final hidden
    states ("last" token or "mean"). api_key: the key every request but /health and /metrics must carry (None: no
    key). allowed_origins: the origins browsers may call from (CORS; "*": any). max_body_bytes: request bodies at
    most (413). log_interval: seconds between throughput lines while the engine works (0: none). workers: threads of
    the pool that renders templates and runs tokenizers.
    """
    own = engine_loop is None
    if own:
        from dtorch.engine.loop import EngineLoop

        engine_loop = EngineLoop(llm.engine)
    server = _Server(llm, served_model_name, workers)
    hide_paths(model_paths(llm), served_model_name)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if own:
            engine_loop.start()
        server.loop = asyncio.get_running_loop()
        server.serving = True
        stats = asyncio.create_task(log_throughput(server.engine, log_interval)) if log_interval > 0 else None
        try:
            yield
        finally:
            server.serving = False
            if stats is not None:
                stats.cancel()
            await asyncio.to_thread(engine_loop.stop, 0.0)
            server.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="dtorch", lifespan=lifespan, default_response_class=Json)
    app.state.server = server
    # the last added runs first: CORS (a preflight carries no key), then the key, then the body's size
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    add_error_handlers(app)
    add_utility_routes(app, server, pooling)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        """200 {"status": "ok"} once every step shape is built; 200 {"status": "warming", "step_shapes_built": k,
        "step_shapes": n} while they are built between requests (requests are answered meanwhile, each shape built
        when first needed); 503 {"status": "unavailable", "error": ...} before serving or once shutting down
        (llama.cpp's server answers 503 while it loads), or once a rank of a model served across ranks is lost."""
        up = server.serving and getattr(server.engine, "accepting", True)  # False once shutting down
        if server.lost is not None:
            return Json(server.lost_error().body | {"status": "unavailable"}, status_code=503)
        if not up:
            return Json({"status": "unavailable", "error": {"message": "the server is not serving (starting or "
                         "shutting down)", "type": "unavailable_error", "code": 503}}, status_code=503)
        engine = server.engine
        if getattr(engine, "warm", True):
            return Json({"status": "ok"})
        return Json({"status": "warming", "step_shapes_built": engine.warm_built, "step_shapes": engine.warm_total})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    def card() -> dict[str, Any]:
        return {"id": server.name, "object": "model", "created": server.created, "owned_by": "dtorch",
                "max_model_len": llm.max_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        server.check_model(model_id)
        return card()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        params, origin = _sampling(body)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools is not None else None
        choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
        try:
            setup = await server.off_loop(
                llm.chat_setup, [m.as_template_input() for m in body.messages], tools=tools, tool_choice=choice,
                parallel_tool_calls=body.parallel_tool_calls, chat_template_kwargs=body.template_kwargs(),
                add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message)
        except (ArgumentError, ModelError) as exc:
            raise bad_request(exc, "messages") from None
        if setup.structured_outputs is not None and origin == "structured_outputs":
            raise ApiError(400, f"tool_choice {body.tool_choice!r:.60} constrains the reply to tool calls; it "
                                f"cannot be combined with {origin}", param="tool_choice")
        # a response_format with tools: under auto a turn of calls or the answer, under a forced choice the call
        structured = setup.with_answer(params.structured_outputs)
        if structured is not params.structured_outputs:
            params = dataclasses.replace(params, structured_outputs=structured)
            origin = "tools" if setup.structured_outputs is not None else origin
        await server.compile(params, origin)
        a = Answer(f"chatcmpl-{uuid.uuid4().hex}", server.name, server.token_text, server.token_bytes)
        queue = server.submit(a.id, [setup.prompt_ids], params, "messages")
        run = server.deltas(a.id, 1, body.n, queue, None if body.stream else request)
        if body.stream:
            return _EventStream(chat_events(a, body, setup, run))
        return await _respond(chat_response(a, body, setup, run))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        scoring = body.max_tokens == 0  # the prompt alone: its echo and logprobs, no generation
        params, origin = _sampling(body) if not scoring else (None, None)
        prompts = body.prompts()
        try:
            if body.suffix is None:  # a scored prompt runs beside other work: its tokens are bounded as embeddings'
                ids = await server.off_loop(server.encode, prompts, "prompt",
                                            MAX_PASS_TOKENS if body.echo and body.logprobs is not None else None)
            else:
                ids, ends = await server.off_loop(server.infill, prompts, body.suffix)
                if params is not None:
                    params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + ends)
        except (ArgumentError, ModelError) as exc:
            raise bad_request(exc, "prompt") from None
        if not scoring:
            await server.compile(params, origin)
        a = Answer(f"cmpl-{uuid.uuid4().hex}", server.name, server.token_text, server.token_bytes)
        try:
            echoes = await server.echoes(a.id, prompts, ids, body.logprobs, request) if body.echo else None
        except ClientGone:
            return Response(status_code=499)
        if scoring:
            log.info("%s: prompt %d tokens scored (max_tokens 0)", a.id, sum(len(t) for t in ids))
            if body.stream:
                return _EventStream(scored_events(a, body, ids, echoes))
            return Json(scored_response(a, body, ids, echoes))
        queue = server.submit(a.id, ids, params, "prompt")
        run = server.deltas(a.id, len(ids), body.n, queue, None if body.stream else request)
        if body.stream:
            return _EventStream(completion_events(a, body, len(ids), run, echoes))
        return await _respond(completion_response(a, body, len(ids), run, echoes))

    return app


def _sampling(body: ChatCompletionRequest | CompletionRequest) -> tuple[Any, str | None]:
    """The engine's parameters and the field that asked for a structured output (None: none did)."""
    try:
        structured, origin = body.constraint()
    except SamplingError as exc:
        raise ApiError(400, str(exc), param="structured_outputs" if body.structured_outputs else
                       "response_format") from None
    try:
        return body.sampling_params(structured), origin
    except SamplingError as exc:
        raise bad_request(exc, None) from None


async def _respond(make: Any) -> Response:
    """The JSON of a non-streamed answer, or an empty 499 when its client left (nobody reads it)."""
    try:
        return Json(await make)
    except ClientGone:
        return Response(status_code=499)


class _EventStream(StreamingResponse):
    """Server-sent events ending in ``data: [DONE]``. A fault mid-stream becomes an error event (the status line is
    already sent); the events' generator is always closed, so a client that hung up has its requests aborted."""

    def __init__(self, events: AsyncIterator[str]) -> None:
        self._events = events
        super().__init__(self._guarded(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _guarded(self) -> AsyncIterator[str]:
        try:
            async with aclosing(self._events):
                async for event in self._events:
                    yield event
        except Exception as exc:
            if isinstance(exc, ApiError):  # said and answered: no traceback
                log.error("stream failed: %s", exc)
            else:
                log.exception("stream failed")
            yield sse(error_of(exc)[1])
        yield "data: [DONE]\n\n"

    async def stream_response(self, send: Callable) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()  # closes the events, which abort what is unfinished
