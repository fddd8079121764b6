"""The run directory: one folder per stage, a manifest per stage, atomic writes.

Layout::

    runs/<target>/
        regen/manifest.json      what the stage consumed (config hash, inputs), status, timings, versions
        regen/...                the stage's own files
        train-teacher/ ...

Every file a later stage reads is written to a temporary name and renamed into
place, so a killed stage never leaves a file that looks complete.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from .. import __version__
from . import precision
from .errors import DliteError
from .files import atomic_write_json, read_json

PAPER_TRAINING = ("train-teacher", "warmup", "stable")  # the paper's three training stages, in order
TRAINING_STAGES = (*PAPER_TRAINING, "stable-scratch", "stable-parallel")  # and the ablations' single-stage drafters
STAGES = ("regen", "features", *TRAINING_STAGES, "bench", "sessions")  # every stage a run directory holds a folder of


@contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Hold the run directory for one ``dlite run`` at a time (the kernel lets go when the holder dies, even by kill -9)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / ".dlite-run.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise DliteError(f"another `dlite run` (pid {f.read().strip() or '?'}) is working in {run_dir}; "
                             "wait for it to finish or stop it, then run again") from None
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        yield


def versions() -> dict[str, str]:
    import torch
    import transformers

    return {
        "dlite": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def fingerprint_dir(directory: Path) -> str:
    """sha256 over a checkpoint's config and weight files (names and bytes): it changes when its weights do."""
    digest = hashlib.sha256()
    for path in sorted(Path(directory).iterdir()):
        if path.name == "config.json" or path.suffix in (".safetensors", ".bin"):
            digest.update(path.name.encode())
            with path.open("rb") as f:
                while block := f.read(1 << 24):
                    digest.update(block)
    return digest.hexdigest()[:16]


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


class Stage:
    """One stage's folder under the run directory and its ``manifest.json``.

    ``status`` is ``running`` from :meth:`begin` until :meth:`finish` sets
    ``done``; a stage killed on the way stays ``running`` on disk and is shown
    as partial.
    """

    def __init__(self, run_dir: Path, name: str):
        if name not in STAGES:
            raise ValueError(f"unknown stage {name}")
        self.name = name
        self.dir = Path(run_dir) / name
        self.manifest_path = self.dir / "manifest.json"
        self._started = time.time()
        self._precision_mark = precision.mark()  # the decisions asked for from now on are this stage's

    def manifest(self) -> dict | None:
        return read_json(self.manifest_path)

    def begin(self, config_hash: str, config: dict, inputs: dict, force: bool = False, keyed: bool = False) -> bool:
        """Claim the stage for this config; return False if it is already done with it.

        A stage left by a different config is refused unless ``force``, which wipes it.  A ``keyed`` stage
        (the bench: every line of its files is keyed by what made it) is claimed by any config, keeps its
        files and is never done: each claim decides for itself what is left to do.
        """
        old = self.manifest()
        if old is not None and old["config_hash"] != config_hash:
            if not (force or keyed):
                raise DliteError(
                    f"{self.dir} was produced by a different config (hash {old['config_hash']}, now {config_hash});"
                    " pass --force to discard it and start again"
                )
            if not keyed:
                shutil.rmtree(self.dir)
            old = None
        if old is not None and old["status"] == "done" and not keyed:
            return False
        self.dir.mkdir(parents=True, exist_ok=True)
        manifest = old or {"stage": self.name, "config_hash": config_hash, "elapsed_s": 0.0, "runs": 0}
        manifest.update(
            config=config,
            inputs=inputs,
            status="running",
            started=manifest.get("started") or _now(),
            versions=versions(),
            runs=manifest["runs"] + 1,
        )
        self._elapsed_before = manifest["elapsed_s"]
        self._started = time.time()
        atomic_write_json(self.manifest_path, manifest)
        return True

    def update(self, **fields: Any) -> None:
        """Record progress (e.g. ``progress={"done": 3, "total": 8, "unit": "prompts"}``) and elapsed time."""
        manifest = self.manifest()
        manifest.update(fields, elapsed_s=round(self._elapsed_before + time.time() - self._started, 3))
        decisions = precision.made(self._precision_mark)
        if decisions:  # the precision decisions (precision.py) this stage's work was done under
            manifest["precision"] = decisions
        atomic_write_json(self.manifest_path, manifest)

    def finish(self, **fields: Any) -> None:
        """Mark the stage done; its recorded progress reads complete (progress is recorded only now and then)."""
        progress = (self.manifest() or {}).get("progress")
        if progress and "progress" not in fields:
            fields["progress"] = {**progress, "done": progress["total"]}
        self.update(status="done", finished=_now(), **fields)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def stage_rows(run_dir: Path) -> list[dict]:
    """What ``dlite status`` shows: one row per stage, done / partial / missing."""
    rows = []
    for name in STAGES:
        stage = Stage(run_dir, name)
        manifest = stage.manifest() if stage.manifest_path.exists() else None
        row = {"stage": name, "status": "missing", "progress": "", "size": dir_size(stage.dir), "seconds": None, "produced_by": ""}
        if manifest is not None:
            row["status"] = "done" if manifest["status"] == "done" else "partial"
            progress = manifest.get("progress")
            if progress:  # a finished stage counts all (manifests written before finish() said so may lag)
                done = progress["total"] if manifest["status"] == "done" else progress["done"]
                row["progress"] = f"{done}/{progress['total']} {progress['unit']}"
            when = (manifest.get("finished") or manifest["started"])[:16].replace("T", " ")
            row["produced_by"] = f"config {manifest['config_hash'][:8]} target {manifest['inputs'].get('target', '?')[:8]} {when}"
            row["seconds"] = manifest["elapsed_s"]
        rows.append(row)
    return rows


def human_bytes(size: float) -> str:
    """A size on disk as a reader takes it in: 512 B, 3.8 MB, 1.2 GB."""
    if size < 1000:
        return f"{size:.0f} B"
    for unit in ("KB", "MB", "GB"):
        size /= 1000
        if size < 1000 or unit == "GB":
            return f"{size:.1f} {unit}"


def status_lines(run_dir: Path, verbose: bool) -> list:
    """``dlite status``: a rich table of :func:`stage_rows`, then with ``verbose`` what produced each stage."""
    from rich.table import Table
    from rich.text import Text

    rows = stage_rows(run_dir)
    table = Table(title=f"dlite run {run_dir}")
    for column in ("stage", "status", "progress", "size", "time"):
        table.add_column(column, no_wrap=True, justify="right" if column in ("size", "time") else "left")
    colours = {"done": "green", "partial": "yellow", "missing": "dim"}
    for row in rows:
        size = human_bytes(row["size"]) if row["size"] else ""
        seconds = f"{row['seconds']:.0f} s" if row["seconds"] is not None else ""
        table.add_row(row["stage"], f"[{colours[row['status']]}]{row['status']}[/]", row["progress"], size, seconds)
    produced = [Text(f"{row['stage']}: {row['produced_by']}") for row in rows if verbose and row["produced_by"]]
    return [table, *produced]
