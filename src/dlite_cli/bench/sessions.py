"""``dlite sessions``: agent sessions against an OpenAI-compatible server, end to end, prefill included.

A session replays one episode of an agentic workload (BFCL-v3, SWE-Bench★, ToolTalk, τ²★) the way an agent drives a
server: each turn sends the whole conversation so far — the episode's messages up to that turn and every reply the
server wrote before — as one streamed, greedy chat completion, and appends the reply.  N sessions run C at a time.

Per turn it keeps the time to first token, the gaps between streamed chunks (inter-token latency: a chunk carries
what one decode round commits, so a speculative round is one gap), the latency, and the prompt, cached and
completion tokens the server reports.  Per run: completion tokens per second of wall time, and on how many turns
a method wrote its engine's plain decoding's text.

Each (method, concurrency) run gets a fresh ``dlite serve`` as a user starts it (dlite's engine, or vLLM's for
``vllm:NAME``; ``decode.max_batch`` slots), so that no run is served from the prefix cache or the suffix trees of
the one before; ``--url`` measures one
server that is already running instead.  Every run is a line of RUN/sessions/runs.jsonl under a key of what
determines it: an interrupted command resumes with the run it was in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..core.artifacts import Stage, fingerprint_dir
from ..core.config import Config, config_hash
from ..core.devices import hardware, resolve_device
from ..core.errors import DliteError
from ..core.processes import free_port, started
from ..core.progress import progress_bar
from ..data.workloads import Episode, Unavailable, episode_key, load, select
from ..decoding.grammar import Grammars
from ..decoding.methods import checkpoint_of, known_method, parse_method
from ..models.chat import chat_prompt_ids
from ..models.targets import load_target_config, load_tokenizer, prepare_target
from .bench import append_line, read_lines
from .report import Table, speedup_interval

EPISODES_READ = 64  # episodes read per workload to find those with enough turns
RETRIES = 2  # a turn whose connection failed is sent again this many times before it counts as failed
CONNECTION_ERRORS = (httpx.RemoteProtocolError, httpx.ConnectError, httpx.ReadError, httpx.WriteError)


@dataclass
class Session:
    id: str  # workload/episode id
    workload: str
    turns: list[list[dict]]  # messages appended before each assistant turn
    tools: list[dict]  # the tools its system prompt describes, as OpenAI's (none where the workload does not say)


@dataclass
class SessionsPlan:
    methods: list[str]  # as the bench names them: ar, dlite, suffix, dlite+suffix, vllm:NAME …
    concurrency: list[int]  # sessions at once
    sessions: int
    turns: int  # per session, at most
    max_tokens: int  # per reply
    url: str | None = None  # a running server to measure instead of starting dlite's
    tool_choice: str | None = None  # auto, required: each session's tools sent with it (None: its messages alone)


def agent_sessions(count: int, turns: int, fits=lambda episode: True) -> list[Session]:
    """``count`` sessions taken in turn from each agentic workload that has episodes here, each an episode's first
    ``turns`` turns; a workload whose episodes are all shorter gives its longest.  Episodes ``fits`` refuses (too long
    for the server's context) are passed over."""
    pools = []
    for workload in select("agentic", None):
        loaded = load(workload, None, EPISODES_READ)
        if isinstance(loaded, Unavailable):
            continue
        episodes = [e for e in loaded[0] if fits(Episode(e.id, e.turns[:turns], e.tools))]
        need = min(turns, max((len(e.turns) for e in episodes), default=0))
        pools.append([Session(f"{workload.name}/{e.id}", workload.name, e.turns[:need], e.tools) for e in episodes if len(e.turns) >= need > 0])
    sessions = [pool[i] for i in range(max(map(len, pools), default=0)) for pool in pools if i < len(pool)]
    if len(sessions) < count:
        raise DliteError(f"only {len(sessions)} agent sessions fit here, {count} asked for")
    return sessions[:count]


def sessions_key(sessions: list[Session]) -> str:
    return hashlib.sha1(json.dumps([[s.id, episode_key(Episode(s.id, s.turns))] for s in sessions]).encode()).hexdigest()[:12]


# ---------------------------------------------------------------- the client


def stream_turn(client: httpx.Client, url: str, model: str, messages: list[dict], max_tokens: int, tools: list[dict] | None = None,
                tool_choice: str | None = None) -> dict:
    """One streamed greedy chat completion (offering ``tools`` with ``tool_choice``, where given) → its text, tool
    calls, time to first token, chunk gaps, latency (s) and usage.  Sent again, up to RETRIES times, where the
    connection failed (a server may close a kept-alive connection between requests without saying so; the openai SDK
    retries the same way)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if tools:
        body |= {"tools": tools, "tool_choice": tool_choice}
    for attempt in itertools.count():
        try:
            return streamed(client, url, body)
        except CONNECTION_ERRORS:
            if attempt == RETRIES:
                raise


def streamed(client: httpx.Client, url: str, body: dict) -> dict:
    """One try of :func:`stream_turn`."""
    start, stamps, text, usage, calls, stats = time.perf_counter(), [], "", {}, {}, {}
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise DliteError(f"{url} answered HTTP {response.status_code}: {response.read().decode()[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage, stats = event.get("usage") or usage, event.get("dlite") or stats  # dlite's server: its acceptance statistics
            deltas = [c["delta"] for c in event.get("choices", [])]
            piece = "".join(d.get("content") or "" for d in deltas)
            for call in (call for d in deltas for call in d.get("tool_calls") or []):  # a call whole, or its name then its arguments in pieces
                name, arguments = calls.get(call["index"], ("", ""))
                function = call.get("function") or {}
                calls[call["index"]] = (name + (function.get("name") or ""), arguments + (function.get("arguments") or ""))
            if piece or any(d.get("tool_calls") for d in deltas):
                stamps.append(time.perf_counter())
                text += piece
    details = usage.get("prompt_tokens_details") or {}
    return {"text": text, "calls": [list(calls[i]) for i in sorted(calls)], "ttft_s": stamps[0] - start if stamps else None,
            "gaps_s": [b - a for a, b in itertools.pairwise(stamps)],
            "latency_s": time.perf_counter() - start, "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "tau": stats.get("tau"), "rounds": stats.get("rounds")}


def play(client: httpx.Client, url: str, model: str, session: Session, max_tokens: int, tool_choice: str | None, valid, done) -> list[dict]:
    """A session's turns, one after the other, each reply appended to the conversation → a record per turn (with
    ``tool_choice``, the session's tools are offered, and ``valid(calls, tools)`` says whether the reply's calls are
    calls of them with valid arguments).  A turn that fails is recorded with its reason (``error``), and the session
    ends there: its conversation cannot go on."""
    messages, records = [], []
    tools = session.tools if tool_choice else None
    for index, turn in enumerate(session.turns):
        messages += turn
        where = {"session": session.id, "workload": session.workload, "turn": index}
        try:
            record = stream_turn(client, url, model, messages, max_tokens, tools, tool_choice)
        except (httpx.HTTPError, DliteError, ValueError) as e:
            records.append({**where, "error": f"{type(e).__name__}: {e}"})
            done(len(session.turns) - index)
            break
        messages.append(assistant_message(record["text"], record["calls"], index))
        text = record.pop("text")
        if tools:
            record["valid_calls"] = valid(record["calls"], tools)
        records.append({**where, **record, "text_sha": hashlib.sha1(text.encode()).hexdigest()[:12], "text": text})
        done(1)
    return records


def assistant_message(text: str, calls: list[list[str]], turn: int) -> dict:
    """A reply as the next turn sends it back: its text, and its tool calls, if it made any."""
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None, "tool_calls": [
        {"id": f"call_{turn}_{i}", "type": "function", "function": {"name": name, "arguments": arguments}} for i, (name, arguments) in enumerate(calls)]}


def failed_turns(record: dict) -> list[dict]:
    """A run's turns that failed (each with its ``error``)."""
    return [t for t in record["turns"] if "error" in t]


