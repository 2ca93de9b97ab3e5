"""The OpenAI request bodies the server accepts, as pydantic models, and the error body it answers with.

Fields are OpenAI's (plus vLLM's extras ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``); unknown
fields are ignored, as OpenAI does. Ranges are checked here, so a bad value is a 400 naming its field before any
work starts; ``SamplingParams`` checks them again for callers of the engine that do not come through HTTP.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from dtorch.engine.sampling import MAX_LOGPROBS, MAX_N, SamplingParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; ``content`` as a string or as a list of text parts (joined). Other keys pass to the template."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(p.text for p in self.content)
        return d


class _Sampling(_Body):
    """The fields chat and text completions share."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and (len(v) > 4 or not all(v)):
            raise ValueError("stop must be a non-empty string or a list of at most 4 non-empty strings")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p, seed=self.seed, max_tokens=max_tokens, stop=stop,
            ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logprobs=logprobs, n=self.n)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``. logprobs: return the chosen tokens' logprobs; top_logprobs: and k more."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters (max_completion_tokens wins over the older max_tokens; None: up to the context)."""
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(limit, (self.top_logprobs or 0) if self.logprobs else None)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. prompt: a string, a list of token ids, or a list of either (one choice set each);
    logprobs: k, the chosen tokens' logprobs and k alternatives."""

    prompt: str | list[int] | list[str | list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("prompt must not be empty (a string, token ids, or a list of either)")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per engine request."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def sampling_params(self) -> SamplingParams:
        return self._params(self.max_tokens, self.logprobs)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def field_path(loc: tuple[int | str, ...]) -> str | None:
    """The request field a pydantic error location is in: ("body", "messages", 0, "role") -> "messages"."""
    parts = [p for p in loc if p != "body"]
    return str(parts[0]) if parts and isinstance(parts[0], str) else None
