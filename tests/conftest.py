"""Shared fixtures: an isolated dlite cache, the micro target, and the CLI run as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlite_cli.devices import resolve_device

REPO = Path(__file__).resolve().parents[1]
DEVICE = resolve_device("auto")  # the device policy's choice: tests run there unless they say they need the CPU


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One dlite cache for the whole session, so the micro target is built once."""
    path = tmp_path_factory.mktemp("dlite-cache")
    os.environ["DLITE_CACHE"] = str(path)
    return path


@pytest.fixture
def run_cli(cache_dir, tmp_path):
    """Run ``dlite ARGS`` in ``tmp_path`` as a separate process (``env``: variables to add); return the CompletedProcess."""

    def run(*args: str, check: bool = True, cwd: Path = tmp_path, env: dict | None = None) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [sys.executable, "-m", "dlite_cli", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            env={**os.environ, "DLITE_CACHE": str(cache_dir), "COLUMNS": "200", **(env or {})},
            timeout=300,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"dlite {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done

    return run
