"""`gpu-generation`: create, show and verify generation certificates.

Exit codes: 0 ok/verified, 2 verification failed (or `show`/`history` found a stored generation
newer than the verified chain: the active generation they can name is not the newest one), 4 refused, 64 usage, 65 malformed input,
66 missing job/ledger/key, 73 already initialized, 75 etcd unreachable, 77 permission denied.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import typer

from gpuguard.cli import generation_bench
from gpuguard.cli._app import (
    console,
    emit_json,
    entry,
    job_dir_option,
    make_app,
    require_job,
    safe_line,
    stdout_is_terminal,
)
from gpuguard.cli._text import NARROW, columns, echo, echo_lines, lines_for, short
from gpuguard.foundation.env import LEDGER_ENV, SNAPSHOT_ROOT_ENV
from gpuguard.foundation.errors import EXIT_CRITICAL, EXIT_OK

app = make_app(
    "gpu-generation",
    "Generation certificates: membership (incarnations) + commit frontier + state digest + ownership, certified together.",
)

# One schema name per document shape (the certificate inside keeps its own, gpuguard.certificate/2, shown
# with its parts read in: Certificate.expanded_dict).
INIT_SCHEMA = "gpuguard.generation-init/1"
SHOW_SCHEMA = "gpuguard.generation-show/1"
HISTORY_SCHEMA = "gpuguard.generation-history/1"
VERIFY_SCHEMA = "gpuguard.generation-verify/1"
EXPLAIN_SCHEMA = "gpuguard.generation-explain/1"

LEDGER_OPTION = typer.Option(
    None,
    "--ledger",
    metavar="URL",
    envvar=LEDGER_ENV,
    show_envvar=True,
    help="Ledger URL: etcd://host:port/prefix (default: <job-dir>/ledger/, or what init recorded).",
)
JSON_OPTION = typer.Option(False, "--json", help="Print a JSON document instead of text.")
TIMEOUT_OPTION = typer.Option(5.0, "--timeout", min=0.1, help="Seconds to wait for the ledger (etcd).")


def _when(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _emit_text(title: str, lines: list[str]) -> None:
    """A rich panel on a terminal, plain lines when piped; control characters and newlines from records
    escaped; lines broken between words to the width (`cli._text`), inside the panel's borders too."""
    title, lines = safe_line(title), [safe_line(line) for line in lines]
    width = columns()
    if stdout_is_terminal():
        from rich.panel import Panel
        from rich.text import Text

        inner = lines_for(lines, None if width is None else width - 4)
        console().print(Panel(Text("\n".join(inner), no_wrap=True), title=title, expand=False))
    else:
        echo_lines([title, *(f"  {line}" for line in lines)])


def _switch_lines(extra: Mapping[str, Any]) -> list[str]:
    """How the generation came about: an in-place switch or a restart, its phases and layout."""
    lines: list[str] = []
    if extra.get("switch"):
        lines.append(f"switch         {extra['switch']}")
    rnd = _rendezvous_round(extra)
    if rnd is not None:
        attempt = f" (attempt {extra['attempt']})" if extra.get("attempt") else ""
        lines.append(f"rendezvous     round {rnd}{attempt}")
        agents = extra.get("rendezvous_participants")
        if isinstance(agents, list) and agents:
            lines.append(
                f"agents         {len(agents)}: {', '.join(str(a) for a in agents[:8])}{' ...' if len(agents) > 8 else ''}"
            )
    phases = extra.get("phases")
    if isinstance(phases, Mapping) and phases:
        lines.append("phases         " + ", ".join(f"{k} {_seconds(v)}" for k, v in phases.items()))
    layout, before = extra.get("layout"), extra.get("previous_layout")
    if isinstance(layout, Mapping):
        shown = _layout_text(layout)
        if isinstance(before, Mapping):
            shown = f"{_layout_text(before)} -> {shown}"
        lines.append(f"layout         {shown}")
    return lines


