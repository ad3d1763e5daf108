"""Property tests for the log parsers: garbage never raises and never invents events; noise, CRLF,
truncation and chunking never change what a valid line says; the fast scanner equals the line parser."""

from __future__ import annotations

import io

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.collectors.logparse import MARKERS, has_marker, iter_events, parse_line  # noqa: E402
from gpuguard.collectors.logscan import LogScan  # noqa: E402
from gpuguard.collectors.logtime import line_time  # noqa: E402
from tests.support.cli import REAL_LOGS

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Real lines that each hold one event (taken from the fixtures) - the valid material for the properties.
REAL_LINES: list[str] = []
for _path in sorted(REAL_LOGS.glob("*.log")):
    for _line in _path.read_text("utf-8", "replace").splitlines():
        if parse_line(_line, 1) is not None:
            REAL_LINES.append(_line)
ALL_REAL_BYTES = b"".join(p.read_bytes() for p in sorted(REAL_LOGS.glob("*.log")))

IDENTITY = (
    "xid",
    "sxid",
    "pci_bus_id",
    "seq",
    "op",
    "exitcode",
    "local_rank",
    "timeout_ms",
    "elapsed_ms",
    "ib_status",
    "recovery_action_to",
    "caused_by",
)
noise_text = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n[]\x85\u2028\u2029"), max_size=200
).filter(lambda s: not has_marker(s))


def scan(data: bytes, chunk: int, accelerated: bool = True) -> list[dict]:
    return [e.to_json() for e in LogScan(io.BytesIO(data), chunk_size=chunk, accelerated=accelerated)]


def lines_of(data: bytes) -> list[dict]:
    return [e.to_json() for e in iter_events(io.BytesIO(data))]


@given(st.binary(max_size=4096), st.integers(min_value=1, max_value=512))
@SETTINGS
def test_random_bytes_never_raise_and_events_only_on_marker_lines(data, chunk):
    events = scan(data, chunk)
    assert events == lines_of(data)
    lines = data.split(b"\n")
    for ev in events:
        raw = lines[ev["line"] - 1].decode("utf-8", "replace")
        assert has_marker(raw)
    if not any(m.encode() in data for m in MARKERS):
        assert events == []


@given(st.lists(noise_text, max_size=30))
@SETTINGS
def test_text_without_markers_gives_no_events(lines):
    assert list(iter_events(lines)) == []
    assert all(parse_line(line, 1) is None for line in lines)


@given(st.sampled_from(REAL_LINES), noise_text, noise_text)
@SETTINGS
def test_noise_around_a_valid_line_keeps_its_meaning(line, prefix, suffix):
    clean = parse_line(line, 7)
    noisy = parse_line(f"{prefix} {line} {suffix}" if suffix else f"{prefix} {line}", 7)
    assert clean is not None and noisy is not None
    assert noisy.kind == clean.kind
    for key in IDENTITY:
        if key in clean.fields and key not in ("caused_by",):
            assert noisy.fields.get(key) == clean.fields[key], (key, line, prefix, suffix)


@given(st.sampled_from(REAL_LINES), st.data())
@SETTINGS
def test_truncation_never_yields_a_wrong_code(line, data):
    full = parse_line(line, 1)
    assert full is not None
    cut = data.draw(st.integers(min_value=0, max_value=len(line)))
    part = parse_line(line[:cut], 1)
    if part is None:
        return
    for key in IDENTITY:
        if part.fields.get(key) is not None and key in full.fields:
            assert part.fields[key] == full.fields[key], (key, line[:cut])


