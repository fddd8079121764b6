"""``dlite regen``: the target model rewrites the responses of the training prompts.

Output, under ``<run-dir>/regen/``::

    chunks/00000.jsonl   one record per prompt of chunk 0 (a chunk is regen.chunk_size prompts)
    chunks/00000.0003.features.safetensors
                         what the engine computed over batch 3 of chunk 0's sequences, as the feature cache holds it
                         (the dlite backend, where training caches features: features.FeatureCache takes them)
    skipped.jsonl        malformed source records and prompts that failed, with the reason
    manifest.json

A record is ``{"id", "source", "messages", "response", "input_ids", "prompt_len",
"finish_reason"}``; ``input_ids`` is the chat-formatted prompt followed by the
response tokens (ending with EOS when the model stopped), the exact sequence
later stages feed the target.  A multi-turn trace (an agent's: tool results
between its replies) is written turn by turn, each reply after the context the
earlier ones made, and is one record: ``messages`` is the conversation before its
last reply, ``response`` that reply, ``input_ids`` the whole trace, and ``spans``
the ``[start, end)`` ranges of ``input_ids`` the target wrote, one per reply.

Within a chunk, prompts are sorted by length and cut into fixed batches; each
finished batch is appended to ``chunks/NNNNN.partial`` as one JSON line and the
file is renamed to ``.jsonl`` when the chunk is complete.  A killed run resumes
from the last whole batch, and because batches and sampling seeds are fixed by
the plan, the final records equal those of an uninterrupted run.  ``--shard i/n``
gives worker i the chunks c with c % n == i.  ``--reuse-from DIR`` takes another run's
records for the prompts it already answered (a mix that grows regenerates only what is
new): they are the chunk's first line of ``.partial`` (``"batch": "reused"``), and the
chunk's batches are cut from the prompts left; the features its engine kept of them come along
(``chunks/NNNNN.reused0.features.safetensors``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ..core.artifacts import Stage
from ..core.config import Config, RegenConfig, SourceConfig, config_hash
from ..core.devices import resolve_device
from ..core.errors import DliteError
from ..core.files import atomic_write_text
from ..core.progress import progress_bar
from ..data.prompts import Prompt, Skipped, plan_prompts
from ..models.chat import chat_prompt_ids
from ..models.linears import pack_modules
from ..models.targets import Work, load_model, load_tokenizer, prepare_target
from .sequences import FeatureRecorder, Sequence, read_sequences, runner_sequence, sequences_metadata, spans_of, write_sequences

RETRIES = 6  # attempts per request with the openai backend


@dataclass
class Completion:
    token_ids: list[int]  # response tokens, ending with EOS when the model stopped
    text: str
    finish_reason: str  # "stop" | "length"


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` → ``(i, n)`` with 0 <= i < n."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise DliteError(f"--shard {text!r}: expected i/n, e.g. 0/4") from None
    if not 0 <= index < count:
        raise DliteError(f"--shard {text!r}: expected 0 <= i < n")
    return index, count


def iter_records(run_dir: Path) -> Iterator[dict]:
    """The records of a finished regen stage, in plan order."""
    stage = Stage(run_dir, "regen")
    manifest = stage.manifest()
    if manifest is None or manifest["status"] != "done":
        raise DliteError(f"no finished regen stage in {run_dir}: run `dlite regen` first")
    yield from _chunk_records(stage.dir / "chunks")


def kept_feature_files(run_dir: Path) -> list[Path]:
    """The files of Sequences regen's engine kept (EngineBackend.write_kept), one per batch, in ``run_dir``'s regen stage."""
    return sorted((Stage(run_dir, "regen").dir / "chunks").glob("*.features.safetensors"))


def _chunk_records(chunks_dir: Path) -> Iterator[dict]:
    """The records of the finished chunks in ``chunks_dir``, in plan order, failed prompts left out."""
    for chunk in sorted(chunks_dir.glob("*.jsonl")):
        with chunk.open() as f:
            for line in f:
                record = json.loads(line)
                if "error" not in record:
                    yield record


# ---------------------------------------------------------------- backends


class HFBackend:
    """transformers ``generate`` on padded batches (the default, and the CPU path)."""

    def __init__(self, model, tokenizer, regen: RegenConfig):
        self.model, self.tokenizer, self.regen = model, tokenizer, regen
        pack_modules(model)  # batch 32 on a 2-core EPYC: 57 → 71 tok/s, the same tokens
        eos = model.generation_config.eos_token_id
        self.stop_ids = {tokenizer.eos_token_id} | set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    def close(self) -> None:
        pass  # the model is the caller's

    def generate(self, prompt_ids: list[list[int]], messages: list[list[dict]], seed: int) -> list[Completion | str]:
        pad = self.tokenizer.pad_token_id
        width = max(map(len, prompt_ids))
        input_ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(prompt_ids):  # left padding
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        sampling = self.regen.temperature > 0
        options = dict(temperature=self.regen.temperature, top_p=self.regen.top_p, top_k=0) if sampling else {}
        torch.manual_seed(seed)
        with torch.inference_mode():
            output = self.model.generate(
                input_ids=input_ids.to(self.model.device),
                attention_mask=attention_mask.to(self.model.device),
                max_new_tokens=min(self.regen.max_new_tokens, self.regen.max_length - width),
                do_sample=sampling,
                pad_token_id=pad,
                eos_token_id=sorted(self.stop_ids),
                **options,
            )
        completions = []
        for row in output[:, width:].tolist():
            stop = next((i for i, token in enumerate(row) if token in self.stop_ids), None)
            ids = row if stop is None else row[: stop + 1]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            completions.append(Completion(ids, text, "length" if stop is None else "stop"))
        return completions


class EngineBackend:
    """dlite's own engine (engine.py) without a drafter, on each batch: a row that stops leaves the pass, where
    transformers' ``generate`` computes it to the batch's end, and no prompt is padded (smollm2-135m's backend).  A
    trace's next turn finds the one before in the slot it left, as in the server, and prefills only what is new.
    ``keep``: (layer ids, top-k) to keep each sequence's features at those layers and its p^T as training's feature
    cache holds them (sequences.FeatureRecorder), so that its feature pass takes them instead of running the target
    over every sequence again."""

    def __init__(self, model, tokenizer, regen: RegenConfig, keep: tuple[list[int], int] | None = None):
        from ..decoding.engine import Engine, stop_tokens_and_text
        from ..decoding.proposers.none import NoDrafter
        from ..models.runner import TargetRunner

        runner = TargetRunner(model, [] if keep is None else sorted({*keep[0], len(model.model.layers)}), regen.batch_size, regen.max_length + 2)
        self.drafter = NoDrafter() if keep is None else FeatureRecorder(runner)
        self.engine, self.regen, self.keep = Engine(runner, self.drafter, *stop_tokens_and_text(model, tokenizer)), regen, keep
        self.kept: dict[tuple[int, ...], torch.Tensor] = {}  # a finished request's ids (prompt and output) → its features (T − 1, S', H)

    def close(self) -> None:
        pass  # the model is the caller's

    def timing(self) -> str:
        """Where the engine's time went so far: prompt tokens computed and found in a slot, and the prefill's and the
        decode's rates."""
        stats = self.engine.stats
        computed, decode = stats.prompt_tokens - stats.reused_prompt_tokens, stats.draft_seconds + stats.verify_seconds + stats.overhead_seconds
        return (f"prefill: {computed} prompt tokens computed ({stats.reused_prompt_tokens} more found in a slot, a trace's turns before) in "
                f"{stats.prefill_seconds:.1f} s, {computed / max(stats.prefill_seconds, 1e-9):.0f} tok/s; decode: {stats.generated_tokens} tokens "
                f"in {decode:.1f} s, {stats.generated_tokens / max(decode, 1e-9):.0f} tok/s over {stats.steps} batched steps")

    def generate(self, prompt_ids: list[list[int]], messages: list[list[dict]], seed: int) -> list[Completion | str]:
        from ..decoding.requests import Request, SamplingParams

        regen = self.regen
        # a turn a next one continues is not a record's whole sequence: its features are the next turn's prompt's
        self.kept = {ids: features for ids, features in self.kept.items() if not any(tuple(p[: len(ids)]) == ids for p in prompt_ids)}
        requests = [Request(ids, SamplingParams(min(regen.max_new_tokens, regen.max_length - len(ids)), regen.temperature,
                                                regen.top_p, seed=seed + row))
                    for row, ids in enumerate(prompt_ids)]
        self.engine.run(requests)
        if self.keep is not None:
            self.kept.update((tuple(r.tokens), self.drafter.kept.pop(r)) for r in requests)
        return [Completion(r.output_ids, r.text, "stop" if r.finish_reason == "stop" else "length") for r in requests]

    def write_kept(self, records: list[dict], path: Path) -> None:
        """Write to ``path`` the Sequences (sequences.Sequence) of the ``records`` whose features the engine kept, and forget
        them all.  Their last token's features are zeros: no pass reads that token, and no anchor's
        pivot lies there."""
        layer_ids, top_k = self.keep
        sequences = {}
        for record in records:
            features = self.kept.get(tuple(record["input_ids"]))
            if features is not None:
                padded = torch.cat([features, features.new_zeros(1, *features.shape[1:])])
                sequences[record["id"]] = runner_sequence(self.engine.runner, layer_ids, record, padded, top_k, torch.float16)
        self.kept.clear()
        if sequences:
            write_sequences(path, list(sequences.values()), {"ids": json.dumps(list(sequences)), "layers": json.dumps(layer_ids), "top_k": str(top_k)})


class OpenAIBackend:
    """Any OpenAI-compatible server (SGLang, vLLM, ``dlite serve``): chat completions, ``concurrency`` at a time."""

    def __init__(self, base_url: str, concurrency: int, tokenizer, regen: RegenConfig, thinking: bool, model: str | None):
        import httpx

        self.client = httpx.Client(base_url=base_url.rstrip("/"), timeout=httpx.Timeout(600.0, connect=10.0))
        self.concurrency, self.tokenizer, self.regen, self.thinking = concurrency, tokenizer, regen, thinking
        try:
            self.model = model or self.client.get("/models").raise_for_status().json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise DliteError(f"the server at {base_url} did not list a model on GET /models ({e})") from None

    def close(self) -> None:
        self.client.close()

    def generate(self, prompt_ids: list[list[int]], messages: list[list[dict]], seed: int) -> list[Completion | str]:
        room = [self.regen.max_length - len(ids) for ids in prompt_ids]
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(self._one, messages, room, range(seed, seed + len(messages))))

    def _one(self, messages: list[dict], room: int, seed: int) -> Completion | str:
        import httpx

        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": min(self.regen.max_new_tokens, room),
            "temperature": self.regen.temperature,
            "top_p": self.regen.top_p,
            "seed": seed,
            "chat_template_kwargs": {"enable_thinking": self.thinking},
        }
        wait = 0.0
        for attempt in range(RETRIES):  # retry transport errors, 429 (busy) and 5xx, backing off
            time.sleep(min(wait, 30.0))
            wait = 0.5 * 2**attempt
            try:
                response = self.client.post("/chat/completions", json=body)
            except httpx.TransportError as e:
                response = e
                continue
            if response.status_code < 500 and response.status_code != 429:
                break
            wait = float(response.headers.get("retry-after", wait))
        if isinstance(response, Exception) or response.status_code != 200:
            return f"server error: {response if isinstance(response, Exception) else response.text[:200]}"
        choice = response.json()["choices"][0]
        text = choice["message"]["content"] or ""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        stopped = choice["finish_reason"] == "stop"
        return Completion(ids + [self.tokenizer.eos_token_id] if stopped else ids, text, "stop" if stopped else "length")


