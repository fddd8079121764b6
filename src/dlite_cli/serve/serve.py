"""``dlite serve``: an OpenAI-compatible HTTP server whose requests share the engine's continuous batch.

    GET  /v1/models   /health   /metrics (Prometheus text)
    POST /v1/completions   /v1/chat/completions   (``stream: true`` → server-sent events)

One worker thread owns the Engine.  HTTP handlers (asyncio) validate a request, template and
tokenize it off the event loop, hand it to the worker and await its text as it grows; the worker
admits requests into free slots (the one holding the longest prefix of the prompt), prefills them
a chunk per round between the running rows' rounds, and publishes what each request gained.  A
client that goes away cancels its request, which frees its slot at once.

Chat requests speak OpenAI's tools protocol (``tools``, ``tool_choice``, assistant ``tool_calls``,
``tool`` messages): tools reach the prompt through the target's chat template or dlite's default
(models/chat.py), and ``<tool_call>`` blocks in the output come back as ``tool_calls``, streamed as
deltas.  A field the server does not know, or cannot honour, is ignored with a log line, as vLLM
does; a malformed value of one it knows is refused with an OpenAI-style error body.  A request the
engine fails on fails alone, with its traceback in the log; if the worker itself stops, every
request gets 503 and ``/health`` says why.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..core.errors import DliteError
from ..decoding.engine import Engine
from ..decoding.requests import Request, SamplingParams
from ..models.chat import TOOL_CALL, TOOL_CALL_OPEN, chat_prompt_ids, parse_tool_call

MAX_BODY_BYTES = 1 << 20
TAU_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)
POLL_SECONDS = 0.25  # how often a non-streaming handler checks that its client is still there
logger = logging.getLogger("dlite.serve")


# ---------------------------------------------------------------- request bodies


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
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionBody(Sampling):
    prompt: str | list[int]


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


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    chat_template_kwargs: dict | None = None  # extension (SGLang, vLLM): e.g. {"enable_thinking": false}
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    def offered_tools(self) -> list[dict]:
        """The tools the prompt offers (none where tool_choice is none)."""
        return [] if not self.tools or self.tool_choice == "none" else [tool.model_dump(exclude_none=True) for tool in self.tools]

    def unhonoured(self) -> list[str]:
        """What this request asks that the server does not do, besides unknown fields: logged, then decoded anyway."""
        notes = []
        if self.tools and self.tool_choice not in (None, "none", "auto"):
            notes.append("tool_choice other than none or auto is decoded as auto (no constrained decoding)")
        if self.response_format and self.response_format.type != "text":
            notes.append(f"response_format {self.response_format.type} is decoded as text")
        return notes


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


# ---------------------------------------------------------------- the engine worker


@dataclass(eq=False)
class Job:
    """One HTTP request's decoding: the engine Request and where its progress is published, as events
    ("text", str), ("tool_call", dict), ("done", finish reason) and ("error", message, HTTP status)."""

    request: Request
    loop: asyncio.AbstractEventLoop
    tool_calls: ToolCallSplit | None = None  # where the request offers tools
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent: str = ""  # text already published (without tools)

    def publish(self, engine: Engine) -> None:
        """Called by the worker after a step: push the new text and tool calls (and the end, if reached)."""
        request = self.request
        done = request.finish_reason is not None
        text = request.text if done else held_back(engine.text_of(request), request.params.stop)
        if self.tool_calls is not None:
            new, calls = self.tool_calls.feed(text, done)
        else:  # the text only grows (engine.OutputText), so what is new is its tail
            new, calls, self.sent = text[len(self.sent) :], [], text
        if new:
            self._push(("text", new))
        for call in calls:
            self._push(("tool_call", call))
        if done:
            called = self.tool_calls is not None and self.tool_calls.calls and request.finish_reason == "stop"
            self._push(("done", "tool_calls" if called else request.finish_reason))

    def fail(self, message: str, status: int) -> None:
        self._push(("error", message, status))

    def _push(self, event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def held_back(text: str, stops: tuple[str, ...]) -> str:
    """``text`` without a tail that could still become a stop string."""
    return text[: len(text) - partial_suffix(text, stops)]


def partial_suffix(text: str, marks: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper beginning of one of ``marks``."""
    return max((k for mark in marks for k in range(1, len(mark)) if text.endswith(mark[:k])), default=0)


