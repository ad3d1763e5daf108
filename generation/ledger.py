"""The ledger: an append-only hash chain of certificates with compare-and-swap activation.

The logic every backend shares lives here (walking and verifying the chain, the activation
rules, fencing, the commit frontier); a backend only provides a few storage primitives:
exclusive creation of generation N, reading it, a content-addressed chunk store (a `/2`
certificate's member table and body, stored before it) and append-only logs. `open_ledger` picks the
backend from a URL: none -> `<job-dir>/ledger/` (directory), `etcd://host:port/prefix` -> etcd.

The active generation is the highest generation reachable from generation 0 through an
unbroken chain of valid certificates (parseable, canonical, signed, linked). Because a backend
can only ever *create* generation N = parent + 1 exclusively, exactly one racer wins.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from gpuguard.foundation.errors import DataError, NoInputError, RefusedError
from gpuguard.generation import rules
from gpuguard.generation.canonical import canonical_bytes, parse_canonical
from gpuguard.generation.certificate import check
from gpuguard.generation.chunks import Blob, ChunkLoader
from gpuguard.generation.records import Certificate, CommitRecord, Violation, encode_time

LEDGER_SCHEMA = "gpuguard.ledger/1"
REFUSAL_SCHEMA = "gpuguard.refusal/1"
FRONTIER_SCHEMA = "gpuguard.frontier/1"
FRONTIER_EVIDENCE = ("barrier", "snapshot", "reports")
FRONTIER_TRIES = 8  # compare-and-swap attempts of one raise before it gives up (contention)


@dataclass(frozen=True)
class FrontierRecord:
    """ "Every member of `generation` committed through `step`": the one record a generation keeps of
    its commits (docs/formats/ledger.md, "Frontier records"). Written by one member that proved it
    (`evidence`): `barrier` — every member met on the control group after committing the step;
    `snapshot` — every member took part in the collective sharded snapshot of the step, which each
    submits after committing it; `reports` — an in-place coordinator's inference from the survivors'
    reports. Only ever raised."""

    generation: int
    step: int
    by: str  # the incarnation that wrote it
    evidence: str
    time: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": FRONTIER_SCHEMA,
            "generation": self.generation,
            "step": self.step,
            "by": self.by,
            "evidence": self.evidence,
            "time": encode_time(self.time),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FrontierRecord:
        if d.get("schema") != FRONTIER_SCHEMA:
            raise ValueError(f"not a {FRONTIER_SCHEMA} record")
        gen, step = d.get("generation"), d.get("step")
        if type(gen) is not int or type(step) is not int or step < 0:
            raise ValueError("generation and step must be integers (step >= 0)")
        evidence = d.get("evidence")
        if evidence not in FRONTIER_EVIDENCE:
            raise ValueError(f"evidence must be one of {', '.join(FRONTIER_EVIDENCE)}")
        return cls(gen, step, str(d.get("by", "")), str(evidence), float(d.get("time", "0")))


@dataclass(frozen=True)
class Refusal:
    """A refused activation, kept so `gpu-generation explain` can say which rule and which member."""

    time: float
    generation: int
    parent_generation: int | None
    certificate_digest: str
    issued_by: str
    reason: str
    violations: tuple[Violation, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": REFUSAL_SCHEMA,
            "time": encode_time(self.time),
            "generation": self.generation,
            "parent_generation": self.parent_generation,
            "certificate_digest": self.certificate_digest,
            "issued_by": self.issued_by,
            "reason": self.reason,
            "violations": [v.to_dict() for v in self.violations],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Refusal:
        return cls(
            float(d.get("time", "0")),
            int(d.get("generation", -1)),
            d.get("parent_generation"),
            str(d.get("certificate_digest", "")),
            str(d.get("issued_by", "")),
            str(d.get("reason", "")),
            tuple(Violation.from_dict(v) for v in d.get("violations", [])),
        )


def decode_certificate(raw: bytes, load: ChunkLoader | None = None, where: str = "") -> Certificate:
    """Bytes of a stored certificate -> Certificate; ValueError says why they are not one.

    A `/2` certificate reads its member table and body through `load` when they are first used
    (`Ledger.decode` passes the ledger's chunk store); without it, using them is a DataError."""
    return Certificate.from_dict(parse_canonical(raw.rstrip(b"\n")), load=load, where=where)


def encode_certificate(cert: Certificate) -> bytes:
    return cert.canonical() + b"\n"


def parse_lines(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """Complete JSON lines of an append-only log; a torn last line is ignored, garbled ones counted."""
    records: list[dict[str, Any]] = []
    bad = 0
    lines = data.split(b"\n")
    for line in lines[:-1]:  # the part after the last newline is an unfinished append
        if not line:
            continue
        try:
            records.append(parse_canonical(line))
        except ValueError:
            bad += 1
    return records, bad


class Ledger(ABC):
    """The generation ledger of one job (see the module docstring)."""

    url: str

    def __init__(self, key: bytes | None) -> None:
        self.key = key
        self._chain: list[Certificate] = []  # verified prefix of the chain, generation i at index i

    # -- backend primitives ---------------------------------------------------------------
    @abstractmethod
    def _read(self, generation: int) -> bytes | None:
        """The stored bytes of generation N, or None if it does not exist."""

    @abstractmethod
    def _create(self, generation: int, data: bytes, refusal: dict[str, Any] | None = None) -> bool:
        """Create generation N exclusively (and only while N-1 is the active one); False if lost,
        and then `refusal` is appended to the `refusals` log."""

    @abstractmethod
    def _generations(self) -> list[int]:
        """Every generation number that has a stored record (valid or not)."""

    @abstractmethod
    def _append(self, log: str, record: dict[str, Any]) -> None:
        """Append one record to an append-only log (`commits-<G>`, `fenced`, `refusals`)."""

    @abstractmethod
    def _read_log(self, log: str) -> bytes:
        """All bytes of a log (b'' when it does not exist)."""

    @abstractmethod
    def _read_frontier(self, generation: int) -> tuple[bytes | None, Any]:
        """The stored frontier record of a generation (None: none yet) and a compare-and-swap token."""

    @abstractmethod
    def _write_frontier(self, generation: int, data: bytes, token: Any) -> bool:
        """Replace the frontier record only while `generation` is active and the record is still the
        one `token` names; False otherwise (one transaction, or under a lock)."""

    @abstractmethod
    def _read_chunk(self, sha256: str) -> bytes | None:
        """The stored chunk named `sha256` (unchecked: `chunks.fetch` checks it), None if absent."""

    @abstractmethod
    def _write_chunks(self, chunks: Sequence[Blob]) -> None:
        """Store chunks (each under its digest) durably, before the certificate naming them is created."""

    @abstractmethod
    def _chunk_stamps(self) -> dict[str, int]:
        """Every stored chunk -> when it was last written (etcd: mod revision; directory: mtime, ns)."""

    @abstractmethod
    def _gen_stamp(self, generation: int) -> int | None:
        """When generation N's certificate was created, on the chunks' scale (None: not stored)."""

    @abstractmethod
    def _delete_chunk(self, sha256: str, stamp: int) -> bool:
        """Delete a chunk only while it was last written at `stamp`; True if deleted."""

    def _append_if_active(self, generation: int, log: str, record: dict[str, Any]) -> bool:
        """Append while `generation` is active. Backends with transactions close the check-then-write
        window; the directory backend checks just before its single append (a commit that slips in
        after the next certificate was issued cannot move that certificate's frontier)."""
        self._append(log, record)
        return True

    def close(self) -> None:  # noqa: B027 - a backend without connections has nothing to close
        return None

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the chain ------------------------------------------------------------------------
    def record_name(self, generation: int) -> str:
        return f"{self.url} generation {generation}"

    def decode(self, raw: bytes, generation: int) -> Certificate:
        """Stored bytes of `generation` -> its certificate, whose parts load from this ledger's chunks."""
        return decode_certificate(raw, self._read_chunk, self.record_name(generation))

    def _valid_next(self, raw: bytes, parent: Certificate | None) -> Certificate | None:
        expected = 0 if parent is None else parent.generation + 1
        try:
            cert = self.decode(raw, expected)
        except ValueError:
            return None
        if cert.generation != expected or rules.chain_continuity(cert, parent):
            return None
        if self.key is not None and rules.signature(cert, self.key):
            return None
        return cert

    def _read_from(self, generation: int) -> Iterator[bytes]:
        """Stored records generation, generation+1, ... until the first missing one.

        Backends may override this to fetch them in one request (etcd: one range read).
        """
        while (raw := self._read(generation)) is not None:
            yield raw
            generation += 1

    def active(self) -> Certificate | None:
        """The active certificate (None: the ledger has no valid genesis)."""
        for raw in self._read_from(len(self._chain)):
            cert = self._valid_next(raw, self._chain[-1] if self._chain else None)
            if cert is None:
                break
            self._chain.append(cert)
        return self._chain[-1] if self._chain else None

    def require_active(self) -> Certificate:
        cert = self.active()
        if cert is None:
            raise NoInputError(f"{self.url}: no valid genesis certificate (run `gpu-generation init`)")
        return cert

    def history(self) -> list[Certificate]:
        """The verified chain, generation 0 first, ending at the active generation."""
        self.active()
        return list(self._chain)

    def get(self, generation: int) -> Certificate:
        """Certificate N as stored (parsed, not judged: use `verify` for that)."""
        self.active()
        if 0 <= generation < len(self._chain):
            return self._chain[generation]
        raw = self._read(generation)
        if raw is None:
            raise NoInputError(f"{self.url}: no generation {generation}")
        try:
            return self.decode(raw, generation)
        except ValueError as exc:
            raise DataError(f"{self.url}: generation {generation}: {exc}") from None

    def raw(self, generation: int) -> bytes | None:
        return self._read(generation)

    def generations(self) -> list[int]:
        return sorted(self._generations())

    # -- activation -----------------------------------------------------------------------
    def initialize(self, cert: Certificate) -> None:
        """Store the genesis certificate (generation 0)."""
        if cert.generation != 0:
            raise ValueError("initialize() takes the genesis certificate")
        self.activate(cert)

    def activate(self, cert: Certificate, *, manifest_ok: bool | None = None) -> None:
        """Compare-and-swap: activate `cert` only if its parent is still the active generation.

        Every rule is checked first; a refusal is recorded (see `refusals()`) and raised as
        RefusedError naming the rule and the member.
        """
        if self.key is None:
            raise NoInputError("activation needs the job's signing key")
        parent = self.active()
        violations: list[Violation] = []
        active_gen = None if parent is None else parent.generation
        if cert.parent_generation != active_gen:
            violations.append(
                Violation(
                    "compare-and-swap",
                    f"the active generation is {active_gen if active_gen is not None else '(none)'}, "
                    f"the certificate's parent is {cert.parent_generation}",
                )
            )
        else:
            committed = None if parent is None else self._committed_by_all(parent)
            violations += check(cert, parent=parent, key=self.key, committed_by_all=committed, manifest_ok=manifest_ok)
        if not violations:
            lost = [
                Violation("compare-and-swap", f"generation {cert.generation} was activated by another issuer first")
            ]
            self._store_chunks(cert, parent)
            # the refusal a lost race records travels with the attempt (etcd: the txn's failure branch)
            if not self._create(cert.generation, encode_certificate(cert), self._refusal(cert, lost).to_dict()):
                self._refuse(cert, lost, recorded=True)
        if violations:
            self._refuse(cert, violations)
        self.active()

    def _store_chunks(self, cert: Certificate, parent: Certificate | None) -> None:
        """Every chunk `cert` names and its parent does not (those are stored already): content
        addressing shares what two generations have in common."""
        have = set(parent.chunk_refs()) if parent is not None else set()
        todo = {b.sha256: b for b in cert.chunks() if b.sha256 not in have}
        if todo:
            self._write_chunks(list(todo.values()))

    @staticmethod
    def _refusal(cert: Certificate, violations: list[Violation]) -> Refusal:
        return Refusal(
            time.time(),
            cert.generation,
            cert.parent_generation,
            cert.digest(),
            cert.issued_by,
            cert.reason,
            tuple(violations),
        )

    def _refuse(self, cert: Certificate, violations: list[Violation], *, recorded: bool = False) -> None:
        if not recorded:
            try:
                self._append("refusals", self._refusal(cert, violations).to_dict())
            except Exception:  # noqa: BLE001 - the refusal itself must still reach the caller
                pass
        first = violations[0]
        who = f" (rank {first.member})" if first.member is not None else ""
        more = f" (+{len(violations) - 1} more)" if len(violations) > 1 else ""
        raise RefusedError(
            f"activation of generation {cert.generation} refused by rule {first.rule}{who}: {first.message}{more}"
        )

    def refusals(self) -> list[Refusal]:
        records, _ = parse_lines(self._read_log("refusals"))
        return [Refusal.from_dict(r) for r in records if r.get("schema") == REFUSAL_SCHEMA]

    # -- chunks no certificate names --------------------------------------------------------
    def unreferenced_chunks(self) -> dict[str, int]:
        """Chunks that no stored certificate names, written before the active generation's
        certificate (digest -> stamp): left by an activation that lost its race or failed
        between its chunks and its transaction. A chunk written after the active certificate may
        belong to an activation under way (the activator stores, or re-writes, every chunk its
        parent does not name *after* it read that parent), so it is kept."""
        active = self.active()
        cut = None if active is None else self._gen_stamp(active.generation)
        if cut is None:
            return {}
        named: set[str] = set()
        for n in self.generations():
            raw = self._read(n)
            try:
                named.update(self.decode(raw, n).chunk_refs() if raw is not None else ())
            except ValueError:
                continue  # an unreadable certificate: nothing of it can be used or verified
        return {sha: stamp for sha, stamp in self._chunk_stamps().items() if sha not in named and stamp < cut}

    def prune_chunks(self, *, dry_run: bool = False) -> list[str]:
        """Delete `unreferenced_chunks()` (each only if not re-written since it was listed)."""
        found = self.unreferenced_chunks()
        if dry_run:
            return sorted(found)
        return sorted(sha for sha, stamp in found.items() if self._delete_chunk(sha, stamp))

    # -- commits and fencing --------------------------------------------------------------
    def record_commit(self, generation: int, step: int, rank: int, incarnation_id: str) -> bool:
        """Record that `rank` committed `step` in `generation`; False if fenced (stale), counted.

        Stale = stamped with a generation older than the active one, or from an incarnation
        that is not the active member on that rank (a zombie of a replaced process).
        """
        rec = CommitRecord(generation, step, rank, incarnation_id, time.time())
        active = self.require_active()
        if generation > active.generation:
            raise RefusedError(f"commit for generation {generation}, but the active generation is {active.generation}")
        if generation < active.generation or active.ranks.get(rank) is None or active.ranks[rank].id != incarnation_id:
            self._append("fenced", {**rec.to_dict(), "active": active.generation})
            return False
        if self._append_if_active(generation, f"commits-{generation}", rec.to_dict()):
            return True
        self._append("fenced", {**rec.to_dict(), "active": generation + 1})
        return False

    def commits(self, generation: int) -> tuple[list[CommitRecord], int]:
        """The commit records of a generation and the number of garbled lines."""
        records, bad = parse_lines(self._read_log(f"commits-{generation}"))
        out = []
        for r in records:
            try:
                out.append(CommitRecord.from_dict(r))
            except ValueError:
                bad += 1
        return out, bad

    def last_committed_by_all(self, generation: int) -> int | None:
        """The newest step every member of `generation` committed (None: some member committed none)."""
        return self._committed_by_all(self.get(generation))

    def _committed_by_all(self, cert: Certificate) -> int | None:
        """The frontier record's step, or what the per-rank commit records (the transitions harness and
        jobs of older runtimes write them) prove, whichever is newer: each is a proof on its own."""
        if not cert.members:
            return None
        rec = self.frontier_record(cert.generation)
        logged = self._committed_by_logs(cert)
        proved = [s for s in (rec.step if rec is not None else None, logged) if s is not None]
        return max(proved) if proved else None

    def _committed_by_logs(self, cert: Certificate) -> int | None:
        generation = cert.generation
        newest: dict[int, int] = {}
        members = cert.ranks
        for c in self.commits(generation)[0]:
            inc = members.get(c.rank)
            if c.generation == generation and inc is not None and inc.id == c.incarnation_id:
                newest[c.rank] = max(newest.get(c.rank, -1), c.step)
        if set(newest) != set(members):
            return None
        return min(newest.values())

    # -- the frontier record: one per generation, not one per rank-step ----------------------
    def record_frontier(self, generation: int, step: int, incarnation_id: str, evidence: str) -> bool:
        """Raise the frontier record of `generation` to `step` (never lowers it); False when fenced:
        `generation` is not the active one, or `incarnation_id` is none of its members."""
        rec = FrontierRecord(generation, step, incarnation_id, evidence, time.time())
        active = self.require_active()
        if generation != active.generation or all(m.incarnation.id != incarnation_id for m in active.members):
            self._append("fenced", {**rec.to_dict(), "active": active.generation})
            return False
        for _ in range(FRONTIER_TRIES):
            current, token = self._frontier(generation)
            if current is not None and current.step >= step:
                return True
            if self._write_frontier(generation, dumps_record(rec.to_dict()), token):
                return True
            if self.require_active().generation != generation:
                self._append("fenced", {**rec.to_dict(), "active": generation + 1})
                return False
        raise RefusedError(f"frontier of generation {generation}: {FRONTIER_TRIES} writers raced; not raised")

    def frontier_record(self, generation: int) -> FrontierRecord | None:
        """The frontier record of a generation (None: none, or not a valid record)."""
        return self._frontier(generation)[0]

    def _frontier(self, generation: int) -> tuple[FrontierRecord | None, Any]:
        raw, token = self._read_frontier(generation)
        if raw is None:
            return None, token
        try:
            rec = FrontierRecord.from_dict(parse_canonical(raw.rstrip(b"\n")))
        except ValueError:
            return None, token  # unreadable: as if absent (the next write replaces it)
        return (rec if rec.generation == generation else None), token

    def fenced_count(self) -> int:
        return len(parse_lines(self._read_log("fenced"))[0])

    def lease_time_left(self, incarnation_ids: Sequence[str]) -> dict[str, int] | None:
        """Seconds each incarnation's lease key (`P/lease/<id>`, docs/formats/leases.md) has left, for
        the ids that still have one; None where the ledger holds no leases (a directory ledger: one
        host, where the process table is the proof). What `gpu-recover status` says of an incarnation
        certified quiet by fencing: a key still there means it may still be running."""
        return None


def new_temp_name() -> str:
    return f".tmp-{uuid.uuid4().hex}"


def dumps_record(record: dict[str, Any]) -> bytes:
    return canonical_bytes(record) + b"\n"