def answered_turns(record: dict) -> list[dict]:
    """A run's turns that the server answered: all its measurements are of these."""
    return [t for t in record["turns"] if "error" not in t]


def run_level(url: str, sessions: list[Session], concurrency: int, max_tokens: int, label: str, tool_choice: str | None = None, valid=None) -> dict:
    """Every session against ``url``, ``concurrency`` at a time (offering its tools with ``tool_choice``, where given;
    ``valid`` as :func:`play` takes it) → {"wall_s", "model", "turns": [per turn]}."""
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        try:
            model = client.get(url + "/v1/models").json()["data"][0]["id"]
            stream_turn(client, url, model, [{"role": "user", "content": "Hello."}], 4)  # the server's first request is its own warm-up
        except (httpx.HTTPError, ValueError, LookupError) as e:
            raise DliteError(f"{url} does not answer as an OpenAI-compatible server ({type(e).__name__}: {e})") from None
        total = sum(len(s.turns) for s in sessions)
        with progress_bar(f"{label}, {concurrency} at once", total) as bar:
            start = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                played = list(pool.map(lambda s: play(client, url, model, s, max_tokens, tool_choice, valid, lambda n: bar.update(advance=n)), sessions))
            wall = time.perf_counter() - start
    return {"wall_s": wall, "model": model, "turns": [t for turns in played for t in turns]}


