"""`gpu-doctor contract PATH... [--json] [--pg NAME]`: the first collective where ranks disagree.

Why: when one rank skips or reorders a collective, NCCL and gloo match calls by position, so the
job hangs (or gloo aborts a rank) at a *later* call and the stack trace points at the wrong line.
This reads every rank's Flight Recorder dump (pickle or JSON, through a restricted unpickler) or
gpuguard collective trace, and names the first divergent sequence number, the ranks, the field and
the call sites, with the "one call ahead" explanation when the traces show it.

What must agree depends on the collective (gather/scatter roots, uneven all_to_all splits, the `_v`
variants, send/recv pairs): diagnostics.collective_semantics, docs/formats/collective-semantics.md.

Exit codes: 0 every contract holds; 1 a contract is broken; 3 no divergence found but the result is
partial (a rank's dump missing, duplicated or refused, or nothing compared: its part of the contract
is unknown); 64 usage error; 65 unreadable, truncated, unsafe or malformed dump (every input refused;
when only some are, each is one line on stderr and the rest are analysed, partial); 66 input
missing; 77 permission denied. Never imports torch.
"""

from __future__ import annotations

from typing import Any

import typer

from gpuguard.foundation.errors import EXIT_OK, EXIT_UNKNOWN, EXIT_WARNING

_PROGRESS_MIN_FILES = 64


def register(*, app: typer.Typer, diagnose: typer.Typer, watch: typer.Typer, plan: typer.Typer) -> None:
    """Add `gpu-doctor contract` to the app."""

    @app.command("contract")
    def contract(
        paths: list[str] = typer.Argument(..., metavar="PATH...", help="Per-rank dumps, or directories holding them."),
        as_json: bool = typer.Option(False, "--json", help="Print a gpuguard.contract/1 JSON document."),
        pg: str = typer.Option(
            None, "--pg", metavar="NAME", help="Check only this process group (name or description)."
        ),
        world_size: int = typer.Option(
            None, "--world-size", min=1, help="Expected ranks 0..N-1 (finds missing dumps of the last ranks)."
        ),
        jobs: int = typer.Option(None, "--jobs", min=1, help="Processes that read dumps (default: auto)."),
    ) -> int:
        """Check the collective contract (same order, op, count, dtype, reduce op on every rank).

        Reads PyTorch Flight Recorder dumps (pickle or JSON; named <prefix><rank>) and gpuguard
        collective traces. Exit 0: contract holds; 1: broken; 3: no divergence but partial (a dump
        missing or duplicated); 65 bad dump; 66 missing input.
        """
        return run_contract(paths, as_json=as_json, pg=pg, world_size=world_size, jobs=jobs)


def run_contract(
    paths: list[str],
    *,
    as_json: bool = False,
    pg: str | None = None,
    world_size: int | None = None,
    jobs: int | None = None,
) -> int:
    import sys

    from gpuguard.cli._app import console, emit_json
    from gpuguard.cli._progress import ProgressBar
    from gpuguard.collectors.flight_recorder import check_usage_pg, discover, load_all, unknown_version_notes
    from gpuguard.diagnostics.contract import Interner, check, report_to_json

    files, notes = discover(paths)
    interner = Interner()
    with ProgressBar(enabled=not as_json and len(files) >= _PROGRESS_MIN_FILES) as bar:
        loaded, refused = load_all(files, interner, jobs=jobs, progress=bar.ticker("reading dumps", len(files)))
    if refused and not loaded:
        raise refused[0]
    for exc in refused:  # one line per refused file; the rest is still analysed
        print(f"gpu-doctor contract: refused {exc}", file=sys.stderr)
    traces = [item.trace for item in loaded]
    if pg is not None:
        names = {n for t in traces for s in t.streams for n in (s.pg, s.pg_desc, f"{s.pg}:{s.pg_desc}") if n}
        names |= {n for item in loaded for rec in item.p2p for n in (rec[0], rec[1], f"{rec[0]}:{rec[1]}") if n}
        check_usage_pg(names, pg)
    skipped = sum(t.skipped for t in traces)
    warns = [f"refused {exc}; that rank's part of the contract is unknown" for exc in refused]
    if skipped:
        warns.append(f"{skipped} point-to-point entr(ies) without a readable peer were not compared")
    warns += unknown_version_notes(traces)  # a dump format newer or older than the reader knows
    if any(not s.states_reliable for t in traces for s in t.streams):
        warns.append(
            "gloo records completion late (after wait() returns, and on failure too): completion states "
            "were not compared, only the calls themselves; and it records no point-to-point calls, so "
            "send/recv were not checked"
        )
    report = check(
        traces,
        interner,
        pg=pg,
        world_size=world_size,
        warnings=warns,
        partial=bool(refused or skipped),
        p2p={item.trace.rank: item.p2p for item in loaded if item.p2p},
        completed={item.trace.rank: item.completed for item in loaded if item.completed},
    )
    inputs = [
        {
            "path": item.trace.source,
            "rank": item.trace.rank,
            "format": item.trace.format,
            "version": item.trace.version,
            "entries": item.entries,
            "skipped_p2p": item.trace.skipped,
            "p2p": len(item.p2p),
        }
        for item in loaded
    ]
    doc = report_to_json(report, inputs)
    doc["notes"] = notes
    doc["refused"] = [str(exc) for exc in refused]
    code = contract_exit_code(report.holds, report.partial)
    if as_json:
        emit_json(doc)
        return code
    _render(report, traces, interner, notes, len(loaded), console())
    return code