class ToolCallSplit:
    """A growing output split into its text before the first ``<tool_call>`` and the tool calls after it (models/chat.py).
    Text that could still become ``<tool_call>`` is held back; a call is published when its block closes.  An
    output whose tool-call blocks parse to none ends as text, all of it."""

    def __init__(self, parallel: bool):
        self.parallel = parallel  # False: the first call only (OpenAI's parallel_tool_calls)
        self.calls: list[dict] = []
        self.sent = 0  # text[:sent] published as content
        self.scanned = 0  # text[:scanned] read for tool calls

    def feed(self, text: str, done: bool) -> tuple[str, list[dict]]:
        """The whole text so far → (content to publish now, tool calls to publish now)."""
        start = text.find(TOOL_CALL_OPEN)
        if start < 0:
            end = len(text) if done else len(text) - partial_suffix(text, (TOOL_CALL_OPEN,))
            return self._content(text, end), []
        content, calls = self._content(text, start), []
        for match in TOOL_CALL.finditer(text, max(self.scanned, start)):
            self.scanned = match.end()
            call = parse_tool_call(match.group(1))
            if call is not None and (self.parallel or not self.calls):
                self.calls.append(call)
                calls.append(call)
        if done and not self.calls:
            content += self._content(text, len(text))
        return content, calls

    def _content(self, text: str, end: int) -> str:
        new = text[self.sent : end]
        self.sent = max(self.sent, end)
        return new


class Busy(Exception):
    pass


class Stopped(Exception):
    pass


class Worker:
    """The thread that owns the engine; everything else talks to it through ``submit`` and ``cancel``."""

    def __init__(self, engine: Engine, max_queue: int):
        self.engine = engine
        self.metrics = Metrics(engine={"drafter": engine.drafter.name, "path": engine.runner.path, "device": str(engine.runner.device)})
        self.capacity = len(engine.free) + max_queue  # requests in slots plus those waiting
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.jobs: dict[Request, Job] = {}
        self.in_flight = 0
        self.stopped: str | None = None  # why the worker stopped, once it has
        self.lock = threading.Lock()
        threading.Thread(target=self._run, name="dlite-engine", daemon=True).start()

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.stopped:
                raise Stopped(self.stopped)
            if self.in_flight >= self.capacity:
                raise Busy
            self.in_flight += 1
            self.inbox.put(("add", job))

    def cancel(self, job: Job) -> None:
        self.inbox.put(("cancel", job))

    def _run(self) -> None:
        try:
            while True:
                self._take_inbox(block=not self.engine.busy)
                if self.engine.busy:
                    self._step()
                self.metrics.batch_size = len(self.engine.active)
                self.metrics.queue_depth = len(self.engine.waiting) + len(self.engine.prefilling)
        except BaseException as e:  # the worker itself broke: every request, now and later, gets 503
            logger.exception("the engine worker stopped; the server answers 503 from now on")
            with self.lock:  # submit adds nothing after this
                self.stopped = f"the engine worker stopped: {e!r}"
            while True:
                try:
                    kind, job = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    self.jobs[job.request] = job
            for job in list(self.jobs.values()):
                self._close(job, self.stopped, 503)

    def _step(self) -> None:
        for request in self.engine.step():
            job = self.jobs.get(request)
            if job is None:
                continue
            if request.error is not None:
                logger.error("request failed in the engine; the server goes on", exc_info=request.error)
                self._close(job, f"the engine failed on this request: {request.error!r}", 500)
                continue
            job.publish(self.engine)
            if request.finish_reason is not None:
                self._close(job)

    def _take_inbox(self, block: bool) -> None:
        """Apply every pending add and cancel; wait for one first if ``block``."""
        try:
            message = self.inbox.get(block=block)
            while True:
                kind, job = message
                if kind == "add":
                    self.jobs[job.request] = job
                    try:
                        self.engine.add(job.request)
                    except DliteError as e:
                        self._close(job, str(e), 400)
                elif job.request in self.jobs:
                    self.engine.cancel(job.request)
                    self._close(job)
                message = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _close(self, job: Job, error: str | None = None, status: int = 500) -> None:
        del self.jobs[job.request]
        with self.lock:
            self.in_flight -= 1
        if error:
            job.fail(error, status)
        self.metrics.finished(job.request)


