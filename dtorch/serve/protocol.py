"""The request bodies the server accepts, as pydantic models, and the error body it answers with.

Fields are OpenAI's plus vLLM's extras (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``structured_outputs``, ``chat_template_kwargs`` ...). A field the server does not know is a 400
naming it, as OpenAI answers ("Unrecognized request argument supplied: max_token"), and so is a known field the
server cannot honour (``prediction``, ``web_search_options``, audio output): nothing that would change the answer is
dropped silently. OpenAI's fields that change nothing for a local server are accepted and ignored: ``user``,
``service_tier``, ``prompt_cache_key`` (prefix caching is automatic), ``safety_identifier``, ``store`` (nothing is
stored), ``metadata``, ``verbosity``, ``"audio": null``, ``"modalities": ["text"]``. Types are strict, as OpenAI's
(``"max_tokens": true`` or ``1.5`` is no integer; a number is finite, NaN and Infinity are refused as such), and ranges
are checked here, so a bad value is a 400 naming its field before any work starts; ``SamplingParams`` checks them
again for callers of the engine that do not come through HTTP.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from dtorch.engine.chat_format import ROLES
from dtorch.engine.sampling import MAX_LOGPROBS, MAX_N, REPETITION_PENALTY_RANGE, SamplingParams
from dtorch.engine.structured import StructuredOutputsParams

MAX_INPUTS = 2048  # inputs of one embeddings request at most (OpenAI's limit), and prompts of one completion
MAX_PASS_TOKENS = 300_000  # tokens of one request's prompt passes (embeddings, scoring) at most: OpenAI's limit


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Body):
    """A call in an assistant message of the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # streamed calls carry it; replayed as they came


