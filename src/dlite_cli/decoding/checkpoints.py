"""Drafter checkpoints as methods name them: a stage's export in the run directory, a hub id or a directory; their
origin for the bench's tables, and ``dlite export``."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.errors import DliteError
from ..data.hub import from_hub, is_hub_id
from ..models.release import is_release, load_drafter

# drafter names → the run-directory stage whose export they load
STAGE_OF = {"dlite": "stable", "history": "train-teacher", "parallel": "stable-parallel", "scratch": "stable-scratch"}


def is_checkpoint_name(drafter: str) -> bool:
    """Whether ``drafter`` can name a checkpoint: a stage's drafter, a hub id or an existing directory."""
    return drafter in STAGE_OF or is_hub_id(drafter) or Path(drafter).is_dir()


def resolve_drafter_path(drafter: str, run_dir: Path) -> Path:
    """``dlite``/``history``/``parallel``/``scratch`` → the run directory's export (refused in one sentence where that
    stage has not run); a hub id → its local snapshot; anything else is a directory (a dlite export, or a checkpoint
    in the public release's format)."""
    if drafter in STAGE_OF:
        path = Path(run_dir) / STAGE_OF[drafter] / "drafter"
        if not (path / "config.json").is_file():
            raise DliteError(f"no {drafter} drafter in {run_dir}: {path} does not exist (train the `{STAGE_OF[drafter]}` stage first, or pass a path)")
        return path
    if is_hub_id(drafter):
        from huggingface_hub import snapshot_download

        local = "pass a local copy of it as a directory instead, or point HF_HOME at a cache that holds it and set HF_HUB_OFFLINE=1"
        return Path(from_hub(lambda repo, **only: snapshot_download(repo, **only), drafter, f"the drafter {drafter}", local))
    return Path(drafter)


def drafter_origin(directory: Path) -> str:
    """What made a checkpoint, for the bench's tables: the dlite stage that trained it (also kept through an export
    in the release's format), ``release`` for the public release's own, ``unknown`` for an export that does not say."""
    raw = json.loads((Path(directory) / "config.json").read_text())
    stage = Path(directory).parent.name
    return raw.get("origin") or ("release" if is_release(raw) else stage if stage in STAGE_OF.values() else "unknown")


def export_drafter(config, run_dir: Path, drafter: str, out: Path, format_: str, log) -> None:
    """``dlite export``: the drafter named (a stage's, a hub id or a directory) written to ``out`` in ``format_``, the
    public release's (release.py); refused in one sentence where its spec uses a dlite-only option."""
    from ..models.release import ARCHITECTURE_VERSION, export_release
    from ..models.targets import target_config

    if format_ != ARCHITECTURE_VERSION:
        raise DliteError(f"unknown export format {format_!r}: expected {ARCHITECTURE_VERSION}")
    if not is_checkpoint_name(drafter):
        raise DliteError(f"unknown drafter {drafter!r}: expected {', '.join(STAGE_OF)}, a drafter directory or a hub id")
    directory, arch = resolve_drafter_path(drafter, run_dir), target_config(config, log)
    export_release(load_drafter(directory, arch), arch, out, str(directory), drafter_origin(directory))
    log(f"wrote {directory} in the {ARCHITECTURE_VERSION} format to {out}")
