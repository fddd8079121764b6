"""The OpenAI protocol's request bodies, as dlite's server (app.py) reads them, and its error body.

Chat bodies carry OpenAI's tools protocol (``tools``, ``tool_choice``, assistant ``tool_calls``, ``tool``
messages) and structured outputs (``response_format``): a reply they constrain is decoded under a grammar.  A field the
server does not know is kept here to be ignored with a log line, as vLLM does; a malformed value of one it knows is
refused with an OpenAI-style error body (:class:`ApiError`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..decoding.grammar import reply_format


class Body(BaseModel):
    """A request body's part: its known fields are checked strictly, unknown ones kept to be logged and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)

    def ignored(self, prefix: str = "") -> list[str]:
        """The fields given here and in nested parts that this server ignores, as dotted paths."""
        names = [prefix + name for name in self.model_extra or {}]
        for name, value in self:
            for i, item in enumerate(value if isinstance(value, list) else [value]):
                if isinstance(item, Body):
                    names += item.ignored(f"{prefix}{name}{f'.{i}' if isinstance(value, list) else ''}.")
        return names


class StreamOptions(Body):
    include_usage: bool = False


class Sampling(Body):
    """Fields shared by both endpoints."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # extension (SGLang, vLLM): 0 = all tokens
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=16)  # choices, each decoded as a request of its own
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionBody(Sampling):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)  # each token's log-probability and this many likeliest tokens'


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionCall(Body):
    name: str
    arguments: str


class ToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's: the call it answers

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required, except in an assistant message with tool_calls")
        return self

    def as_dict(self) -> dict:
        """The message as models/chat.py reads it."""
        content = self.content if isinstance(self.content, str) or self.content is None else "".join(part.text for part in self.content)
        message = {"role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class Function(Body):
    name: str
    description: str | None = None
    parameters: dict | None = None


class Tool(Body):
    type: Literal["function"]
    function: Function


class NamedToolChoice(Body):
    type: Literal["function"]
    function: dict


class JsonSchema(Body):
    name: str
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # true: no properties beyond those the schema names


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _has_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required where type is json_schema")
        return self


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    chat_template_kwargs: dict | None = None  # extension (SGLang, vLLM): e.g. {"enable_thinking": false}
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def offered_tools(self) -> list[dict]:
        """The tools the prompt offers (none where tool_choice is none)."""
        return [] if not self.tools or self.tool_choice == "none" else [tool.model_dump(exclude_none=True) for tool in self.tools]

    def reply_format(self) -> dict | None:
        """The structural tag the reply must match (decoding/grammar.py), or None where it is free text."""
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, Body) else self.tool_choice
        response_format = self.response_format.model_dump(by_alias=True) if self.response_format else None
        return reply_format(self.offered_tools(), choice, response_format, self.parallel_tool_calls)


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, and the offending parameter."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def validation_error(e: ValidationError) -> ApiError:
    first = e.errors()[0]
    param = ".".join(str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"unrecognized request argument supplied: {param}", param=param)
    if first["type"] == "missing":
        return ApiError(400, f"missing required parameter: {param}", param=param)
    return ApiError(400, f"invalid value for {param}: {first['msg']}", param=param)
