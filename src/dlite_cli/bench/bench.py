"""``dlite bench``: every method on the same episodes in one process, interleaved, resumable, and every
measurement kept for the plans that come after.

For each episode of each workload, every method in turn replays the conversation: the turn's
messages are appended, the method decodes the assistant's reply (greedy by default, so every method
writes the same reply and sees the same contexts), the reply is appended, and so on.  Methods
alternate episode by episode, after a warm-up, so drift of the machine hits all of them alike.

A measurement is stored under a key of everything that determines it (:meth:`Bench._key`): the
method and its drafter's fingerprint, the workload, the episode's id and text, the token budget and
temperature, the decode settings, the target's fingerprint and dtype, and the hardware.  A plan
(which workloads, episodes and methods) measures only what no earlier plan in the run directory
measured under the same key and reuses the rest; ``--force`` measures the whole plan again.

    <run>/bench/results.jsonl       one line per measured (workload, episode, method): id, key, per-turn statistics
    <run>/bench/concurrency.jsonl   one line per measured (concurrency, method): throughput of the batched engine
    <run>/bench/plans/<plan>/       a plan's tables, plots and summary.md, and plan.json: the plan, the ids of
                                    the measurements its tables show, what was unavailable and why
    <run>/bench/*.md, *.png, ...    the latest plan's tables, plots and summary.md

Lines are appended as they finish, so an interrupted bench resumes where it stopped.  The tables
and plots (report.py) are written from the plan's measurements at the end.

Suffix decoding (``suffix``, ``NAME+suffix``) in dlite's engine measures an episode with a global tree that holds
what the method wrote on the workload's earlier episodes, every turn, the oldest first (none with
``suffix.max_cached_requests`` 0): as an agent's server would, having served those before.  Its key and record name
those episodes, and a bench that reuses them, resumed or later, builds that tree from their stored responses.  In
vLLM (``vllm:suffix``), whose tree dlite cannot set, every episode is measured on its prompt trees alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path

from ..core.artifacts import Stage, fingerprint_dir
from ..core.config import Config, SuffixConfig, config_hash
from ..core.devices import hardware, resolve_device
from ..core.errors import DliteError
from ..core.files import atomic_path, atomic_write_json, atomic_write_text, read_json
from ..core.memory import MemoryPlan, checked, device_memory
from ..core.progress import progress_bar
from ..data.workloads import BY_NAME, Episode, Unavailable, episode_key, load, select
from ..decoding.checkpoints import drafter_origin
from ..decoding.decoding_plan import bench_plan, verify_tokens
from ..decoding.engine import Engine, proposer_setup, stop_tokens_and_text
from ..decoding.methods import FASTEST_PLAIN, PLAIN, VLLM_PREFIX, checkpoint_of, known_method, load_proposer, parse_method
from ..decoding.proposers.suffix import suffix_part
from ..decoding.requests import Request, SamplingParams
from ..models.chat import chat_prompt_ids
from ..models.graphs import CAPTURES
from ..models.runner import TargetRunner, decode_path, pass_width
from ..models.targets import Work, load_target, prepare_target, target_config
from .report import PLOTS, write_report

THROUGHPUT_WORKLOADS = ("humaneval", "sharegpt", "mt_bench")  # the first available one feeds the concurrency sweep


def prompt_trees_only(settings: SuffixConfig) -> SuffixConfig:
    """Suffix decoding in vLLM as the bench measures it: no global tree (vLLM's would hold whatever its engine wrote
    before in this process: the warm-up, other workloads), so that a measurement does not depend on what ran before it."""
    return dataclasses.replace(settings, max_cached_requests=0)


@dataclasses.dataclass
class BenchPlan:
    label: str  # the suite, or the one workload: names the plan's folder
    workloads: list[str]
    methods: list[str]
    limit: int
    max_new_tokens: int
    temperature: float
    concurrency: list[int]
    data: dict[str, str]
    # methods the plan runs in vLLM because the bench's engine is vLLM (not because they were named vllm:NAME): one
    # that vLLM cannot run is measured in dlite's engine instead
    moved_to_vllm: list[str] = dataclasses.field(default_factory=list)


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


def stored_by_key(path: Path, start: int) -> dict[str, dict]:
    """key → the latest measurement from line ``start`` of ``path`` on (lines written before keys were kept are skipped)."""
    return {record["key"]: record for record in read_lines(path)[start:] if "key" in record}


class Bench:
    def __init__(self, config: Config, run_dir: Path, plan: BenchPlan, log=print):
        self.config, self.plan, self.log = config, plan, log
        self.stage = Stage(run_dir, "bench")
        self.results, self.throughput = self.stage.dir / "results.jsonl", self.stage.dir / "concurrency.jsonl"

    def run(self, force: bool = False) -> list[dict]:
        """Measure what the run directory does not hold yet (with ``force``, all of the plan), write the plan's
        tables → the plan's episode measurements (records as in results.jsonl)."""
        episodes, unavailable = self._load_episodes()
        memory = self._memory_plan()
        model, self.tokenizer, target = load_target(self.config.target, self.log, Work.decoding(self.config))
        decode = self.config.decode
        self.path = decode_path(decode.path, model.device, model.dtype, decode.identical_text)
        width = pass_width(verify_tokens(self.config), model.dtype, self.path, decode.identical_text)
        recorded = {"plan": dataclasses.asdict(self.plan), "decode": dataclasses.asdict(self.config.decode),
                    "draft_tokens": self.config.drafter.draft_tokens, "decode_path": self.path}
        digest = config_hash(recorded, target.fingerprint)
        self.plan_dir = self.stage.dir / "plans" / f"{self.plan.label}-{digest[:8]}"
        self.stage.begin(digest, recorded, {"target": target.fingerprint}, keyed=True)
        self.stage.update(memory_plan=memory.as_dict())
        self._clean_torn_tail()
        state = read_json(self.plan_dir / "plan.json") or {}
        # measurements before these lines are not this plan's: those it re-measures under --force (kept through a kill)
        reuse_from = state.get("reuse_from", {"results": 0, "concurrency": 0})
        if force:
            reuse_from = {"results": len(read_lines(self.results)), "concurrency": len(read_lines(self.throughput))}
        self.hardware = hardware(model.device)
        # what every measurement of this process shares (with its own method, drafter and episode, its key)
        self.setting = {"target": target.fingerprint, "dtype": str(model.dtype), "thinking": self.config.target.thinking,
                        "hardware": self.hardware, "decode": dataclasses.asdict(self.config.decode), "decode_path": self.path,
                        "pass_width": width, "draft_tokens": self.config.drafter.draft_tokens}
        unavailable["methods"] = self._load_methods(model, width)
        for kind, reasons in unavailable.items():
            for name, reason in reasons.items():
                self.log(f"{kind[:-1]} {name} unavailable: {reason}")
        if not self.engines:
            raise DliteError("no method could be loaded: " + "; ".join(unavailable["methods"].values()))
        record = {"plan": dataclasses.asdict(self.plan), "reuse_from": reuse_from, "unavailable": unavailable}
        atomic_write_json(self.plan_dir / "plan.json", {**record, "status": "running"})
        self.warmed_up = False
        results, measured = self._episodes(episodes, reuse_from["results"])
        throughput, measured_throughput = self._concurrency(episodes, reuse_from["concurrency"])
        ids = {"episodes": [r["id"] for r in results], "concurrency": [r["id"] for r in throughput]}
        counts = {"measured": measured + measured_throughput, "reused": len(results) + len(throughput) - measured - measured_throughput}
        atomic_write_json(self.plan_dir / "plan.json", {**record, "status": "done", "measurements": ids, **counts})
        self.stage.finish(summary={"plan": self.plan_dir.name, "hardware": self.hardware, "decode_path": self.path,
                                   "episodes": sum(len(e) for e, _ in episodes.values()), "unavailable": unavailable, **counts,
                                   # captured in this process (each taken out of the time it fell in)
                                   "graph_captures": CAPTURES.count, "graph_capture_seconds": round(CAPTURES.seconds, 3)})
        self.log(f"bench plan {self.plan_dir.name}: measured {counts['measured']}, reused {counts['reused']} "
                 f"(episode runs and concurrency levels; --force measures them again)")
        self._report(results, throughput, unavailable)
        return results

    def _memory_plan(self) -> MemoryPlan:
        """The plan's memory plan (memory.py) on the target's device; one that does not fit is refused before the target loads."""
        arch, device = target_config(self.config, self.log), resolve_device(self.config.target.device)
        capacity, levels = device_memory(device), self.plan.concurrency

        def planned(levels: list[int]) -> MemoryPlan:
            return bench_plan(self.config, arch, device.type, self.plan.methods, levels, self.plan.max_new_tokens)

        def advice() -> str:
            fitting = [level for level in levels if planned([level]).fits(capacity)]
            return f"--concurrency {','.join(map(str, fitting))} fits" if fitting else "not even one row at the target's context fits"

        return checked(planned(levels), capacity, advice, self.log)

    def _load_episodes(self) -> tuple[dict[str, tuple[list[Episode], str]], dict]:
        """The plan's episodes per workload, and what is unavailable; a named ``--data`` that gives none is an error."""
        episodes, unavailable = {}, {"workloads": {}, "methods": {}}
        for name in self.plan.workloads:
            result = load(BY_NAME[name], self.plan.data.get(name), self.plan.limit)
            if isinstance(result, Unavailable):
                if name in self.plan.data:
                    raise DliteError(f"--data {name}={self.plan.data[name]}: {result.reason}")
                unavailable["workloads"][name] = result.reason
            else:
                episodes[name] = result
        return episodes, unavailable

    def _load_methods(self, model, width: int) -> dict[str, str]:
        """An engine per method of the plan (and ar:fastest beside padded plain decoding) → the methods that could
        not be loaded, with the reason."""
        self.engines, self.drafters, self.fingerprints, self.origins, self.engine_keys = {}, {}, {}, {}, {}
        self.fastest_path = "graphs" if model.device.type == "cuda" else "eager"
        unavailable, proposers = {}, {}
        methods = list(self.plan.methods)
        for method in methods:  # a method measured in dlite's engine instead of vLLM joins the list as it goes
            if method == PLAIN and (width > 1 or self.path != self.fastest_path):
                methods.append(FASTEST_PLAIN)
            try:
                if parse_method(method).in_vllm:
                    self._load_vllm(method, model)
                else:
                    proposers[method] = self._load_proposer(method, model)
            except DliteError as e:
                unavailable[method] = str(e)
                methods += self._measured_instead(method, methods, unavailable)
        self._engines(proposers, model, width)
        # methods whose suffix trees keep earlier responses → that drafter, and what its global tree holds now
        self.global_trees = {m: suffix_part(p) for m, p in proposers.items() if suffix_part(p) and self.config.suffix.max_cached_requests}
        self.tree_holds: dict[str, tuple[str, list[str]]] = {}
        return unavailable

    def _measured_instead(self, method: str, methods: list[str], unavailable: dict[str, str]) -> list[str]:
        """For a method the plan moved to vLLM that vLLM could not load: the methods to measure in dlite's engine instead
        (it, and plain decoding where that is not measured yet), noted in ``unavailable``."""
        local = parse_method(method).local
        if method not in self.plan.moved_to_vllm or local in methods:
            return []
        unavailable[method] += f"; measured in dlite's engine as {local}"
        return [local] + ([PLAIN] if PLAIN not in methods else [])

    def _load_proposer(self, name: str, model):
        """The proposer of a method in dlite's engine (decoding/methods.py), labelled and keyed by its checkpoint."""
        method = parse_method(name)
        setup = proposer_setup(self.config, model, model.config.max_position_embeddings, self.path, self.log)
        directory = checkpoint_of(method, self.stage.dir.parent)
        proposer = load_proposer(method, directory, setup)
        if suffix_part(proposer):  # its settings are part of what was measured
            self.engine_keys[name] = {"suffix": dataclasses.asdict(self.config.suffix)}
        self._label(name, directory, method.drafter_option)
        return proposer

    def _engines(self, proposers: dict, model, width: int) -> None:
        """An engine per proposer.  Methods share a runner where their drafters read the same target layers (those that
        read none join the first), so the prompt prefilled for one method is reused by the next on the same episode:
        prefill is the target's work alone, the same for every method, and excluded from the speedup."""
        eos, detokenize = stop_tokens_and_text(model, self.tokenizer)
        capacity, chunk = model.config.max_position_embeddings, self.config.decode.prefill_chunk
        shared = next((tuple(p.target_layers) for p in proposers.values() if p.target_layers), ())
        runners = {}
        for method, proposer in proposers.items():
            if method == FASTEST_PLAIN:
                runner = TargetRunner(model, [], 1, capacity, chunk, self.fastest_path)
                self.engines[method] = Engine(runner, proposer, eos, detokenize)
                continue
            layers = tuple(proposer.target_layers) or shared
            if layers not in runners:
                # one pass width for every method (padded plain decoding too, in a lower precision): the same text
                runners[layers] = TargetRunner(model, list(layers), 1, capacity, chunk, self.path, width)
            adaptive = self.config.decode.adaptive and parse_method(method).adaptive
            self.engines[method] = Engine(runners[layers], proposer, eos, detokenize, adaptive=adaptive)

    def _label(self, method: str, directory: Path | None, name: str) -> None:
        """What ``method``'s measurements are labelled and keyed by: its checkpoint (path, fingerprint, origin), or
        ``name`` where it has none."""
        if directory is None:
            self.drafters[method] = self.fingerprints[method] = name
            self.origins[method] = "no checkpoint"
        else:
            self.drafters[method], self.fingerprints[method], self.origins[method] = str(directory), fingerprint_dir(directory), drafter_origin(directory)

    def _load_vllm(self, method: str, model) -> None:
        """A vLLM engine for ``vllm:NAME`` (vllm_engine), keyed also by vLLM's version and settings."""
        from ..vllm_engine.engine import VllmEngine, resolve

        directory, spec = resolve(parse_method(method), self.stage.dir.parent, self.config.drafter.draft_tokens, model.config,
                                  prompt_trees_only(self.config.suffix))
        try:
            engine = VllmEngine(prepare_target(self.config.target, self.log).path, spec, self.config.vllm, str(model.dtype).removeprefix("torch."), self.log)
        except (RuntimeError, ValueError) as e:  # vLLM's own, from its engine process: the cause is in the log above
            raise DliteError(f"vLLM could not start {method}: {str(e).splitlines()[0]}") from None
        self.engines[method] = engine
        self._label(method, directory, parse_method(method).local)
        self.engine_keys[method] = {"engine": engine.version, "vllm": dataclasses.asdict(self.config.vllm)}
        if spec and "suffix_decoding_max_cached_requests" in spec:
            self.engine_keys[method]["suffix"] = dataclasses.asdict(prompt_trees_only(self.config.suffix))

    def _report(self, results: list[dict], throughput: list[dict], unavailable: dict) -> None:
        """The plan's tables and plots in its folder, and copied to the top of the bench folder (the latest plan)."""
        written = write_report(self.plan_dir, results, throughput, unavailable, self.config.target.model, self.hardware)
        for name in set(PLOTS) - set(written):  # a plot of an earlier plan that this one has no data for
            (self.stage.dir / name).unlink(missing_ok=True)
        for name in written:
            with atomic_path(self.stage.dir / name) as tmp:
                shutil.copyfile(self.plan_dir / name, tmp)
        self.log(f"wrote {len(written)} files to {self.plan_dir} and {self.stage.dir}: tables 1-4 and τ by context (md, csv, json, tex), plots and summary.md")

    def _key(self, **fields) -> str:
        """The key of a measurement: this process's setting and the measurement's own ``fields``."""
        return config_hash(self.setting, fields)

    # ----- the episodes

    def _episodes(self, episodes: dict[str, tuple[list[Episode], str]], reuse_from: int) -> tuple[list[dict], int]:
        """Every method on every episode, the stored measurements reused → the plan's records, and how many were measured."""
        stored = stored_by_key(self.results, reuse_from)
        # (workload, episode, source, method, key), interleaved: every method on an episode, then the next, in order and then
        # in reverse, so that a machine that speeds up or slows down during an episode's runs favours no method
        work, keys = [], {}  # keys: (workload, episode id, method) → key
        for name, (items, source) in episodes.items():
            for index, episode in enumerate(items):
                for method in list(self.engines)[:: 1 if index % 2 == 0 else -1]:
                    tree = {"suffix_tree": [e.id for e in items[:index]]} if method in self.global_trees else {}
                    key = self._key(method=method, drafter=self.fingerprints[method], workload=name, episode=episode.id,
                                    text=episode_key(episode), max_new_tokens=self.plan.max_new_tokens, temperature=self.plan.temperature,
                                    **self.engine_keys.get(method, {}), **tree)
                    keys[name, episode.id, method] = key
                    work.append((name, episode, source, method, key))
        missing = [item for item in work if item[-1] not in stored]
        self.stage.update(progress={"done": len(work) - len(missing), "total": len(work), "unit": "episode runs"})
        with progress_bar("bench episodes", total=len(work), completed=len(work) - len(missing)) as bar:
            for done, (name, episode, source, method, key) in enumerate(missing, len(work) - len(missing) + 1):
                self._warm_up()
                tree = self._hold_earlier_episodes(method, name, episodes[name][0], episode, stored, keys)
                turns = self._replay(self.engines[method], episode, keep_output=method in self.global_trees)
                stored[key] = {"id": uuid.uuid4().hex[:12], "key": key, "workload": name, "episode": episode.id, "method": method,
                               "drafter": self.drafters[method], "drafter_fingerprint": self.fingerprints[method], "source": source, "turns": turns,
                               **tree}
                append_line(self.results, stored[key])
                bar.update(advance=1, description=f"bench {name}")
                self.stage.update(progress={"done": done, "total": len(work), "unit": "episode runs"})
        # each with its checkpoint's origin as it is now (a stored key pins the checkpoint's bytes)
        return [{**stored[key], "origin": self.origins[method]} for _, _, _, method, key in work], len(missing)

    def _hold_earlier_episodes(self, method: str, workload: str, items: list[Episode], episode: Episode, stored: dict, keys: dict) -> dict:
        """Before ``method`` decodes ``episode``: a global suffix tree (if it keeps one) that holds its responses on the
        workload's episodes before this one, built from their stored records where it does not already → the record's
        note of what it held."""
        drafter = self.global_trees.get(method)
        if drafter is None:
            return {}
        earlier = [e.id for e in items[: items.index(episode)]]
        records = [stored[keys[workload, e, method]] for e in earlier]
        if self.tree_holds.get(method) != (workload, earlier):
            drafter.reset([turn["output_ids"] for record in records for turn in record["turns"] if "output_ids" in turn])
        self.tree_holds[method] = (workload, earlier + [episode.id])  # once it has decoded this one
        return {"suffix_tree": {"episodes": earlier, "responses": sum("output_ids" in t for r in records for t in r["turns"])}}

    def _replay(self, engine: Engine, episode: Episode, keep_output: bool = False) -> list[dict]:
        """Decode every assistant turn of ``episode``, the context growing turn by turn (``keep_output``: each turn's
        token ids in its record)."""
        messages, turns = [], []
        for index, turn in enumerate(episode.turns):
            messages = messages + turn
            ids = chat_prompt_ids(self.tokenizer, messages, self.config.target.thinking)
            room = engine.room(len(ids))
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
                "capture_s": stats.capture_seconds,
                "proposed": stats.proposed, "accepted": stats.accepted, "draft_kv_bytes": stats.draft_kv_bytes,
                "output_sha": hashlib.sha1(json.dumps(request.output_ids).encode()).hexdigest()[:12],
                **({"output_ids": request.output_ids} if keep_output else {}),
            })
            messages = messages + [{"role": "assistant", "content": request.text}]
        return turns

    def _warm_up(self) -> None:
        """Once, before the first measurement of this process: every engine decodes a few tokens."""
        if self.warmed_up:
            return
        ids = chat_prompt_ids(self.tokenizer, [{"role": "user", "content": "Say hello."}], self.config.target.thinking)
        for engine in self.engines.values():
            engine.run([Request(ids, SamplingParams(max_new_tokens=8))])
        self.tree_holds.clear()  # the warm-up's response is in them
        self.warmed_up = True

    # ----- throughput vs concurrency (Table 4)

    def _concurrency(self, episodes: dict[str, tuple[list[Episode], str]], reuse_from: int) -> tuple[list[dict], int]:
        """Each method's batched throughput at each level, the stored measurements reused → the plan's records,
        and how many were measured."""
        source = next((name for name in THROUGHPUT_WORKLOADS if name in episodes), None)
        if source is None or not self.plan.concurrency:
            return [], 0
        items = episodes[source][0]
        prompts = [chat_prompt_ids(self.tokenizer, e.turns[0], self.config.target.thinking) for e in items]
        stored, records, measured = stored_by_key(self.throughput, reuse_from), [], 0
        for level in self.plan.concurrency:
            batch = [prompts[i % len(prompts)] for i in range(2 * level)]  # every slot serves two requests
            for method, engine in self.engines.items():
                if method == FASTEST_PLAIN:
                    continue
                key = self._key(method=method, drafter=self.fingerprints[method], workload=source, concurrency=level,
                                texts=[episode_key(e) for e in items], max_new_tokens=self.plan.max_new_tokens, temperature=self.plan.temperature,
                                **self.engine_keys.get(method, {}))
                if key not in stored:
                    self._warm_up()
                    measure = self._vllm_throughput if parse_method(method).in_vllm else self._throughput
                    stored[key] = {"id": uuid.uuid4().hex[:12], "key": key, "concurrency": level, "method": method, "workload": source,
                                   **measure(engine, level, batch)}
                    append_line(self.throughput, stored[key])
                    measured += 1
                    self.log(f"concurrency {level} {method}: {stored[key]['tokens_per_s']:.1f} tok/s, tau {stored[key]['tau']:.2f}")
                records.append(stored[key])
        return records, measured

    def _throughput(self, engine: Engine, level: int, batch: list[list[int]]) -> dict:
        """``batch`` through a copy of ``engine`` with ``level`` slots: each method at its own pass width, plain
        decoding at its fastest (one token a pass)."""
        runner = engine.runner
        path = runner.path if engine.drafter.draft_tokens else self.fastest_path
        wide_runner = TargetRunner(runner.model, runner.capture_layers, level, runner.capacity, runner.prefill_chunk, path,
                                   runner.width if engine.drafter.draft_tokens else 1, keep_features=False)  # one turn each
        wide = Engine(wide_runner, engine.drafter, engine.eos_ids, engine.detokenize)  # the drafter keeps its costs
        if suffix_part(engine.drafter):  # a global tree of the sweep's own requests alone
            suffix_part(engine.drafter).reset()
            self.tree_holds.clear()
        start, captured = time.perf_counter(), CAPTURES.seconds
        requests = wide.run([Request(ids, SamplingParams(self.plan.max_new_tokens, self.plan.temperature, seed=i)) for i, ids in enumerate(batch)])
        capture = CAPTURES.seconds - captured  # a fresh runner captures its graphs as it goes: not the decoding's time
        seconds = time.perf_counter() - start - capture
        tokens = sum(r.stats.generated_tokens for r in requests)
        return {"requests": len(requests), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "tau": wide.stats.tau,
                "capture_seconds": capture}

    def _vllm_throughput(self, engine, level: int, batch: list[list[int]]) -> dict:
        """``batch`` through vLLM's scheduler (vllm_engine.VllmEngine), ``level`` requests in flight at a time."""
        requests = [Request(ids, SamplingParams(self.plan.max_new_tokens, self.plan.temperature, seed=i)) for i, ids in enumerate(batch)]
        start = time.perf_counter()
        engine.run(requests, concurrency=level)
        seconds = time.perf_counter() - start
        tokens = sum(r.stats.generated_tokens for r in requests)
        tau = sum(r.stats.committed for r in requests) / max(sum(r.stats.rounds for r in requests), 1)
        return {"requests": len(requests), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "tau": tau, "capture_seconds": 0.0}

    # ----- helpers

    def _clean_torn_tail(self) -> None:
        """Rewrite the result files without a line torn by a kill, so appends start clean."""
        for path in (self.results, self.throughput):
            if path.exists():
                atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in read_lines(path)))


