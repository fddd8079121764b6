"""`dlite sessions` on the micro target: agent sessions through real `dlite serve` processes on loopback."""

import json

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


def test_an_unknown_method_or_a_url_with_no_server_is_refused_in_one_sentence(run_cli, tmp_path):
    done = run_cli(*SESSIONS, "--methods", "ar,nosuch", check=False)
    assert done.returncode == 2 and "nosuch" in done.stderr + done.stdout
    assert not (tmp_path / "runs" / "micro" / "sessions" / "runs.jsonl").exists()  # refused before any server starts
    done = run_cli(*SESSIONS, "--url", "http://127.0.0.1:9", check=False)
    assert done.returncode == 2 and "does not answer as an OpenAI-compatible server" in done.stderr and "Traceback" not in done.stderr
