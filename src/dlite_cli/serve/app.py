"""dlite's OpenAI-compatible HTTP app: its routes, and the responses it builds.

    GET  /v1/models   /health   /metrics (Prometheus text)
    POST /v1/completions   /v1/chat/completions   (``stream: true`` → server-sent events)

HTTP handlers (asyncio) validate a request (bodies.py), template and tokenize it off the event loop, hand it to the
engine's worker (worker.py), one engine request per choice (``n``), and await its text as it grows, with its tokens'
log-probabilities where asked.  A client that goes away cancels its requests, which frees their slots at once.  Chat
requests speak OpenAI's tools protocol: tools reach the prompt through the target's chat template or dlite's default
(models/chat.py), and ``<tool_call>`` blocks in the output come back as ``tool_calls``, streamed as deltas; a reply
whose format the request constrains (a JSON response format, an enforced tool choice) is decoded under a grammar
(decoding/grammar.py).  Fields the server ignores are logged; a refused request, or one the engine
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
from ..decoding.grammar import Grammar
from ..decoding.requests import Logprob, Request, SamplingParams
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
        requests = self.engine_requests(body, await self.off_loop(self.completion_ids, body), body.max_tokens, default_max=16, logprobs=body.logprobs)
        return await self.decode(http, body, self.jobs(requests), completion_chunk, completion_response)

    async def chat_completions(self, http: HttpRequest):
        body = await self.parse(http, ChatBody)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        requests = self.engine_requests(body, await self.off_loop(self.chat_ids, body), requested, default_max=self.max_tokens, logprobs=logprobs)
        for request in requests:
            request.grammar = await self.off_loop(self.chat_grammar, body)
        return await self.decode(http, body, self.jobs(requests, body.parallel_tool_calls if body.offered_tools() else None), chat_chunk, chat_response)

    def jobs(self, requests: list[Request], parallel_tool_calls: bool | None = None) -> list[Job]:
        """A job for each of a body's requests (its choices), publishing to one queue; ``parallel_tool_calls``: where
        the prompt offers tools, whether a reply's every call is read out of it (else the first alone)."""
        events, loop = asyncio.Queue(), asyncio.get_running_loop()
        return [Job(request, loop, index, events, None if parallel_tool_calls is None else ToolCallSplit(parallel_tool_calls))
                for index, request in enumerate(requests)]

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

    def chat_grammar(self, body: ChatBody) -> Grammar | None:
        """The grammar the reply must match (a JSON response format, an enforced tool choice), or None; a format that
        cannot be met or compiled is refused (400)."""
        try:
            reply = body.reply_format()
            return None if reply is None else self.engine.grammars.grammar(reply)
        except DliteError as e:
            raise ApiError(400, str(e)) from None

    def engine_requests(self, body: Sampling, prompt_ids: list[int], requested: int | None, default_max: int, logprobs: int | None) -> list[Request]:
        """The body's ``n`` choices as engine requests (choice i sampled with seed + i, where a seed is given)."""
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
        seeds = [None if body.seed is None else body.seed + i for i in range(body.n)]
        requests = [Request(prompt_ids, SamplingParams(requested, body.temperature, body.top_p, body.top_k, stops, seed, logprobs)) for seed in seeds]
        try:
            self.engine.validate(requests[0])
        except DliteError as e:
            raise ApiError(400, str(e)) from None
        return requests

    async def decode(self, http: HttpRequest, body: Sampling, jobs: list[Job], chunk, final):
        """Run ``jobs`` (the body's choices); return the whole response, or stream it as server-sent events.
        ``chunk(identifier, model, index, text, finish, first=False, tool_call=None, logprobs=None)`` is a stream's event
        for choice ``index``, ``final(identifier, model, requests, choices)`` the whole response, each choice
        ``(text, tool_calls, finish, logprobs)``; ``logprobs`` as :meth:`logprob_entries` writes them."""
        self.submit(jobs)
        identifier = f"{'chatcmpl' if isinstance(body, ChatBody) else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if not body.stream:
            return await self.whole_response(http, jobs, partial(final, identifier, self.model_name, [job.request for job in jobs]))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = self.streamed_events(jobs, partial(chunk, identifier, self.model_name), include_usage)
        return StreamingResponse(events, media_type="text/event-stream")

    def logprob_entries(self, request: Request, logprobs: list[Logprob]) -> list[dict] | None:
        """``logprobs`` in OpenAI's chat form (each token's text, log-probability, UTF-8 bytes and likeliest tokens), or
        None where ``request`` asked for none."""
        if request.params.logprobs is None:
            return None

        def entry(token: int, logprob: float) -> dict:
            text = self.tokenizer.decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]

    def submit(self, jobs: list[Job]) -> None:
        """Hand ``jobs`` to the worker, all or none: 429 where it has no room for them, 503 where it has stopped."""
        submitted = []
        try:
            for job in jobs:
                self.worker.submit(job)
                submitted.append(job)
        except (Busy, Stopped) as e:
            for job in submitted:
                self.worker.cancel(job)
            if isinstance(e, Stopped):
                raise ApiError(503, str(e), "server_error") from None
            raise ApiError(429, f"the server is busy: {self.worker.capacity} requests are already in flight; retry shortly", "rate_limit_exceeded") from None

    def cancel(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.worker.cancel(job)

    async def whole_response(self, http: HttpRequest, jobs: list[Job], final):
        """``final(choices)`` once every job is done, a choice ``(text, tool_calls, finish, logprobs)`` for each; a client
        that goes away meanwhile cancels them (499)."""
        texts, calls, finishes = [[] for _ in jobs], [[] for _ in jobs], [None] * len(jobs)
        events = jobs[0].events
        try:
            while None in finishes:
                try:
                    index, event = await asyncio.wait_for(events.get(), POLL_SECONDS)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        self.cancel(jobs)
                        return JSONResponse({}, status_code=499)
                    continue
                if event[0] == "error":
                    self.cancel(jobs)
                    raise ApiError(event[2], event[1], "server_error")
                if event[0] == "done":
                    finishes[index] = event[1]
                else:
                    (calls if event[0] == "tool_call" else texts)[index].append(event[1])
        except asyncio.CancelledError:
            self.cancel(jobs)
            raise
        return final([("".join(text), called, finish, self.logprob_entries(job.request, job.request.logprobs))
                      for text, called, finish, job in zip(texts, calls, finishes, jobs)])

    async def streamed_events(self, jobs: list[Job], chunk, include_usage: bool):
        """The jobs' progress as server-sent events, each ``chunk(index, text, finish, first=False, tool_call=None,
        logprobs=None)``, then the usage (where asked) and ``[DONE]``; a stream closed before the end cancels them."""
        running, calls, events = len(jobs), [0] * len(jobs), jobs[0].events
        try:
            for index in range(len(jobs)):
                yield sse(chunk(index, None, None, first=True))
            while running:
                index, event = await events.get()
                request = jobs[index].request
                if event[0] == "error":
                    yield sse({"error": ApiError(event[2], event[1], "server_error").body()["error"]})
                    break
                if event[0] == "text":
                    yield sse(chunk(index, event[1], None, logprobs=self.logprob_entries(request, event[2])))
                elif event[0] == "tool_call":
                    yield sse(chunk(index, None, None, tool_call=(calls[index], event[1])))
                    calls[index] += 1
                else:
                    running -= 1
                    yield sse(chunk(index, None, event[1], logprobs=self.logprob_entries(request, event[2]) if event[2] else None))
            if not running and include_usage:
                yield sse({**chunk(0, None, None), "choices": [], **usage_fields([job.request for job in jobs])})
            yield "data: [DONE]\n\n"
        finally:
            if running:  # the client went away (or the stream failed): free the slots now
                self.cancel(jobs)


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


def completion_chunk(identifier: str, model: str, index: int, text: str | None, finish: str | None, first: bool = False,
                     logprobs: list[dict] | None = None) -> dict:
    """A streamed completion's event for choice ``index``: text gained (and its tokens' ``logprobs``, in chat form), or
    the finish reason (the ``first`` event is like any without text)."""
    return {"id": identifier, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text or "", "finish_reason": finish, "logprobs": completion_logprobs(logprobs)}]}


