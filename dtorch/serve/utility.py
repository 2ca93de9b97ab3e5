"""The server's routes beside generation: ``/v1/embeddings`` (OpenAI's), ``/tokenize`` and ``/detokenize`` (vLLM's
request and response shapes)."""

from __future__ import annotations

import base64
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from dtorch.core.errors import ArgumentError, DtorchError, ModelError
from dtorch.serve.errors import ApiError, ClientGone, Json, bad_request
from dtorch.serve.protocol import MAX_PASS_TOKENS, DetokenizeRequest, EmbeddingRequest, TokenizeRequest

log = logging.getLogger("dtorch.serve")


def add_utility_routes(app: FastAPI, server: Any, pooling: str) -> None:
    """Add the embeddings and tokenizer routes of ``server`` (``serve.server.Server``) to ``app``."""
    llm = server.llm

    def tokenizer() -> Any:
        try:
            return llm.need_tokenizer("tokenizing text")
        except ModelError as exc:
            raise ApiError(400, str(exc), param="prompt") from None

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
        start = time.monotonic()
        server.check_model(body.model)
        try:
            inputs = body.inputs()
        except ValueError as exc:
            raise ApiError(400, f"input: {exc}", param="input") from None
        width = llm.config.hidden_size
        if body.dimensions is not None and body.dimensions != width:
            raise ApiError(400, f"dimensions: this model's embeddings have {width} dimensions and cannot be "
                                f"shortened; leave dimensions out or give {width}", param="dimensions")
        server.check_ranks()
        try:
            ids = await server.off_loop(server.encode, inputs, "input", MAX_PASS_TOKENS)
        except (ArgumentError, ModelError) as exc:
            raise bad_request(exc, "input") from None
        rid = f"embd-{uuid.uuid4().hex}"
        try:  # one request in the engine's queue, its inputs in chunks beside other work; aborted on hang-up
            vectors = await server.passes(rid, len(ids), lambda job, sink: llm.engine.add_embedding(
                job, ids[int(job.rsplit("-", 1)[1])], pooling, sink, group=rid), request, "input")
        except ClientGone:
            return Response(status_code=499)
        tokens = sum(len(t) for t in ids)
        data = await server.off_loop(_embedding_data, vectors, body.encoding_format)
        log.info("%s: %d inputs, %d tokens, %.2f s", rid, len(ids), tokens, time.monotonic() - start)
        return {"object": "list", "data": data, "model": server.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    # /tokenize and /detokenize take the body as bytes: parsing, checking and (de)tokenizing all run on the worker
    # pool, so that a large one (a 5 MB prompt, 2M ids) never stalls the event loop, and past a cap it is a 400
    max_chars, max_ids = tokenize_caps(llm.max_len)

    def _tokens(body: TokenizeRequest) -> list[int]:
        if body.prompt is not None:
            if len(body.prompt) > max_chars:
                raise ApiError(400, f"prompt: {len(body.prompt)} characters; /tokenize takes at most {max_chars}",
                               param="prompt", code="too_long")
            return tokenizer().encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools is not None else None
        return llm.chat_setup([m.as_template_input() for m in body.messages], tools=tools,
                              chat_template_kwargs=body.chat_template_kwargs,
                              add_generation_prompt=body.add_generation_prompt,
                              continue_final_message=body.continue_final_message, limit=max_ids).prompt_ids

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        raw = await request.body()

        def run() -> dict[str, Any]:
            body = _parsed(TokenizeRequest, raw)
            server.check_model(body.model)
            try:
                ids = _tokens(body)
            except (ArgumentError, ModelError) as exc:
                raise bad_request(exc, "prompt" if body.prompt is not None else "messages") from None
            strs = [tokenizer().id_to_token(t) for t in ids] if body.return_token_strs else None
            return {"count": len(ids), "max_model_len": llm.max_len, "tokens": ids, "token_strs": strs}

        return await server.off_loop(lambda: Json(run()))  # the JSON text made there too

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        raw = await request.body()

        def run() -> dict[str, Any]:
            body = _parsed(DetokenizeRequest, raw)
            server.check_model(body.model)
            if len(body.tokens) > max_ids:
                raise ApiError(400, f"tokens: {len(body.tokens)} token ids; /detokenize takes at most {max_ids}",
                               param="tokens", code="too_long")
            vocab = llm.engine.vocab_size
            bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(400, f"tokens: token id {bad} is not in [0, {vocab})", param="tokens")
            return {"prompt": tokenizer().decode(body.tokens)}

        try:
            return await server.off_loop(lambda: Json(run()))  # the JSON text made there too
        except DtorchError as exc:
            raise bad_request(exc, "tokens") from None


def tokenize_caps(max_len: int) -> tuple[int, int]:
    """What /tokenize and /detokenize take at most: (characters of a prompt, token ids), well past what a prompt
    of the context (``max_len`` tokens) needs, so that counting a too-long prompt still works."""
    return max(1 << 20, 16 * max_len), max(1 << 18, 4 * max_len)


def _parsed(model: Any, raw: bytes) -> Any:
    """``raw`` (a JSON body) as the pydantic ``model``; its errors as FastAPI's (a 400 naming the field)."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


def _embedding_data(vectors: list[Any], encoding_format: str) -> list[dict[str, Any]]:
    """OpenAI's ``data`` of embeddings ([H] float32 tensors): lists of floats, or base64 of little-endian float32."""
    data = []
    for i, v in enumerate(vectors):
        if encoding_format == "base64":
            value: Any = base64.b64encode(v.numpy().astype("<f4").tobytes()).decode()
        else:
            value = v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    return data
