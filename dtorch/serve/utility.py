"""The server's routes beside generation: ``/v1/embeddings`` (OpenAI's), ``/tokenize`` and ``/detokenize`` (vLLM's
request and response shapes)."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from dtorch.core.errors import ArgumentError, DtorchError, EngineBusy, ModelError
from dtorch.serve.errors import ApiError, bad_request
from dtorch.serve.protocol import DetokenizeRequest, EmbeddingRequest, TokenizeRequest

log = logging.getLogger("dtorch.serve")


def add_utility_routes(app: FastAPI, server: Any, pooling: str) -> None:
    """Add the embeddings and tokenizer routes of ``server`` (the app's ``_Server``) to ``app``."""
    llm = server.llm

    def tokenizer() -> Any:
        try:
            return llm.need_tokenizer("tokenizing text")
        except ModelError as exc:
            raise ApiError(400, str(exc), param="prompt") from None

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        start = time.monotonic()
        server.check_model(body.model)
        try:
            inputs = body.inputs()
        except ValueError as exc:
            raise ApiError(400, f"input: {exc}", param="input") from None
        try:
            ids = await server.off_loop(server.encode, inputs, "input")
        except (ArgumentError, ModelError) as exc:
            raise bad_request(exc, "input") from None
        width = llm.config.hidden_size
        if body.dimensions is not None and body.dimensions != width:
            raise ApiError(400, f"dimensions: this model's embeddings have {width} dimensions and cannot be "
                                f"shortened; leave dimensions out or give {width}", param="dimensions")
        server.check_ranks()
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in ids]
        rid = f"embd-{uuid.uuid4().hex}"

        def sink(job_id: str, result: Any) -> None:  # on the engine's thread
            f = futures[int(job_id.rsplit("-", 1)[1])]
            try:
                loop.call_soon_threadsafe(lambda: f.done() or f.set_result(result))
            except RuntimeError:  # the event loop is closed: the server is gone
                pass

        try:
            for i, t in enumerate(ids):
                llm.engine.add_embedding(f"{rid}-{i}", t, pooling, sink)
        except EngineBusy as exc:
            raise ApiError(503, str(exc), "ServiceUnavailableError", None, "engine_busy") from None
        server.waiting.update(futures)
        try:
            vectors = await asyncio.gather(*futures)
        finally:
            server.waiting.difference_update(futures)
        data = []
        for i, v in enumerate(vectors):
            if isinstance(v, BaseException):
                raise v
            if body.encoding_format == "base64":
                value: Any = base64.b64encode(v.numpy().astype("<f4").tobytes()).decode()
            else:
                value = v.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
        tokens = sum(len(t) for t in ids)
        log.info("%s: %d inputs, %d tokens, %.2f s", rid, len(ids), tokens, time.monotonic() - start)
        return {"object": "list", "data": data, "model": server.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @app.post("/tokenize")
    async def tokenize(raw: dict[str, Any]) -> dict[str, Any]:
        try:
            body = TokenizeRequest.model_validate(raw)
        except ValidationError as exc:
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
        server.check_model(body.model)

        def run() -> list[int]:
            if body.prompt is not None:
                return tokenizer().encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools is not None else None
            return llm.chat_setup([m.as_template_input() for m in body.messages], tools=tools,
                                  chat_template_kwargs=body.chat_template_kwargs,
                                  add_generation_prompt=body.add_generation_prompt,
                                  continue_final_message=body.continue_final_message, limit=None).prompt_ids

        try:
            ids = await server.off_loop(run)
        except (ArgumentError, ModelError) as exc:
            raise bad_request(exc, "prompt" if body.prompt is not None else "messages") from None
        strs = [tokenizer().id_to_token(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": llm.max_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        server.check_model(body.model)
        vocab = llm.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"tokens: token id {bad[0]} is not in [0, {vocab})", param="tokens")
        try:
            return {"prompt": tokenizer().decode(body.tokens)}
        except DtorchError as exc:
            raise bad_request(exc, "tokens") from None

