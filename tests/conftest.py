"""Shared fixtures and helpers: an isolated dlite cache, the CLI run in this process, one trained micro run for the
session, a χ² test, weights as a GGUF file's dequantise; with DLITE_TEST_TIMEOUT set, a time limit on each test."""

from __future__ import annotations

import io
import math
import os
import shutil
import signal
import subprocess
import sys
import traceback
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from unittest.mock import patch

import pytest
import torch

from dlite_cli.cli import main
from dlite_cli.core.devices import resolve_device

REPO = Path(__file__).resolve().parents[1]
DEVICE = resolve_device("auto")  # the device policy's choice: tests run there unless they say they need the CPU
TEST_TIMEOUT = float(os.environ.get("DLITE_TEST_TIMEOUT", 0))  # seconds per test (make gpu-check); unset: no limit


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """With DLITE_TEST_TIMEOUT set, a test still running after that many seconds (its call; not its fixtures' setup)
    fails and the run goes on to the next: SIGALRM's handler fails it at the next Python instruction, so a call into C
    that is under way ends first."""
    if not TEST_TIMEOUT:
        yield
        return

    def stop(signum, frame):
        pytest.fail(f"timed out after {TEST_TIMEOUT:g} s (DLITE_TEST_TIMEOUT)", pytrace=False)

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, TEST_TIMEOUT)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One dlite cache for the whole session, so the micro target is built once."""
    path = tmp_path_factory.mktemp("dlite-cache")
    os.environ["DLITE_CACHE"] = str(path)
    return path


def cli(cache_dir: Path, cwd: Path, *args: str, check: bool = True, env: dict | None = None, process: bool = False) -> subprocess.CompletedProcess:
    """Run ``dlite ARGS`` in ``cwd`` (``env``: variables to add) as the command runs; return its exit status, stdout and
    stderr.  It runs in this process (an exception the command does not turn into a message: exit status 1 and its
    traceback, as Python's own), or with ``process`` as ``python -m dlite_cli``: for a variable read when a library is
    imported, or a path to import from."""
    variables = {"DLITE_CACHE": str(cache_dir), "COLUMNS": "200", **(env or {})}
    if process:
        done = subprocess.run([sys.executable, "-m", "dlite_cli", *args], cwd=cwd, capture_output=True, text=True,
                              env={**os.environ, **variables}, timeout=300)
    else:
        done = _in_this_process(cwd, args, variables)
    if check and done.returncode != 0:
        raise AssertionError(f"dlite {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done


def _in_this_process(cwd: Path, args: tuple[str, ...], variables: dict) -> subprocess.CompletedProcess:
    """``cli``'s run in this process: the working directory, the environment and sys.argv set for it and restored after."""
    stdout, stderr, before = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with patch.dict(os.environ, variables), patch.object(sys, "argv", ["dlite", *args]), redirect_stdout(stdout), redirect_stderr(stderr):
            try:
                main()
                code = 0
            except SystemExit as e:
                code = e.code or 0  # dlite and click exit with a number
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess(["dlite", *args], code, stdout.getvalue(), stderr.getvalue())


@pytest.fixture
def run_cli(cache_dir, tmp_path):
    """``cli`` in ``tmp_path`` unless ``cwd`` says otherwise."""

    def run(*args: str, check: bool = True, cwd: Path = tmp_path, env: dict | None = None, process: bool = False) -> subprocess.CompletedProcess:
        return cli(cache_dir, cwd, *args, check=check, env=env, process=process)

    return run


# The session's micro pipeline: long enough for a kill -9 to land mid-training, on the CPU (where training is bitwise
# reproducible), with fixed-length proposals (adaptive ones follow the passes' timings; the text is the same either way)
MICRO_RUN_OPTIONS = ("--set", "train.teacher_epochs=12", "--set", "target.device=cpu", "--set", "decode.adaptive=false")


@dataclass
class MicroRun:
    """One ``dlite run micro`` (MICRO_RUN_OPTIONS) for the whole session, run in two parts as a user resumes one."""

    directory: Path  # its run directory: every stage done; read it, never write it (``copy`` what a test changes)
    until: subprocess.CompletedProcess  # dlite run micro --until stable
    rest: subprocess.CompletedProcess  # dlite run micro --from stable-parallel

    def copy(self, to: Path, stages: tuple[str, ...] = ("regen",)) -> Path:
        """A run directory at ``to`` holding these stages' folders of this run, as if they had run there."""
        for stage in stages:
            shutil.copytree(self.directory / stage, to / stage)
        return to


@pytest.fixture(scope="session")
def micro_run(cache_dir, tmp_path_factory) -> MicroRun:
    """The micro pipeline, trained and benched once: the tests that need a finished stage start from a copy of it."""
    where = tmp_path_factory.mktemp("micro-run")
    until = cli(cache_dir, where, "run", "micro", *MICRO_RUN_OPTIONS, "--until", "stable")
    rest = cli(cache_dir, where, "run", "micro", *MICRO_RUN_OPTIONS, "--from", "stable-parallel")
    return MicroRun(where / "runs" / "micro", until, rest)


def chi_square_passes(samples: list[int], expected: torch.Tensor) -> bool:
    """Pearson's test at level 0.001 (categories with expected count < 5 pooled)."""
    n = len(samples)
    counts = torch.bincount(torch.tensor(samples), minlength=len(expected)).float()
    big = expected * n >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    wanted = torch.cat([expected[big] * n, (expected[~big] * n).sum()[None]])
    keep = wanted > 0
    statistic = float(((observed[keep] - wanted[keep]) ** 2 / wanted[keep]).sum())
    dof = int(keep.sum()) - 1
    z = 3.09  # upper 0.001 quantile of the normal; Wilson–Hilferty for the chi-square quantile
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return statistic < critical


# An agent framework's request: tools offered, the developer role, an assistant turn that only called a tool
# (content null) and the tool's answer.
AGENT_TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                                 "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
AGENT_MESSAGES = [
    {"role": "developer", "content": "You are a coding agent. Use the tools."},
    {"role": "user", "content": "What does textwrap.dedent do?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "textwrap.py"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "def dedent(text):\n    \"\"\"Remove any common leading whitespace.\"\"\""},
]


def on_levels(rows: int, columns: int, bits: int, seed: int = 0) -> torch.Tensor:
    """A float32 weight (rows, columns) as a GGUF file's 4-bit (Q4_1) or 8-bit (Q8_0) weights dequantise to: every
    group of 32 along a row on 16 levels from its least weight to its largest, or on 255 levels symmetric about 0
    with its largest magnitude on the top one; float16 scales."""
    generator = torch.Generator().manual_seed(seed)
    shape = (rows, columns // 32, 32)
    if bits == 4:
        codes = torch.randint(0, 16, shape, generator=generator)
        codes[..., 0], codes[..., 1] = 0, 15
        scale = (torch.rand(rows, columns // 32, 1, generator=generator) * 0.01 + 0.002).half().float()
        low = (-7.5 * scale + torch.randn(scale.shape, generator=generator) * 0.003).half().float()
        return (codes * scale + low).view(rows, columns)
    codes = torch.randint(-127, 128, shape, generator=generator)
    codes[..., 0] = 127
    scale = (torch.rand(rows, columns // 32, 1, generator=generator) * 0.001 + 0.0001).half().float()
    return (codes * scale).view(rows, columns)