def _ownership_lines(cert: Any) -> list[str]:
    """The ownership map in force and, for a sharded restore, the frontier snapshot's map and the
    reshard plan in words (`extra.ownership_map`, `extra.reshard`: docs/formats/certificate.md)."""
    extra = cert.extra or {}
    lines = [f"ownership map  version {cert.ownership_map_version}"]
    omap = extra.get("ownership_map")
    if isinstance(omap, Mapping):
        by_rank = br if isinstance(br := omap.get("by_rank"), Mapping) else {}
        counts = ", ".join(f"rank {r} {n}" for r, n in list(by_rank.items())[:16])
        lines.append(
            f"               frontier snapshot: v{omap.get('version')}, world {omap.get('world_size')}, "
            f"{omap.get('objects')} chunks ({counts}), digest {short(omap.get('digest'))}"
        )
    reshard = extra.get("reshard")
    if isinstance(reshard, Mapping):
        words = reshard.get("lines")
        if isinstance(words, (list, tuple)):
            lines.append(f"reshard        {words[0] if words else ''}")
            lines += [f"               {w}" for w in words[1:40]]
        if reshard.get("basis"):
            lines.append(f"               ({reshard['basis']}; checked against the real layout at restore)")
    elif extra.get("reshard_note"):
        lines.append(f"reshard        {extra['reshard_note']}")
    held = extra.get("sharded_state")
    if isinstance(held, Mapping):  # an in-place switch with sharded state (docs/formats/inplace.md)
        lines.append(
            f"state          in the survivors' memory: {held.get('chunks')} chunks ({held.get('replicated')} held by "
            f"more than one), digest {short(extra.get('sharded_state_digest'))}; lost ranks {list(held.get('lost') or [])}: "
            "every shard they held has a surviving replica, moved peer to peer to the new world"
        )
    return lines


def _rendezvous_round(extra: Mapping[str, Any] | None) -> int | None:
    """The torchrun rendezvous round a generation was activated in: `extra["rendezvous_round"]`, or
    for certificates issued before it was recorded, the round of the attempt token (`r<N>-p<port>`)."""
    extra = extra or {}
    rnd = extra.get("rendezvous_round")
    if isinstance(rnd, int) and not isinstance(rnd, bool):
        return rnd
    token = extra.get("attempt")
    if isinstance(token, str) and token.startswith("r"):
        head = token[1:].split("-", 1)[0]
        if head.isdigit():
            return int(head)
    return None


def _seconds(value: Any) -> str:
    return f"{value:.3f}s" if isinstance(value, (int, float)) else str(value)


def _layout_text(layout: Mapping[str, Any]) -> str:
    return " x ".join(f"{k}={layout[k]}" for k in ("dp", "tp", "pp") if k in layout) or str(dict(layout))


def _cert_lines(cert: Any, parent: Any = None, shown: int | None = None) -> list[str]:
    f = cert.frontier
    lines = [
        f"job            {cert.job_id}",
        f"generation     {cert.generation} (parent {cert.parent_generation if cert.parent_generation is not None else '-'})",
        f"reason         {cert.reason}",
        f"activated      {_when(cert.activation_time)} by {cert.issued_by}",
        f"frontier       step {f.step}, state {short(f.state_manifest_digest) if f.state_manifest_digest else '(none)'}",
    ]
    if "soundness" in (cert.extra or {}):
        from gpuguard.recovery.snapshots.soundness import certificate_line

        lines.append(f"soundness      {certificate_line(cert.extra['soundness'])}")
    if f.collective_seq:
        lines.append("collectives    " + ", ".join(f"{k}={v}" for k, v in sorted(f.collective_seq.items())))
    lines += _ownership_lines(cert)
    lines += _switch_lines(cert.extra or {})
    forced = "  FORCED: quiescence of the old generation was not established" if cert.forced else ""
    lines.append(f"parent retired quiescence {cert.quiescence}{forced}")
    evidence = cert.quiescence_evidence
    lines += [f"               - {e}" for e in (evidence if shown is None else evidence[:shown])]
    if shown is not None and len(evidence) > shown:
        lines.append(f"               ... {len(evidence) - shown} more lines of evidence (--json for all)")
    count = len(cert.members)  # from the chunk references: no member chunk read yet
    lines.append(f"members        {count}")
    admitted = set(cert.admitted)
    listed = cert.member_table.first(shown) if shown is not None else tuple(cert.members)
    parent_rank = {p.incarnation.id: p.rank for p in parent.members} if parent is not None and listed else {}
    for m in listed:
        i = m.incarnation
        tag = ""
        if i.id in parent_rank and parent_rank[i.id] != m.rank:
            tag = f"  (same incarnation, renumbered from rank {parent_rank[i.id]})"
        elif m.rank in admitted:
            tag = "  (new incarnation, admitted)"
        gpu = f" gpu {i.gpu_uuid}" if i.gpu_uuid else ""
        lines.append(f"  rank {m.rank:<4} {i.id[:12]} {i.host} pid {i.pid}{gpu}{tag}")
    if len(listed) < count:
        lines.append(f"  ... {count - len(listed)} more (--members N, or --json for all)")
    lines.append(f"digest         {short(cert.digest())} (--json: whole)")
    return lines


