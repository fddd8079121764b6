"""`dlite serve` as a real server on loopback, driven by the official openai client and raw HTTP."""

import json
import logging
import sys
import threading
import time
from contextlib import contextmanager
from typing import Literal

import httpx
import openai
import pydantic
import pytest
import torch
from conftest import AGENT_MESSAGES, AGENT_TOOLS, DEVICE

from dlite_cli.core.config import DrafterConfig, TargetConfig, load_config
from dlite_cli.core.processes import free_port, started
from dlite_cli.decoding.engine import load_engine
from dlite_cli.models.model import Drafter, DrafterSpec
from dlite_cli.models.runner import Prefill
from dlite_cli.models.targets import load_model, prepare_target
from dlite_cli.serve.app import create_app
from dlite_cli.serve.worker import ToolCallSplit

CHAT = [{"role": "user", "content": "def parse(self, text):"}]
FIXED = ("--set", "decode.adaptive=off")


@pytest.fixture(scope="module")
def drafter_dir(cache_dir, tmp_path_factory):
    """An (untrained) DLite checkpoint: the server drafts with it, so the pivot-feature path is served."""
    model = load_model(prepare_target(TargetConfig(model="micro"), log=lambda _: None), "float32", DEVICE)
    spec = DrafterSpec.for_target(model.config, DrafterConfig(num_target_layers=3, draft_tokens=4, num_layers=1, head_rank=16), 0)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("drafter")
    Drafter(spec).save(path)
    return path


@pytest.fixture(scope="module")
def server_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="module")
def server(cache_dir, drafter_dir, server_dir):
    # fixed drafting: adaptive drafting decides from measured times what to propose, and so a request's τ and
    # which tokens a seed samples (never the greedy text) could differ between this server and `dlite generate`
    port = free_port()
    argv = [sys.executable, "-m", "dlite_cli", "serve", "--target", "micro", "--port", str(port), "--drafter", str(drafter_dir), *FIXED,
            "--max-batch", "2", "--max-queue", "1", "--max-context", "1024", "--max-tokens", "40"]
    with started(argv, server_dir / "serve.log", port, {"DLITE_CACHE": str(cache_dir)}, server_dir) as server:
        yield server.url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def metric(url: str, series: str) -> float:
    """The value of one series (name with labels) on GET /metrics; 0 if not there yet."""
    values = dict(line.rsplit(" ", 1) for line in httpx.get(url + "/metrics").text.splitlines() if not line.startswith("#"))
    return float(values.get(series, 0))


def test_models_chat_and_completions_equal_dlite_generate(client, run_cli, drafter_dir):
    (model,) = client.models.list().data
    assert model.id == "micro"
    chat = client.chat.completions.create(model="micro", messages=CHAT, max_tokens=20, temperature=0)
    generated = json.loads(run_cli("generate", "--target", "micro", "--drafter", str(drafter_dir), "-p", CHAT[0]["content"],
                                   "--max-new-tokens", "20", *FIXED, "--json").stdout)
    assert chat.choices[0].message.content == generated["text"] and chat.choices[0].finish_reason == generated["finish_reason"]
    assert chat.usage.completion_tokens == generated["generated_tokens"] and chat.usage.prompt_tokens == generated["prompt_tokens"]
    assert chat.model_extra["dlite"]["tau"] == generated["tau"]  # acceptance statistics in the extra field
    completion = client.completions.create(model="micro", prompt="import os\n", max_tokens=12, temperature=0)
    assert completion.usage.completion_tokens == 12 and completion.choices[0].finish_reason == "length"
    assert isinstance(completion.choices[0].text, str)
    unbounded = client.chat.completions.create(model="micro", messages=CHAT, temperature=0)  # --max-tokens 40, not the room left
    bounded = client.chat.completions.create(model="micro", messages=CHAT, max_tokens=40, temperature=0)
    assert unbounded.usage.completion_tokens <= 40 and unbounded.choices[0].message.content == bounded.choices[0].message.content
    two_turns = CHAT + [{"role": "assistant", "content": chat.choices[0].message.content}, {"role": "user", "content": "again"}]
    follow_up = client.chat.completions.create(model="micro", messages=two_turns, max_tokens=5, temperature=0)
    assert follow_up.usage.prompt_tokens > chat.usage.prompt_tokens + chat.usage.completion_tokens


