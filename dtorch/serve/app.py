"""The OpenAI-compatible HTTP layer: a FastAPI app over an engine that runs on its own thread.

``build_app(llm, served_model_name)`` takes anything with ``tokenizer``, ``chat_prompt``, ``max_len`` and
``engine`` (``add_request``, ``abort``, ``stats``). Each HTTP request adds one engine request per prompt; the
engine calls a sink on its thread after each step, which hands the ``Delta`` to this request's asyncio queue.
A client that hangs up has its engine requests aborted, which frees their cache blocks.

Faults: a bad request is a 400 naming its field (OpenAI's error JSON), an unknown model a 404, a full queue a 503,
anything else a 500; none of them stops the server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from functools import lru_cache
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from dtorch.core.errors import ArgumentError, DtorchError, EngineBusy, ModelError, SamplingError
from dtorch.engine.request import Delta
from dtorch.serve.metrics import CONTENT_TYPE, ServerMetrics
from dtorch.serve.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice, error_body, field_path
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


class ApiError(Exception):
    """An error answered with ``status`` and OpenAI's error JSON."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


class _ClientGone(Exception):
    """The client of a non-streamed request disconnected."""


def _bad_request(exc: DtorchError, param: str | None) -> ApiError:
    """A 400 for an error the engine or tokenizer raised; a SamplingError names its own field, and so does an error
    with a ``param`` (``chat_format.field_error``)."""
    if isinstance(exc, SamplingError):
        m = re.match(r"SamplingParams: (\w+)", str(exc))
        param = m.group(1) if m else None
    return ApiError(400, str(exc), param=getattr(exc, "param", None) or param)