@app.command("init")
def init_cmd(
    job_dir: Path = job_dir_option(),
    ledger: str | None = LEDGER_OPTION,
    job_id: str | None = typer.Option(None, "--job-id", help="Job id (default: the job directory's name)."),
    timeout: float = TIMEOUT_OPTION,
    as_json: bool = JSON_OPTION,
) -> int:
    """Create the ledger, a 0600 signing key and the signed genesis certificate (generation 0)."""
    from gpuguard.generation.job import init_job
    from gpuguard.generation.keys import key_path

    result = init_job(job_dir, url=ledger, job_id=job_id, timeout=timeout)
    g = result.genesis
    if as_json:
        emit_json(
            {
                "schema": INIT_SCHEMA,
                "ledger": result.ledger.url,
                "key": str(key_path(job_dir)),
                "digest": g.digest(),
                "certificate": g.expanded_dict(),
            }
        )
    else:
        echo(
            safe_line(
                f"initialized job {g.job_id}: ledger {result.ledger.url}, key {key_path(job_dir)} (0600), "
                f"generation 0 {short(g.digest())}"
            )
        )
    return EXIT_OK


@app.command("show")
def show_cmd(
    job_dir: Path = job_dir_option(),
    ledger: str | None = LEDGER_OPTION,
    timeout: float = TIMEOUT_OPTION,
    as_json: bool = JSON_OPTION,
    members: int = typer.Option(
        256, "--members", min=0, help="List at most this many members (text; only their chunks are read)."
    ),
) -> int:
    """The active generation: members and incarnations, frontier, state digest, why the parent retired."""
    from gpuguard.generation.job import open_job_ledger

    led = open_job_ledger(require_job(job_dir), ledger, timeout=timeout)
    cert = led.require_active()
    beyond = _unverified_after(led, cert.generation)
    if as_json:
        emit_json(
            {
                "schema": SHOW_SCHEMA,
                "ledger": led.url,
                "active": not beyond,
                "digest": cert.digest(),
                "signature_checked": led.key is not None,
                "rendezvous_round": _rendezvous_round(cert.extra),
                "unverified_after_active": beyond,
                "certificate": cert.expanded_dict(),
            }
        )
    else:
        parent = led.get(cert.parent_generation) if cert.parent_generation is not None else None
        lines = _cert_lines(cert, parent, members)
        if led.key is None:
            lines.append("warning: no signing key in the job directory: signatures were not checked")
        title = f"active generation {cert.generation} — {led.url}"
        if beyond:
            title = f"NOT VERIFIED: newest verified generation {cert.generation} — {led.url}"
            lines.insert(0, _beyond_line(beyond))
        _emit_text(title, lines)
    return EXIT_CRITICAL if beyond else EXIT_OK


