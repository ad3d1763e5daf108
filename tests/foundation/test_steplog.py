"""StepLog writer and its reader: round trip, torn/interleaved/garbage files, clock jumps, rotation."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.collectors.step_records import read_job
from gpuguard.foundation.observations import BETWEEN, CLOSED, COLLECTIVE, COMPUTING, STARTING
from gpuguard.foundation.steplog import StepLog, safe_incarnation, segment_name
from gpuguard.foundation.steplog import decode_lines as parse_lines
from tests.support.cli import REAL_LOGS


def _one_step(log: StepLog, step: int, compute: float = 0.0, wait: float = 0.0, nbytes: int = 1024) -> None:
    log.begin_step(step)
    if compute:
        time.sleep(compute)
    log.enter_collective(step, "all_reduce", nbytes)
    if wait:
        time.sleep(wait)
    log.exit_collective(step)
    log.end_step(step)


def test_round_trip_compute_and_wait_are_separated(tmp_path: Path) -> None:
    log = StepLog(tmp_path, 3, "inc-1", generation=2)
    for s in range(3):
        _one_step(log, s, compute=0.02, wait=0.05)
    log.begin_step(3)
    log.enter_collective(3, "all_gather", 4096)
    job = read_job(tmp_path)
    assert list(job.ranks) == [3]
    r = job.ranks[3]
    assert (r.pid, r.generation, r.incarnation) == (os.getpid(), 2, "inc-1")
    assert [s.step for s in r.steps] == [0, 1, 2]
    for s in r.steps:
        assert 0.015 <= s.compute_s < s.compute_s + s.wait_s
        assert s.wait_s >= 0.045
        assert s.nbytes == 1024
    assert r.steps[1].interval_s is not None and r.steps[1].interval_s >= 0.06
    assert r.phase.kind == COLLECTIVE and r.phase.seq == 3 and r.phase.op == "all_gather"
    assert r.phase.nbytes == 4096 and r.phase.step == 3
    log.exit_collective(3)
    assert read_job(tmp_path).ranks[3].phase.kind == COMPUTING
    log.end_step(3)
    assert read_job(tmp_path).ranks[3].phase.kind == BETWEEN
    log.close()
    assert read_job(tmp_path).ranks[3].phase.kind == CLOSED


def test_no_directory_and_no_records_are_empty_not_errors(tmp_path: Path) -> None:
    assert read_job(tmp_path / "missing").ranks == {}
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "junk.txt").write_text("x")
    assert read_job(tmp_path).ranks == {}
    StepLog(tmp_path, 0, "a")  # header only: a rank that has not stepped yet
    r = read_job(tmp_path).ranks[0]
    assert r.phase.kind == STARTING and r.steps == () and r.last_wall > 0


def test_torn_last_record_is_ignored(tmp_path: Path) -> None:
    log = StepLog(tmp_path, 0, "a")
    _one_step(log, 0)
    path = tmp_path / "ranks" / segment_name(0, "a", 0)
    with open(path, "ab") as fh:
        fh.write(b"E 1 17000")  # the writer was interrupted mid-line
    r = read_job(tmp_path).ranks[0]
    assert [s.step for s in r.steps] == [0] and r.bad_lines == 0


def test_interleaved_and_garbage_lines_are_counted_not_fatal(tmp_path: Path) -> None:
    a = StepLog(tmp_path, 1, "same")
    b = StepLog(tmp_path, 1, "same")  # two writers on one file: interleaved records
    for s in range(5):
        _one_step(a, s)
        _one_step(b, s)
    path = tmp_path / "ranks" / segment_name(1, "same", 0)
    with open(path, "ab") as fh:
        fh.write(b"S x y z\n\x00\xff\xfe garbage\nE 1 2 3\nH {not json\nH [1]\nE 9 1 2 -1 0 0\n")
    r = read_job(tmp_path).ranks[1]
    assert r.bad_lines == 6
    assert len(r.steps) == 10


def test_clock_jump_counts_but_durations_use_the_monotonic_clock(tmp_path: Path) -> None:
    d = tmp_path / "ranks"
    d.mkdir()
    lines = [
        'H {"v":1,"rank":0,"incarnation":"a","generation":0,"pid":1,"host":"h","wall":1000.0,"mono":10.0}',
        "S 0 1000.0 10.0",
        "C 0 0 1000.5 10.5 8 all_reduce",
        "X 0 1000.6 10.6 0.1",
        "E 0 1000.7 10.7 0.6 0.1 8",
        # the wall clock jumps back one hour; monotonic time goes on
        "S 1 -2599.3 10.7",
        "C 1 1 -2598.8 11.2 8 all_reduce",
        "X 1 -2598.7 11.3 0.1",
        "E 1 -2598.6 11.4 0.6 0.1 8",
    ]
    (d / segment_name(0, "a", 0)).write_text("\n".join(lines) + "\n")
    r = read_job(tmp_path).ranks[0]
    assert r.clock_jumps == 1
    assert abs(r.steps[1].interval_s - 0.7) < 1e-9


def test_newest_incarnation_wins(tmp_path: Path) -> None:
    old = StepLog(tmp_path, 2, "old", generation=0)
    _one_step(old, 0)
    new = StepLog(tmp_path, 2, "new", generation=1)
    _one_step(new, 7)
    r = read_job(tmp_path).ranks[2]
    assert r.incarnation == "new" and r.incarnations_seen == 2 and r.steps[0].step == 7


def test_rotation_bounds_the_size(tmp_path: Path) -> None:
    log = StepLog(tmp_path, 0, "a", max_bytes=4096, keep=2)
    for s in range(2000):
        _one_step(log, s)
    files = sorted((tmp_path / "ranks").iterdir())
    assert len(files) == 2
    assert sum(f.stat().st_size for f in files) <= 2 * (4096 + 200)
    r = read_job(tmp_path).ranks[0]
    assert r.steps[-1].step == 1999 and r.pid == os.getpid()


def test_concurrent_reader_never_fails(tmp_path: Path) -> None:
    log = StepLog(tmp_path, 0, "a", max_bytes=8192, keep=2)
    stop = threading.Event()

    def write() -> None:
        s = 0
        while not stop.is_set():
            _one_step(log, s)
            s += 1

    t = threading.Thread(target=write)
    t.start()
    try:
        seen = 0
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            job = read_job(tmp_path)
            if 0 in job.ranks:
                assert job.ranks[0].bad_lines == 0
                seen += 1
        assert seen > 0
    finally:
        stop.set()
        t.join()


def test_incarnation_names_are_file_safe() -> None:
    assert safe_incarnation("a.b/c d") == "a-b-c-d"
    assert "/" not in segment_name(1, "../../etc", 0)


_line = st.one_of(
    st.text(max_size=60),
    st.builds(
        lambda k, a, b: f"{k} {a} {b}",
        st.sampled_from("SCXEBFZHQ"),
        st.integers(-5, 10**6),
        st.floats(allow_nan=True, allow_infinity=True),
    ),
    st.builds(
        lambda s, w, m, c, x, n: f"E {s} {w} {m} {c} {x} {n}",
        st.integers(0, 10**9),
        st.floats(0, 2e9),
        st.floats(0, 1e7),
        st.floats(-1, 100),
        st.floats(-1, 100),
        st.integers(0, 2**40),
    ),
)


@given(st.lists(_line, max_size=40))
@settings(max_examples=200, deadline=None)
def test_parser_never_raises_on_any_lines(lines: list[str]) -> None:
    r = parse_lines(lines, rank=0, incarnation="x")
    assert r.bad_lines <= len(lines)
    for s in r.steps:
        assert s.compute_s >= 0 and s.wait_s >= 0


@given(st.binary(max_size=400), st.integers(0, 400))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_reader_survives_arbitrary_bytes_and_truncation(tmp_path: Path, junk: bytes, cut: int) -> None:
    d = tmp_path / "h"
    if d.exists():
        for f in (d / "ranks").iterdir():
            f.unlink()
    log = StepLog(d, 5, "z")
    for s in range(3):
        _one_step(log, s)
    log.close()
    path = d / "ranks" / segment_name(5, "z", 0)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - min(cut, len(data))] + junk)
    job = read_job(d)
    assert set(job.ranks) <= {5}


@given(st.lists(st.tuples(st.floats(0, 0.5), st.floats(0, 0.5), st.integers(0, 2**31)), min_size=1, max_size=30))
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_records_round_trip_the_numbers(tmp_path: Path, steps: list[tuple[float, float, int]]) -> None:
    """What the parser returns for a well-formed stream is exactly what was written (µs resolution)."""
    hdr = 'H {"v":1,"rank":4,"incarnation":"p","generation":3,"pid":42,"host":"n1","wall":100.0,"mono":5.0}'
    lines, t = [hdr], 5.0
    for i, (comp, wait, nb) in enumerate(steps):
        lines.append(f"S {i} {t + 95:.6f} {t:.6f}")
        lines.append(f"C {i} {i} {t + 95 + comp:.6f} {t + comp:.6f} {nb} all_reduce")
        lines.append(f"X {i} {t + 95 + comp + wait:.6f} {t + comp + wait:.6f} {wait:.6f}")
        t += comp + wait
        lines.append(f"E {i} {t + 95:.6f} {t:.6f} {comp:.6f} {wait:.6f} {nb}")
    r = parse_lines(lines, rank=4, incarnation="p")
    assert r.bad_lines == 0 and r.clock_jumps == 0 and (r.pid, r.host, r.generation) == (42, "n1", 3)
    assert [(round(s.compute_s, 6), round(s.wait_s, 6), s.nbytes) for s in r.steps] == [
        (round(c, 6), round(w, 6), n) for c, w, n in steps
    ]


# -- the training-log collector (jobs without the writer) ------------------------------------------
def test_step_times_from_an_ordinary_log(tmp_path: Path) -> None:
    import pytest

    from gpuguard.collectors.log_steps import LogStepSpec, read_log_steps
    from gpuguard.foundation.errors import DataError

    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text("step_log:\n  pattern: '^(?P<ts>\\S+) \\[rank(?P<rank>\\d+)\\] step (?P<step>\\d+)'\n")
    log = tmp_path / "train.log"
    log.write_text(
        "2026-11-29T10:00:00 [rank0] step 1\n2026-11-29T10:00:01.5 [rank0] step 2\nnoise\n"
        "2026-11-29T10:00:03 [rank0] step 3\n2026-11-29T10:00:00 [rank1] step 1\nbad-ts [rank1] step 2\n"
    )
    series = read_log_steps([log, tmp_path / "missing.log"], LogStepSpec.from_yaml(spec_file))
    assert [s.compute_s for s in series[0].steps] == [1.5, 1.5]
    assert series[0].phase.step == 3 and series[0].phase.kind == BETWEEN
    assert 1 not in series  # one good line (no duration yet) and one with a bad timestamp: no step
    ms = LogStepSpec.compile(r"it (?P<step>\d+) took (?P<step_ms>\d+)ms", default_rank=5)
    log.write_text("it 1 took 250ms\nit 2 took 300ms\n")
    assert [s.compute_s for s in read_log_steps([log], ms)[5].steps] == [0.25, 0.3]
    for bad in ("(", r"step (\d+)"):
        with pytest.raises(DataError):
            LogStepSpec.compile(bad)
    log.write_text("2026-11-29 10:00:00,000 it 1\n2026-11-29 10:00:02,500 it 2\n")  # the lines' own time
    assert [s.compute_s for s in read_log_steps([log], LogStepSpec.compile(r"it (?P<step>\d+)"))[0].steps] == [2.5]
    spec_file.write_text("pattern: [unclosed")
    with pytest.raises(DataError):
        LogStepSpec.from_yaml(spec_file)


@given(st.lists(st.text(max_size=50), max_size=30))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_log_collector_never_raises(tmp_path: Path, lines: list[str]) -> None:
    from gpuguard.collectors.log_steps import LogStepSpec, read_log_steps

    log = tmp_path / "fuzz.log"
    log.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass"))
    spec = LogStepSpec.compile(r"r(?P<rank>\d*) s(?P<step>-?\d*) t(?P<ts>\S*) d(?P<step_s>\S*)")
    for s in read_log_steps([log], spec).values():
        assert all(x.compute_s >= 0 for x in s.steps)


def test_reader_reads_only_the_tail_it_needs(tmp_path: Path) -> None:
    log = StepLog(tmp_path, 0, "a", max_bytes=64 * 1024, keep=4)
    for s in range(3000):
        _one_step(log, s)
    log.begin_step(3000)
    r = read_job(tmp_path, max_steps=100).ranks[0]
    assert r.pid == os.getpid() and r.bad_lines == 0
    assert 100 == len(r.steps) and r.steps[-1].step == 2999
    assert r.phase.kind == COMPUTING and r.phase.step == 3000 and r.phase.seq == 2999


def test_collective_context_manager_and_error_exit(tmp_path: Path) -> None:
    import pytest

    with pytest.raises(RuntimeError):
        with StepLog(tmp_path, 0, "cm") as log:
            log.begin_step(0)
            with log.collective(0, "all_gather", 64):
                pass
            log.end_step(0)
            log.begin_step(1)
            with log.collective(1, "all_reduce", 64):
                raise RuntimeError("Connection closed by peer [10.0.0.2]:1234")
    r = read_job(tmp_path).ranks[0]
    assert [s.step for s in r.steps] == [0]
    assert r.phase.kind == COLLECTIVE and r.phase.seq == 1  # it died waiting in collective 1, not closed
    assert any("Connection closed by peer" in e for e in r.errors)
    log = StepLog(tmp_path, 1, "ok")
    with log:
        log.heartbeat()
    assert read_job(tmp_path).ranks[1].phase.kind == CLOSED


def test_doctor_path_does_not_import_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    log = StepLog(tmp_path, 0, "t")
    _one_step(log, 0)
    code = (
        "import sys; from gpuguard.cli.doctor_job import assess; assess(sys.argv[1]); "
        "import gpuguard.cli.doctor; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_exit_codes_from_torchrun_lines(tmp_path: Path) -> None:
    from gpuguard.collectors.liveness import exit_codes_from_logs

    real = REAL_LOGS
    log = tmp_path / "t.log"
    log.write_text(
        "ERROR: failed (exitcode: -9) local_rank: 0 (pid: 31631) of binary: /usr/bin/python3\n"
        "  exitcode  : 1 (pid: 5939)\nexitcode: nothing here\n"
    )
    assert exit_codes_from_logs([log, tmp_path / "missing"]) == {31631: -9, 5939: 1}
    assert exit_codes_from_logs([real / "073-torchrun.log"])[2385923] == -6  # a real torchrun failure report
