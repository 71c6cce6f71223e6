"""What the terminal shows: a progress bar while measuring, then a table per dtype and mode.

rich draws both when it is installed; plain print stands in for it otherwise.
"""

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

try:
    from rich import box
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table
except ImportError:
    Console = None

from .workloads import floor_name

if TYPE_CHECKING:
    from .runner import Record, Result

COLUMNS = ("features", "impl", "median µs", "p20–p80 µs", "×floor", "graph µs", "GB/s", "rel error",
           "peak MB")


@contextlib.contextmanager
def progress(total: int) -> Iterator[Callable[[str], None]]:
    """Yields advance(label): call it as each of the total steps starts."""
    if Console is None:
        steps = iter(range(1, total + 1))
        yield lambda label: print(f"[{next(steps)}/{total}] {label}", flush=True)
        return
    columns = (TextColumn("{task.description:<42}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("", total=total)
        started = False

        def advance(label: str) -> None:
            nonlocal started
            bar.update(task, description=label, advance=1 if started else 0)
            started = True

        yield advance
        bar.update(task, completed=total)


def fmt(value: float | None) -> str:
    """Three or more significant digits, none of them noise: 12,072 / 795.5 / 0.86."""
    if value is None:
        return "–"
    digits = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2
    return f"{value:,.{digits}f}"


def fmt_error(record: "Record") -> str:
    if record.rel_error is None:
        return "–"
    return f"{record.rel_error:.1e}" + (" inexact" if record.inexact else "")


def row(record: "Record") -> tuple[str, ...]:
    if record.error:
        return (str(record.features), record.impl, "failed: " + record.error, "", "", "", "", "", "")
    spread = f"{fmt(record.p20_us)}–{fmt(record.p80_us)}"
    graph = fmt(record.graph_us) if record.graph_note is None else "no graph"
    return (str(record.features), record.impl, fmt(record.median_us), spread,
            fmt(record.ratio_to_floor), graph, fmt(record.gbps), fmt_error(record), fmt(record.peak_mb))


def floor_label(record: "Record") -> str:
    return f"floor ({floor_name(record.op, record.mode)})"


def floor_row(record: "Record") -> tuple[str, ...]:
    datasheet = f" (datasheet {fmt(record.datasheet_floor_us)})" if record.datasheet_floor_us else ""
    return (str(record.features), floor_label(record), fmt(record.floor_us) + datasheet, "", "1.00", "", "", "",
            "")


def tables(result: "Result") -> Iterator[tuple[str, list[tuple[str, ...]]]]:
    """(title, rows) per dtype and mode; each features group starts with its floor."""
    settings = result.settings
    for dtype in settings.dtypes:
        for mode in settings.modes:
            rows = []
            for features in settings.features:
                group = [r for r in result.records if (r.dtype, r.mode, r.features) == (dtype, mode, features)]
                if group:
                    rows += [floor_row(group[0])] + [row(r) for r in group]
            yield f"{dtype} {mode} · {settings.inputs} · {settings.dist}", rows


def header(result: "Result") -> str:
    """Where the numbers come from: device, versions and commit."""
    if not result.records:
        return "no measurements"
    first = result.records[0]
    return (f"{first.device} · torch {first.torch} · triton {first.triton} · "
            f"flashmax {first.flashmax_commit[:12]} · {first.date}")


def not_run(result: "Result") -> list[str]:
    return [f"{impl.name}: {impl.reason}" for impl in result.impls if not impl.available]


def print_tables(result: "Result") -> None:
    if Console is None:
        print(header(result))
        for title, rows in tables(result):
            widths = [max(len(cell) for cell in column) for column in zip(COLUMNS, *rows)]
            print(f"\n{title}")
            for cells in (COLUMNS, *rows):
                print("  ".join(cell.rjust(width) for cell, width in zip(cells, widths)))
        for line in not_run(result):
            print(f"not run: {line}")
        return
    console = Console()
    if not console.is_terminal:  # a pipe or a file has no width to fit: keep the rows whole
        console = Console(width=160)
    console.print(header(result))
    for title, rows in tables(result):
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
        for name in COLUMNS:
            table.add_column(name, justify="left" if name == "impl" else "right", no_wrap=True)
        for cells in rows:
            style = "dim" if cells[1].startswith("floor (") else ("red" if "inexact" in cells[7] else None)
            table.add_row(*cells, style=style)
        console.print(table)
    for line in not_run(result):
        console.print(f"[dim]not run: {line}[/dim]")
