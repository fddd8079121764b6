"""``dlite run PIPELINE``: the stages of ``pipelines/<name>.yaml`` in order, over one run directory.

A pipeline stage is a ``dlite`` command line.  Every stage is resumable on its own (a finished
one does nothing, a partial one continues, see artifacts.py), so the runner keeps no state of
its own: run it again after a crash or a ``kill -9`` and it goes on where the stages stopped.
Stages run in this process unless they name a ``launch`` prefix (``accelerate launch ...``),
in which case they run as a child that dies with the runner.  One runner at a time holds a
run directory (a lock the kernel releases when the holder dies).
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import typer
from typer.core import TyperGroup

from .core.artifacts import STAGES, Stage, dir_size, human_bytes, run_dir_lock
from .core.config import Pipeline, PipelineStage
from .core.errors import DliteError
from .core.processes import die_with_parent


@dataclass
class StageTiming:
    name: str
    seconds: float
    already_done: bool  # the stage was finished before this run started


def select_stages(pipeline: Pipeline, first: str | None, last: str | None) -> list[PipelineStage]:
    """The stages from ``first`` through ``last`` (inclusive; None = the ends)."""
    names = [stage.name for stage in pipeline.stages]
    for flag, name in (("--from", first), ("--until", last)):
        if name is not None and name not in names:
            raise DliteError(f"{flag} {name}: pipeline {pipeline.name} has no such stage (its stages: {', '.join(names)})")
    start = names.index(first) if first else 0
    stop = names.index(last) + 1 if last else len(names)
    if start >= stop:
        raise DliteError(f"--from {first} comes after --until {last} in pipeline {pipeline.name}")
    return pipeline.stages[start:stop]


def stage_argv(group: TyperGroup, pipeline: Pipeline, stage: PipelineStage, run_dir: Path, overrides: list[str]) -> list[str]:
    """The stage's ``dlite`` arguments, checked by the command's own parser (nothing is run)."""
    command = group.get_command(typer.Context(group), stage.command)
    if command is None:
        raise DliteError(f"pipeline {pipeline.name}, stage {stage.name}: {stage.command!r} is not a dlite command")
    accepts = {param.name for param in command.params}
    argv = [stage.command, *stage.args, "--target", pipeline.target]
    if "run_dir" in accepts:
        argv += ["--run-dir", str(run_dir)]
    if "set_" in accepts:
        argv += [arg for item in overrides for arg in ("--set", item)]
    try:
        command.make_context(stage.command, argv[1:], parent=typer.Context(group, info_name="dlite"))
    except typer.TyperException as e:  # the parser's errors: unknown option, bad value, missing argument
        message = e.format_message() if hasattr(e, "format_message") else str(e)  # with the option's name
        raise DliteError(f"pipeline {pipeline.name}, stage {stage.name}: {message}") from None
    return argv


def launcher(stage: PipelineStage) -> list[str]:
    """``stage.launch`` as an argv prefix, its program found on PATH or beside this Python."""
    program, *rest = shlex.split(stage.launch)
    beside = Path(sys.executable).parent / program
    found = shutil.which(program) or (str(beside) if beside.is_file() else None)
    if found is None:
        raise DliteError(f"stage {stage.name}: launcher {program!r} is not installed (looked on PATH and in {beside.parent})")
    return [found, *rest, "-m", "dlite_cli"]


def _stage_done(run_dir: Path, stage: PipelineStage) -> bool:
    """Whether the stage's folder holds a finished manifest (stages without a folder: False)."""
    folder = stage.name if stage.name in STAGES else stage.command
    if folder not in STAGES:
        return False
    manifest = Stage(run_dir, folder).manifest()
    return manifest is not None and manifest["status"] == "done"


def run_pipeline(
    pipeline: Pipeline,
    group: TyperGroup,
    run_dir: Path,
    overrides: list[str],
    first: str | None = None,
    last: str | None = None,
    dry_run: bool = False,
    log: Callable[[str], None] = print,
) -> list[StageTiming]:
    """Run the selected stages of ``pipeline`` in order; return how long each took."""
    stages = select_stages(pipeline, first, last)
    commands = []
    for stage in stages:  # every command line is checked before the first stage starts
        argv = stage_argv(group, pipeline, stage, run_dir, overrides)
        commands.append((stage, argv, launcher(stage) if stage.launch else None))
    timings = []
    with nullcontext() if dry_run else run_dir_lock(run_dir):
        for index, (stage, argv, prefix) in enumerate(commands, 1):
            log(f"[{index}/{len(commands)}] {stage.name}: {shlex.join((prefix or ['dlite']) + argv)}")
            if dry_run:
                continue
            already_done = _stage_done(run_dir, stage)
            start = time.perf_counter()
            if prefix is None:
                group.main(args=argv, prog_name="dlite", standalone_mode=False)
            else:
                # a stage gets SIGTERM when the runner dies, even by kill -9, so no orphan keeps writing
                done = subprocess.run(prefix + argv, preexec_fn=functools.partial(die_with_parent, signal.SIGTERM, os.getpid()))
                if done.returncode != 0:
                    raise DliteError(f"stage {stage.name} failed with exit code {done.returncode}; run the pipeline again to resume it")
            timings.append(StageTiming(stage.name, time.perf_counter() - start, already_done))
    return timings


def timing_rows(timings: list[StageTiming], run_dir: Path) -> list[dict]:
    """One row per stage (name, seconds, share of the run, bytes on disk), then the total."""
    total = sum(t.seconds for t in timings)
    rows = [{"stage": t.name + (" (done before)" if t.already_done else ""), "seconds": t.seconds,
             "share": t.seconds / total if total else 0.0, "size": dir_size(run_dir / t.name)} for t in timings]
    return rows + [{"stage": "total", "seconds": total, "share": 1.0, "size": dir_size(run_dir)}]


def timing_table(name: str, timings: list[StageTiming], run_dir: Path):
    """``dlite run``'s closing table (rich): each stage's wall time, its share and its size on disk."""
    from rich.table import Table

    table = Table(title=f"dlite run {name}: wall time per stage ({run_dir})")
    for column in ("stage", "time", "share", "disk"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    for row in timing_rows(timings, run_dir):
        seconds = row["seconds"]
        shown = f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s" if seconds < 600 else f"{seconds / 60:.1f} min"
        table.add_row(row["stage"], shown, f"{100 * row['share']:.0f} %", human_bytes(row["size"]) if row["size"] else "")
    return table
