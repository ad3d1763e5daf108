"""`gpu-doctor picture`: which rank is slow and where a restart's time went, drawn.

In the terminal: a heatmap of ranks x steps (each rank's own compute lateness, `diagnostics.lateness`)
and a timeline of each restart's phases (`doctor.job_trace`), with rich, inside the terminal's width,
readable without colour (the shade is in the character). `--export perfetto`: the Chrome trace of the
whole history for ui.perfetto.dev or chrome://tracing. `--plot FILE.png|svg`: step-time histograms per
generation, through matplotlib when it is installed (an optional extra: never on the doctor's import
path, never a dependency of the cron sweep).

Exit codes: 0; 64 usage; 66 job dir missing; 69 --plot without matplotlib; 73 output exists.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

from gpuguard.cli._app import console, job_dir_option, stdout_is_terminal
from gpuguard.cli._text import columns, echo
from gpuguard.cli._text import say as say_on
from gpuguard.foundation.errors import EXIT_OK, MissingDependencyError, NoInputError, UsageError

SHADES = " ░▒▓█"  # lateness 0 .. the grid's worst, readable without colour
ON_TIME = 0.1  # under this fraction of the worst lateness a cell is "on time" (·)
_STYLE = ("", "green", "yellow", "dark_orange", "red")


def heatmap_lines(grid: Any, width: int | None) -> list[tuple[str, list[int]]]:
    """(text, shade index per step cell) per line: a title, one row per rank, a scale."""
    worst = grid.worst
    out: list[tuple[str, list[int]]] = [
        ("lateness: each rank's own compute time minus the step's median", []),
        (f"generation {grid.generation}, steps {grid.steps[0]}..{grid.steps[-1]}, worst {_seconds(worst, worst)}", []),
    ]
    digits = len(str(max(grid.ranks)))
    for i, rank in enumerate(grid.ranks):
        shades = [
            0 if v is None or worst <= 0 or v < worst * ON_TIME else min(len(SHADES) - 1, 1 + int(v / worst * 3))
            for v in grid.late[i]
        ]
        cells = "".join(
            " " if v is None else SHADES[k] if k else "·" for v, k in zip(grid.late[i], shades, strict=True)
        )
        out.append((f"rank {rank:>{digits}} {cells} mean {_seconds(grid.row_mean(i), worst)}", shades))
    out.append(
        (f"scale: · on time (under a tenth of the worst)  {' '.join(SHADES[1:])}  up to {_seconds(worst, worst)}", [])
    )
    return out


def _seconds(v: float, scale: float) -> str:
    """A lateness in the unit its grid needs: milliseconds when even the worst is under a second."""
    return f"{v * 1000:.1f} ms" if scale < 1 else f"{v:.2f} s"


def timeline_lines(phases: list[Any], width: int | None) -> list[str]:
    """Per restart: its total, then one line per phase: duration, a bar placed in time, what it was."""
    bar_w = max(10, min(40, (width or 100) - 50))
    lines: list[str] = []
    for gen in sorted({p.generation for p in phases}):
        mine = [p for p in phases if p.generation == gen]
        t0, t1 = min(p.start for p in mine), max(p.end for p in mine)
        span = max(t1 - t0, 1e-9)
        first = mine[0].phase
        what = (
            f"in-place switch into generation {gen}"
            if first == "down_inplace"
            else f"restart into generation {gen}"
            if first.startswith("down")
            else f"start of generation {gen}"
        )
        lines.append(f"{what}: {t1 - t0:.2f} s to the first step's end")
        for p in mine:
            a = int((p.start - t0) / span * bar_w)
            b = max(a + 1, int(round((p.end - t0) / span * bar_w)))
            bar = (" " * a + "█" * (b - a)).ljust(bar_w)
            lines.append(f"  {p.end - p.start:>7.2f} s |{bar}| {p.label}")
    return lines or ["no activation record: nothing to draw on the timeline"]


def timeline_hang(width: int | None) -> int:
    """Where a timeline line's label starts: its continuation lines align under it."""
    return 2 + 9 + 2 + max(10, min(40, (width or 100) - 50)) + 2