def contract_exit_code(holds: bool, partial: bool) -> int:
    """1 broken (a divergence among the dumps read is real even when some are missing); 3 when no
    divergence was found but some rank's part is unknown (never "holds"); 0 only when complete."""
    if not holds:
        return EXIT_WARNING
    return EXIT_UNKNOWN if partial else EXIT_OK


def _render(report: Any, traces: list, interner: Any, notes: list[str], n_files: int, out: Any) -> None:
    from rich.table import Table
    from rich.text import Text

    from gpuguard.cli._app import safe_text
    from gpuguard.diagnostics.contract import around, format_ranks

    for w in (*report.warnings, *notes):
        out.print(Text.assemble(("warning: ", "yellow"), safe_text(w)))
    label = " (PARTIAL: part of the input is missing, refused or guessed; see the warnings)" if report.partial else ""
    checked = sum(t.checked for t in report.timelines)
    div = report.first_divergence
    if div is None:
        if report.partial:
            out.print(
                f"[bold yellow]contract UNKNOWN[/]{label}: no divergence among {n_files} dump(s) "
                f"({checked} collective(s) compared), but part of the contract is unknown (see the warnings).",
                markup=True,
            )
        else:
            out.print(
                f"[bold green]contract holds[/]: {len(report.timelines)} process group timeline(s), "
                f"{n_files} dump(s), {checked} collective(s) compared on every rank; no divergence.",
                markup=True,
            )
        table = Table("pg", "scope", "generation", "ranks", "window", "checked")
        for t in report.timelines:
            window = f"#{t.first_seq}..#{t.last_seq}" if t.first_seq is not None else "-"
            table.add_row(
                safe_text(f"{t.pg}" + (f" ({t.pg_desc})" if t.pg_desc else "")),
                t.scope,
                str(t.generation),
                format_ranks(t.ranks),
                window,
                str(t.checked),
            )
        out.print(table)
        return
    from rich.markup import escape

    where = escape(safe_text(f"pg {div.pg}" + (f" ({_desc(report, div)})" if _desc(report, div) else "")))
    if div.members is not None:
        where += f" [{format_ranks(div.members)}]"
    out.print(
        f"[bold red]contract BROKEN[/]{label}: first divergence at {where} generation {div.generation}"
        + (f" seq #{div.seq}" if div.kind != "membership_mismatch" else "")
        + f": [bold]{escape(safe_text(div.kind))}[/] ({escape(safe_text(div.field))}"
        + (f", {escape(safe_text(div.record))}" if div.record else "")
        + f"), culprit rank(s) {format_ranks(div.ranks)}"
        + (" [yellow](ambiguous)[/]" if div.ambiguous else ""),
        markup=True,
    )
    point_to_point = any(
        s.signature is not None and s.signature.op.startswith(("send ", "recv ")) for s in (div.majority, *div.others)
    )
    if div.kind == "membership_mismatch" or point_to_point:  # no collective timeline to tabulate
        out.print(safe_text(div.explanation), markup=False)
        return
    table = Table(title=None)
    table.add_column("seq", justify="right")
    sides = (div.majority, *div.others)
    for i, side in enumerate(sides):
        role = "majority" if i == 0 else "culprit"
        table.add_column(f"{role}: rank(s) {format_ranks(side.ranks)}")
    for seq, cells in around(traces, interner, div):
        mark = seq == div.seq
        table.add_row(
            f"{'>' if mark else ' '} {seq}", *(Text(safe_text(c)) for c in cells), style="bold" if mark else None
        )
    out.print(table)
    out.print(safe_text(div.explanation), markup=False)
    for side in sides:
        if side.call_site:
            out.print(safe_text(f"  call site of rank(s) {format_ranks(side.ranks)}: {side.call_site}"), markup=False)
    for hint in div.hints:
        out.print(safe_text(f"hint: {hint}"), markup=False)
    rest = report.divergences[1:]
    if rest:
        out.print(
            f"{len(rest)} other process group(s) diverge too: "
            + safe_text("; ".join(f"pg {d.pg} #{d.seq} {d.kind} rank(s) {format_ranks(d.ranks)}" for d in rest)),
            markup=False,
        )


def _desc(report: Any, div: Any) -> str:
    for t in report.timelines:
        if t.pg == div.pg and t.generation == div.generation:
            return t.pg_desc
    return ""
