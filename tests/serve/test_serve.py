"""`dlite serve` as a real server on loopback, driven by the official openai client and raw HTTP."""

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
from conftest import DEVICE

from dlite_cli.core.config import DrafterConfig, TargetConfig
from dlite_cli.models.model import Drafter, DrafterSpec
from dlite_cli.models.targets import load_model, prepare_target

CHAT = [{"role": "user", "content": "def parse(self, text):"}]
FIXED = ("--set", "decode.adaptive=off")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def drafter_dir(cache_dir, tmp_path_factory):
    """An (untrained) DLite checkpoint: the server drafts with it, so the pivot-feature path is served."""
    model = load_model(prepare_target(TargetConfig(model="micro"), log=lambda _: None), "float32", DEVICE)
    spec = DrafterSpec.for_target(model.config, DrafterConfig(num_target_layers=3, draft_tokens=4, num_layers=1, head_rank=16), 0)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("drafter")
    Drafter(spec).save(path)
    return path


def start_server(cache_dir, workdir, *args):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "dlite_cli", "serve", "--target", "micro", "--port", str(port), *args],
        cwd=workdir, env={**os.environ, "DLITE_CACHE": str(cache_dir)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        assert process.poll() is None, process.communicate()[1][-2000:]
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def server(cache_dir, drafter_dir, tmp_path_factory):
    # fixed drafting: adaptive drafting decides from measured times what to propose, and so a request's τ and
    # which tokens a seed samples (never the greedy text) could differ between this server and `dlite generate`
    process, url = start_server(cache_dir, tmp_path_factory.mktemp("serve"), "--drafter", str(drafter_dir), *FIXED,
                                "--max-batch", "2", "--max-queue", "1", "--max-context", "512", "--max-tokens", "40")
    yield url
    process.terminate()
    process.wait(timeout=30)


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


@pytest.mark.parametrize(
    "path, body, status, says",
    [
        ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/chat/completions", b"[1, 2]", 400, "must be a JSON object"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "ten"}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "temperature": 5}, 400, "temperature"),
        ("/v1/chat/completions", {"messages": CHAT, "frobnicate": True}, 400, "unrecognized request argument supplied: frobnicate"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
        ("/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}, 404, "does not exist"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens must be between 1 and"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 100000}, 400, "max_tokens must be between 1 and"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 2}, 400, "n"),
        ("/v1/completions", {"prompt": "x " * 600}, 400, "maximum context is 512 tokens"),
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