def draw(history: Any, width: int | None, out: Any = None, steps: int = 60) -> None:
    """The heatmap and the timeline: on `out` (a rich console: the heatmap's shades coloured), else as
    plain lines broken to the width (`cli._text`)."""
    from gpuguard.diagnostics.lateness import lateness_grid

    def say(text: str, hang: int | None = None) -> None:
        if out is None:
            echo(text, hang=hang)
        else:
            say_on(out, text, hang=hang)

    grid = lateness_grid(history.series, last=min(steps, max(10, (width or 200) - 20)))
    if not (grid.ranks and grid.steps):
        say("no step records under the job directory's ranks/")
    for text, shades in heatmap_lines(grid, width) if grid.ranks and grid.steps else ():
        if out is None or not shades:
            say(text)
            continue
        from rich.text import Text

        line = Text(text, no_wrap=True)
        start = text.index(" ", 5) + 1
        for j, k in enumerate(shades):
            if k:
                line.stylize(_STYLE[k], start + j, start + j + 1)
        out.print(line, soft_wrap=True)
    say("")
    for text in timeline_lines(list(history.phases), width):
        say(text, hang=timeline_hang(width))


def _plot(history: Any, path: str, force: bool) -> None:
    """Step-time (period) histograms, one per generation, into a PNG or SVG file."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".png", ".svg"):
        raise UsageError(f"--plot {path}: the file must end in .png or .svg")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError(
            "--plot needs matplotlib, which is not installed (pip install matplotlib)"
        ) from None
    import io

    from gpuguard.foundation.outfile import write_output_file

    by_gen: dict[int, list[float]] = {}
    for s in history.series:
        by_gen.setdefault(s.generation, []).extend(st.interval_s for st in s.steps if st.interval_s)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for gen, values in sorted(by_gen.items()):
        if values:
            ax.hist(values, bins=40, alpha=0.6, label=f"generation {gen} (n={len(values)})")
    ax.set_xlabel("step period (s)")
    ax.set_ylabel("steps")
    ax.set_title("step time per generation")
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format=suffix[1:])
    plt.close(fig)
    write_output_file(path, buf.getvalue(), force=force, what="--plot")


def register(*, app: typer.Typer, **_: Any) -> None:
    @app.command("picture")
    def picture_cmd(
        job_dir: Path = job_dir_option(),
        export: str | None = typer.Option(
            None, "--export", metavar="perfetto", help="Print the Chrome trace JSON (ui.perfetto.dev) instead."
        ),
        plot: str | None = typer.Option(
            None, "--plot", metavar="FILE.png|svg", help="Also write step-time histograms per generation (matplotlib)."
        ),
        force: bool = typer.Option(False, "--force", help="Let --plot replace an existing regular file."),
        steps: int = typer.Option(60, "--steps", min=1, metavar="N", help="Steps in the heatmap (at most the width)."),
    ) -> int:
        """Heatmap of each rank's own lateness and the timeline of each restart (Chrome trace: --export)."""
        from gpuguard.doctor.job_trace import chrome_trace, read_job_history

        if not job_dir.is_dir():
            raise NoInputError(f"job directory {job_dir} does not exist")
        if export is not None and export != "perfetto":
            raise UsageError(f"--export {export}: the one export is perfetto (Chrome trace JSON)")
        history = read_job_history(job_dir)
        if plot is not None:
            _plot(history, plot, force)
        if export is not None:
            sys.stdout.write(json.dumps(chrome_trace(history)) + "\n")
            return EXIT_OK
        draw(history, columns(), console() if stdout_is_terminal() else None, steps)
        if plot is not None:
            echo(f"wrote {plot}")
        return EXIT_OK
