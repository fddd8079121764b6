"""Which data the benchmarks read and which the drafter trains on: never the same.

Each data set read by both sides is split here, once, and both sides read their part through this module:

- ShareGPT: a fixed ~5 % of the conversations, chosen by a hash of the id (:func:`is_heldout`), is the
  bench's (the ShareGPT workload, Long Dialogue's chats); the training source ``sharegpt`` drops them, and
  every chat whose first message is one of theirs (popular requests recur across conversations).
  The hub's chat sources (``open-perfectblend``, ``nemotron-v2``) drop the same share of theirs, as they
  always have: no bench reads it, and their training prompts stay the ones they were.
- The agentic data sets (BFCL multi-turn base, ToolTalk's conversations, τ²-bench's airline tasks): the
  first half of the records, in the order the bench reads them, is the bench's (an odd count's extra one
  included); the second half is training's (:func:`part_of`).
- The standard library: its modules are split into :data:`BENCH_MODULES`, the source of the SWE-Bench and
  Code Repo stand-ins, and :data:`TRAINING_MODULES`, the source of ``stdlib-code`` and ``swe-stdlib``.
"""

from __future__ import annotations

import hashlib

HELDOUT_PERCENT = 5

# Its first eleven hold the functions of the first SWE-Bench stand-ins from before the split, so those stay the same;
# the others are the modules with the fewest functions, so that the functions split about evenly.
BENCH_MODULES = (
    "typing", "calendar", "operator", "glob", "statistics", "email.utils", "urllib.parse", "inspect", "uuid",
    "shutil", "linecache", "argparse", "bisect", "configparser", "copy", "csv", "fractions", "graphlib", "hmac",
    "html", "json", "keyword", "pathlib", "random", "sched", "string", "zipfile",
)
TRAINING_MODULES = (
    "base64", "colorsys", "dataclasses", "difflib", "enum", "fnmatch", "functools", "getopt", "gettext", "gzip",
    "heapq", "ipaddress", "mimetypes", "ntpath", "platform", "posixpath", "pprint", "quopri", "re", "secrets",
    "shlex", "tarfile", "tempfile", "textwrap", "tokenize", "traceback", "warnings",
)
# Modules whose public functions become requests and agent transcripts (pure Python, no side effects on import).
STDLIB_MODULES = tuple(sorted(BENCH_MODULES + TRAINING_MODULES))


def is_heldout(sample_id: str) -> bool:
    """True for the fixed ~5 % of samples reserved for benchmarks, decided by the id alone.  A ShareGPT id names a
    piece of a longer conversation (``sharegpt:<conversation>_<piece>``): every piece of one conversation falls on
    the same side."""
    source, _, native = sample_id.partition(":")
    if source == "sharegpt":
        sample_id = f"{source}:{native.rsplit('_', 1)[0]}"
    return int(hashlib.sha1(sample_id.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def part_of(records: list, part: str) -> list:
    """The ``part`` ("bench" or "training") of an agentic data set's records, listed in the order the bench reads
    them: the bench's is the first half, an odd count's extra record included; training's is the rest."""
    half = (len(records) + 1) // 2
    return {"bench": records[:half], "training": records[half:]}[part]


def stdlib_modules(part: str) -> tuple[str, ...]:
    """The standard-library modules of ``part`` ("bench" or "training")."""
    return {"bench": BENCH_MODULES, "training": TRAINING_MODULES}[part]