def _unverified_after(led: Any, active: int) -> list[int]:
    """Stored generations past the verified chain: a corrupt, forged or unreachable newest certificate."""
    return sorted(n for n in led.generations() if n > active)


def _beyond_line(beyond: list[int]) -> str:
    return (
        f"CORRUPT OR UNVERIFIABLE: generation(s) {beyond} are stored but do not verify, so the newest "
        "generation is unknown (run `gpu-generation verify`)"
    )


@app.command("history")
def history_cmd(
    job_dir: Path = job_dir_option(),
    ledger: str | None = LEDGER_OPTION,
    timeout: float = TIMEOUT_OPTION,
    as_json: bool = JSON_OPTION,
) -> int:
    """Every generation of the verified chain, oldest first, with fenced commits and refusals counted."""
    from gpuguard.generation.job import open_job_ledger
    from gpuguard.generation.records import encode_time

    led = open_job_ledger(require_job(job_dir), ledger, timeout=timeout)
    chain = led.history()
    if not chain:
        led.require_active()
    rows = [
        {
            "generation": c.generation,
            "digest": c.digest(),
            "reason": c.reason,
            "members": len(c.members),
            "admitted": list(c.admitted),
            "frontier_step": c.frontier.step,
            "state_manifest_digest": c.frontier.state_manifest_digest,
            "quiescence": c.quiescence,
            "forced": c.forced,
            "activation_time": encode_time(c.activation_time),  # as the certificate stores it: a decimal string
            "issued_by": c.issued_by,
            "switch": (c.extra or {}).get("switch"),
            "rendezvous_round": _rendezvous_round(c.extra),
        }
        for c in chain
    ]
    beyond = _unverified_after(led, chain[-1].generation)
    if as_json:
        emit_json(
            {
                "schema": HISTORY_SCHEMA,
                "ledger": led.url,
                "active_generation": chain[-1].generation,  # as in gpuguard.status/1 (show's "active" is a bool)
                "generations": rows,
                "unverified_after_active": beyond,
                "fenced_commits": led.fenced_count(),
                "refusals": len(led.refusals()),
            }
        )
        return EXIT_CRITICAL if beyond else EXIT_OK
    echo(safe_line(f"ledger {led.url}: active generation {chain[-1].generation}"))
    width = columns()
    table = width is None or width >= NARROW
    if table:
        echo(
            f"{'gen':>4}  {'activated':<23}  {'reason':<14}  {'switch':<8}  {'round':>5}  {'members':>7}  {'step':>8}  "
            "quiescence  digest"
        )
    for c in chain:
        q = c.quiescence + (" FORCED" if c.forced else "")
        switch = str((c.extra or {}).get("switch") or "-")
        rnd = _rendezvous_round(c.extra)
        shown_round = "-" if rnd is None else str(rnd)
        if table:
            row = (
                f"{c.generation:>4}  {_when(c.activation_time):<23}  {c.reason[:14]:<14}  {switch[:8]:<8}  "
                f"{shown_round:>5}  {len(c.members):>7}  {c.frontier.step:>8}  {q:<10}  {short(c.digest())}"
            )
        else:  # one line per generation, broken between words below the table's width
            rest = "" if rnd is None else f", round {rnd}"
            row = (
                f"{c.generation:>4}  {_when(c.activation_time)}  {c.reason} ({switch}{rest}), {len(c.members)} members, "
                f"step {c.frontier.step}, quiescence {q}, {short(c.digest())}"
            )
        echo(safe_line(row), hang=6)
    if beyond:
        echo(_beyond_line(beyond))
    echo(f"fenced commits: {led.fenced_count()}, refused activations: {len(led.refusals())}")
    return EXIT_CRITICAL if beyond else EXIT_OK


def _soundness_note(manifest: Any) -> tuple[bool, str] | None:
    """(sound, its line) of a manifest's soundness record; None when it records none."""
    from gpuguard.recovery.snapshots.soundness import of_extra

    try:
        verdict = of_extra(manifest.extra)
    except ValueError as exc:
        return False, f"unreadable soundness record ({exc})"
    return None if verdict is None else (verdict.sound, verdict.line())


