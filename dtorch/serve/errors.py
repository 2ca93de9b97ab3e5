"""How the server answers a fault: OpenAI's error JSON with the status that fits (a bad request 400 naming its field,
an unknown model 404, a full queue 503, anything else 500), from an exception raised anywhere in a request. A prompt
past the context is OpenAI's ``context_length_exceeded`` in OpenAI's words, which clients such as litellm key on."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from dtorch.core.errors import ArgumentError, ContextLengthError, DtorchError, EngineBusy, ModelError, SamplingError
from dtorch.serve.protocol import error_body, field_path

log = logging.getLogger("dtorch.serve")


class ClientGone(Exception):
    """The client of a request that is not streamed disconnected: nobody reads its answer."""


class ApiError(Exception):
    """An error answered with ``status`` and OpenAI's error JSON."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


class Json(JSONResponse):
    """A JSON response whose text may quote a client's input as it came, lone surrogates included (a model named
    ``"\\ud800"``): those are written as JSON escapes instead of failing the response."""

    def render(self, content: Any) -> bytes:
        # in JSON text every str is inside a string literal, where backslashreplace's "\\ud800" is that escape
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
            "utf-8", "backslashreplace")


def context_exceeded(exc: ContextLengthError, param: str | None, what: str | None = None) -> ApiError:
    """OpenAI's 400 for a prompt that does not fit (code ``context_length_exceeded``), then dtorch's own words;
    ``what``: "messages" or "prompt" (default: from ``param``)."""
    what = what or ("messages" if param == "messages" else "prompt")
    least = "at least " if exc.at_least else ""
    if exc.requested:
        asked = (f"you requested {least}{exc.tokens + exc.requested} tokens ({least}{exc.tokens} in the {what}, "
                 f"{exc.requested} in the completion). Please reduce the length of the {what} or completion.")
    else:
        asked = f"your {what} resulted in {least}{exc.tokens} tokens. Please reduce the length of the {what}."
    return ApiError(400, f"This model's maximum context length is {exc.limit} tokens. However, {asked} ({exc})",
                    param=param, code="context_length_exceeded")


def bad_request(exc: DtorchError, param: str | None) -> ApiError:
    """A 400 for an error the engine or tokenizer raised; a SamplingError names its own field, and so does an error
    with a ``param`` (``chat_format.field_error``)."""
    if isinstance(exc, ContextLengthError):
        return context_exceeded(exc, param)
    if isinstance(exc, SamplingError):
        m = re.match(r"SamplingParams: (\w+)", str(exc))
        param = m.group(1) if m else None
    return ApiError(400, str(exc), param=getattr(exc, "param", None) or param)


def error_of(exc: Exception) -> tuple[int, dict[str, Any]]:
    """The status and error JSON of any exception."""
    if isinstance(exc, ApiError):
        return exc.status, exc.body
    if isinstance(exc, EngineBusy):
        return 503, error_body(str(exc), "ServiceUnavailableError", None, "engine_busy")
    if isinstance(exc, (ArgumentError, ModelError, SamplingError)):
        return 400, bad_request(exc, None).body
    # the exception's text may name the server's files or code: it goes to the log (the handlers log it), not here
    return 500, error_body("The server had an error while processing your request; its log has the details.",
                           "InternalServerError", None, "internal_error")


def add_error_handlers(app: FastAPI) -> None:
    """Answer every exception of a request with OpenAI's error JSON."""
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
        return Json(error_body(message, param=field_path(loc)), status_code=400)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return Json(exc.body, status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        return Json(error_body(str(exc.detail)), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal(_request: Request, exc: Exception) -> JSONResponse:
        status, body = error_of(exc)
        if status == 500:
            log.error("request failed", exc_info=exc)
        return Json(body, status_code=status)