def plan_from(config: Config, suite: str, workload: str | None, methods: str | None, limit: int | None, max_new_tokens: int | None,
              temperature: float, concurrency: str | None, data: list[str], engine: str | None = None, log=print) -> BenchPlan:
    """The command line's choices, the config's ``bench`` section where it makes none → a BenchPlan
    (one-sentence errors for bad values, an unknown method's among them, before anything loads).  ``engine`` (auto, vllm
    or dlite; None: decode.engine; decoding/engines.choose_engine) is where the methods run (:func:`engine_methods`)."""
    from ..decoding.engines import choose_engine

    defaults = config.bench
    named = method_names(methods, defaults.methods)
    for name in named + defaults.compare:
        known_method(name)
    names, moved = engine_methods(named, defaults.compare, choose_engine(config, engine, log), log)
    levels = defaults.concurrency
    if concurrency is not None:
        try:
            levels = [int(c) for c in concurrency.split(",") if c.strip()]
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
    return BenchPlan(workload or suite, [w.name for w in select(suite, workload)], names, limit or defaults.limit,
                     max_new_tokens or defaults.max_new_tokens, temperature, levels, sources, moved)


def method_names(text: str | None, default: list[str]) -> list[str]:
    """``--methods``' comma-separated list (None: ``default``), each once, in order; empty is a one-sentence error."""
    names = default if text is None else [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise DliteError("--methods is empty: expected e.g. ar,dlite,ngram,suffix,dlite+suffix,vllm:ar")
    return list(dict.fromkeys(names))


def engine_methods(names: list[str], compare: list[str], engine: str, log=print) -> tuple[list[str], list[str]]:
    """A plan's methods run in ``engine`` (vllm or dlite) → (the methods to measure, those of them moved to vLLM).

    In vLLM every method is ``vllm:NAME`` but a history drafter, which vLLM cannot run and which stays in dlite's engine.
    Then ``compare`` (bench.compare) runs in the other engine beside them: in dlite's engine when the plan runs in
    vLLM, in vLLM (where it is installed; else said in one line) when it runs in dlite's.  Each engine's plain decoding
    is measured wherever one of its methods is: speedups are against it."""
    from ..decoding.engines import VLLM_INSTALL, supported_vllm

    def movable(name: str) -> bool:
        method = parse_method(name)
        return not method.in_vllm and not method.keeps_history

    moved = [VLLM_PREFIX + n for n in names if engine == "vllm" and movable(n)]
    methods = [VLLM_PREFIX + n if VLLM_PREFIX + n in moved else n for n in names]
    if engine == "vllm":
        methods += compare
    elif compare and supported_vllm():
        methods += [VLLM_PREFIX + n for n in compare if not parse_method(n).keeps_history]
    elif compare:
        log(f"bench.compare's methods are not measured in vLLM: it is not installed ({VLLM_INSTALL})")
    engines = {parse_method(n).in_vllm for n in methods}
    plain = [m for m in (PLAIN, VLLM_PREFIX + PLAIN) if parse_method(m).in_vllm in engines]
    return list(dict.fromkeys(methods + plain)), moved