class SGLangBackend:
    """SGLang's offline engine on token ids (GPU machines)."""

    def __init__(self, model_path: str, tokenizer, regen: RegenConfig, dtype: str):
        try:
            import sglang
        except ImportError:
            raise DliteError("the sglang backend needs SGLang installed (pip install 'dlite-cli[sglang]') on a GPU machine") from None
        self.engine = sglang.Engine(model_path=model_path, dtype=dtype, random_seed=regen.seed, skip_tokenizer_init=True)
        self.tokenizer, self.regen = tokenizer, regen

    def close(self) -> None:
        """Stop the engine's processes and free the GPU they hold, for the stages that run after regen in this process."""
        self.engine.shutdown()

    def generate(self, prompt_ids: list[list[int]], messages: list[list[dict]], seed: int) -> list[Completion | str]:
        params = [
            {
                "temperature": self.regen.temperature,
                "top_p": self.regen.top_p,
                "max_new_tokens": min(self.regen.max_new_tokens, self.regen.max_length - len(ids)),
                "sampling_seed": seed + i,
            }
            for i, ids in enumerate(prompt_ids)
        ]
        completions = []
        for out in self.engine.generate(input_ids=prompt_ids, sampling_params=params):
            ids = list(out["output_ids"])
            reason = out["meta_info"]["finish_reason"]["type"]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            completions.append(Completion(ids, text, reason) if reason in ("stop", "length") else f"engine: {reason}")
        return completions


