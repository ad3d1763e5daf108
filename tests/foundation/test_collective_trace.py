"""gpuguard's CollectiveTrace: ring semantics, atomic dumps on demand / on failure / on a real signal
(chained with the previous handler), and dumps that the contract loader reads back exactly."""

from __future__ import annotations

import json
import os
import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.collectors.flight_recorder import load_dump
from gpuguard.diagnostics.contract import Interner, Signature, check
from gpuguard.foundation.collective_trace import SCHEMA, CollectiveTrace, call_site, install_signal_dump


def test_ring_keeps_the_newest_entries_oldest_first(tmp_path):
    t = CollectiveTrace(rank=1, generation=2, capacity=3, world_size=4)
    for seq in range(1, 6):
        t.record("all_reduce", "default", seq, 1024, "float32", "sum")
    assert t.complete(5) and t.complete(4, "default") and not t.complete(1)
    doc = json.loads(open(t.dump(tmp_path / "rank_{rank}.json")).read())
    assert doc["schema"] == SCHEMA and doc["rank"] == 1 and doc["generation"] == 2
    assert (doc["recorded"], doc["dropped"], doc["capacity"]) == (5, 2, 3)
    assert [e["seq"] for e in doc["entries"]] == [3, 4, 5]
    assert [e["state"] for e in doc["entries"]] == ["scheduled", "completed", "completed"]
    assert doc["entries"][2]["completed_ns"] >= doc["entries"][2]["time_ns"]
    assert [p.name for p in tmp_path.iterdir()] == ["rank_1.json"]  # no temp file left behind
    with pytest.raises(ValueError):
        CollectiveTrace(0, 0, capacity=0)


def test_signal_dump_is_chained_with_the_previous_handler(tmp_path):
    seen = []
    old = signal.signal(signal.SIGUSR2, lambda s, f: seen.append(s))
    try:
        t = CollectiveTrace(rank=0, generation=0)
        t.record("broadcast", "default", 1, 64, "float32", call_site=call_site(0))
        install_signal_dump(t, tmp_path / "g{generation}" / "rank_{rank}.json")
        os.kill(os.getpid(), signal.SIGUSR2)  # a real signal; Python runs the handler at once
        doc = json.loads((tmp_path / "g0" / "rank_0.json").read_text())
        assert doc["reason"] == "signal SIGUSR2" and doc["entries"][0]["op"] == "broadcast"
        assert doc["entries"][0]["call_site"].endswith(f"test_collective_trace.py:{_line_of('call_site=call_site(0)')}")
        assert seen == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, old)


def _line_of(text: str) -> int:
    with open(__file__) as fh:
        return next(i for i, line in enumerate(fh, 1) if text in line and "_line_of" not in line)


def test_guard_dumps_on_failure_and_reraises(tmp_path):
    t = CollectiveTrace(rank=2, generation=0)
    with pytest.raises(RuntimeError, match="peer"):
        with t.guard(tmp_path / "rank_2.json"):
            t.record("all_reduce", "default", 1, 8, "float32", "max")
            raise RuntimeError("Connection closed by peer")
    doc = json.loads((tmp_path / "rank_2.json").read_text())
    assert doc["reason"].startswith("failure RuntimeError") and doc["entries"][0]["reduce_op"] == "max"


entries = st.lists(
    st.tuples(
        st.sampled_from(["all_reduce", "all_gather", "barrier"]),
        st.integers(0, 1 << 30),
        st.sampled_from(["float32", "int64"]),
        st.sampled_from([None, "sum", "max"]),
        st.booleans(),
    ),
    min_size=0,
    max_size=40,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries, st.integers(1, 50))
def test_dump_round_trips_through_the_contract_loader(tmp_path, rows, capacity):
    t = CollectiveTrace(rank=3, generation=7, capacity=capacity, world_size=4)
    for seq, (op, n, dt, red, done) in enumerate(rows, 1):
        t.record(op, "tp", seq, n, dt, red, f"x.py:{seq}")
        if done:
            t.complete(seq)
    path = t.dump(tmp_path / "rank_3.json")
    it = Interner()
    loaded = load_dump(path, it)
    kept = rows[-capacity:] if rows else []
    assert loaded.entries == len(kept) and loaded.trace.rank == 3 and loaded.trace.world_size == 4
    if not kept:
        assert loaded.trace.streams == ()
        return
    (stream,) = loaded.trace.streams
    assert stream.generation == 7 and stream.pg == "tp"
    assert [it.signatures[i] for i in stream.sig_ids] == [
        Signature(op=op, in_dtypes=(dt,), count=n, reduce_op=red) for op, n, dt, red, _ in kept
    ]
    assert stream.states == ["completed" if d else "scheduled" for *_, d in kept]
    assert check([loaded.trace], it).holds


def test_persisted_ring_survives_sigabrt(tmp_path):
    """gloo SIGABRTs a rank on a size mismatch: the mmap ring is still there, and loads."""
    import subprocess
    import sys

    code = (
        "import os\n"
        "from gpuguard.foundation.collective_trace import CollectiveTrace\n"
        f"t = CollectiveTrace(3, 1, capacity=4, world_size=4, persist={str(tmp_path / 'rank_{rank}.ring')!r})\n"
        "for s in range(1, 7):\n"
        "    t.record('all_reduce', 'default', s, 512 if s == 6 else 1024, 'float32', 'sum', f'train.py:{s}')\n"
        "    if s < 6:\n"
        "        t.complete(s)\n"
        "os.abort()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGABRT
    it = Interner()
    loaded = load_dump(tmp_path / "rank_3.ring", it)
    (stream,) = loaded.trace.streams
    assert loaded.trace.format == "gpuguard-ring" and loaded.trace.rank == 3 and loaded.trace.world_size == 4
    assert stream.generation == 1 and stream.seqs == [3, 4, 5, 6]
    assert stream.states == ["completed", "completed", "completed", "scheduled"]
    assert it.signatures[stream.sig_ids[-1]] == Signature(
        "all_reduce", in_dtypes=("float32",), count=512, reduce_op="sum"
    )
    assert it.sites[stream.site_ids[-1]] == "train.py:6"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=2000), st.integers(0, 64))
def test_corrupt_rings_are_clear_errors(tmp_path, blob, keep):
    from gpuguard.foundation.collective_trace import PERSIST_MAGIC
    from gpuguard.foundation.errors import DataError

    real = tmp_path / "real.ring"
    t = CollectiveTrace(0, 0, capacity=2, persist=real)
    t.record("all_reduce", "default", 1, 8, "float32")
    good = real.read_bytes()
    p = tmp_path / "rank_0.ring"
    p.write_bytes(good[:keep] + blob if keep < len(good) else PERSIST_MAGIC + blob)
    try:
        load_dump(p, Interner())
    except DataError as exc:
        assert exc.exit_code == 65
