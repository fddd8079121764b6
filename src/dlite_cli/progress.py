"""Progress bars for long work: rich, with count, rate and ETA."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class Bar:
    """One task of a rich progress display; ``update(advance=n, description=...)``."""

    def __init__(self, progress: Progress, task):
        self._progress, self._task = progress, task

    def update(self, **fields) -> None:
        self._progress.update(self._task, **fields)


@contextmanager
def progress_bar(description: str, total: int, completed: int = 0, enabled: bool = True) -> Iterator[Bar]:
    """A bar on stderr; ``enabled=False`` (e.g. on non-main processes) shows nothing."""
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), disable=not enabled) as progress:
        yield Bar(progress, progress.add_task(description, total=total, completed=completed))