# ---------------------------------------------------------------- the stage


def run_regen(
    config: Config,
    run_dir: Path,
    *,
    limit: int | None = None,
    shard: tuple[int, int] = (0, 1),
    base_url: str | None = None,
    concurrency: int = 16,
    model_name: str | None = None,
    force: bool = False,
    reuse_from: Path | None = None,
    log=print,
) -> dict:
    """Run (or resume) this worker's part of the regen stage; return the manifest's summary."""
    regen = config.regen
    if regen.backend == "openai" and not base_url:
        raise DliteError("the openai backend needs --base-url, e.g. http://127.0.0.1:8000/v1")
    target = prepare_target(config.target, log)
    tokenizer = load_tokenizer(target)

    def too_long(prompt: Prompt, source: SourceConfig) -> str | None:
        length = len(chat_prompt_ids(tokenizer, prompt.messages, config.target.thinking))
        limit, key = ((source.max_prompt_tokens, f"source {source.name}'s max_prompt_tokens") if source.max_prompt_tokens
                      else (regen.max_prompt_tokens, "regen.max_prompt_tokens"))
        return f"prompt has {length} tokens, over {key}={limit}" if length > limit else None

    prompts, source_skips = plan_prompts(regen, limit, log, unusable=too_long)
    if not prompts:
        reason = f" (first skip: {source_skips[0].reason})" if source_skips else ""
        raise DliteError(f"regen has no prompts to run: the configured sources gave no usable prompt{reason}")
    plan_digest = hashlib.sha256("\n".join(p.id for p in prompts).encode()).hexdigest()[:16]
    written = _records_of(reuse_from, config, target.fingerprint) if reuse_from is not None else None  # before --force wipes it
    stage = Stage(run_dir, "regen")
    stage_hash = config_hash(config.target.identity(), regen, {"limit": limit, "plan": plan_digest})
    inputs = {"target": target.fingerprint, "prompts": plan_digest, "sources": [s.name for s in regen.sources]}
    recorded = {"target": dataclasses.asdict(config.target), "regen": dataclasses.asdict(regen), "limit": limit}
    if not stage.begin(stage_hash, recorded, inputs, force):
        log(f"regen in {stage.dir} is already done with this config; nothing to do")
        return stage.manifest()["summary"]

    chunks_dir = stage.dir / "chunks"
    chunks_dir.mkdir(exist_ok=True)
    chunks = [prompts[i : i + regen.chunk_size] for i in range(0, len(prompts), regen.chunk_size)]
    if written is not None:
        reused = _reuse(written, chunks, chunks_dir, shard, tokenizer, config)
        stage.update(reused={"from": str(reuse_from), "records": reused})
        log(f"reused {reused} records of {reuse_from}")
    mine = [c for c in range(len(chunks)) if c % shard[1] == shard[0] and not _chunk_path(chunks_dir, c).exists()]
    done = sum(len(chunks[c]) for c in range(len(chunks)) if _chunk_path(chunks_dir, c).exists())
    done += sum(len(records) for c in mine for records in _read_partial(_partial_path(chunks_dir, c)).values())
    if mine:
        device = resolve_device(config.target.device)
        model = load_model(target, config.target.dtype, device, log, Work("batched", regen.batch_size)) if regen.backend in ("hf", "dlite") else None
        generator = {
            "hf": lambda: HFBackend(model, tokenizer, regen),
            "dlite": lambda: EngineBackend(model, tokenizer, regen, _kept_layers(config, model)),
            "openai": lambda: OpenAIBackend(base_url, concurrency, tokenizer, regen, config.target.thinking, model_name),
            "sglang": lambda: SGLangBackend(target.path, tokenizer, regen, config.target.dtype),  # SGLang knows auto too
        }[regen.backend]()
        started, new_tokens, rate = time.time(), 0, 0.0
        try:
            with progress_bar("regen", total=len(prompts), completed=done) as bar:
                for c in mine:
                    for records in _run_chunk(c, chunks[c], chunks_dir, generator, tokenizer, config, regen):
                        done += len(records)
                        new_tokens += sum(e - s for r in records if "error" not in r and r.get("labels") != "target" for s, e in spans_of(r))
                        rate = new_tokens / (time.time() - started)
                        bar.update(advance=len(records), description=f"regen {rate:.0f} tok/s")
                        stage.update(progress={"done": done, "total": len(prompts), "unit": "prompts"})
        finally:
            generator.close()
        log(f"generated {new_tokens} tokens in {time.time() - started:.1f} s ({rate:.1f} tok/s, backend {regen.backend}; kept original responses not counted)")
        if isinstance(generator, EngineBackend):
            log(generator.timing())
    return _finalize(stage, chunks, chunks_dir, source_skips, shard, log)