@dataclass
class Metrics:
    """Counters for GET /metrics (Prometheus text format)."""

    requests: dict = field(default_factory=dict)  # finish reason → count
    errors: dict = field(default_factory=dict)  # HTTP status → count
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those a slot held already (prefix cache hits)
    generated_tokens: int = 0
    tau_counts: list = field(default_factory=lambda: [0] * len(TAU_BUCKETS))
    tau_sum: float = 0.0
    tau_count: int = 0
    batch_size: int = 0
    queue_depth: int = 0
    engine: dict = field(default_factory=dict)  # what decodes: drafter, decode path, device

    def finished(self, request: Request) -> None:
        reason = request.finish_reason or "error"
        if request.stats is None:  # never reached the engine
            return
        self.requests[reason] = self.requests.get(reason, 0) + 1
        self.prompt_tokens += request.stats.prompt_tokens
        self.cached_tokens += request.stats.reused_prompt_tokens
        self.generated_tokens += request.stats.generated_tokens
        if request.stats.rounds:
            tau = request.stats.tau
            self.tau_sum, self.tau_count = self.tau_sum + tau, self.tau_count + 1
            for i, bound in enumerate(TAU_BUCKETS):
                self.tau_counts[i] += tau <= bound

    def render(self) -> str:
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(self.engine.items()))
        lines = ["# HELP dlite_engine_info The drafter, decode path (eager, static, graphs) and device in use.", "# TYPE dlite_engine_info gauge",
                 f"dlite_engine_info{{{labels}}} 1"]
        lines += ["# HELP dlite_requests_total Requests finished, by finish reason.", "# TYPE dlite_requests_total counter"]
        lines += [f'dlite_requests_total{{reason="{k}"}} {v}' for k, v in sorted(self.requests.items())]
        lines += ["# HELP dlite_request_errors_total Requests refused, by HTTP status.", "# TYPE dlite_request_errors_total counter"]
        lines += [f'dlite_request_errors_total{{status="{k}"}} {v}' for k, v in sorted(self.errors.items())]
        for name, value, help_text in (
            ("dlite_prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished requests."),
            ("dlite_prompt_tokens_cached_total", self.cached_tokens,
             "Of those, tokens found in a slot's cache and not computed again (hit rate: this over dlite_prompt_tokens_total)."),
            ("dlite_generated_tokens_total", self.generated_tokens, "Tokens generated for finished requests."),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
        lines += ["# HELP dlite_tau Acceptance length per request (tokens per verify round).", "# TYPE dlite_tau histogram"]
        lines += [f'dlite_tau_bucket{{le="{b}"}} {c}' for b, c in zip(TAU_BUCKETS, self.tau_counts)]
        lines += [f'dlite_tau_bucket{{le="+Inf"}} {self.tau_count}', f"dlite_tau_sum {self.tau_sum:.4f}", f"dlite_tau_count {self.tau_count}"]
        for name, value, help_text in (
            ("dlite_queue_depth", self.queue_depth, "Requests waiting for a slot."),
            ("dlite_batch_size", self.batch_size, "Rows in the engine's current batch."),
            ("process_resident_memory_bytes", resident_memory(), "Resident memory of the server process."),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"]
        return "\n".join(lines) + "\n"


def resident_memory() -> int:
    """This process's resident set size in bytes (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


# ---------------------------------------------------------------- the HTTP app


class Server:
    """What the HTTP handlers share: the engine's worker, the tokenizer (run on its own thread) and the served
    model's name and defaults.  Its methods are the handlers that create_app routes to, and their helpers."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, thinking: bool, max_queue: int, max_tokens: int):
        self.engine = engine
        self.worker = Worker(engine, max_queue)
        self.tokenizer = tokenizer
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="dlite-tokenizer")
        self.tokenizer_size = len(tokenizer)
        self.model_name, self.thinking, self.max_tokens = model_name, thinking, max_tokens
        self.created = int(time.time())

    def error_response(self, e: ApiError) -> JSONResponse:
        self.worker.metrics.errors[e.status] = self.worker.metrics.errors.get(e.status, 0) + 1
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    async def on_api_error(self, _, e: ApiError):
        return self.error_response(e)

    async def on_not_found(self, http: HttpRequest, _):
        return self.error_response(ApiError(404, f"no route {http.method} {http.url.path}", "not_found_error"))

    async def on_wrong_method(self, http: HttpRequest, _):
        return self.error_response(ApiError(405, f"{http.method} is not allowed on {http.url.path}", "invalid_request_error"))

    # The routes' handlers carry no docstrings: FastAPI would publish them in /openapi.json.

    async def health(self):
        if self.worker.stopped:
            return JSONResponse({"status": "error", "error": self.worker.stopped}, status_code=503)
        return {"status": "ok"}

    async def metrics(self):
        return PlainTextResponse(self.worker.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created, "owned_by": "dlite"}]}

    async def completions(self, http: HttpRequest):
        body = await self.parse(http, CompletionBody)
        request = self.engine_request(body, await self.off_loop(self.completion_ids, body), body.max_tokens, default_max=16)
        return await self.decode(http, body, Job(request, asyncio.get_running_loop()), completion_chunk, completion_response)

    async def chat_completions(self, http: HttpRequest):
        body = await self.parse(http, ChatBody)
        for note in body.unhonoured():
            logger.warning("/v1/chat/completions: %s", note)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        request = self.engine_request(body, await self.off_loop(self.chat_ids, body), requested, default_max=self.max_tokens)
        tool_calls = ToolCallSplit(body.parallel_tool_calls) if body.offered_tools() else None
        return await self.decode(http, body, Job(request, asyncio.get_running_loop(), tool_calls), chat_chunk, chat_response)

    async def parse(self, http: HttpRequest, schema: type[Body]) -> Body:
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body is larger than {MAX_BODY_BYTES} bytes")
        raw = await http.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body is larger than {MAX_BODY_BYTES} bytes")
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            body = schema.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None
        if body.model not in (None, self.model_name):
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {self.model_name!r}", "not_found_error", "model")
        if ignored := body.ignored():
            logger.warning("%s: ignoring fields this server does not support: %s", http.url.path, ", ".join(ignored))
        return body

    async def off_loop(self, function, *args):
        """``function(*args)`` on the one tokenizer thread, so the event loop goes on serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, function, *args)

    def completion_ids(self, body: CompletionBody) -> list[int]:
        prompt_ids = body.prompt if isinstance(body.prompt, list) else self.tokenizer(body.prompt, add_special_tokens=False)["input_ids"]
        if not prompt_ids:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        if any(not 0 <= t < self.tokenizer_size for t in prompt_ids):
            raise ApiError(400, f"prompt token ids must be in [0, {self.tokenizer_size})", param="prompt")
        return prompt_ids

    def chat_ids(self, body: ChatBody) -> list[int]:
        options = body.chat_template_kwargs or {}
        try:
            thinking = bool(options.get("enable_thinking", self.thinking))
            return chat_prompt_ids(self.tokenizer, [m.as_dict() for m in body.messages], thinking, body.offered_tools())
        except Exception as e:  # a template that rejects this conversation (e.g. roles out of order)
            raise ApiError(400, f"the chat template rejected these messages: {e}", param="messages") from None

    def engine_request(self, body: Sampling, prompt_ids: list[int], requested: int | None, default_max: int) -> Request:
        room = self.engine.room(len(prompt_ids))
        if room < 1:
            raise ApiError(400, f"this model's maximum context is {self.engine.capacity} tokens and the prompt has {len(prompt_ids)}", param="messages")
        if requested is None:
            requested = min(default_max, room)
        if not 1 <= requested <= room:
            raise ApiError(400, f"max_tokens must be between 1 and {room} for this prompt of {len(prompt_ids)} tokens "
                                f"(context {self.engine.capacity}), got {requested}", param="max_tokens")
        stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, "stop must be at most 4 non-empty strings", param="stop")
        params = SamplingParams(requested, body.temperature, body.top_p, body.top_k, stops, body.seed)
        request = Request(prompt_ids, params)
        try:
            self.engine.validate(request)
        except DliteError as e:
            raise ApiError(400, str(e)) from None
        return request

    async def decode(self, http: HttpRequest, body: Sampling, job: Job, chunk, final):
        """Run ``job``; return the whole response, or stream it as server-sent events.  ``chunk(identifier, model, text,
        finish, first=False, tool_call=None)`` is a stream's event, ``final(identifier, model, request, text, tool_calls,
        finish)`` the whole response."""
        self.submit(job)
        identifier = f"{'chatcmpl' if isinstance(body, ChatBody) else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if not body.stream:
            return await self.whole_response(http, job, partial(final, identifier, self.model_name, job.request))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = self.streamed_events(job, partial(chunk, identifier, self.model_name), include_usage)
        return StreamingResponse(events, media_type="text/event-stream")

    def submit(self, job: Job) -> None:
        """Hand ``job`` to the worker: 429 where it has no room for another request, 503 where it has stopped."""
        try:
            self.worker.submit(job)
        except Busy:
            raise ApiError(429, f"the server is busy: {self.worker.capacity} requests are already in flight; retry shortly", "rate_limit_exceeded") from None
        except Stopped as e:
            raise ApiError(503, str(e), "server_error") from None

    async def whole_response(self, http: HttpRequest, job: Job, final):
        """``final(text, tool_calls, finish)`` once ``job`` is done; a client that goes away meanwhile cancels it (499)."""
        text, calls = [], []
        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), POLL_SECONDS)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        self.worker.cancel(job)
                        return JSONResponse({}, status_code=499)
                    continue
                if event[0] == "error":
                    raise ApiError(event[2], event[1], "server_error")
                if event[0] == "done":
                    return final("".join(text), calls, event[1])
                (calls if event[0] == "tool_call" else text).append(event[1])
        except asyncio.CancelledError:
            self.worker.cancel(job)
            raise

    async def streamed_events(self, job: Job, chunk, include_usage: bool):
        """``job``'s progress as server-sent events, each ``chunk(text, finish, first=False, tool_call=None)``, then the
        usage (where asked) and ``[DONE]``; a stream closed before the end cancels ``job``."""
        finished, calls = False, 0
        try:
            yield sse(chunk(None, None, first=True))
            while True:
                event = await job.events.get()
                if event[0] == "error":
                    yield sse({"error": ApiError(event[2], event[1], "server_error").body()["error"]})
                    break
                if event[0] == "text":
                    yield sse(chunk(event[1], None))
                    continue
                if event[0] == "tool_call":
                    yield sse(chunk(None, None, tool_call=(calls, event[1])))
                    calls += 1
                    continue
                finished = True
                yield sse(chunk(None, event[1]))
                if include_usage:
                    yield sse({**chunk(None, None), "choices": [], **usage_fields(job.request)})
                break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (or the stream failed): free the slot now
                self.worker.cancel(job)


def create_app(engine: Engine, tokenizer, model_name: str, thinking: bool, max_queue: int, max_tokens: int):
    """The FastAPI app serving ``engine`` (which it drives from its own worker thread); ``max_tokens``: a chat
    request's completion tokens when it names none (a completion's: 16, as OpenAI's)."""
    app = FastAPI(title="dlite", docs_url=None, redoc_url=None)
    server = Server(engine, tokenizer, model_name, thinking, max_queue, max_tokens)
    app.add_exception_handler(ApiError, server.on_api_error)
    app.add_exception_handler(404, server.on_not_found)
    app.add_exception_handler(405, server.on_wrong_method)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.metrics, methods=["GET"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    return app


def completion_chunk(identifier: str, model: str, text: str | None, finish: str | None, first: bool = False) -> dict:
    """A streamed completion's event: text gained, or the finish reason (the ``first`` event is like any without text)."""
    return {"id": identifier, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]}


