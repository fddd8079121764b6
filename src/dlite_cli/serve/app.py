"""dlite's OpenAI-compatible HTTP app: its routes, and the responses it builds.

    GET  /v1/models   /health   /metrics (Prometheus text)
    POST /v1/completions   /v1/chat/completions   (``stream: true`` → server-sent events)

HTTP handlers (asyncio) validate a request (bodies.py), template and tokenize it off the event loop, hand it to the
engine's worker (worker.py) and await its text as it grows.  A client that goes away cancels its request, which
frees its slot at once.  Chat requests speak OpenAI's tools protocol: tools reach the prompt through the target's
chat template or dlite's default (models/chat.py), and ``<tool_call>`` blocks in the output come back as
``tool_calls``, streamed as deltas.  Fields the server ignores are logged; a refused request, or one the engine
failed on, gets an OpenAI-style error body; if the worker has stopped, every request gets 503 and ``/health`` says
why.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError

from ..core.errors import DliteError
from ..decoding.engine import Engine
from ..decoding.requests import Request, SamplingParams
from ..models.chat import chat_prompt_ids
from .bodies import ApiError, Body, ChatBody, CompletionBody, Sampling, validation_error
from .worker import Busy, Job, Stopped, ToolCallSplit, Worker

MAX_BODY_BYTES = 1 << 20
POLL_SECONDS = 0.25  # how often a non-streaming handler checks that its client is still there
logger = logging.getLogger("dlite.serve")


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