def _kept_layers(config: Config, model) -> tuple[list[int], int] | None:
    """What the engine keeps of each sequence where training caches its features: (the drafter's target layers,
    p^T's top-k), else None."""
    from ..models.model import DrafterSpec

    if config.train.features != "cached":
        return None
    return DrafterSpec.for_target(model.config, config.drafter, 0).target_layer_ids, config.train.target_top_k


def _chunk_path(chunks_dir: Path, chunk: int) -> Path:
    return chunks_dir / f"{chunk:05d}.jsonl"


def _partial_path(chunks_dir: Path, chunk: int) -> Path:
    return chunks_dir / f"{chunk:05d}.partial"


def _run_chunk(chunk, prompts, chunks_dir, generator, tokenizer, config, regen) -> Iterator[list[dict]]:
    """Generate one chunk batch by batch, appending finished batches; yield each new batch's records."""
    partial = _partial_path(chunks_dir, chunk)
    finished = _read_partial(partial)
    reused = {r["id"] for r in finished.get("reused", [])}
    tokenized = [chat_prompt_ids(tokenizer, p.messages, config.target.thinking) for p in prompts]
    order = sorted((i for i in range(len(prompts)) if prompts[i].id not in reused), key=lambda i: (len(tokenized[i]), prompts[i].id))
    batches = [order[i : i + regen.batch_size] for i in range(0, len(order), regen.batch_size)]
    with partial.open("a") as out:
        for b, batch in enumerate(batches):
            if b in finished:
                continue
            records = _generate_batch([prompts[i] for i in batch], [tokenized[i] for i in batch], generator, _seed(regen.seed, chunk, b), tokenizer,
                                      regen, config.target.thinking)
            if isinstance(generator, EngineBackend) and generator.keep is not None:  # before the batch counts as done
                generator.write_kept(records, chunks_dir / f"{chunk:05d}.{b:04d}.features.safetensors")
            out.write(json.dumps({"batch": b, "records": records}) + "\n")
            out.flush()
            os.fsync(out.fileno())
            finished[b] = records
            yield records
    by_id = {r["id"]: r for records in finished.values() for r in records}
    lines = "".join(json.dumps(by_id[p.id]) + "\n" for p in prompts)
    atomic_write_text(_chunk_path(chunks_dir, chunk), lines)
    partial.unlink()