def completion_response(identifier: str, model: str, request: Request, text: str, calls: list[dict], finish: str) -> dict:
    """A whole completion (``calls``: none, as completions offer no tools)."""
    return {**completion_chunk(identifier, model, text, finish), **usage_fields(request)}


def chat_chunk(identifier: str, model: str, text: str | None, finish: str | None, first: bool = False, tool_call: tuple[int, dict] | None = None) -> dict:
    """A streamed chat completion's event: the assistant's role (``first``), content gained, a tool call as
    ``(index, call)``, or the finish reason."""
    if first:
        delta = {"role": "assistant", "content": ""}
    elif tool_call is not None:
        index, call = tool_call
        delta = {"tool_calls": [{"index": index, **call}]}
    else:
        delta = {"content": text} if text else {}
    return {"id": identifier, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}


def chat_response(identifier: str, model: str, request: Request, text: str, calls: list[dict], finish: str) -> dict:
    """A whole chat completion: its content and the tool calls it made."""
    message = {"role": "assistant", "content": (text or None) if calls else text}
    if calls:
        message["tool_calls"] = calls
    return {"id": identifier, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}], **usage_fields(request)}


def usage_fields(request: Request) -> dict:
    """OpenAI's ``usage`` (prompt tokens found in a slot's cache as ``cached_tokens``) plus dlite's acceptance
    statistics in the extra field ``dlite``."""
    stats = request.stats
    usage = {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
             "total_tokens": stats.prompt_tokens + stats.generated_tokens,
             "prompt_tokens_details": {"cached_tokens": stats.reused_prompt_tokens}}
    return {"usage": usage, "dlite": stats.as_dict()}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def serve(config, run_dir, drafter: str, host: str, port: int, max_batch: int | None, max_queue: int, max_context: int | None,
          max_tokens: int, engine: str | None, log) -> None:
    """Load the target and drafter, then serve until interrupted: in the engine ``engine`` names (None: decode.engine;
    auto: vLLM where it is installed and can draft with the drafter), vLLM's OpenAI server or dlite's own."""
    from ..decoding.engines import open_engine

    def in_vllm():
        from ..vllm_engine.engine import serve_vllm

        serve_vllm(config, run_dir, drafter, host, port, max_batch or config.decode.max_batch, max_queue, max_context, max_tokens, log)

    open_engine(config, engine, in_vllm, lambda: serve_dlite(config, run_dir, drafter, host, port, max_batch, max_queue, max_context, max_tokens, log), log)


def serve_dlite(config, run_dir, drafter: str, host: str, port: int, max_batch: int | None, max_queue: int, max_context: int | None,
                max_tokens: int, log) -> None:
    """dlite's own server (:func:`create_app`) on ``host``:``port`` until interrupted."""
    import uvicorn

    from ..decoding.engine import load_engine

    decoder, tokenizer = load_engine(config, run_dir, drafter, slots=max_batch, capacity=max_context, log=log, response_tokens=max_tokens)
    app = create_app(decoder, tokenizer, config.name, config.target.thinking, max_queue, max_tokens)
    handler = logging.StreamHandler()  # the server's warnings (ignored fields) and failures, with their tracebacks
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    log(f"serving {config.name} with drafter {drafter} ({len(decoder.free)} slots, context {decoder.capacity}, "
        f"{decoder.runner.path} decoding on {decoder.runner.device}) "
        f"on http://{host}:{port}/v1")
    uvicorn.run(app, host=host, port=port, log_level="warning")
