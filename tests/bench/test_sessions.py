"""`dlite sessions` on the micro target: agent sessions through real `dlite serve` processes on loopback."""

import json
import socketserver
import threading

import pytest

SESSIONS = ["sessions", "--target", "micro", "--sessions", "2", "--turns", "3", "--max-tokens", "4", "--concurrency", "1,2"]


def test_sessions_replay_agent_episodes_through_a_fresh_server_per_run_and_resume(run_cli, tmp_path):
    done = run_cli(*SESSIONS, "--methods", "ar,ngram")
    folder = tmp_path / "runs" / "micro" / "sessions"
    runs = [json.loads(line) for line in (folder / "runs.jsonl").read_text().splitlines()]
    assert [(r["method"], r["concurrency"]) for r in runs] == [("ar", 1), ("ar", 2), ("ngram", 1), ("ngram", 2)]
    assert len({r["server"] for r in runs}) == 4 and all("--drafter" in r["server"] for r in runs)  # a server of its own each
    for run in runs:
        assert len(run["turns"]) == 2 * 3 and {t["workload"] for t in run["turns"]} <= {"bfcl_v3", "tooltalk", "tau2_airline", "swe_bench"}
        by_turn = {(t["session"], t["turn"]): t for t in run["turns"]}
        for (session, turn), record in by_turn.items():
            assert record["completion_tokens"] == 4 and record["ttft_s"] > 0 and record["latency_s"] >= record["ttft_s"]
            if turn:  # the whole turn before is served from the cache: its prompt, and its reply as far as it renders the same
                before = by_turn[session, turn - 1]
                assert before["prompt_tokens"] <= record["cached_tokens"] < record["prompt_tokens"]
    rows = {(r["method"], r["sessions at once"]): r for r in json.loads((folder / "sessions.json").read_text())["rows"]}
    assert rows["ngram", 1]["same text as plain"] == "100 %" and rows["ngram", 2]["speedup"]  # float32: greedy text is the target's
    assert "of up to 3 turns, 4 tokens a reply" in (folder / "sessions.md").read_text()
    again = run_cli(*SESSIONS, "--methods", "ar,ngram")  # every run is kept: nothing is measured or served again
    assert len((folder / "runs.jsonl").read_text().splitlines()) == 4 and "ar, 1 at once" not in again.stderr
    assert done.stderr.count("| ngram | dlite |") == 2  # the table, printed


def test_sessions_offer_their_tools_and_an_enforced_tool_choice_makes_every_reply_a_call(run_cli, tmp_path):
    """The micro target is random: only the grammar makes a reply a tool call (one cut by the token budget ends as text)."""
    for module in ("xgrammar", "fastapi"):  # dlite's dependencies, absent from a bare GPU machine's python
        pytest.importorskip(module)
    plain = ["sessions", "--target", "micro", "--sessions", "2", "--turns", "3", "--max-tokens", "64", "--concurrency", "1", "--methods", "ngram"]
    run_cli(*plain)
    run_cli(*plain, "--tool-choice", "required")  # measured, not taken from the run without tools
    folder = tmp_path / "runs" / "micro" / "sessions"
    runs = [json.loads(line) for line in (folder / "runs.jsonl").read_text().splitlines()]
    assert len(runs) == 2 and not any("valid_calls" in t for t in runs[0]["turns"])
    turns = runs[1]["turns"]
    offered = [t for t in turns if "valid_calls" in t]
    assert offered and {t["workload"] for t in offered} <= {"bfcl_v3", "tooltalk"}
    assert all(t["calls"] or t["text"].startswith('<tool_call>\n{"name": "') for t in offered)
    rows = json.loads((folder / "sessions.json").read_text())["rows"]
    assert rows[0]["valid tool calls"].endswith(" %") and float(rows[0]["τ"]) >= 1
    assert "with tool_choice required" in (folder / "sessions.md").read_text()
    done = run_cli(*SESSIONS, "--tool-choice", "sometimes", check=False)
    assert done.returncode == 2 and "--tool-choice must be auto or required" in done.stderr