@dataclass
class Written:
    """What another run's regen stage wrote, for ``--reuse-from``: its finished records by id, the file of Sequences its
    engine kept of each (id → path, read from the files' metadata alone), and the ``regen.max_length`` they were
    written under."""

    records: dict[str, dict]
    kept: dict[str, Path]
    max_length: int


def _records_of(run_dir: Path, config: Config, fingerprint: str) -> Written:
    """What another run's regen stage wrote (:class:`Written`).  Refused unless the same target wrote it with the same
    sampling and ``max_new_tokens``."""
    manifest = Stage(run_dir, "regen").manifest()
    if manifest is None:
        raise DliteError(f"--reuse-from {run_dir}: it has no regen stage to reuse")
    theirs, ours = manifest["config"], {"target": config.target.identity(), "regen": dataclasses.asdict(config.regen)}
    same = {
        "target": ({k: v for k, v in theirs["target"].items() if k != "device"}, ours["target"]),
        "target weights": (manifest["inputs"]["target"], fingerprint),
        **{f"regen.{k}": (theirs["regen"][k], ours["regen"][k]) for k in ("temperature", "top_p", "seed", "max_new_tokens")},
    }
    differ = [f"{name} {a} there, {b} here" if name.startswith("regen") else name for name, (a, b) in same.items() if a != b]
    if differ:
        raise DliteError(f"--reuse-from {run_dir}: its records were written with a different " + "; ".join(differ))
    kept = {i: path for path in kept_feature_files(run_dir) for i in json.loads(sequences_metadata(path)["ids"])}
    return Written({r["id"]: r for r in _chunk_records(run_dir / "regen" / "chunks")}, kept, theirs["regen"]["max_length"])


