"""Terminal output: one rich console (stderr), progress bars, summary tables.

Everything human-facing goes to stderr so stdout stays clean for data (``mtpipe decode --input - > out.txt``).
In a torchrun launch only rank 0 prints (``mtpipe.training.distributed.is_rank0``).

When stderr is not a terminal (a pipe, a log file, CI) rich would wrap at 80 columns; a log is read with a pager or
grep, where a table row or a sacreBLEU signature split over lines is worse than a long line, so the console is then
as wide as :data:`PIPE_WIDTH` (``COLUMNS``, when set, still wins).
"""

from __future__ import annotations

from typing import Any, Iterable

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from mtpipe import env

PIPE_WIDTH = 10_000  # columns of the console when stderr is not a terminal: in effect, no wrapping


def _make_console() -> Console:
    c = Console(stderr=True, highlight=False)
    if not c.is_terminal and not env.get("COLUMNS"):
        c = Console(stderr=True, highlight=False, width=PIPE_WIDTH)
    return c


console = _make_console()


def _quiet() -> bool:
    # Non-zero ranks of a torchrun launch stay silent.
    return env.get("RANK", "0") != "0" or env.get("MTPIPE_QUIET") == "1"


class _TimeRemaining(TimeRemainingColumn):
    """rich's ETA, unless the task carries its own estimate in the field ``eta_seconds`` (``mtpipe train``: the
    sooner of the step plan's end and train.max_time's), which rich's rate-times-steps-left cannot know."""

    def render(self, task: Any) -> Any:
        eta = task.fields.get("eta_seconds")
        if eta is None:
            return super().render(task)
        from rich.text import Text

        minutes, seconds = divmod(int(eta), 60)
        hours, minutes = divmod(minutes, 60)
        return Text(f"{hours:d}:{minutes:02d}:{seconds:02d}", style="progress.remaining")


class _Bar(BarColumn):
    """rich's bar, unless the task carries the fraction done in the field ``fraction`` (``mtpipe train``: the budget
    spent, :meth:`mtpipe.training.budget.Budget.progress`): a run that ``train.max_time`` ends is done when its
    minutes are, not at the ``n/total`` updates of its epoch or step cap that the count beside the bar shows."""

    def render(self, task: Any) -> Any:
        bar = super().render(task)
        fraction = task.fields.get("fraction")
        if fraction is not None:
            bar.total, bar.completed = 1.0, min(max(float(fraction), 0.0), 1.0)
        return bar


def progress(*extra_columns: Any, transient: bool = False) -> Progress:
    """A progress bar: description, bar, n/total, elapsed, ETA, plus any extra columns (e.g. a rate field)."""
    return Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        _Bar(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        _TimeRemaining(),
        *extra_columns,
        console=console,
        transient=transient,
        disable=_quiet(),
    )


def table(title: str, columns: Iterable[str], rows: Iterable[Iterable[Any]]) -> None:
    """Print a summary table (numbers right-aligned, thousands separated)."""
    if _quiet():
        return
    cols = list(columns)
    t = Table(title=title, title_justify="left")
    for i, c in enumerate(cols):
        t.add_column(c, justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*[fmt(v) for v in row])
    console.print(t)


def fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return "" if v is None else str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def info(msg: str, *, whole: bool = False) -> None:
    """Print a line; ``whole``: never wrapped, not even on a terminal, so that it copies as one line (a signature)."""
    if not _quiet():
        console.print(msg, soft_wrap=whole)


def warn(msg: str) -> None:
    if not _quiet():
        console.print(f"[yellow]warning:[/yellow] {msg}")
