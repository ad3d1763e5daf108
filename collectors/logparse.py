"""One streaming parser for every log gpuguard reads: kernel Xid/SXid, NCCL, watchdog, gloo, torchrun, CUDA.

Why one parser: an on-call engineer pastes whatever they have (dmesg, journal, a rank's stderr, the
torchrun summary) and the node verdict and the job vote read the same records, so every line goes
through the same ordered rule list and yields at most one `Event`.

- `parse_line(text, line_no)`: one line, no context (multi-line messages give what the line holds).
- `iter_events(lines)`: a stream of lines (str or bytes) with the small state multi-line messages need
  (fallen-off-bus over three lines, torchrun failure records, rendezvous results).
- `iter_file_events(path_or_file)` (in `logscan`): the fast path for big files.

Event kinds and their fields (`gpuguard.events/1`; every event also has kind, line, severity
[info | warning | critical: critical = the GPU/node needs reset, drain or RMA], diagnosis, text, source,
timestamp when absolute, uptime_s for dmesg's monotonic clock; a field is null when not printed):

| kind | fields |
| --- | --- |
| xid | xid, pci_bus_id (dddd:bb:dd.f), pid, process, name, message, channel; 13: gpc/tpc/sm; 45: caused_by; 63: remap_pending; 144-150: nvlink_unit, nvlink_fatal, link, intr_info, error_status, subcode_v1/v2; 154: recovery_action_from/_to, recovery_action; device-plugin form: gpu_uuid |
| sxid | sxid, pci_bus_id, fatal, message |
| xid (unreadable code) | xid = null, xid_raw (the token: 7+ digits, hex, a sign, non-ASCII digits), pci_bus_id, pid, process, message |
| gpu_fault | fault (`gpu_faults.FAULTS`: init_failed, unreachable, pcie_fatal / pcie_nonfatal / pcie_corrected, fabric_manager, gsp_timeout, memsys_error), pci_bus_id; init: init_code, minor; AER: device (gpu / port), error_source, recovery_failed; GSP: gpu_index, function, message |
| gpu_lost | pci_bus_id, source_form (kernel / nvidia-smi) |
| gpu_reset_required, gpu_identity, hung_task | gpu_index, message / pci_bus_id, uuid, serial / task, pid, blocked_s |
| nccl_warn | host, pid, rank, device, location, message; IB: ib_status, ib_status_name, vendor_err, peer |
| nccl_error | error, nccl_result (ncclResult_t number), result (name), location, nccl_version, rank |
| watchdog_timeout | seq, op, timeout_ms, elapsed_ms, rank, numel_in, numel_out, pg, pg_name, blocking_wait |
| watchdog_failure | seq, last_enqueued, last_completed, rank, pg |
| watchdog_hang, watchdog_abort | rank, pg, reason, stuck_s, queued_work |
| gloo_error | error, rank, op, timeout_ms, peer |
| worker_failure | local_rank, exitcode, signal, pid, binary; summary records: rank, host, root_cause |
| worker_stop, worker_restart, worker_group_failed | pid, signal / attempts_left, max_restarts |
| rendezvous, rendezvous_error | phase, round, restart_count, master_addr, master_port, group_rank, group_world_size / error, endpoint, errno |
| cuda_error | error, cuda_code, rank, via_watchdog, fault (a hardware cause: ecc_uncorrectable, nvlink_uncorrectable, fabric_not_initialized, gpu_lost, unknown_error) |
| cuda_assert | file, source_line, kernel, block, thread, condition, rank |
| nic_error | device, function, pid, mlx5_status, errno, message |
| driver_error, host_hw_error, pcie_degraded, config_error | error / hw_severity / pci_bus_id, available, capable, limited_at / error |

NCCL / watchdog / gloo events whose message names a hardware cause get the same `fault` field.

A line is a candidate only if it holds one of `MARKERS`; state only ever looks at candidate lines, so
the fast scanner (which never decodes other lines) and `iter_events` yield identical events. Lines
are split into records at carriage returns (progress bars), and records longer than `MAX_LINE`
characters are cut (a log line is never that long; a binary blob might be). Bytes are decoded as UTF-8
with replacement characters. Events carry the line number of their line (`\n`-counted).

Lazy imports (start-up time): ahocorasick_rs, only for the marker scan of big inputs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from gpuguard.collectors.logrule import ABSORBED, Found, ParseState, Rule, hw_fault, lazy_re
from gpuguard.collectors.logrules_comm import RULES as _COMM
from gpuguard.collectors.logrules_kernel import RULES as _KERNEL
from gpuguard.collectors.logrules_runtime import CUDA_RULES as _CUDA
from gpuguard.collectors.logrules_runtime import HOST_RULES as _HOST
from gpuguard.collectors.logrules_runtime import RULES as _RUNTIME
from gpuguard.collectors.logtime import line_time
from gpuguard.foundation import gpu_faults
from gpuguard.foundation import xid_catalog as catalog
from gpuguard.foundation.events import EVENTS_SCHEMA, Event

__all__ = [
    "EVENTS_SCHEMA",
    "MARKERS",
    "MAX_LINE",
    "LogParser",
    "RULES",
    "has_marker",
    "iter_events",
    "parse_line",
    "records",
]

# Order is priority: the first rule that recognises a line wins. Watchdog timeouts before NCCL
# errors (the timeout line names the op), NCCL WARN before CUDA (`NCCL WARN Cuda failure`), CUDA
# before the watchdog-abort wrapper (`watchdog thread terminated with exception: CUDA error: ...`).
RULES: tuple[Rule, ...] = (
    *_KERNEL,
    _COMM[0],  # WorkNCCL(...) watchdog timeout
    _COMM[1],  # NCCL WARN
    _COMM[2],  # NCCL error / ncclXxxError
    *_CUDA,
    *_COMM[3:],  # watchdog status, hang, abort; gloo
    *_RUNTIME,
    *_HOST,
)
MARKERS: tuple[str, ...] = tuple(dict.fromkeys(m for rule in RULES for m in rule.markers))
_MARKER_RE = lazy_re("|".join(re.escape(m) for m in sorted(MARKERS, key=len, reverse=True)))  # the fallback only
MAX_LINE = 2 << 20  # characters parsed per line
MAX_TEXT = 2000  # characters of the line kept in the event
_PENDING_SPAN = 12  # lines a rendezvous result block may span
# Application-side kinds whose message may name a hardware cause (`fault` field, gpu_faults.FAULTS).
_HW_KINDS = frozenset(("nccl_warn", "nccl_error", "watchdog_abort", "watchdog_failure", "watchdog_hang", "gloo_error"))


def _marker_test():
    """`text -> bool`: does the text hold a marker? Aho-Corasick when available (~20x faster on lines
    without one than the alternation regex, which tries every marker at every position)."""
    try:
        import ahocorasick_rs
    except ImportError:  # pragma: no cover - depends on the environment
        return lambda text: _MARKER_RE.search(text) is not None
    ac = ahocorasick_rs.AhoCorasick(list(MARKERS), matchkind=ahocorasick_rs.MATCHKIND_LEFTMOST_FIRST)
    return lambda text: bool(ac.find_matches_as_indexes(text))


has_marker = _marker_test()
has_marker.__doc__ = "Does the text hold one of `MARKERS` (only then can it be an event)?"


def _rules_test():
    """`text -> rules`: the rules one of whose markers the text holds, in priority order (the same as
    testing `any(m in text for m in rule.markers)` for every rule, in one Aho-Corasick pass)."""
    try:
        import ahocorasick_rs
    except ImportError:  # pragma: no cover - depends on the environment
        return lambda text: tuple(r for r in RULES if any(m in text for m in r.markers))
    ac = ahocorasick_rs.AhoCorasick(list(MARKERS))  # standard match kind: overlapping = every marker present
    by_marker = [frozenset(i for i, rule in enumerate(RULES) if m in rule.markers) for m in MARKERS]
    cache: dict[frozenset[int], tuple[Rule, ...]] = {}

    def rules_of(text: str) -> tuple[Rule, ...]:
        hits = ac.find_matches_as_indexes(text, overlapping=True)
        if not hits:
            return ()
        key = frozenset(h[0] for h in hits)
        rules = cache.get(key)
        if rules is None:
            rules = tuple(RULES[i] for i in sorted(frozenset().union(*(by_marker[m] for m in key))))
            if len(cache) < 4096:
                cache[key] = rules
        return rules

    return rules_of


_rules_of = _rules_test()


def records(line: str | bytes | bytearray | memoryview) -> list[str]:
    """The records of one line: split on carriage returns (tqdm progress bars rewrite a line with `\r`
    many thousand times before the `\n`, and a watchdog error may sit in the middle), each cut to
    `MAX_LINE` characters. A CRLF ending leaves an empty last record."""
    return _records(line)[0]


def _records(line: str | bytes | bytearray | memoryview) -> tuple[list[str], list[bool] | None]:
    """(records, which are unreadable or None when none is): a record is unreadable when its bytes are
    not valid UTF-8 (decoded with replacement characters) or it is longer than `MAX_LINE` (cut)."""
    if isinstance(line, memoryview):
        line = bytes(line)
    if isinstance(line, (bytes, bytearray)):
        if line.endswith(b"\n"):
            line = line[:-1]
        raw = line.split(b"\r") if b"\r" in line else [line]
        parts, flags = [], []
        for piece in raw:
            try:
                text, bad = piece.decode("utf-8"), False
            except UnicodeDecodeError:
                text, bad = piece.decode("utf-8", errors="replace"), True
            parts.append(text[:MAX_LINE])
            flags.append(bad or len(text) > MAX_LINE)
        return parts, flags if any(flags) else None
    if line.endswith("\n"):
        line = line[:-1]
    if "\r" not in line:
        return [line[:MAX_LINE]], [True] if len(line) > MAX_LINE else None
    pieces = line.split("\r")
    cut = [len(piece) > MAX_LINE for piece in pieces]
    return [piece[:MAX_LINE] for piece in pieces], cut if any(cut) else None


class LogParser:
    """Feed candidate (or all) lines in order; get events. Call `close()` at the end of the stream."""

    def __init__(self, source: str | None = None, *, year: int | None = None) -> None:
        self.source = source
        self.state = ParseState(year=year)
        # Lines that hold a marker but could not be read as they were: not valid UTF-8 (bytes input;
        # decoded with replacement characters) or longer than MAX_LINE characters (cut). Their events,
        # if any, may be missing or incomplete: `gpu-doctor logs` says how many were skipped.
        self.unreadable = 0
        self._last_unreadable = -1

    def _event(self, found: Found, line_no: int, text: str) -> Event:
        timestamp, uptime = line_time(text, self.state.year)
        if found.timestamp is not None and timestamp is None:
            timestamp = found.timestamp
        fields = dict(found.fields)
        if uptime is not None:
            fields["uptime_s"] = uptime
        severity, diagnosis = found.severity, found.diagnosis
        if found.kind in _HW_KINDS and "fault" not in fields:
            fault = hw_fault(text)
            if fault is not None:  # e.g. NCCL "unhandled cuda error ... 'uncorrectable ECC error encountered'"
                info = gpu_faults.fault(fault)
                fields["fault"] = fault
                severity = catalog.event_severity(info.severity)
                diagnosis = f"{info.name}. {info.action} ({diagnosis})" if diagnosis else f"{info.name}. {info.action}"
        kept = text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "…"
        return Event(
            kind=found.kind,
            line=line_no,
            text=kept.strip(),
            fields=fields,
            timestamp=timestamp,
            source=self.source,
            severity=severity,
            diagnosis=diagnosis,
        )

    def _flush_pending(self) -> list[Event]:
        pending = self.state.pending
        if pending is None:
            return []
        self.state.pending = None
        line_no, text, found = pending
        return [self._event(found, line_no, text)]

    def feed(self, line: str | bytes | bytearray, line_no: int) -> list[Event]:
        """Events completed by this line (usually zero or one; a flushed multi-line event may precede)."""
        parts, bad = _records(line)
        if bad is not None:
            self.note_unreadable(parts, bad, line_no)
        if len(parts) == 1:
            return self._feed_record(parts[0], line_no)
        out: list[Event] = []
        for part in parts:
            out.extend(self._feed_record(part, line_no))
        return out

    def note_unreadable(self, parts: list[str], bad: list[bool], line_no: int) -> None:
        """Count line `line_no` as unreadable if one of its unreadable records holds a marker (once per line)."""
        if line_no != self._last_unreadable and any(b and has_marker(p) for p, b in zip(parts, bad)):
            self.unreadable += 1
            self._last_unreadable = line_no

    def _feed_record(self, text: str, line_no: int) -> list[Event]:
        rules = _rules_of(text)
        if not rules:
            return []
        out: list[Event] = []
        pending = self.state.pending
        if pending is not None and line_no - pending[0] > _PENDING_SPAN:
            out.extend(self._flush_pending())
        for rule in rules:
            found = rule.parse(text, line_no, self.state)
            if found is None:
                continue
            if found is ABSORBED:
                if pending is not None and self.state.pending is not pending and self.state.pending is not None:
                    line0, text0, found0 = pending  # a new multi-line event replaced an unfinished one
                    out.append(self._event(found0, line0, text0))
                return out
            out.extend(self._flush_pending())
            out.append(self._event(found, line_no, text))
            return out
        out.extend(self._flush_pending())
        return out

    def close(self) -> list[Event]:
        return self._flush_pending()


def parse_line(text: str | bytes, line_no: int, source: str | None = None) -> Event | None:
    """The event one line holds on its own (the first one if `\r` splits it into several), or None."""
    parser = LogParser(source)
    events = parser.feed(text, line_no) + parser.close()
    return events[0] if events else None


def iter_events(
    lines: Iterable[str | bytes], *, source: str | None = None, start_line: int = 1, year: int | None = None
) -> Iterator[Event]:
    """Events from a stream of lines, in line order; line numbers start at `start_line`."""
    parser = LogParser(source, year=year)
    for line_no, line in enumerate(lines, start=start_line):
        yield from parser.feed(line, line_no)
    yield from parser.close()
