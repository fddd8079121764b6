"""Files written whole or not at all, and the dlite cache they live in.

Every file a later stage reads is written to a temporary name and renamed into
place, so a killed stage never leaves a file that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from .errors import DliteError


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary file path beside ``path`` that replaces ``path`` only if the block succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    tmp.chmod(0o644)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one, never a part."""
    with atomic_path(path) as tmp:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory that becomes ``path`` only if the block succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    os.chmod(tmp, 0o755)
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        raise DliteError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None


def cache_dir() -> Path:
    """``$DLITE_CACHE``, or ``~/.cache/dlite``: prepared targets, downloaded wheels."""
    return Path(os.environ.get("DLITE_CACHE") or Path.home() / ".cache" / "dlite")