@given(st.lists(st.sampled_from(REAL_LINES) | noise_text, max_size=40))
@SETTINGS
def test_crlf_endings_change_nothing(lines):
    lf = "\n".join(lines).encode()
    crlf = "\r\n".join(lines).encode()
    assert lines_of(crlf) == lines_of(lf)
    assert scan(crlf, 64) == scan(lf, 64)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(REAL_LINES) | noise_text | st.binary(max_size=80).map(lambda b: b.decode("latin-1")),
            st.sampled_from(["\n", "\n", "\r", "\r\n"]),
        ),
        max_size=60,
    ),
    st.integers(min_value=1, max_value=4096),
    st.booleans(),
    st.booleans(),
)
@SETTINGS
def test_fast_scanner_equals_line_parser(parts, chunk, accelerated, trailing_newline):
    data = "".join(p + sep for p, sep in parts).encode("utf-8", "surrogatepass")
    if not trailing_newline and data.endswith(b"\n"):
        data = data[:-1]
    assert scan(data, chunk, accelerated) == lines_of(data)


def test_progress_bar_records_split_at_carriage_returns():
    """tqdm rewrites one line with \r for hours; the watchdog error lands in the middle of it."""
    bar = "".join(
        f"Epoch 0: {i % 100:3d}%|#####     | {i}/500150 [6:28:43<94:39:17,  1.37it/s]\r" for i in range(40000)
    )
    error = (
        "[E ProcessGroupNCCL.cpp:458] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=96120, "
        "OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 25624887 milliseconds before timing out."
    )
    data = ("first line\n" + bar + error + "\r" + bar + "\n" + error + "\n").encode()
    assert len(data) > 4 << 20  # one line, several chunks long
    for chunk in (1 << 18, 1 << 20):
        events = scan(data, chunk)
        assert [(e["line"], e["kind"], e["seq"]) for e in events] == [
            (2, "watchdog_timeout", 96120),
            (3, "watchdog_timeout", 96120),
        ]
    assert lines_of(data) == events


@given(st.integers(min_value=0, max_value=len(ALL_REAL_BYTES)), st.integers(min_value=1, max_value=1 << 16))
@settings(max_examples=25, deadline=None)
def test_real_logs_concatenated_and_cut_anywhere(cut, chunk):
    data = ALL_REAL_BYTES[:cut]
    assert scan(data, chunk) == lines_of(data)


def test_megabyte_lines_and_invalid_utf8():
    xid = b"[ 12.5] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    junk = bytes(range(128, 256)) * 4096  # 512 KiB of invalid UTF-8
    data = b"A" * (1 << 20) + b"\n" + junk + xid + junk + b"\n" + b"\xff\xfe" * 70000 + b"\n" + xid + b"\r\n"
    for chunk in (4096, 1 << 16, 1 << 23):
        events = scan(data, chunk)
        assert [(e["line"], e["kind"], e["xid"], e["pci_bus_id"]) for e in events] == [
            (2, "xid", 79, "0000:3b:00.0"),
            (4, "xid", 79, "0000:3b:00.0"),
        ]
        assert events == lines_of(data)
    one = parse_line(b"x" * (1 << 20) + xid, 1)
    assert one is not None and one.fields["xid"] == 79


def test_lines_beyond_the_cap_are_cut_the_same_way_on_both_paths():
    xid = b"NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=python, DBE"
    data = b"x" * (9 << 20) + xid + b"\nNVRM: Xid (PCI:0000:3b:00): 13, pid=2, name=python, SM\n"
    assert [e["xid"] for e in scan(data, 1 << 20)] == [13] == [e["xid"] for e in lines_of(data)]


@given(st.text(max_size=300))
@SETTINGS
def test_line_time_never_raises(text):
    ts, up = line_time(text)
    assert ts is None or isinstance(ts, float)
    assert up is None or up >= 0


@pytest.mark.parametrize("accelerated", [True, False])
@pytest.mark.parametrize("chunk", [100, 348, 4096])
def test_every_carriage_return_record_of_a_line_is_scanned(chunk, accelerated):
    """Found by the property above: the plain finder jumped to the next `\\n` after a hit, so a second
    marker in a `\\r`-separated record of the same line was never looked at."""
    line = next(x for x in REAL_LINES if "NVRM: Xid" in x)
    data = f"{line}\r{line}\n{line}".encode()
    assert [e["line"] for e in scan(data, chunk, accelerated)] == [1, 1, 2] == [e["line"] for e in lines_of(data)]
