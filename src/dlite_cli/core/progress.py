"""Progress of long work, with count, rate and ETA: a rich bar on a terminal, plain lines in a log.

When stderr is not a terminal (``make reproduce > log``, a batch job) a bar would draw nothing, so one
line is printed every ``DLITE_PROGRESS_INTERVAL`` seconds (default 30) instead, and one at the end.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .errors import DliteError

INTERVAL_VARIABLE = "DLITE_PROGRESS_INTERVAL"


class Bar:
    """One task of a rich progress display; ``update(advance=n, description=...)``."""

    def __init__(self, progress: Progress, task):
        self._progress, self._task = progress, task

    def update(self, **fields) -> None:
        self._progress.update(self._task, **fields)


class LogLines:
    """The same interface as :class:`Bar`, printed as a line every ``interval`` seconds from a timer thread:
    ``regen: 96/480 (20%), 3.2/s, eta 2:00``."""

    def __init__(self, console: Console, description: str, total: int, completed: int, interval: float):
        self.console, self.description, self.total, self.completed = console, description, total, completed
        self._first, self._started, self._interval = completed, time.monotonic(), interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._thread.start()

    def update(self, advance: int = 0, description: str | None = None) -> None:
        self.completed += advance
        self.description = description or self.description

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.completed != self._first:  # the last line says where it ended; nothing done, nothing to say
            self.report()

    def report(self) -> None:
        elapsed = time.monotonic() - self._started
        rate = (self.completed - self._first) / elapsed if elapsed > 0 else 0.0
        left = self.total - self.completed
        eta = _clock(left / rate) if rate > 0 else "?" if left else "0:00"
        share = f" ({100 * self.completed / self.total:.0f}%)" if self.total else ""
        self.console.print(f"{self.description}: {self.completed}/{self.total}{share}, {rate:.2f}/s, "
                           f"elapsed {_clock(elapsed)}, eta {eta}", markup=False, highlight=False, soft_wrap=True)

    def _tick(self) -> None:
        while not self._stop.wait(self._interval):
            self.report()


def _interval() -> float:
    text = os.environ.get(INTERVAL_VARIABLE, "30")
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if seconds <= 0:
        raise DliteError(f"{INTERVAL_VARIABLE} must be a positive number of seconds, got {text!r}")
    return seconds


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}" if minutes >= 60 else f"{minutes}:{seconds:02d}"


@contextmanager
def progress_bar(description: str, total: int, completed: int = 0, enabled: bool = True) -> Iterator[Bar | LogLines]:
    """A bar on stderr, or lines in a log; ``enabled=False`` (e.g. on non-main processes) shows nothing."""
    console = Console(stderr=True)
    if enabled and not console.is_terminal:
        lines = LogLines(console, description, total, completed, _interval())
        try:
            yield lines
        finally:
            lines.close()
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, disable=not enabled) as progress:
        yield Bar(progress, progress.add_task(description, total=total, completed=completed))