class ChatMessage(_Body):
    """One message of the conversation. ``content`` is a string or a list of text parts (joined); an assistant
    message may leave it null when it has ``tool_calls``; a ``tool`` message answers the call ``tool_call_id``. The
    fields a replayed OpenAI reply carries (``refusal``, ``annotations``, ``audio``, ``function_call``) are accepted
    when null."""

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        if v not in ROLES:
            raise ValueError(f"unknown role {v!r}; the roles are {', '.join(ROLES)}")
        return v

    def as_template_input(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio", "function_call",
                                                        "reasoning"})
        d["content"] = "".join(p.text for p in self.content) if isinstance(self.content, list) else self.content
        if self.reasoning is not None and self.reasoning_content is None:
            d["reasoning_content"] = self.reasoning
        if self.tool_calls is not None:
            d["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        return d


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs json_schema: {'name': ..., 'schema': {...}}")
        return self


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs``: exactly one of json (a schema), regex, choice, grammar (Lark or GBNF),
    json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(_Body):
    """The fields chat and text completions share."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's fields that change nothing here: ids and tags for the caller's records, a tier of service (one
    # here), a key for prompt caching (automatic here), storage (nothing is stored)
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and (len(v) > 4 or not all(v)):
            raise ValueError("stop must be a non-empty string or a list of at most 4 non-empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            # ASCII digits only ("²" and "١" are str.isdigit), no leading zero ("01" would merge with "1"), and a
            # size an id can have (int() of 5000 digits is refused by Python itself)
            if not re.fullmatch(r"0|[1-9][0-9]{0,9}", key):
                raise ValueError(f"keys are token ids written in plain decimal (\"42\"), got {key!r:.40}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return v

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @model_validator(mode="after")
    def _one_constraint(self) -> _Sampling:
        if self.structured_outputs is not None and self.response_format is not None and \
                self.response_format.type != "text":
            raise ValueError("give structured_outputs or response_format, not both")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)

    def constraint(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The structured output asked for and the field that asked (``response_format``, ``structured_outputs``).
        Raises ``SamplingError`` for a bad one."""
        rf, so = self.response_format, self.structured_outputs
        if so is not None:
            return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                           json_object=bool(so.json_object)), "structured_outputs"
        if rf is None or rf.type == "text":
            return None, None
        if rf.type == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {"type": "object"}
        return StructuredOutputsParams(json=schema, strict=bool(rf.json_schema.strict)), "response_format"

    def _params(self, max_tokens: int | None, logprobs: int | None,
                structured: StructuredOutputsParams | None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p, seed=self.seed, max_tokens=max_tokens, stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=logprobs, n=self.n,
            min_tokens=self.min_tokens if max_tokens is None else min(self.min_tokens, max_tokens),
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            structured_outputs=structured)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``. logprobs: return the chosen tokens' logprobs; top_logprobs: and k more.
    echo: start the reply with the last message's content when that message is the reply's role (vLLM's)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None  # to the template, as vLLM does
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    verbosity: Literal["low", "medium", "high"] | None = None  # for OpenAI's reasoning models; nothing here
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and v != ["text"]:
            raise ValueError(f"this server writes text only: modalities must be ['text'], got {v}")
        return v

    @field_validator("audio", "prediction", "web_search_options")
    @classmethod
    def _unsupported(cls, v: Any, info: ValidationInfo) -> Any:
        what = {"audio": "audio output (this server writes text only)", "prediction": "Predicted Outputs",
                "web_search_options": "web search (this server has no network tools)"}[info.field_name]
        if v is not None:
            raise ValueError(f"{what} is not supported; leave {info.field_name} out")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs

    def sampling_params(self, structured: StructuredOutputsParams | None) -> SamplingParams:
        """The engine's parameters (max_completion_tokens wins over the older max_tokens; None: up to the context)."""
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(limit, (self.top_logprobs or 0) if self.logprobs else None, structured)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. prompt: a string, a list of token ids, or a list of either (one choice set each);
    logprobs: k, the chosen tokens' logprobs and k alternatives; echo: the prompt before the completion (with
    logprobs: the prompt tokens' too, the first one's null)."""

    prompt: str | list[int] | list[str | list[int]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions; 0 scores the prompt (with echo)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None  # fill-in-the-middle: the text after the completion (a code model's FIM tokens)

    @field_validator("suffix")
    @classmethod
    def _suffix_alone(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.data.get("echo"):
            raise ValueError("suffix cannot be combined with echo")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("prompt must not be empty (a string, token ids, or a list of either)")
        if isinstance(v, list) and not isinstance(v[0], int) and len(v) > MAX_INPUTS:
            raise ValueError(f"prompt is a list of {len(v)} prompts; a request takes at most {MAX_INPUTS}")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported: ask for n choices and rank them yourself")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per engine request."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def sampling_params(self, structured: StructuredOutputsParams | None) -> SamplingParams:
        return self._params(self.max_tokens, self.logprobs, structured)


class EmbeddingRequest(_Body):
    """``POST /v1/embeddings``: input as a string, token ids, or a list of either; encoding_format "float" or
    "base64" (little-endian float32, what the openai client asks for)."""

    model: str | None = None
    input: str | list[int] | list[str | list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        p = self.input
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p or any(isinstance(x, list) and not x for x in p) or any(x == "" for x in p):
            raise ValueError("input must not be empty")
        if len(p) > MAX_INPUTS:
            raise ValueError(f"input is a list of {len(p)} inputs; a request takes at most {MAX_INPUTS} (OpenAI's "
                             "limit): send them in several requests")
        return list(p)


class TokenizeRequest(_Body):
    """vLLM's ``POST /tokenize``: a ``prompt``, or ``messages`` rendered with the chat template first."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give a prompt or messages (one of them)")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


# (server path, what clients see instead), longest path first: the server's own files never reach a client
_HIDDEN: list[tuple[str, str]] = []


def hide_paths(paths: list[str], name: str) -> None:
    """Let every error message name ``name`` (the served model) where it would name one of ``paths`` (the model's
    files and folders on this server)."""
    for p in paths:
        if p and len(p) > 1 and (p, name) not in _HIDDEN:
            _HIDDEN.append((p, name))
    _HIDDEN.sort(key=lambda pn: -len(pn[0]))


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``, the server's paths hidden."""
    for path, name in _HIDDEN:
        message = message.replace(path, name)
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def field_path(loc: tuple[int | str, ...]) -> str | None:
    """The request field a pydantic error location is in: ("body", "messages", 0, "role") -> "messages"."""
    parts = [p for p in loc if p != "body"]
    return str(parts[0]) if parts and isinstance(parts[0], str) else None