# ---------------------------------------------------------------- dlite's servers


def dlite_serve_argv(method: str, target: str, run_dir: Path, overrides: list[str], port: int) -> list[str]:
    """``dlite serve`` for ``method`` (``vllm:NAME``: NAME in vLLM's server) as a user starts it: its slots, queue and
    context the config's."""
    argv = [sys.executable, "-m", "dlite_cli", "serve", "--target", target, "--run-dir", str(run_dir.resolve()), "--engine", parse_method(method).engine.lower(),
            "--drafter", parse_method(method).drafter_option, "--port", str(port)]
    return argv + [a for o in overrides for a in ("--set", o)]


# ---------------------------------------------------------------- the command


def run_sessions(config: Config, target: str, run_dir: Path, overrides: list[str], plan: SessionsPlan, force: bool = False, log=print) -> list[dict]:
    """Every (method, concurrency) run of ``plan`` that RUN/sessions does not hold yet (``force``: all), then the table."""
    prepared = prepare_target(config.target, log)
    tokenizer = load_tokenizer(prepared)
    room = load_target_config(prepared).max_position_embeddings

    def fits(episode: Episode) -> bool:  # its messages, tools and every reply (and its turn's markers) in the target's context
        messages, tools = [m for turn in episode.turns for m in turn], episode.tools if plan.tool_choice else None
        return len(chat_prompt_ids(tokenizer, messages, config.target.thinking, tools)) + plan.turns * (plan.max_tokens + 8) <= room

    sessions = agent_sessions(plan.sessions, plan.turns, fits)
    # an unknown or missing drafter is refused before any server starts
    drafters = {m: None if plan.url else checkpoint_of(known_method(m), run_dir) for m in plan.methods}
    stage = Stage(run_dir, "sessions")
    recorded = {"plan": dataclasses.asdict(plan), "sessions": [s.id for s in sessions]}
    stage.begin(config_hash(recorded), recorded, {"target": prepared.fingerprint}, keyed=True)
    runs_path = stage.dir / "runs.jsonl"
    valid = calls_checker(tokenizer) if plan.tool_choice else None
    stored = {} if force else {r["key"]: r for r in read_lines(runs_path) if not failed_turns(r)}  # a run with failed turns is run again
    where = hardware(resolve_device(config.target.device))  # where dlite's servers run
    setting = {"target": prepared.fingerprint, "hardware": where, "sessions": sessions_key(sessions), "max_tokens": plan.max_tokens, "tool_choice": plan.tool_choice,
               "server": plan.url or {"decode": dataclasses.asdict(config.decode), "suffix": dataclasses.asdict(config.suffix),
                                      "vllm": dataclasses.asdict(config.vllm)}}
    records = []
    for method, directory in drafters.items():
        for level in plan.concurrency:
            key = config_hash(setting, {"method": method, "concurrency": level, "drafter": fingerprint_dir(directory) if directory else None})
            if key not in stored:
                server, measured = measure(method, level, sessions, plan, target, run_dir, overrides, stage.dir, valid)
                stored[key] = {"key": key, "method": method, "concurrency": level, "server": server, "hardware": where, **measured}
                append_line(runs_path, stored[key])
                if failed := failed_turns(stored[key]):
                    log(f"{method}, {level} at once: {len(failed)} of {len(sessions)} sessions ended at a turn the server did not "
                        f"answer ({failed[0]['error'][:200]}); the table counts the turns it answered, and the run is measured again next time")
            records.append(stored[key])
            stage.update(progress={"done": len(records), "total": len(plan.methods) * len(plan.concurrency), "unit": "runs"})
    table = sessions_table(records, where, plan)
    table.write(stage.dir)
    stage.finish(summary={"runs": len(records), "hardware": where})
    log(table.markdown())
    log(f"wrote {stage.dir}/sessions.md (csv, json, tex) and runs.jsonl")
    return records


