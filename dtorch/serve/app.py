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
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse

from dtorch.core.errors import ArgumentError, ModelError, SamplingError
from dtorch.serve.cli import MAX_BODY_BYTES
from dtorch.serve.errors import ApiError, ClientGone, Json, add_error_handlers, bad_request, error_of
from dtorch.serve.guard import ApiKey, BodyLimit
from dtorch.serve.logs import log_throughput
from dtorch.serve.metrics import CONTENT_TYPE
from dtorch.serve.protocol import (
    MAX_PASS_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    hide_paths,
)
from dtorch.serve.responses import (
    Answer,
    chat_events,
    chat_response,
    completion_events,
    completion_response,
    scored_events,
    scored_response,
    sse,
)
from dtorch.serve.server import WORKERS, Server
from dtorch.serve.utility import add_utility_routes

log = logging.getLogger("dtorch.serve")


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
    server = Server(llm, served_model_name, workers)
    if isinstance(getattr(engine_loop, "at_grace_end", None), list):  # an EngineLoop: its shutdown ends our waits
        engine_loop.at_grace_end.append(server.grace_ended)
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