def completion_logprobs(entries: list[dict] | None) -> dict | None:
    """Chat-form logprob entries in the completions endpoint's older form (offsets from the first of them)."""
    if entries is None:
        return None
    offsets = [0]
    for entry in entries[:-1]:
        offsets.append(offsets[-1] + len(entry["token"]))
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries], "text_offset": offsets[: len(entries)]}


def completion_response(identifier: str, model: str, requests: list[Request], choices: list[tuple]) -> dict:
    """A whole completion: each choice ``(text, tool_calls, finish, logprobs)`` (no tool calls: completions offer no tools)."""
    return {"id": identifier, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": completion_logprobs(logprobs)}
                        for index, (text, _, finish, logprobs) in enumerate(choices)], **usage_fields(requests)}


def chat_chunk(identifier: str, model: str, index: int, text: str | None, finish: str | None, first: bool = False,
               tool_call: tuple[int, dict] | None = None, logprobs: list[dict] | None = None) -> dict:
    """A streamed chat completion's event for choice ``index``: the assistant's role (``first``), content gained (with
    its tokens' ``logprobs``), a tool call as ``(its index, call)``, or the finish reason."""
    if first:
        delta = {"role": "assistant", "content": ""}
    elif tool_call is not None:
        call_index, call = tool_call
        delta = {"tool_calls": [{"index": call_index, **call}]}
    else:
        delta = {"content": text} if text else {}
    return {"id": identifier, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": chat_logprobs(logprobs)}]}


def chat_logprobs(entries: list[dict] | None) -> dict | None:
    return None if entries is None else {"content": entries}


def chat_response(identifier: str, model: str, requests: list[Request], choices: list[tuple]) -> dict:
    """A whole chat completion: each choice ``(text, tool_calls, finish, logprobs)`` as a message with its content and
    the tool calls it made."""
    def choice(index: int, text: str, calls: list[dict], finish: str, logprobs: list[dict] | None) -> dict:
        message = {"role": "assistant", "content": (text or None) if calls else text}
        if calls:
            message["tool_calls"] = calls
        return {"index": index, "message": message, "finish_reason": finish, "logprobs": chat_logprobs(logprobs)}

    return {"id": identifier, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice(index, *result) for index, result in enumerate(choices)], **usage_fields(requests)}


def usage_fields(requests: list[Request]) -> dict:
    """OpenAI's ``usage`` for a body's requests, its choices (their prompt counted once; of it, the tokens found in a
    slot's cache as ``cached_tokens``) plus dlite's acceptance statistics, the first choice's, in the extra field
    ``dlite``."""
    first = requests[0].stats
    completion = sum(request.stats.generated_tokens for request in requests)
    usage = {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion, "total_tokens": first.prompt_tokens + completion,
             "prompt_tokens_details": {"cached_tokens": first.reused_prompt_tokens}}
    return {"usage": usage, "dlite": first.as_dict()}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