def _reuse(written: Written, chunks: list[list[Prompt]], chunks_dir: Path, shard, tokenizer, config: Config) -> int:
    """Seed this shard's chunks that have not started with the ``written`` records of their prompts (a chunk that
    they all cover is complete), and the Sequences the other run's engine kept of them; return how many records were
    taken.  A record is taken when it starts with the prompt's ids and its length limit could not have cut it
    differently: the same ``max_length``, or a one-turn prompt whose reply fits under both limits."""
    records, their_max_length = written.records, written.max_length
    room = min(their_max_length, config.regen.max_length) - config.regen.max_new_tokens

    def taken(prompt: Prompt) -> dict | None:
        record = records.get(prompt.id)
        if record is None:
            return None
        ids = chat_prompt_ids(tokenizer, prompt.messages, config.target.thinking)
        fits = their_max_length == config.regen.max_length or (not prompt.later_turns and len(ids) <= room)
        return record if fits and record["input_ids"][: len(ids)] == ids else None

    count = 0
    for c, chunk in enumerate(chunks):
        partial = _partial_path(chunks_dir, c)
        if c % shard[1] != shard[0] or _chunk_path(chunks_dir, c).exists() or partial.exists():
            continue
        reused = [r for r in map(taken, chunk) if r is not None]
        _carry_kept(written.kept, [r["id"] for r in reused], lambda n, c=c: chunks_dir / f"{c:05d}.reused{n}.features.safetensors")
        if len(reused) == len(chunk):
            atomic_write_text(_chunk_path(chunks_dir, c), "".join(json.dumps(r) + "\n" for r in reused))
        elif reused:
            atomic_write_text(partial, json.dumps({"batch": "reused", "records": reused}) + "\n")
        count += len(reused)
    return count


