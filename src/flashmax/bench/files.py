"""What the run leaves in the output folder: bench.json, bench.md and a plot per mode, or after a
sweep one plot of every mode against the copy bandwidth."""

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from .report import floor_label, fmt, header, not_run
from .workloads import MODES, floor_name, tensors_moved

if TYPE_CHECKING:
    from .runner import Record, Result


def write_all(result: "Result", out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    plots = write_sweep_plot(result, out) if result.settings.sweep else write_plots(result, out)
    return [write_json(result, out / "bench.json"), write_markdown(result, out / "bench.md"), *plots]


def _finite_or_none(value):
    # JSON has no NaN or infinity: a NaN error (a broken output) is written as null.
    return None if isinstance(value, float) and not math.isfinite(value) else value


def write_json(result: "Result", path: Path) -> Path:
    records = [{key: _finite_or_none(value) for key, value in dataclasses.asdict(record).items()}
               for record in result.records]
    not_run_impls = [{"impl": impl.name, "impl_version": impl.version, "reason": impl.reason}
                     for impl in result.impls if not impl.available]
    path.write_text(json.dumps({"records": records, "not_run": not_run_impls}, indent=1) + "\n")
    return path


def cell(record: "Record | None") -> str:
    """µs (×floor), GPU time where there is one, marked where inexact or the run failed."""
    if record is None:
        return ""
    if record.error:
        return "failed"
    mark = " inexact" if record.inexact else ""
    time_us, floor_us = _gpu_or_wall(record)
    return f"{fmt(time_us)} (×{fmt(time_us / floor_us if time_us else None)}){mark}"


def write_markdown(result: "Result", path: Path) -> Path:
    settings = result.settings
    impls = [impl.name for impl in result.impls if impl.available]
    floors = ", ".join(f"{mode} {tensors_moved(settings.op, mode)}" for mode in MODES if mode != "eager")
    lines = [f"# flashmax bench: {settings.title}", "", header(result), "",
             f"Inputs: {settings.inputs}, `{settings.dist}`. Cells: median µs (× floor), on a GPU "
             "the GPU time alone (CUDA-graph replay, L2 flushed before each run), elsewhere wall time; "
             "the floor is `x.clone()` timed the same way, scaled to the tensors each mode moves "
             f"({floors}). Mode eager: forward + backward through autograd by the wall clock, each call "
             "synchronised, host time included, no flush; its floor is "
             f"`{floor_name(settings.op, 'eager')}` forward + backward on the same input, timed call for "
             "call in turn with each implementation. *inexact*: relative error above 1e-4 (bf16/fp16: above "
             "their eps) against a float64 oracle."]
    for dtype in settings.dtypes:
        for mode in settings.modes:
            tokens = "tokens | " if settings.sweep else ""  # a sweep's rows differ per width
            lines += ["", f"## {dtype} {mode}", "", f"| features | {tokens}floor µs | " + " | ".join(impls) + " |",
                      "|---:|---:|" + "---:|" * (len(impls) + bool(tokens))]
            for features in settings.features:
                group = {r.impl: r for r in result.records if (r.dtype, r.mode, r.features) == (dtype, mode, features)}
                if group:
                    first = next(iter(group.values()))
                    floor_us = _shown_floor(first)
                    cells = [cell(group.get(name)) for name in impls]
                    tokens = f"{first.tokens} | " if settings.sweep else ""
                    lines.append(f"| {features} | {tokens}{fmt(floor_us)} | " + " | ".join(cells) + " |")
    if not_run(result):
        lines += ["", "Not run: " + "; ".join(not_run(result)) + "."]
    path.write_text("\n".join(lines) + "\n")
    return path


def _pyplot():
    """matplotlib.pyplot drawing to files only, or None (said once) where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plots")
        return None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def write_plots(result: "Result", out: Path) -> list[Path]:
    """bench-MODE.png: time against features on log-log axes, one panel per dtype, floor dashed."""
    plt = _pyplot()
    if plt is None:
        return []
    settings = result.settings
    paths = []
    for mode in settings.modes:
        figure, axes = plt.subplots(1, len(settings.dtypes), figsize=(6 * len(settings.dtypes), 4.5),
                                    squeeze=False)
        for ax, dtype in zip(axes[0], settings.dtypes):
            records = [r for r in result.records if (r.dtype, r.mode) == (dtype, mode)]
            _plot_panel(ax, records)
            ax.set_title(f"{dtype} {mode} · {settings.inputs} · {settings.dist}")
        figure.tight_layout()
        path = out / f"bench-{mode}.png"
        figure.savefig(path, dpi=120)
        plt.close(figure)
        paths.append(path)
    return paths


def write_sweep_plot(result: "Result", out: Path) -> list[Path]:
    """bench-sweep.png: percent of copy bandwidth (100 × floor / time) against features, one panel per
    mode, a line per dtype (and per impl where there are several); 100% is the clone's speed."""
    plt = _pyplot()
    if plt is None:
        return []
    settings = result.settings
    impls = list(dict.fromkeys(r.impl for r in result.records))
    figure, axes = plt.subplots(1, len(settings.modes), figsize=(8 * len(settings.modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], settings.modes):
        for impl in impls:
            for dtype in settings.dtypes:
                points = [(r.features, _percent_of_copy(r)) for r in result.records
                          if (r.impl, r.dtype, r.mode) == (impl, dtype, mode) and _percent_of_copy(r)]
                if points:
                    ax.plot(*zip(*sorted(points)), "o-", markersize=3,
                            label=f"{impl} {dtype}" if len(impls) > 1 else dtype)
        ax.axhline(100, color="k", linestyle="--", linewidth=1, label="copy (clone)")
        powers = [2**k for k in range(max(min(settings.features), 1).bit_length() - 1,
                                      max(settings.features).bit_length())]
        ax.set_xscale("log", base=2)
        ax.set_xticks(powers, [_short(f) for f in powers], minor=False, fontsize="small")
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("features")
        ax.set_ylabel("% of copy bandwidth (GPU time where measured)")
        ax.set_title(f"{mode} · {settings.inputs} · {settings.dist}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    figure.tight_layout()
    path = out / "bench-sweep.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return [path]


def _percent_of_copy(record: "Record") -> float | None:
    time_us, floor_us = _gpu_or_wall(record)
    return 100 * floor_us / time_us if time_us else None


def _short(features: int) -> str:
    """A tick label: 512, 1K, 64K, 1M."""
    for unit, scale in (("M", 2**20), ("K", 2**10)):
        if features >= scale and features % scale == 0:
            return f"{features // scale}{unit}"
    return str(features)


def _gpu_or_wall(record: "Record") -> tuple[float | None, float]:
    """(time, floor): GPU time alone where it was measured, else wall time, as in the tables."""
    if record.graph_ratio_to_floor is not None:
        return record.graph_us, record.floor_graph_us
    return record.median_us, record.floor_us


def _shown_floor(record: "Record") -> float:
    """The floor of a table row or plot: the clone's GPU time where it was measured."""
    return record.floor_graph_us or record.floor_us


def _plot_panel(ax, records: list["Record"]) -> None:
    if not records:
        return
    floors = {r.features: r for r in records}
    features = sorted(floors)
    ax.plot(features, [_shown_floor(floors[f]) for f in features], "k--",
            label=floor_label(records[0]))
    if any(floors[f].datasheet_floor_us for f in features):
        ax.plot(features, [floors[f].datasheet_floor_us for f in features], "k:", label="datasheet floor")
    for impl in dict.fromkeys(r.impl for r in records):
        points = [(r.features, _gpu_or_wall(r)[0]) for r in records if r.impl == impl and _gpu_or_wall(r)[0]]
        if points:
            ax.plot(*zip(*points), "o-", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_xticks(features, [str(f) for f in features], minor=False)
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("features")
    ax.set_ylabel("median µs (GPU time where measured)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
