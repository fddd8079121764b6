"""The Hugging Face hub: whether it can be reached from here, and one sentence with the way out when what
dlite needs from it (a target, a regen source, a bench workload) cannot be had.

A machine without the hub fails at once, never after a minute of the libraries' retries; a target
already in the local cache is then loaded from there.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Iterator

from ..core.errors import DliteError

LOCAL_DATA = "a .jsonl, .json or .parquet file, or a directory of them"  # what a local copy of a data set may be
LOCAL_TARGET = ("pass a local checkpoint with --set target.model=DIR, or point HF_HOME (or HF_HUB_CACHE) at a cache "
                "that holds it and set HF_HUB_OFFLINE=1")


def is_hub_id(text: str) -> bool:
    """``owner/name`` that is not a local path."""
    return text.count("/") == 1 and not text.startswith((".", "/", "~")) and not Path(text).expanduser().exists()


@functools.cache
def hub_problem() -> str | None:
    """Why the Hugging Face hub cannot be reached from here (asked once), or None if it can."""
    import httpx
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        httpx.head(constants.ENDPOINT, timeout=5.0)
    except httpx.HTTPError as e:
        return f"the hub at {constants.ENDPOINT} is not reachable: {type(e).__name__}"
    return None


def hub_failure(what: str, reason: str | Exception, way_out: str) -> DliteError:
    """One sentence: ``what`` could not be loaded from the hub, why, and ``way_out``."""
    if isinstance(reason, Exception):
        first = str(reason).strip().splitlines()[0] if str(reason).strip() else ""
        reason = f"{type(reason).__name__}: {first[:160]}" if first else type(reason).__name__
    return DliteError(f"could not load {what} from the Hugging Face hub ({reason.rstrip('.')}); {way_out}")


def from_hub(load, hub_id: str, what: str, way_out: str = LOCAL_TARGET):
    """``load(hub_id, local_files_only=...)`` (a ``from_pretrained``): from the local cache alone when the hub
    cannot be reached, and a :func:`hub_failure` when that fails."""
    problem = hub_problem()
    try:
        return load(hub_id, local_files_only=problem is not None)
    except OSError as e:  # transformers' not found, not reachable, gated: all OSError
        raise hub_failure(what, problem or e, way_out) from None


def hub_records(hub_id: str, name: str | None = None, split: str | None = None, way_out: str = "") -> Iterator[dict]:
    """A hub data set (configuration ``name``), streamed: one ``split``, or all splits interleaved round-robin."""
    if (problem := hub_problem()) is not None:  # streaming needs the hub itself, never a cache
        raise hub_failure(f"the data set {hub_id}", problem, way_out)
    import datasets

    try:
        splits = datasets.load_dataset(hub_id, name, streaming=True)
    except Exception as e:  # the hub raises many types; the user needs the sentence
        raise hub_failure(f"the data set {hub_id}", e, way_out) from None
    if split is not None:
        if split not in splits:
            raise DliteError(f"the hub data set {hub_id} has no split {split!r} (it has {', '.join(splits)})")
        yield from splits[split]
        return
    iterators = [iter(splits[each]) for each in sorted(splits)]
    for group in itertools.zip_longest(*iterators):
        yield from (record for record in group if record is not None)