def _carry_kept(kept: dict[str, Path], ids: list[str], path_of) -> None:
    """Write the Sequences of the records ``ids`` from the ``kept`` files that hold them to ``path_of(n)``, one file for
    each n-th kind of file they came from (layers and top-k), so that the feature stage takes them as it takes this
    run's own.  Only the files holding one of ``ids`` are read."""
    wanted = set(ids)
    kinds: dict[tuple[str, str], list[tuple[str, Sequence]]] = {}
    for path in sorted({kept[i] for i in wanted if i in kept}):
        sequences, metadata = read_sequences(path)
        items = kinds.setdefault((metadata["layers"], metadata["top_k"]), [])
        items += [(i, s) for i, s in zip(json.loads(metadata["ids"]), sequences) if i in wanted and kept[i] == path]
    for n, ((layers, top_k), items) in enumerate(kinds.items()):
        write_sequences(path_of(n), [s for _, s in items], {"ids": json.dumps([i for i, _ in items]), "layers": layers, "top_k": top_k})


def _read_partial(partial: Path) -> dict[int | str, list[dict]]:
    """Batches a killed run finished, and the records reused (key ``"reused"``); a torn last line (the kill
    mid-write) is dropped."""
    finished = {}
    if partial.exists():
        for line in partial.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                break
            finished[entry["batch"]] = entry["records"]
        # Rewrite without the torn tail so appended batches start on a clean line.
        atomic_write_text(partial, "".join(json.dumps({"batch": b, "records": r}) + "\n" for b, r in finished.items()))
    return finished


def _seed(seed: int, chunk: int, batch: int) -> int:
    return (seed * 1_000_003 + chunk * 1009 + batch) % 2**31


def _generate_batch(prompts: list[Prompt], prompt_ids: list[list[int]], generator, seed: int, tokenizer, regen: RegenConfig,
                    thinking: bool) -> list[dict]:
    """Records for a batch: the target writes the responses, except those whose source keeps its original
    (marked ``labels: target``: training takes their labels from the target's pass, not from the text)."""
    rewrite = [i for i, p in enumerate(prompts) if not p.keep_original]
    written = _write(prompts, prompt_ids, rewrite, generator, seed, tokenizer, regen, thinking)
    records = []
    for i, (prompt, ids) in enumerate(zip(prompts, prompt_ids)):
        turns = written[i] if i in written else [(prompt.messages, ids, _original_completion(prompt.original, len(ids), tokenizer, regen))]
        if isinstance(turns, str):
            records.append({"id": prompt.id, "source": prompt.source, "error": turns})
            continue
        messages, last_ids, last = turns[-1]
        record = {
            "id": prompt.id,
            "source": prompt.source,
            "messages": messages,
            "response": last.text,
            "input_ids": last_ids + last.token_ids,
            "prompt_len": len(ids),
            "finish_reason": last.finish_reason,
        }
        if len(turns) > 1:
            record["spans"] = written_spans(record["input_ids"], [(turn_ids, completion.token_ids) for _, turn_ids, completion in turns])
        records.append(record | ({"labels": "target"} if prompt.keep_original else {}))
    return records