class _Server:
    """The app's state: the model, its engine, the metrics, and how a request runs."""

    def __init__(self, llm: Any, served_model_name: str) -> None:
        self.llm, self.engine, self.name = llm, llm.engine, served_model_name
        self.metrics = ServerMetrics(self.engine)
        self.created = int(time.time())
        self.serving = False
        self.token_text = lru_cache(maxsize=65536)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        tok = self.llm.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok is not None else str(token_id)

    def echoes(self, prompts: list[str | list[int]], ids: list[list[int]], logprobs: int | None) -> list[Echo]:
        """The echoed prompts of a completion and, with ``logprobs``, their tokens' logprobs (a forward pass of each
        prompt of its own: the engine computes only what it samples from)."""
        out = []
        for p, t in zip(prompts, ids, strict=True):
            text = p if isinstance(p, str) else self.llm.tokenizer.decode(t, skip_special_tokens=False) \
                if self.llm.tokenizer is not None else ""
            out.append(Echo(text, None if logprobs is None else self._prompt_logprobs(t, logprobs)))
        return out

    def _prompt_logprobs(self, ids: list[int], k: int) -> dict[str, Any]:
        lp = torch.log_softmax(self.llm.logits(ids).float(), dim=-1)[:-1]  # [T - 1, V]: position i predicts i + 1
        nxt = torch.tensor(ids[1:], dtype=torch.int64)
        values = lp.gather(1, nxt[:, None])[:, 0].tolist() if len(ids) > 1 else []
        tops: list[dict[str, float] | None] = [None]
        if k and len(ids) > 1:
            top = torch.topk(lp, k, dim=-1)
            tops += [{self.token_text(i): v for i, v in zip(ti, tv, strict=True)}
                     for ti, tv in zip(top.indices.tolist(), top.values.tolist(), strict=True)]
        else:
            tops += [{} for _ in values]
        tokens = [self.token_text(t) for t in ids]
        offsets = [sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [None, *values], "top_logprobs": tops, "text_offset": offsets}

    def check_model(self, model: str | None) -> None:
        if model and model != self.name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.name}`.",
                           "NotFoundError", "model", "model_not_found")

    async def compile(self, params: Any, origin: str | None) -> None:
        """Compile the request's grammar off the event loop (the engine then only copies it); a 400 naming
        ``origin`` (response_format, structured_outputs, tool_choice) when the library cannot."""
        if params.structured_outputs is None:
            return
        try:
            await asyncio.to_thread(self.engine.grammars.compile, params.structured_outputs)
        except DtorchError as exc:
            raise ApiError(400, str(exc), param=origin) from None

    def submit(self, rid: str, prompts: list[list[int]], params: Any, param: str) -> asyncio.Queue[Delta]:
        """Add one engine request per prompt (ids ``rid-0``, ``rid-1``, ...); their deltas arrive on the queue."""
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
                raise ApiError(400, f"this model's context is {self.llm.max_len} tokens; the prompt has {len(ids)} and "
                                    f"max_tokens asks for {limit} more", param="max_tokens")
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
                raise _bad_request(exc, param) from None
            raise
        return queue

    async def deltas(self, rid: str, prompts: int, n: int, queue: asyncio.Queue[Delta],
                     request: Request | None) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) until every choice has finished. With ``request`` (non-streamed), its client is
        polled, and _ClientGone raised when it left. However this ends, the unfinished engine requests are aborted.
        """
        left = {f"{rid}-{p}": n for p in range(prompts)}
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
                            raise _ClientGone()
                    if d is None:
                        continue
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
            for r, choices in left.items():  # their "abort" deltas come after this generator is gone
                self.engine.abort(r)
                self.metrics.finished.labels("abort").inc(choices)

def build_app(llm: Any, served_model_name: str, *, engine_loop: Any = None, pooling: str = "last") -> FastAPI:
    """The FastAPI app serving ``llm`` as ``served_model_name``.

    engine_loop: what steps the engine (``stop(grace)``), run by the caller (``dtorch serve`` runs it on its main
    thread, where the model was loaded; see ``EngineLoop``). None: the app starts an ``EngineLoop`` on a thread of its
    own. Either way the app stops it at shutdown, after uvicorn's graceful shutdown has let requests in flight
    finish, with no grace of its own: what is left is aborted. pooling: how ``/v1/embeddings`` pools the final hidden
    states ("last" token or "mean").
    """
    own = engine_loop is None
    if own:
        from dtorch.engine.engine import EngineLoop

        engine_loop = EngineLoop(llm.engine)
    server = _Server(llm, served_model_name)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if own:
            engine_loop.start()
        server.serving = True
        try:
            yield
        finally:
            server.serving = False
            await asyncio.to_thread(engine_loop.stop, 0.0)

    app = FastAPI(title="dtorch", lifespan=lifespan)
    app.state.server = server
    _add_error_handlers(app)
    add_utility_routes(app, server, pooling)

    @app.get("/health")
    async def health() -> Response:
        up = server.serving and getattr(server.engine, "accepting", True)  # False once shutting down
        return Response(status_code=200 if up else 503)

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
            setup = await asyncio.to_thread(
                llm.chat_setup, [m.as_template_input() for m in body.messages], tools=tools, tool_choice=choice,
                parallel_tool_calls=body.parallel_tool_calls, chat_template_kwargs=body.template_kwargs(),
                add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message)
        except (ArgumentError, ModelError) as exc:
            raise _bad_request(exc, "messages") from None
        if setup.structured_outputs is not None:
            if params.structured_outputs is not None:
                raise ApiError(400, f"tool_choice {body.tool_choice!r:.60} constrains the reply to tool calls; it "
                                    f"cannot be combined with {origin}", param="tool_choice")
            params, origin = dataclasses.replace(params, structured_outputs=setup.structured_outputs), "tools"
        await server.compile(params, origin)
        a = Answer(f"chatcmpl-{uuid.uuid4().hex}", server.name, server.token_text)
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
            ids = await asyncio.to_thread(lambda: [llm.tokenizer.encode(p) if isinstance(p, str) else list(p)
                                                   for p in prompts])
        except (ArgumentError, ModelError) as exc:
            raise _bad_request(exc, "prompt") from None
        except AttributeError:  # no tokenizer
            raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt") from None
        if not scoring:
            await server.compile(params, origin)
        echoes = await asyncio.to_thread(server.echoes, prompts, ids, body.logprobs) if body.echo else None
        a = Answer(f"cmpl-{uuid.uuid4().hex}", server.name, server.token_text)
        if scoring:
            if body.stream:
                return _EventStream(scored_events(a, body, ids, echoes))
            return JSONResponse(scored_response(a, body, ids, echoes))
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
        raise _bad_request(exc, None) from None


async def _respond(make: Any) -> Response:
    """The JSON of a non-streamed answer, or an empty 499 when its client left (nobody reads it)."""
    try:
        return JSONResponse(await make)
    except _ClientGone:
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
            log.exception("stream failed")
            yield sse(_error_of(exc)[1])
        yield "data: [DONE]\n\n"

    async def stream_response(self, send: Callable) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()  # closes the events, which abort what is unfinished


def _error_of(exc: Exception) -> tuple[int, dict[str, Any]]:
    if isinstance(exc, ApiError):
        return exc.status, exc.body
    if isinstance(exc, EngineBusy):
        return 503, error_body(str(exc), "ServiceUnavailableError", None, "engine_busy")
    if isinstance(exc, (ArgumentError, ModelError, SamplingError)):
        return 400, _bad_request(exc, None).body
    return 500, error_body(f"internal error: {type(exc).__name__}: {exc}", "InternalServerError")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = tuple(first.get("loc", ()))
        where = ".".join(str(p) for p in loc if p != "body")
        if first.get("type") == "extra_forbidden":  # OpenAI's words for a field it does not know
            message = f"Unrecognized request argument supplied: {where}"
        else:
            message = f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg", "invalid request"))
        return JSONResponse(error_body(message, param=field_path(loc)), status_code=400)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal(_request: Request, exc: Exception) -> JSONResponse:
        status, body = _error_of(exc)
        if status == 500:
            log.error("request failed", exc_info=exc)
        return JSONResponse(body, status_code=status)
