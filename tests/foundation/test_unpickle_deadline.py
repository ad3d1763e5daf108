"""Untrusted loads bounded in time: a tuple DAG used as a dict key or set member is hashed inside the
C load (no check after the load can run, no signal handler interrupts it), so readers run in forked
workers killed at each item's deadline (`map_with_deadlines`). Every test that could hang on a
regression runs the hostile input in a subprocess with a timeout."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from gpuguard.foundation.unpickle import load_deadline, restricted_loads
from gpuguard.foundation.workers import Overdue, map_with_deadlines
from tests.support.cli import REPO, run_cli


def hashed_dag(levels: int, where: str) -> bytes:
    """A pickle (hand-built opcodes: pickling it would hash it) whose tuple t_k = (t_k-1, t_k-1), a
    file under 1 KB at 60 levels, is hashed by the load: as a dict key, a set or frozenset member, or
    a key of an FR dump's pg_status."""
    out = bytearray(b"\x80\x04)\x940")  # PROTO 4, EMPTY_TUPLE, MEMOIZE (memo 0), POP
    for i in range(levels):
        get = b"j" + i.to_bytes(4, "little")  # LONG_BINGET i
        out += get + get + b"\x86\x940"  # TUPLE2, MEMOIZE (memo i + 1), POP
    key = b"j" + levels.to_bytes(4, "little")
    if where == "dict key":
        out += b"}" + key + b"K\x01s"  # EMPTY_DICT, key, BININT1 1, SETITEM
    elif where == "set member":
        out += b"\x8f(" + key + b"\x90"  # EMPTY_SET, MARK, key, ADDITEMS
    elif where == "frozenset member":
        out += b"(" + key + b"\x91"  # MARK, key, FROZENSET
    else:  # an FR dump: {"version": "2.10", "entries": [], "pg_status": {DAG: 1}}
        out += b"}(\x8c\x07version\x8c\x042.10\x8c\x07entries]\x8c\tpg_status}" + key + b"K\x01su"
    return bytes(out + b".")


WHERE = ("dict key", "set member", "frozenset member", "fr pg_status key")


def test_the_attack_is_what_it_claims_small_and_exponential() -> None:
    """12 levels load (4 k hash steps) and equal the real structure; 60 levels are under 1 KB."""
    t: tuple[Any, ...] = ()
    for _ in range(12):
        t = (t, t)
    assert restricted_loads(hashed_dag(12, "dict key")) == {t: 1}
    assert restricted_loads(hashed_dag(12, "frozenset member")) == frozenset({t})
    assert all(len(hashed_dag(60, w)) < 1024 for w in WHERE)


def _square(i: int) -> int:
    return i * i


def test_results_for_every_item_from_several_workers() -> None:
    got = {d.index: d.value for d in map_with_deadlines(_square, [5.0] * 40, jobs=3)}
    assert got == {i: i * i for i in range(40)}
    assert multiprocessing.active_children() == []


def _hostile(i: int) -> Any:
    if i == 2:
        return restricted_loads(hashed_dag(60, "dict key"))  # never ends
    if i == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    return i


@pytest.mark.parametrize("jobs", [1, 2])
def test_an_endless_item_is_overdue_a_dead_worker_is_reported_and_the_rest_still_run(jobs: int) -> None:
    t0 = time.monotonic()
    done = list(map_with_deadlines(_hostile, [1.0] * 8, jobs=jobs))
    elapsed = time.monotonic() - t0
    by = {d.index: d.value for d in done}
    assert sorted(by) == list(range(8))
    assert by[2] == Overdue(1.0, "took more than 1.0 s")
    assert by[4] == Overdue(1.0, "its reader process died (signal 9)")
    assert all(by[i] == i for i in (0, 1, 3, 5, 6, 7))
    assert elapsed < 30  # a deadline against a hang, not a speed assertion
    assert multiprocessing.active_children() == []
    assert len({d.worker for d in done}) >= 3  # a new worker after each loss


def _boom(i: int) -> int:
    raise ValueError(f"bad {i}")


def test_an_exception_in_the_worker_is_raised_here_naming_the_item() -> None:
    with pytest.raises(RuntimeError, match="failed on item 0: ValueError: bad 0"):
        list(map_with_deadlines(_boom, [5.0], jobs=1))
    assert multiprocessing.active_children() == []


def _first_fast(i: int) -> int:
    if i:
        time.sleep(60)
    return i


def test_closing_early_ends_every_worker() -> None:
    """A consumer that stops (an exception, Ctrl-C) leaves no worker: the others are still busy."""
    gen = map_with_deadlines(_first_fast, [120.0] * 4, jobs=2)
    assert next(gen).value == 0
    assert len(multiprocessing.active_children()) == 2
    t0 = time.monotonic()
    gen.close()
    assert multiprocessing.active_children() == [] and time.monotonic() - t0 < 30


def test_deadline_grows_with_the_input() -> None:
    assert load_deadline(0) == load_deadline(None) == 1.0
    assert load_deadline(2048) < 1.01 and 500 < load_deadline(1 << 30) < 600


# -- end to end: each hostile file in a subprocess with a timeout, so a regression fails, never hangs


@pytest.mark.parametrize("where", WHERE)
def test_gpu_doctor_contract_refuses_a_hashed_dag_within_its_deadline(tmp_path: Any, where: str) -> None:
    dump = tmp_path / "rank_0"
    dump.write_bytes(hashed_dag(60, where))
    t0 = time.monotonic()
    r = run_cli("gpu-doctor", "contract", str(dump), timeout=30)  # today: no end (TimeoutExpired)
    elapsed = time.monotonic() - t0
    assert r.returncode == 65, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "rank_0: refused: reading it took more than 1.0 s" in lines[0], r.stderr
    assert "hashed without bound" in lines[0] and "Traceback" not in r.stderr and r.stdout == ""
    assert elapsed < 30