def _write(prompts: list[Prompt], prompt_ids: list[list[int]], rows: list[int], generator, seed: int, tokenizer, regen: RegenConfig,
           thinking: bool) -> dict[int, list[tuple[list[dict], list[int], Completion]] | str]:
    """The target's replies to ``prompts[rows]``, turn by turn: turn t of every trace that has one in one call of the
    generator, after the messages that follow the trace's previous reply (tool results, the user's next message).
    A trace ends early where its context leaves no room for a reply.  → row → its turns as (messages, prompt ids,
    completion), or the error that stopped it."""
    conversations = {i: list(prompts[i].messages) for i in rows}
    ids = {i: prompt_ids[i] for i in rows}
    written: dict[int, list | str] = {i: [] for i in rows}
    active = list(rows)
    for turn in range(1 + max((len(prompts[i].later_turns) for i in rows), default=0)):
        if turn:
            active = [i for i in active if turn <= len(prompts[i].later_turns)]
            for i in active:
                conversations[i] += prompts[i].later_turns[turn - 1]
                ids[i] = chat_prompt_ids(tokenizer, conversations[i], thinking)
            active = [i for i in active if len(ids[i]) < regen.max_length]
        if not active:
            break
        results = generator.generate([ids[i] for i in active], [conversations[i] for i in active], seed + turn * 10_007)
        for i, result in zip(active, results):
            if isinstance(result, str):
                written[i] = result
                continue
            written[i].append((list(conversations[i]), ids[i], result))
            conversations[i].append({"role": "assistant", "content": result.text})
        active = [i for i in active if not isinstance(written[i], str)]
    return written


def written_spans(input_ids: list[int], turns: list[tuple[list[int], list[int]]]) -> list[list[int]]:
    """The ``[start, end)`` ranges of a trace's ``input_ids`` that hold the target's replies as it wrote them.
    ``turns``: each reply's (prompt ids, reply ids).  A reply is re-read from its text by the next turn's chat
    template: its span ends where ``input_ids`` stops matching the ids the target wrote (a reply whose prompt is not
    a prefix of the trace has none)."""
    spans = []
    for prompt, reply in turns:
        written = prompt + reply
        end = next((n for n, (a, b) in enumerate(zip(input_ids, written)) if a != b), min(len(input_ids), len(written)))
        if end > len(prompt):
            spans.append([len(prompt), end])
    return spans


def _original_completion(text: str, prompt_tokens: int, tokenizer, regen: RegenConfig) -> Completion:
    """The source's own answer as the response, cut to the room regen allows, ended like the target's own."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    room = min(regen.max_new_tokens, regen.max_length - prompt_tokens)
    if len(ids) < room:
        return Completion(ids + [tokenizer.eos_token_id], text, "stop")
    return Completion(ids[:room], tokenizer.decode(ids[:room]), "length")


def _finalize(stage: Stage, chunks, chunks_dir: Path, source_skips: list[Skipped], shard, log) -> dict:
    missing = [c for c in range(len(chunks)) if not _chunk_path(chunks_dir, c).exists()]
    if missing:
        log(f"shard {shard[0]}/{shard[1]} is done; {len(missing)} of {len(chunks)} chunks wait for other shards")
        return {}
    skipped = [dataclasses.asdict(s) for s in source_skips]
    records = tokens = original = 0
    for c in range(len(chunks)):
        for line in _chunk_path(chunks_dir, c).read_text().splitlines():
            record = json.loads(line)
            if "error" in record:
                skipped.append({"id": record["id"], "source": record["source"], "reason": record["error"]})
            else:
                records += 1
                original += record.get("labels") == "target"
                tokens += sum(e - s for s, e in spans_of(record))
    atomic_write_text(stage.dir / "skipped.jsonl", "".join(json.dumps(s) + "\n" for s in skipped))
    if records == 0:
        raise DliteError(f"regen produced no records: all prompts were skipped or failed (reasons in {stage.dir / 'skipped.jsonl'})")
    summary = {"records": records, "original_responses": original, "skipped": len(skipped), "response_tokens": tokens, "chunks": len(chunks)}
    stage.finish(summary=summary, progress={"done": sum(map(len, chunks)), "total": sum(map(len, chunks)), "unit": "prompts"})
    log(f"regen done: {records} records, {tokens} response tokens, {len(skipped)} skipped (see {stage.dir / 'skipped.jsonl'})")
    return summary
