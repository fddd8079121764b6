"""``dlite bench``: every method on the same episodes in one process, interleaved, resumable.

For each episode of each workload, every method in turn replays the conversation: the turn's
messages are appended, the method decodes the assistant's reply (greedy by default, so every method
writes the same reply and sees the same contexts), the reply is appended, and so on.  Methods
alternate episode by episode, after a warm-up, so drift of the machine hits all of them alike.

    <run>/bench/results.jsonl       one line per (workload, episode, method): per-turn statistics
    <run>/bench/concurrency.jsonl   one line per (concurrency, method): throughput of the batched engine
    <run>/bench/unavailable.json    workloads and methods that could not run, with the reason

Lines are appended as they finish, so an interrupted bench resumes where it stopped.  The tables
and plots (report.py) are written from these files at the end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path


from .artifacts import Stage, atomic_write_json
from .config import Config, config_hash
from .devices import hardware
from .drafters import load_proposer, resolve_drafter_path, split_fixed
from .engine import Engine, Request, SamplingParams, stop_tokens_and_text
from .errors import DliteError
from .progress import progress_bar
from .regen import chat_prompt_ids
from .report import write_report
from .runner import TargetRunner, decode_path, pass_width
from .targets import load_target
from .workloads import BY_NAME, Episode, Unavailable, episode_key, load, select

METHOD_NAMES = {"ar": "none", "ar:fastest": "none"}  # bench's names for plain autoregressive decoding
# Plain decoding at its fastest here (one token a pass, eager on a CPU, CUDA graphs on a GPU), measured beside
# "ar" when the methods share passes K + 1 wide (a lower precision: see runner.pass_width): speedups are
# taken against the faster of the two, greedy texts compared with "ar", which computes what the others do.
FASTEST_AR = "ar:fastest"
THROUGHPUT_WORKLOADS = ("humaneval", "sharegpt", "mt_bench")  # the first available one feeds the concurrency sweep


@dataclasses.dataclass
class BenchPlan:
    workloads: list[str]
    methods: list[str]
    limit: int
    max_new_tokens: int
    temperature: float
    concurrency: list[int]
    data: dict[str, str]


def read_lines(path: Path) -> list[dict]:
    """The complete JSON lines of ``path`` (a torn last line from a kill is ignored)."""
    if not path.exists():
        return []
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return lines


def append_line(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


class Bench:
    def __init__(self, config: Config, run_dir: Path, plan: BenchPlan, log=print):
        self.config, self.plan, self.log = config, plan, log
        self.stage = Stage(run_dir, "bench")
        self.results, self.throughput = self.stage.dir / "results.jsonl", self.stage.dir / "concurrency.jsonl"

    def run(self, force: bool = False) -> bool:
        """Measure what is missing; False if the bench was already done with this plan."""
        model, self.tokenizer, target = load_target(self.config.target, self.log)
        self.path = decode_path(self.config.decode.path, model.device, model.dtype)
        width = pass_width(self.config.drafter.draft_tokens, model.dtype)
        recorded = {"plan": dataclasses.asdict(self.plan), "decode": dataclasses.asdict(self.config.decode), "drafter": dataclasses.asdict(self.config.drafter),
                    "decode_path": self.path}
        if not self.stage.begin(config_hash(recorded, target.fingerprint), recorded, {"target": target.fingerprint}, force):
            self._report()
            return False
        self._clean_torn_tail()
        unavailable = {"workloads": {}, "methods": {}}
        self.engines, self.drafters = {}, {}
        eos, detokenize = stop_tokens_and_text(model, self.tokenizer)
        capacity = model.config.max_position_embeddings
        proposers = {}
        self.fastest_path = fastest_path = "graphs" if model.device.type == "cuda" else "eager"
        methods = self.plan.methods
        if "ar" in methods and (width > 1 or self.path != fastest_path):
            methods = methods + [FASTEST_AR]
        for method in methods:
            name = METHOD_NAMES.get(method, method)
            try:
                proposers[method] = load_proposer(name, self.stage.dir.parent, model, capacity, self.config.drafter.draft_tokens, self.config.decode.draft_dtype, self.path)
                self.drafters[method] = name if split_fixed(name)[0] in ("none", "ngram") else str(resolve_drafter_path(split_fixed(name)[0], self.stage.dir.parent))
            except DliteError as e:
                unavailable["methods"][method] = str(e)
        # Methods share a runner where their drafters read the same target layers (those that read none
        # join the first), so the prompt prefilled for one method is reused by the next on the same episode:
        # prefill is the target's work alone, the same for every method, and excluded from the speedup.
        shared = next((tuple(p.target_layers) for p in proposers.values() if p.target_layers), ())
        runners = {}
        for method, proposer in proposers.items():
            if method == FASTEST_AR:
                runner = TargetRunner(model, [], 1, capacity, self.config.decode.prefill_chunk, fastest_path)
                self.engines[method] = Engine(runner, proposer, eos, detokenize)
                continue
            layers = tuple(proposer.target_layers) or shared
            if layers not in runners:
                # one pass width for every method (padded plain decoding too, in a lower precision): the same text
                runners[layers] = TargetRunner(model, list(layers), 1, capacity, self.config.decode.prefill_chunk, self.path, width)
            adaptive = self.config.decode.adaptive and split_fixed(method)[1]
            self.engines[method] = Engine(runners[layers], proposer, eos, detokenize, adaptive=adaptive)
        episodes = {}
        for name in self.plan.workloads:
            result = load(BY_NAME[name], self.plan.data.get(name), self.plan.limit)
            if isinstance(result, Unavailable):
                unavailable["workloads"][name] = result.reason
            else:
                episodes[name] = result
        atomic_write_json(self.stage.dir / "unavailable.json", unavailable)
        for kind, reasons in unavailable.items():
            for name, reason in reasons.items():
                self.log(f"{kind[:-1]} {name} unavailable: {reason}")
        if not self.engines:
            raise DliteError("no method could be loaded: " + "; ".join(unavailable["methods"].values()))
        self._warm_up()
        self._episodes(episodes)
        self._concurrency(episodes)
        self.stage.finish(summary={"hardware": hardware(model.device), "decode_path": self.path, "episodes": sum(len(e) for e, _ in episodes.values()),
                                   "unavailable": unavailable})
        self._report()
        return True

    def _report(self) -> None:
        written = write_report(self.stage.dir, self.config.target.model, self.stage.manifest()["summary"]["hardware"])
        self.log(f"wrote {len(written)} files to {self.stage.dir}: tables 1-4 (md, csv, json, tex), plots and summary.md")

    # ----- the episodes

    def _episodes(self, episodes: dict[str, tuple[list[Episode], str]]) -> None:
        done = {(r["workload"], r["episode"], r["key"], r["method"]) for r in read_lines(self.results)}
        work = [(name, episode, source) for name, (items, source) in episodes.items() for episode in items]
        total = len(work) * len(self.engines)
        finished = sum((n, e.id, episode_key(e), m) in done for n, e, _ in work for m in self.engines)
        with progress_bar("bench episodes", total=total, completed=finished) as bar:
            for name, episode, source in work:
                key = episode_key(episode)
                for method, engine in self.engines.items():  # interleaved: every method on this episode, then the next
                    if (name, episode.id, key, method) in done:
                        continue
                    turns = self._replay(engine, episode)
                    append_line(self.results, {"workload": name, "episode": episode.id, "key": key, "method": method,
                                               "drafter": self.drafters[method], "source": source, "turns": turns})
                    finished += 1
                    bar.update(advance=1, description=f"bench {name}")
                    self.stage.update(progress={"done": finished, "total": total, "unit": "episode runs"})

    def _replay(self, engine: Engine, episode: Episode) -> list[dict]:
        """Decode every assistant turn of ``episode``, the context growing turn by turn."""
        messages, turns = [], []
        for index, turn in enumerate(episode.turns):
            messages = messages + turn
            ids = chat_prompt_ids(self.tokenizer, messages, self.config.target.thinking)
            room = engine.runner.capacity - len(ids) - engine.drafter.draft_tokens - 2
            if room < 1:
                turns.append({"turn": index, "context_tokens": len(ids), "skipped": "context longer than the target's"})
                break
            seed = int(hashlib.sha1(f"{episode.id}:{index}".encode()).hexdigest()[:8], 16)
            params = SamplingParams(min(self.plan.max_new_tokens, room), self.plan.temperature, seed=seed)
            (request,) = engine.run([Request(ids, params)])
            stats = request.stats
            turns.append({
                "turn": index, "context_tokens": len(ids), "generated_tokens": stats.generated_tokens,
                "rounds": stats.rounds, "committed": stats.committed, "prefill_s": stats.prefill_seconds,
                "reused_prompt_tokens": stats.reused_prompt_tokens,
                "draft_s": stats.draft_seconds, "verify_s": stats.verify_seconds, "overhead_s": stats.overhead_seconds,
                "proposed": stats.proposed, "accepted": stats.accepted, "draft_kv_bytes": stats.draft_kv_bytes,
                "output_sha": hashlib.sha1(json.dumps(request.output_ids).encode()).hexdigest()[:12],
            })
            messages = messages + [{"role": "assistant", "content": request.text}]
        return turns

    def _warm_up(self) -> None:
        ids = chat_prompt_ids(self.tokenizer, [{"role": "user", "content": "Say hello."}], self.config.target.thinking)
        for engine in self.engines.values():
            engine.run([Request(ids, SamplingParams(max_new_tokens=8))])

    # ----- throughput vs concurrency (Table 4)

    def _concurrency(self, episodes: dict[str, tuple[list[Episode], str]]) -> None:
        source = next((name for name in THROUGHPUT_WORKLOADS if name in episodes), None)
        if source is None or not self.plan.concurrency:
            return
        prompts = [chat_prompt_ids(self.tokenizer, e.turns[0], self.config.target.thinking) for e in episodes[source][0]]
        done = {(r["concurrency"], r["method"]) for r in read_lines(self.throughput)}
        for level in self.plan.concurrency:
            batch = [prompts[i % len(prompts)] for i in range(2 * level)]  # every slot serves two requests
            for method, engine in self.engines.items():
                if (level, method) in done or method == FASTEST_AR:
                    continue
                runner = engine.runner
                # throughput: each method at its own width; plain decoding at its fastest (one token a pass)
                path = runner.path if engine.drafter.draft_tokens else self.fastest_path
                wide_runner = TargetRunner(runner.model, runner.capture_layers, level, runner.capacity, runner.prefill_chunk, path,
                                           pass_width(engine.drafter.draft_tokens, runner.model.dtype))
                wide = Engine(wide_runner, engine.drafter, engine.eos_ids, engine.detokenize)  # the drafter keeps its costs
                start = time.perf_counter()
                requests = wide.run([Request(ids, SamplingParams(self.plan.max_new_tokens, self.plan.temperature, seed=i)) for i, ids in enumerate(batch)])
                seconds = time.perf_counter() - start
                tokens = sum(r.stats.generated_tokens for r in requests)
                append_line(self.throughput, {"concurrency": level, "method": method, "workload": source, "requests": len(requests),
                                              "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "tau": wide.stats.tau})
                self.log(f"concurrency {level} {method}: {tokens / seconds:.1f} tok/s, tau {wide.stats.tau:.2f}")

    # ----- helpers

    def _clean_torn_tail(self) -> None:
        """Rewrite the result files without a line torn by a kill, so appends start clean."""
        for path in (self.results, self.throughput):
            if path.exists():
                path.write_text("".join(json.dumps(r) + "\n" for r in read_lines(path)))


def plan_from(suite: str, workload: str | None, methods: str, limit: int, max_new_tokens: int, temperature: float,
              concurrency: str, data: list[str]) -> BenchPlan:
    """Parse the command line's choices into a BenchPlan (one-sentence errors for bad values)."""
    names = [m.strip() for m in methods.split(",") if m.strip()]
    if not names:
        raise DliteError("--methods is empty: expected e.g. ar,dlite,history,parallel,ngram")
    try:
        levels = [int(c) for c in concurrency.split(",") if c.strip()] if concurrency else []
    except ValueError:
        raise DliteError(f"--concurrency must be comma-separated integers, got {concurrency!r}") from None
    if any(c < 1 for c in levels):
        raise DliteError(f"--concurrency levels must be at least 1, got {concurrency!r}")
    sources = {}
    for item in data:
        name, sep, where = item.partition("=")
        if not sep or name not in BY_NAME:
            raise DliteError(f"--data {item!r}: expected WORKLOAD=PATH_OR_HUB_ID with a workload among {', '.join(BY_NAME)}")
        sources[name] = where
    return BenchPlan([w.name for w in select(suite, workload)], names, limit, max_new_tokens, temperature, levels, sources)