def test_an_unknown_method_or_a_url_with_no_server_is_refused_in_one_sentence(run_cli, tmp_path):
    done = run_cli(*SESSIONS, "--methods", "ar,nosuch", check=False)
    assert done.returncode == 2 and "nosuch" in done.stderr + done.stdout
    assert not (tmp_path / "runs" / "micro" / "sessions" / "runs.jsonl").exists()  # refused before any server starts
    done = run_cli(*SESSIONS, "--url", "http://127.0.0.1:9", check=False)
    assert done.returncode == 2 and "does not answer as an OpenAI-compatible server" in done.stderr and "Traceback" not in done.stderr


class KeepAliveCloser(socketserver.ThreadingTCPServer):
    """A loopback OpenAI-compatible server as some servers behave (llama.cpp's among them): it keeps a connection open
    after a reply without saying it may close it, and then closes it when the next request arrives, unanswered.
    ``refuse_from``: a chat with that many messages or more is answered HTTP 400, every time."""

    daemon_threads = allow_reuse_address = True

    def __init__(self, refuse_from: int = 10**9):
        super().__init__(("127.0.0.1", 0), CloserHandler)
        self.refuse_from, self.dropped = refuse_from, 0


class CloserHandler(socketserver.StreamRequestHandler):
    def handle(self):
        for answered in range(2):
            head = []
            while (line := self.rfile.readline()) not in (b"\r\n", b""):
                head.append(line)
            if line == b"" or not head:  # the client closed the connection
                return
            length = next((int(h.split(b":")[1]) for h in head if h.lower().startswith(b"content-length")), 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if answered:  # the kept-alive connection's next request: closed unanswered
                self.server.dropped += 1
                return
            if head[0].startswith(b"GET /v1/models"):
                self.reply("200 OK", "application/json", json.dumps({"data": [{"id": "closer"}]}))
            elif len(body["messages"]) >= self.server.refuse_from:
                self.reply("400 Bad Request", "application/json", json.dumps({"error": "the prompt is too long"}))
            else:
                words = ["a", " b", " c", " d"][: body["max_tokens"]]
                events = [{"choices": [{"delta": {"content": w}}]} for w in words]
                events.append({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": len(words)}})
                self.reply("200 OK", "text/event-stream", "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n")

    def reply(self, status: str, kind: str, text: str):
        data = text.encode()
        self.wfile.write(f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        self.wfile.flush()


@pytest.mark.parametrize("refuse_from", [None, 5])
def test_sessions_measure_a_server_that_closes_kept_alive_connections_and_record_turns_it_refuses(run_cli, tmp_path, refuse_from):
    """A connection the server closed between requests is sent again; a turn the server refuses is recorded with its
    reason, its session ends there, and the run says so in one sentence."""
    server = KeepAliveCloser(refuse_from or 10**9)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        done = run_cli(*SESSIONS, "--url", url, "--methods", "closer")
    finally:
        server.shutdown()
        server.server_close()
    assert server.dropped > 0 and "Traceback" not in done.stderr
    runs = [json.loads(line) for line in (tmp_path / "runs" / "micro" / "sessions" / "runs.jsonl").read_text().splitlines()]
    assert [(r["method"], r["concurrency"]) for r in runs] == [("closer", 1), ("closer", 2)]
    for run in runs:
        failed = [t for t in run["turns"] if "error" in t]
        answered = [t for t in run["turns"] if "error" not in t]
        assert all(t["completion_tokens"] == 4 for t in answered)
        if refuse_from is None:
            assert len(answered) == 2 * 3 and not failed
        else:  # every session stops at the first turn whose chat reaches 5 messages
            assert len(failed) == 2 and all("HTTP 400" in t["error"] for t in failed) and 0 < len(answered) < 2 * 3
    if refuse_from:
        assert "2 of 2 sessions ended at a turn the server did not answer (DliteError" in done.stderr
        assert "sessions ended at a turn the server did not answer" in (tmp_path / "runs" / "micro" / "sessions" / "sessions.md").read_text()