def test_streaming_equals_the_whole_response(client):
    whole = client.chat.completions.create(model="micro", messages=CHAT, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(model="micro", messages=CHAT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 24
    pieces = list(client.completions.create(model="micro", prompt="import os\n", max_tokens=12, temperature=0, stream=True))
    plain = client.completions.create(model="micro", prompt="import os\n", max_tokens=12, temperature=0)
    assert "".join(p.choices[0].text for p in pieces) == plain.choices[0].text


def test_stop_strings_cut_the_text_streamed_or_not(client):
    full = client.chat.completions.create(model="micro", messages=CHAT, max_tokens=30, temperature=0).choices[0].message.content
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    expected = full[: full.index(stop)]
    cut = client.chat.completions.create(model="micro", messages=CHAT, max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == expected and cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="micro", messages=CHAT, max_tokens=30, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected


def test_sampling_with_a_seed_is_reproducible(client):
    runs = [client.chat.completions.create(model="micro", messages=CHAT, max_tokens=16, temperature=1.0, top_p=0.9, seed=7)
            for _ in range(2)]
    assert runs[0].choices[0].message.content == runs[1].choices[0].message.content


def test_n_choices_are_decoded_each_with_its_own_seed_streamed_or_not(client):
    options = dict(model="micro", messages=CHAT, max_tokens=16, temperature=1.0)
    both = client.chat.completions.create(**options, seed=3, n=2)
    texts = [choice.message.content for choice in both.choices]
    assert [choice.index for choice in both.choices] == [0, 1] and texts[0] != texts[1]
    assert client.chat.completions.create(**options, seed=4).choices[0].message.content == texts[1]  # choice i: seed + i
    streamed = list(client.chat.completions.create(**options, seed=3, n=2, stream=True))
    assert ["".join(c.choices[0].delta.content or "" for c in streamed if c.choices and c.choices[0].index == i) for i in (0, 1)] == texts


MODE_TOOL = {"type": "function", "function": {"name": "set_mode", "description": "Set the mode.", "parameters": {
    "type": "object", "properties": {"mode": {"enum": ["fast", "slow"]}}, "required": ["mode"], "additionalProperties": False}}}


class Mode(pydantic.BaseModel):
    mode: Literal["fast", "slow"]
    sure: bool


def test_an_enforced_tool_choice_comes_back_as_one_call_of_that_tool_streamed_or_not(client):
    """The micro target is random: only the grammar makes its reply a call, of the tool named, with valid arguments."""
    for choice, tools in (({"type": "function", "function": {"name": "set_mode"}}, AGENT_TOOLS + [MODE_TOOL]), ("required", [MODE_TOOL])):
        options = dict(model="micro", messages=CHAT, tools=tools, tool_choice=choice, max_tokens=200, temperature=0, parallel_tool_calls=False)
        response = client.chat.completions.create(**options)
        calls = response.choices[0].message.tool_calls
        assert response.choices[0].finish_reason == "tool_calls" and len(calls) == 1 and calls[0].function.name == "set_mode"
        assert json.loads(calls[0].function.arguments)["mode"] in ("fast", "slow")
        streamed = list(client.chat.completions.create(**options, stream=True))
        deltas = [call for chunk in streamed if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
        assert [(d.function.name, d.function.arguments) for d in deltas] == [("set_mode", calls[0].function.arguments)]


def test_a_json_schema_reply_parses_into_the_callers_type(client):
    """The openai SDK's structured-output helper sends the type's strict schema and parses the reply into it."""
    for messages in (CHAT, [{"role": "user", "content": "Fast or slow?"}]):
        response = client.beta.chat.completions.parse(model="micro", messages=messages, response_format=Mode, max_tokens=400, temperature=0)
        assert isinstance(response.choices[0].message.parsed, Mode)


def test_logprobs_are_each_written_tokens_in_chat_and_completions_streamed_or_not(client):
    options = dict(model="micro", messages=CHAT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    chat = client.chat.completions.create(**options)
    entries = chat.choices[0].logprobs.content
    assert "".join(entry.token for entry in entries) == chat.choices[0].message.content and len(entries) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.logprob == entry.top_logprobs[0].logprob < 0 for entry in entries)  # greedy: the likeliest
    streamed = list(client.chat.completions.create(**options, stream=True))
    assert [e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content] == [e.token for e in entries]
    completion = client.completions.create(model="micro", prompt="def parse(self, text):", max_tokens=12, temperature=0, logprobs=1)
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text and [len(top) for top in logprobs.top_logprobs] == [1] * len(logprobs.tokens)
    assert client.chat.completions.create(model="micro", messages=CHAT, max_tokens=2).choices[0].logprobs is None


@pytest.mark.parametrize(
    "path, body, status, says",
    [
        ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/chat/completions", b"[1, 2]", 400, "must be a JSON object"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "ten"}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "temperature": 5}, 400, "temperature"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "content is required"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
        ("/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}, 404, "does not exist"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens must be between 1 and"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 100000}, 400, "max_tokens must be between 1 and"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 0}, 400, "n"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": AGENT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}}, 400,
         "'rm', which is not among the tools"),
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, 400, "no tools are given"),
        ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, 400, "json_schema is required"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ("/v1/completions", {"prompt": "x " * 1200}, 400, "maximum context is 1024 tokens"),
        ("/v1/completions", {"prompt": []}, 400, "prompt must not be empty"),
        ("/v1/completions", {"prompt": [1, 10**9]}, 400, "token ids"),
        ("/v1/completions", {}, 400, "missing required parameter: prompt"),
        ("/v1/completions", b'{"prompt": "' + b"a" * (2 << 20) + b'"}', 413, "larger than"),
        ("/v1/nothing", {}, 404, "no route"),
    ],
)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, path, body, status, says):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server + path, content=content, headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == status
    error = response.json()["error"]
    assert says in error["message"] and error["type"]
    assert httpx.post(server + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60).status_code == 200


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    cancelled = metric(server, 'dlite_requests_total{reason="cancelled"}')
    body = {"prompt": "def f(x):", "max_tokens": 480, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", server + "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(l for l in lines if l.startswith("data:"))
        assert next(l for l in lines if l.startswith("data:"))
    deadline = time.time() + 10
    while metric(server, 'dlite_requests_total{reason="cancelled"}') < cancelled + 1:
        assert time.time() < deadline, "the disconnected request kept its slot"
        time.sleep(0.1)
    assert metric(server, "dlite_batch_size") == 0


def test_a_full_queue_answers_429_and_metrics_count_it(server):
    """Two slots and one queue place: a fourth long request is refused at once."""
    body = {"prompt": "def f(x):", "max_tokens": 480, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        streams = [http.stream("POST", server + "/v1/completions", json=body) for _ in range(3)]
        opened = [s.__enter__() for s in streams]
        try:
            for response in opened:
                assert response.status_code == 200
            refused = http.post(server + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_exceeded"
            assert refused.headers["retry-after"] == "1"
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    text = httpx.get(server + "/metrics").text
    assert 'dlite_request_errors_total{status="429"}' in text and "dlite_tau_bucket" in text and "process_resident_memory_bytes" in text


def test_regen_through_the_server_equals_regen_in_process(server, run_cli, tmp_path):
    run_cli("regen", "--target", "micro", "--limit", "4", "--run-dir", str(tmp_path / "hf"))
    run_cli("regen", "--target", "micro", "--limit", "4", "--run-dir", str(tmp_path / "served"),
            "--backend", "openai", "--base-url", server + "/v1", "--concurrency", "4")

    def responses(run):
        records = [json.loads(line) for path in sorted((run / "regen" / "chunks").glob("*.jsonl")) for line in path.read_text().splitlines()]
        return {r["id"]: r["response"] for r in records}

    hf, served = responses(tmp_path / "hf"), responses(tmp_path / "served")
    assert len(hf) == 4 and hf == served


def test_unknown_fields_are_ignored_with_a_log_line(server, server_dir):
    body = {"messages": CHAT, "max_tokens": 2, "frobnicate": True, "logit_bias": {"5": 1}, "messages_extra": 1}
    assert httpx.post(server + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    deadline = time.time() + 10
    while "frobnicate" not in (server_dir / "serve.log").read_text():
        assert time.time() < deadline, "no log line about the ignored fields"
        time.sleep(0.1)
    assert "ignoring fields this server does not support: frobnicate, logit_bias, messages_extra" in (server_dir / "serve.log").read_text()


def test_an_agent_session_with_tools_is_served_and_each_turn_reuses_the_last(client, server):
    """Five turns as an agent framework sends them (tools, tool calls with null content, tool results, the developer
    role), streamed and not: each is answered, and each prompt after the first is found in the cache up to the
    previous turn's prompt."""
    messages, previous = list(AGENT_MESSAGES), 0
    cached_before = metric(server, "dlite_prompt_tokens_cached_total")
    for turn in range(5):
        options = {"model": "micro", "messages": messages, "tools": AGENT_TOOLS, "max_tokens": 8, "temperature": 0, "response_format": {"type": "text"},
                   "tool_choice": ["auto", "required", {"type": "function", "function": {"name": "read_file"}}, "auto", "required"][turn],
                   "parallel_tool_calls": turn % 2 == 0}
        if turn % 2:
            chunks = list(client.chat.completions.create(**options, stream=True, stream_options={"include_usage": True}))
            usage, reply = chunks[-1].usage, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert chunks[-2].choices[0].finish_reason in ("stop", "length", "tool_calls")
        else:
            response = client.chat.completions.create(**options)
            usage, reply = response.usage, response.choices[0].message.content or ""
            assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert usage.prompt_tokens > previous and usage.prompt_tokens_details.cached_tokens >= previous - 2  # (the reply's first tokens may merge)
        previous = usage.prompt_tokens
        messages += [{"role": "assistant", "content": reply},
                     {"role": "tool", "tool_call_id": f"call_{turn}", "content": f"line {turn} of the file"}]
    assert metric(server, "dlite_prompt_tokens_cached_total") > cached_before


def test_tool_calls_are_read_out_of_the_text_as_it_grows_whole_or_char_by_char():
    text = ('Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "grep", "arguments": {"pattern": "def"}}\n</tool_call>')
    whole = ToolCallSplit(parallel=True)
    content, calls = whole.feed(text, done=True)
    assert content == "Let me look.\n" and [c["function"]["name"] for c in calls] == ["read_file", "grep"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"path": "a.py"} and calls[0]["id"].startswith("call_")
    grown, pieces, streamed = ToolCallSplit(parallel=True), [], []
    for end in range(1, len(text) + 1):
        new, calls = grown.feed(text[:end], done=end == len(text))
        pieces.append(new)
        streamed += calls
        assert "<" not in "".join(pieces)  # not even the start of <tool_call> is sent as text
    assert "".join(pieces) == content and [c["function"] for c in streamed] == [c["function"] for c in whole.calls]
    assert len(ToolCallSplit(parallel=False).feed(text, done=True)[1]) == 1
    assert ToolCallSplit(parallel=True).feed("a < b <tool_call>not json</tool_call>", done=True) == ("a < b <tool_call>not json</tool_call>", [])
    assert ToolCallSplit(parallel=True).feed("x <tool_", done=False) == ("x ", [])


@contextmanager
def served_here(cache_dir, slots=2):
    """dlite's server on micro in this process (the engine at hand, to break), on loopback; → (url, engine)."""
    import uvicorn

    engine, tokenizer = load_engine(load_config("micro", []), None, "none", slots=slots, capacity=512, log=lambda _: None)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, tokenizer, "micro", False, 2, 16), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "the in-process server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.mark.parametrize("where", ["prefill", "round"])
def test_a_request_the_engine_fails_on_gets_500_with_a_traceback_logged_and_the_next_is_served(where, cache_dir, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="dlite.serve")
    body = {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
    with served_here(cache_dir) as (url, engine):
        if where == "prefill":
            step = Prefill.step
            monkeypatch.setattr(Prefill, "step", lambda self: 1 / 0 if len(self.prompt) == 7 else step(self))
            body["prompt"] = list(range(1, 8))
        else:
            verify = engine.runner.verify
            monkeypatch.setattr(engine.runner, "verify", lambda *_: 1 / 0)
        failed = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert failed.status_code == 500 and "the engine failed on this request: ZeroDivisionError" in failed.json()["error"]["message"]
        assert any(r.exc_info and r.exc_info[0] is ZeroDivisionError for r in caplog.records)
        if where == "round":
            monkeypatch.setattr(engine.runner, "verify", verify)
        served = httpx.post(url + "/v1/completions", json={**body, "prompt": [5, 6, 7]}, timeout=60)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(url + "/health").json() == {"status": "ok"} and len(engine.free) == 2
        assert 'dlite_requests_total{reason="error"} 1' in httpx.get(url + "/metrics").text


def test_a_worker_that_stops_turns_every_request_into_503_and_health_says_so(cache_dir, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="dlite.serve")
    with served_here(cache_dir) as (url, engine):
        monkeypatch.setattr(engine, "step", lambda: 1 / 0)
        body = {"prompt": "def f(x):", "max_tokens": 4}
        first = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert first.status_code == 503 and "the engine worker stopped" in first.json()["error"]["message"]
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "ZeroDivisionError" in health.json()["error"]
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 503
        assert any("stopped" in r.getMessage() and r.exc_info for r in caplog.records)