def measure(method: str, level: int, sessions: list[Session], plan: SessionsPlan, target: str, run_dir: Path, overrides: list[str],
            logs: Path, valid=None) -> tuple[str, dict]:
    """One run: the sessions, ``level`` at a time, against ``plan.url`` or a fresh ``dlite serve`` for ``method`` (its log
    in ``logs``) → the server (URL or command line) and the measurements (``valid`` as :func:`play` takes it)."""
    if plan.url:
        return plan.url, run_level(plan.url, sessions, level, plan.max_tokens, method, plan.tool_choice, valid)
    port = free_port()
    argv = dlite_serve_argv(method, target, run_dir, overrides, port)
    with started(argv, logs / f"serve-{method.replace(':', '-')}-{level}.log", port) as server:
        return " ".join(["dlite", *argv[3:]]), run_level(server.url, sessions, level, plan.max_tokens, method, plan.tool_choice, valid)


def calls_checker(tokenizer):
    """``valid(calls, tools)``: whether a reply's calls ([name, arguments JSON]) are at least one, each of one of
    ``tools`` with arguments valid under its parameters' schema."""
    grammars = Grammars(tokenizer, len(tokenizer), {tokenizer.eos_token_id})

    def valid(calls: list[list[str]], tools: list[dict]) -> bool:
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
        return bool(calls) and all(name in schemas and grammars.valid_json(arguments, schemas[name]) for name, arguments in calls)

    return valid


# ---------------------------------------------------------------- the table


def by_session(record: dict) -> dict[str, list[float]]:
    """session → [seconds its turns took, completion tokens]: the bench's speedup interval resamples these."""
    out: dict[str, list[float]] = {}
    for turn in answered_turns(record):
        cell = out.setdefault(turn["session"], [0.0, 0])
        cell[0] += turn["latency_s"]
        cell[1] += turn["completion_tokens"] or 0
    return out


def tokens_per_s(record: dict) -> float:
    """A run's completion tokens over its wall time."""
    return sum(t["completion_tokens"] or 0 for t in answered_turns(record)) / record["wall_s"]