SCRIPT = """
import sys, pickle
from pathlib import Path
from gpuguard.collectors.flight_recorder import load_all
from gpuguard.foundation.traces import Interner
loaded, refused = load_all(sorted(Path(sys.argv[1]).iterdir()), Interner(), jobs=int(sys.argv[2]))
print(sorted(x.trace.rank for x in loaded))
print(len(refused), str(refused[0]) if refused else "")
"""


@pytest.mark.parametrize("jobs", [1, 2])
def test_load_all_refuses_the_hashed_dag_and_reads_every_other_dump(tmp_path: Any, jobs: int) -> None:
    from tests.support import contract_job as jh

    for rank in range(5):
        doc = jh.fr_doc([jh.fr_entry(1), jh.fr_entry(2)], ranks=range(5))
        (tmp_path / f"rank_{rank}").write_bytes(pickle.dumps(doc, protocol=2))
    (tmp_path / "rank_2").write_bytes(hashed_dag(60, "fr pg_status key"))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), str(jobs)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO.parent,
    )
    assert out.returncode == 0, out.stderr
    ranks, refused = out.stdout.splitlines()
    assert ranks == "[0, 1, 3, 4]"
    assert refused.startswith("1 ") and "rank_2: refused: reading it took more than" in refused


def test_a_fifo_or_device_is_refused_at_once_never_read(tmp_path: Any) -> None:
    """/dev/zero never ends (today: memory runs out, exit 70); a FIFO without a writer blocks the
    open (today: no end), named or inside a dump directory, where it is skipped with a note."""
    fifo = tmp_path / "dumps" / "rank_1"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    from tests.support import contract_job as jh

    doc = jh.fr_doc([jh.fr_entry(1)], ranks=range(2))
    (fifo.parent / "rank_0").write_bytes(pickle.dumps(doc, protocol=2))
    for path in ("/dev/zero", str(fifo)):
        r = run_cli("gpu-doctor", "contract", path, timeout=30)
        assert r.returncode == 65 and r.stderr.strip().endswith(
            "not a regular file (a FIFO, device or socket is not a dump)"
        )
        assert r.stderr.count("\n") == 1
    r = run_cli("gpu-doctor", "contract", str(fifo.parent), "--json", timeout=30)
    assert r.returncode == 3, r.stderr  # rank 1's dump is missing: partial
    assert "Traceback" not in r.stderr


LOADS_WITHIN = """
import sys, time
from gpuguard.foundation.workers import restricted_loads_within
from gpuguard.foundation.unpickle import Refused
t0 = time.monotonic()
try:
    restricted_loads_within(open(sys.argv[1], "rb").read(), what="rendezvous state")
except Refused as exc:
    print(type(exc).__name__, round(time.monotonic() - t0, 1), exc)
"""


@pytest.mark.parametrize("where", ["dict key", "frozenset member"])
def test_restricted_loads_within_refuses_a_hashed_dag_in_time(tmp_path: Any, where: str) -> None:
    path = tmp_path / "state.pkl"
    path.write_bytes(hashed_dag(60, where))
    out = subprocess.run(
        [sys.executable, "-c", LOADS_WITHIN, str(path)], capture_output=True, text=True, timeout=60, cwd=REPO.parent
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr
    kind, seconds, msg = out.stdout.split(" ", 2)
    assert kind == "Refused" and float(seconds) < 30
    assert (
        msg.strip()
        == "rendezvous state: loading it took more than 1.0 s of CPU (a shared-reference dict key or set member?)"
    )


class _Box:
    def __init__(self, v: Any) -> None:
        self.v = v


def test_restricted_loads_within_returns_the_value_and_raises_the_loads_own_errors() -> None:
    from gpuguard.foundation.unpickle import Refused, Unbounded, admit
    from gpuguard.foundation.workers import restricted_loads_within

    t: tuple[Any, ...] = ()
    for _ in range(8):
        t = (t, t)
    assert restricted_loads_within(hashed_dag(8, "dict key")) == {t: 1}
    box = restricted_loads_within(pickle.dumps(_Box([1, "a"])), admit({(__name__, "_Box"): _Box}))
    assert type(box) is _Box and box.v == [1, "a"]
    with pytest.raises(Refused, match="is not allowed in DCP metadata"):
        restricted_loads_within(pickle.dumps(_Box(1)), what="DCP metadata")
    dag: list[Any] = []
    for _ in range(60):
        dag = [dag, dag]
    with pytest.raises(Unbounded):
        restricted_loads_within(pickle.dumps(dag, protocol=4))
    with pytest.raises(pickle.UnpicklingError):
        restricted_loads_within(b"\x80\x04garbage")
    assert multiprocessing.active_children() == []


def test_restricted_loads_within_counts_the_loads_cpu_not_a_busy_hosts_wall_clock() -> None:
    """A load that waits (a host too busy to run it) is not a load that computes: only CPU is bounded.

    16 rendezvous agents forking at once on 2 loaded cores took more than a wall-clock second for a
    real state of a few KB; the attack burns CPU, so CPU time is what the deadline counts."""
    import time

    from gpuguard.foundation.unpickle import admit
    from gpuguard.foundation.workers import restricted_loads_within

    table = admit({(__name__, "_Box"): _Box})

    def slow(module: str, name: str) -> Any:
        time.sleep(1.5)  # 1.5 s of wall clock, no CPU: the child is merely not running
        return table(module, name)

    t0 = time.monotonic()
    box = restricted_loads_within(pickle.dumps(_Box(7)), slow)
    assert type(box) is _Box and box.v == 7 and time.monotonic() - t0 >= 1.5