def _deep_check(
    job_dir: Path, certs: dict[int, Any], target: int, show_progress: bool, snapshot_root: Path | None = None
) -> tuple[list[Any], dict[str, Any], list[str]]:
    """Re-hash the checkpoint of every checked frontier against its manifest.

    The target generation's state must be there; older frontiers' states may have been pruned
    (a note), but any state still stored must verify.
    """
    from gpuguard.foundation.errors import GpuguardError
    from gpuguard.generation.manifest import find_manifests, legacy_note, load_manifest, verify_manifest
    from gpuguard.generation.verify import Finding

    findings: list[Finding] = []
    notes: list[str] = []
    manifests: dict[str, tuple[Path, Any]] = {}
    from gpuguard.foundation.jobdir import snapshot_root as root_of

    root = root_of(job_dir, snapshot_root)
    roots = [job_dir] + ([root] if root.resolve() != job_dir.resolve() else [])
    for path in sorted({p for root in roots for p in find_manifests(root)}):
        try:
            m = load_manifest(path)
        except GpuguardError as exc:
            findings.append(Finding(str(path), "manifest", str(exc).removeprefix(f"{path}: ")))
            continue
        manifests[m.digest] = (path, m)
    wanted = {c.frontier.state_manifest_digest: n for n, c in certs.items() if c.frontier.state_manifest_digest}
    total = sum(e.spec.byte_length for d in wanted if d in manifests for e in manifests[d][1].entries)
    stats = {"manifests": 0, "objects": 0, "bytes": 0}
    progress_cm = None
    if show_progress and total:
        from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

        progress_cm = Progress(
            "re-hashing",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=console(stderr=True),
            transient=True,
        )
    task = None
    try:
        if progress_cm:
            progress_cm.start()
            task = progress_cm.add_task("hash", total=total)
        for digest, n in sorted(wanted.items(), key=lambda kv: kv[1]):
            if digest not in manifests:
                if n == target:
                    findings.append(
                        Finding(
                            f"generation {n}",
                            "frontier-state",
                            f"no manifest with digest {digest[:16]}… under {job_dir}",
                        )
                    )
                else:
                    notes.append(f"state of generation {n} ({digest[:16]}…) is no longer stored")
                continue
            path, m = manifests[digest]
            advance = (lambda b: progress_cm.advance(task, b)) if progress_cm and task is not None else None
            for problem in verify_manifest(m, path.parent, progress=advance):
                findings.append(Finding(str(path), "frontier-state", problem))
            if (legacy := legacy_note(m)) is not None:
                notes.append(f"{path}: {legacy}")
            sound = _soundness_note(m)
            if sound is not None and sound[0]:
                notes.append(f"{path}: step {m.step}: {sound[1]}")
            elif sound is not None:
                findings.append(Finding(str(path), "soundness", f"step {m.step}: {sound[1]}"))
            stats["manifests"] += 1
            stats["objects"] += len(m.entries)
            stats["bytes"] += sum(e.spec.byte_length for e in m.entries)
    finally:
        if progress_cm:
            progress_cm.stop()
    return findings, stats, notes


