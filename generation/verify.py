"""Verify a ledger end to end: every stored record, the hash chain, the signatures, the rules.

Unlike `Ledger.active()` (which stops quietly at the first bad record, because the active
generation is the end of the valid chain), verification reads every stored generation and
names each record that fails and why: nothing is silently skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuguard.foundation.errors import DataError
from gpuguard.generation import rules
from gpuguard.generation.certificate import check_stored
from gpuguard.generation.ledger import Ledger
from gpuguard.generation.records import Certificate, Violation


@dataclass(frozen=True)
class Finding:
    """A record that failed verification: which record, which rule, why (and which member)."""

    record: str
    rule: str
    message: str
    member: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"record": self.record, "rule": self.rule, "message": self.message, "member": self.member}

    def __str__(self) -> str:
        who = f" (rank {self.member})" if self.member is not None else ""
        return f"{self.record}: {self.rule}{who}: {self.message}"


@dataclass
class Report:
    checked: list[int] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    certificates: dict[int, Certificate] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.findings


def record_name(ledger: Ledger, generation: int) -> str:
    namer = getattr(ledger, "record_name", None)
    return namer(generation) if namer else f"generation {generation}"


def verify_ledger(ledger: Ledger, key: bytes, *, generation: int | None = None) -> Report:
    """Check every stored certificate (or only `generation`, after checking its ancestors' links)."""
    report = Report()
    stored = ledger.generations()
    if not stored:
        report.findings.append(Finding(getattr(ledger, "url", "ledger"), "chain", "the ledger has no certificates"))
        return report
    if generation is not None and generation not in stored:
        report.findings.append(
            Finding(
                record_name(ledger, generation),
                "chain",
                f"generation {generation} is not stored (stored: {min(stored)}..{max(stored)})",
            )
        )
        return report
    last = max(stored) if generation is None else generation
    parent: Certificate | None = None
    for n in range(0, last + 1):
        name = record_name(ledger, n)
        found: list[Finding] = []
        raw = ledger.raw(n)
        cert = None
        if raw is None:
            found.append(Finding(name, "chain", f"generation {n} is missing: the chain is broken"))
        else:
            try:
                cert = ledger.decode(raw, n)
            except ValueError as exc:
                found.append(Finding(name, "encoding", f"unreadable certificate ({exc}): truncated or tampered"))
        if cert is not None:
            if cert.generation != n:
                found.append(Finding(name, "chain", f"record holds generation {cert.generation}, stored as {n}"))
            found += [Finding(name, v.rule, v.message, v.member) for v in _violations(ledger, cert, parent, key)]
            report.certificates[n] = cert
        if parent is not None:
            parent.unload()  # checked against its child: two generations' parts in memory at a time
        if generation is None or n == generation:
            report.checked.append(n)
            report.findings += found
        elif found:
            report.findings.append(Finding(name, "chain", "an ancestor of the requested generation does not verify"))
        parent = cert
    if generation is None:
        for n in range(0, last + 1):
            _, bad = ledger.commits(n)
            if bad:
                report.findings.append(
                    Finding(
                        f"{getattr(ledger, 'url', 'ledger')} commits of generation {n}",
                        "encoding",
                        f"{bad} garbled commit record(s)",
                    )
                )
        stray: list[str] = getattr(ledger, "stray_temp_files", lambda: [])()
        if stray:
            report.notes.append(f"{len(stray)} temp file(s) from interrupted writers (ignored): {', '.join(stray[:3])}")
    return report


def _violations(ledger: Ledger, cert: Certificate, parent: Certificate | None, key: bytes) -> list[Violation]:
    """Every stored rule. The rules past signature and chain read the member tables and bodies of
    the certificate and its parent: a chunk that is missing or altered is an `encoding` violation."""
    try:
        cert.member_table.load()
        list(cert.admitted)
        violations = check_stored(cert, parent=parent, key=key)
    except DataError as exc:
        head = [*rules.signature(cert, key), *rules.chain_continuity(cert, parent)]
        return [*head, Violation("encoding", f"member table or body unreadable: {exc}")]
    if parent is not None:
        violations += rules.frontier_committed(cert, parent, _committed(ledger, parent.generation))
    return violations


def _committed(ledger: Ledger, generation: int) -> int | None:
    try:
        return ledger.last_committed_by_all(generation)
    except Exception:  # noqa: BLE001 - an unreadable parent is reported on its own record
        return None