def percentile(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def summarize(record: dict, plain: dict | None) -> dict:
    """One run's row: throughput, its speedup over its engine's plain decoding (paired by session), latencies, reuse."""
    turns = answered_turns(record)
    gaps = [g for t in turns for g in t["gaps_s"]]
    before = {(t["session"], t["turn"] + 1): t for t in turns}
    later = [(t, before[t["session"], t["turn"]]) for t in turns if t["turn"] > 0 and t["cached_tokens"] is not None]
    reuse = [t["cached_tokens"] / t["prompt_tokens"] for t, _ in later]  # of the prompt
    kept = [min(1.0, t["cached_tokens"] / (b["prompt_tokens"] + b["completion_tokens"])) for t, b in later]  # of what the turn before sent and got
    first = [t["ttft_s"] for t in turns if t["turn"] == 0 and t["ttft_s"] is not None]
    last = max((t["turn"] for t in turns), default=0)
    final = [t["ttft_s"] for t in turns if t["turn"] == last and t["ttft_s"] is not None]
    row = {"tokens_per_s": tokens_per_s(record), "speedup": None, "interval": None, "same_text": None,
           "ttft_first_s": statistics.median(first) if first else None, "ttft_last_s": statistics.median(final) if final else None,
           "itl_p50_ms": 1000 * percentile(gaps, 0.5) if gaps else None, "itl_p99_ms": 1000 * percentile(gaps, 0.99) if gaps else None,
           "reuse_mean": statistics.mean(reuse) if reuse else None, "kept_mean": statistics.mean(kept) if kept else None,
           "kept_min": min(kept) if kept else None,
           "prompt_tokens": statistics.mean([t["prompt_tokens"] for t in turns if t["prompt_tokens"]] or [0]), "turns": len(turns)}
    counted = [t for t in turns if t.get("rounds")]  # dlite's server reports its rounds
    row["tau"] = sum(t["tau"] * t["rounds"] for t in counted) / sum(t["rounds"] for t in counted) if counted else None
    offered = [t for t in turns if "valid_calls" in t]  # turns that offered tools
    row["valid_calls"] = sum(t["valid_calls"] for t in offered) / len(offered) if offered else None
    if plain is not None and plain is not record and turns:
        row["speedup"] = row["tokens_per_s"] / tokens_per_s(plain)
        row["interval"] = speedup_interval(by_session(plain), by_session(record))
        texts = {(t["session"], t["turn"]): t["text_sha"] for t in answered_turns(plain)}
        row["same_text"] = sum(texts.get((t["session"], t["turn"])) == t["text_sha"] for t in turns) / len(turns)
    return row


def _fmt(value, digits: int = 1, suffix: str = "") -> str:
    return "" if value is None else f"{value:.{digits}f}{suffix}"


def sessions_table(records: list[dict], where: str, plan: SessionsPlan) -> Table:
    columns = ["method", "engine", "sessions at once", "completion tok/s", "speedup", "speedup 90% interval", "TTFT first turn s",
               "TTFT last turn s", "ITL p50 ms", "ITL p99 ms", "cached of prompt", "cached of turn before", "same text as plain", "prompt tokens", "τ"]
    if plan.tool_choice:
        columns.append("valid tool calls")
    table = Table("sessions", "Agent sessions end to end", columns)
    runs = {(r["method"], r["concurrency"]): r for r in records}
    for record in records:
        row = summarize(record, runs.get((parse_method(record["method"]).plain, record["concurrency"])))
        interval = "–".join(f"{v:.2f}" for v in row["interval"]) if row["interval"] else ""
        kept = f"{100 * row['kept_mean']:.0f} % (min {100 * row['kept_min']:.0f} %)" if row["kept_mean"] is not None else ""
        table.rows.append({
            "method": parse_method(record["method"]).local, "engine": parse_method(record["method"]).engine,
            "sessions at once": record["concurrency"], "completion tok/s": _fmt(row["tokens_per_s"]), "speedup": _fmt(row["speedup"], 2),
            "speedup 90% interval": interval, "TTFT first turn s": _fmt(row["ttft_first_s"], 2), "TTFT last turn s": _fmt(row["ttft_last_s"], 2),
            "ITL p50 ms": _fmt(row["itl_p50_ms"]), "ITL p99 ms": _fmt(row["itl_p99_ms"]),
            "cached of prompt": _fmt(None if row["reuse_mean"] is None else 100 * row["reuse_mean"], 0, " %"), "cached of turn before": kept,
            "same text as plain": _fmt(None if row["same_text"] is None else 100 * row["same_text"], 0, " %"),
            "prompt tokens": f"{row['prompt_tokens']:.0f}", "τ": _fmt(row["tau"], 2)})
        if plan.tool_choice:
            table.rows[-1]["valid tool calls"] = _fmt(None if row["valid_calls"] is None else 100 * row["valid_calls"], 0, " %")
    workloads = sorted({t["workload"] for r in records for t in r["turns"]})
    table.notes += [
        f"{plan.sessions} sessions ({', '.join(workloads)}) of up to {plan.turns} turns, {plan.max_tokens} tokens a reply, streamed and greedy; "
        f"each turn resends the whole conversation; served on {where}" + (f" at {plan.url}" if plan.url else ", a fresh `dlite serve` per row") + "."
        + (f" Each session with tools (BFCL-v3, ToolTalk) offers them with tool_choice {plan.tool_choice}; valid tool calls: of those turns, the "
           "replies that are one or more calls of an offered tool with arguments valid under its schema." if plan.tool_choice else ""),
        ("completion tok/s: completion tokens over the run's wall time, prefill included. speedup: against the engine's plain decoding "
         "at the same concurrency; its interval resamples sessions (bootstrap), each paired with plain decoding's."),
        ("τ: tokens committed per verify round, as dlite's server reports it (vLLM's does not). "
         "TTFT: median time to the first token of the sessions' first and last turns. ITL: gaps between streamed chunks "
        "(a speculative round's tokens arrive as one chunk). cached: prompt tokens the server reports as served from its "
        "cache in the turns after the first, as a share of their prompt (the rest is new: a tool's result, the user's "
        "next message), and of the prompt and reply of the turn before (all a cache could hold; mean and least)."),
    ]
    for record in records:
        if failed := failed_turns(record):
            table.notes.append(f"{record['method']}, {record['concurrency']} at once: {len(failed)} sessions ended at a turn the server did "
                               f"not answer ({failed[0]['error'][:120]}); the row counts the {len(answered_turns(record))} turns it answered.")
    return table

