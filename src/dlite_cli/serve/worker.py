"""The thread that owns the Engine, its queue, and the counters ``/metrics`` renders.

HTTP handlers hand the worker a :class:`Job` and await its text as it grows; the worker admits requests into free
slots (the one holding the longest prefix of the prompt), prefills them a chunk per round between the running rows'
rounds, and publishes what each request gained: its text, and the ``<tool_call>`` blocks in it as tool calls
(models/chat.py) once each closes.  A cancelled request (its client went away) frees its slot at once.  A request the
engine fails on fails alone, with its traceback in the log; if the worker itself stops, every request, now and later,
is refused with 503 and why.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from dataclasses import dataclass, field

from ..core.errors import DliteError
from ..decoding.engine import Engine
from ..decoding.requests import Request
from ..models.chat import TOOL_CALL, TOOL_CALL_OPEN, parse_tool_call

TAU_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)
logger = logging.getLogger("dlite.serve")


@dataclass(eq=False)
class Job:
    """One choice of an HTTP request's decoding: the engine Request and where its progress is published, as events
    ("text", str, logprobs), ("tool_call", dict), ("done", finish reason, logprobs) and ("error", message, HTTP status);
    logprobs: the request's Logprob entries since the last event that carried them."""

    request: Request
    loop: asyncio.AbstractEventLoop
    index: int = 0  # its choice among the body's
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # (index, event): a body's choices may share one
    tool_calls: ToolCallSplit | None = None  # where the request offers tools
    sent: str = ""  # text already published (without tools)
    logprobs_sent: int = 0  # request.logprobs[:logprobs_sent] published

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
            self._push(("text", new, self._new_logprobs()))
        for call in calls:
            self._push(("tool_call", call))
        if done:
            called = self.tool_calls is not None and self.tool_calls.calls and request.finish_reason == "stop"
            self._push(("done", "tool_calls" if called else request.finish_reason, self._new_logprobs()))

    def _new_logprobs(self) -> list:
        new, self.logprobs_sent = self.request.logprobs[self.logprobs_sent :], len(self.request.logprobs)
        return new

    def fail(self, message: str, status: int) -> None:
        self._push(("error", message, status))

    def _push(self, event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, event))


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