@app.command("verify")
def verify_cmd(
    job_dir: Path = job_dir_option(),
    ledger: str | None = LEDGER_OPTION,
    generation: int | None = typer.Option(None, "--generation", min=0, help="Verify only this generation."),
    deep: bool = typer.Option(False, "--deep", help="Also re-hash the checkpoint files against their manifests."),
    snapshot_root: Path | None = typer.Option(
        None,
        "--snapshot-root",
        help=f"With --deep: where the job's snapshots/ and checkpoints/ live (shared storage), besides the job dir (default: ${SNAPSHOT_ROOT_ENV}).",
    ),
    timeout: float = TIMEOUT_OPTION,
    as_json: bool = JSON_OPTION,
) -> int:
    """Signatures, the hash chain, the rules; with --deep the frontier state's files too. Exit 2 on failure."""
    from gpuguard.foundation.errors import NoInputError
    from gpuguard.foundation.jobdir import snapshot_root as root_of
    from gpuguard.generation.job import open_job_ledger
    from gpuguard.generation.keys import load_key
    from gpuguard.generation.verify import verify_ledger

    key = load_key(require_job(job_dir))
    root = root_of(job_dir, snapshot_root)
    if deep and not root.is_dir():  # a typo'd root would verify nothing and still say "verified"
        raise NoInputError(f"{root}: no such snapshot root (--snapshot-root or ${SNAPSHOT_ROOT_ENV})")
    led = open_job_ledger(job_dir, ledger, timeout=timeout)
    report = verify_ledger(led, key, generation=generation)
    deep_stats = None
    if deep:
        certs = {n: c for n, c in report.certificates.items() if n in report.checked}
        target = generation if generation is not None else max(report.checked, default=0)
        more, deep_stats, notes = _deep_check(
            job_dir, certs, target, stdout_is_terminal() and not as_json, snapshot_root
        )
        report.findings += more
        report.notes += notes
    if as_json:
        emit_json(
            {
                "schema": VERIFY_SCHEMA,
                "ledger": led.url,
                "ok": report.ok,
                "checked": report.checked,
                "findings": [f.to_dict() for f in report.findings],
                "notes": report.notes,
                "deep": deep_stats,
            }
        )
    else:
        for f in report.findings:
            echo(safe_line(f"FAIL {f}"))
        for note in report.notes:
            echo(safe_line(f"note: {note}"))
        what = f"generation {generation}" if generation is not None else f"{len(report.checked)} generation(s)"
        extra = (
            (
                f"; state: {deep_stats['manifests']} manifest(s), {deep_stats['objects']} objects, "
                f"{deep_stats['bytes']} bytes re-hashed"
            )
            if deep_stats
            else ""
        )
        echo(safe_line(("verified " if report.ok else "verification FAILED: ") + f"{what} in {led.url}{extra}"))
    return EXIT_OK if report.ok else EXIT_CRITICAL


@app.command("explain")
def explain_cmd(
    job_dir: Path = job_dir_option(),
    ledger: str | None = LEDGER_OPTION,
    generation: int | None = typer.Option(
        None, "--generation", min=0, help="Explain the refusals of this generation (default: the latest)."
    ),
    show_all: bool = typer.Option(False, "--all", help="Every recorded refusal, not only the latest."),
    timeout: float = TIMEOUT_OPTION,
    as_json: bool = JSON_OPTION,
) -> int:
    """Why an activation was refused: which rule, which member."""
    from gpuguard.generation.job import open_job_ledger

    led = open_job_ledger(require_job(job_dir), ledger, timeout=timeout)
    refusals = sorted(led.refusals(), key=lambda r: r.time)
    if generation is not None:
        refusals = [r for r in refusals if r.generation == generation]
    if not show_all:
        refusals = refusals[-1:]
    if as_json:
        emit_json({"schema": EXPLAIN_SCHEMA, "ledger": led.url, "refusals": [r.to_dict() for r in refusals]})
        return EXIT_OK
    if not refusals:
        echo(safe_line(f"no refused activation recorded in {led.url}"))
        return EXIT_OK
    for r in refusals:
        echo(
            safe_line(
                f"{_when(r.time)}: activation of generation {r.generation} (parent {r.parent_generation}, "
                f"reason {r.reason}, issued by {r.issued_by}, certificate {short(r.certificate_digest)}) was refused:"
            )
        )
        for v in r.violations:
            who = f" rank {v.member}:" if v.member is not None else ""
            echo(safe_line(f"  rule {v.rule}:{who} {v.message}"))
    return EXIT_OK


generation_bench.register(app=app)

main = entry(app, "gpu-generation")

if __name__ == "__main__":
    main()
