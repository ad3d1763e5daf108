"""The directory ledger: CAS activation, commit records, fencing, refusals, crashes, races."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import pytest

from gpuguard.foundation.errors import RefusedError
from gpuguard.generation.ledger_open import open_ledger
from gpuguard.generation.verify import verify_ledger
from tests.support.generation import KEY, child, genesis, members
from tests.support.ledger_race import race, writer_source


@pytest.fixture
def ledger(tmp_path):
    led = open_ledger(tmp_path, key=KEY)
    led.create_root()
    led.initialize(genesis())
    return led


def test_activation_is_compare_and_swap(ledger):
    g0 = ledger.require_active()
    a = child(g0, members(2), reason="operator")
    b = child(g0, members(2), reason="hang")
    ledger.activate(a)
    with pytest.raises(RefusedError, match="compare-and-swap"):
        ledger.activate(b)
    assert ledger.require_active() == a
    assert [c.generation for c in ledger.history()] == [0, 1]
    assert ledger.refusals()[-1].violations[0].rule == "compare-and-swap"


def test_link_never_overwrites_an_existing_generation(ledger, tmp_path):
    """A racer that lost (its view was stale) cannot replace generation N: link() fails."""
    g0 = ledger.require_active()
    a, b = child(g0, members(1)), child(g0, members(1))
    ledger.activate(a)
    assert ledger._create(1, b.canonical()) is False
    assert open_ledger(tmp_path, key=KEY).require_active() == a
    assert not ledger.stray_temp_files()


def test_refused_rule_is_recorded_for_explain(ledger):
    g0 = ledger.require_active()
    bad = child(g0, members(2), quiescence="unknown")
    with pytest.raises(RefusedError, match="quiescence"):
        ledger.activate(bad)
    assert ledger.require_active() == g0
    r = ledger.refusals()[-1]
    assert r.generation == 1 and r.violations[0].rule == "quiescence" and r.certificate_digest == bad.digest()


def test_commit_records_give_the_frontier_and_fence_stale_generations(ledger):
    g1 = child(ledger.require_active(), members(2))
    ledger.activate(g1)
    a, b = g1.members
    assert ledger.last_committed_by_all(1) is None
    for step in range(1, 6):
        assert ledger.record_commit(1, step, 0, a.incarnation.id)
    for step in range(1, 4):
        assert ledger.record_commit(1, step, 1, b.incarnation.id)
    assert ledger.last_committed_by_all(1) == 3
    # frontier past the commit record: refused
    with pytest.raises(RefusedError, match="frontier-committed"):
        ledger.activate(child(g1, g1.members, step=5))
    g2 = child(g1, g1.members, step=3)
    ledger.activate(g2)
    # a slow writer of generation 1 is fenced and counted, nothing merged
    assert ledger.record_commit(1, 4, 1, b.incarnation.id) is False
    assert ledger.last_committed_by_all(1) == 3
    # a zombie incarnation on an active rank is fenced too
    assert ledger.record_commit(2, 4, 1, "not-the-member") is False
    assert ledger.fenced_count() == 2
    with pytest.raises(RefusedError):
        ledger.record_commit(3, 1, 0, a.incarnation.id)


def test_torn_temp_file_is_ignored_and_reported(ledger):
    g1 = child(ledger.require_active(), members(1))
    (ledger.root / ".tmp-deadbeef").write_bytes(g1.canonical()[:37])
    assert ledger.require_active().generation == 0
    ledger.activate(g1)
    rep = verify_ledger(open_ledger(ledger.root.parent, key=KEY), KEY)
    assert rep.ok and any("temp file" in n for n in rep.notes)


@pytest.mark.parametrize("damage", ["truncate", "garble", "delete-middle"])
def test_damaged_final_file_is_named_by_verify(ledger, damage):
    g = ledger.require_active()
    for _ in range(3):
        g = child(g, members(1))
        ledger.activate(g)
    path = ledger.root / "gen-2.json"
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "garble":
        data = bytearray(path.read_bytes())
        data[50] ^= 0x55
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    fresh = open_ledger(ledger.root.parent, key=KEY)
    assert fresh.require_active().generation == 1  # the valid chain ends before the damage
    rep = verify_ledger(fresh, KEY)
    assert not rep.ok
    assert any(f.record.endswith("gen-2.json") for f in rep.findings)
    # generation 3 no longer has a verified parent: it is reported, not skipped
    assert any(f.record.endswith("gen-3.json") for f in rep.findings)


def test_every_single_byte_flip_of_a_certificate_is_caught(ledger):
    g1 = child(ledger.require_active(), members(2))
    ledger.activate(g1)
    path = ledger.root / "gen-1.json"
    orig = path.read_bytes()
    for i in range(len(orig)):
        data = bytearray(orig)
        data[i] ^= 1 << (i % 8)
        path.write_bytes(bytes(data))
        rep = verify_ledger(open_ledger(ledger.root.parent, key=KEY), KEY)
        assert not rep.ok and any(f.record.endswith("gen-1.json") for f in rep.findings), i
    path.write_bytes(orig)
    assert verify_ledger(open_ledger(ledger.root.parent, key=KEY), KEY).ok


def test_sixteen_racers_one_winner_per_round(ledger, tmp_path):
    rounds = 100
    winners = race(tmp_path, None, racers=16, rounds=rounds)
    assert winners == {g: 1 for g in range(rounds)}
    fresh = open_ledger(tmp_path, key=KEY)
    assert fresh.require_active().generation == rounds
    assert verify_ledger(fresh, KEY).ok


def test_kill_9_during_500_activations_leaves_a_whole_chain(ledger, tmp_path):
    """A writer activating in a loop is SIGKILLed at random points (12 times), then finishes the 500."""
    target, rng = 500, random.Random(4)
    src = writer_source(tmp_path, None, target)
    kills = 0
    for attempt in range(13):
        proc = subprocess.Popen([sys.executable, "-c", src], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            if attempt < 12:
                proc.stdout.readline()  # it is activating now
                time.sleep(rng.uniform(0.0, 0.12))
                proc.send_signal(signal.SIGKILL)
                kills += proc.wait(timeout=30) == -signal.SIGKILL
            else:
                assert proc.wait(timeout=60) == 0, proc.stderr.read()
        finally:
            proc.kill()
            proc.wait(timeout=10)
            proc.stdout.close()
            proc.stderr.close()
        fresh = open_ledger(tmp_path, key=KEY)
        active = fresh.require_active().generation
        assert [c.generation for c in fresh.history()] == list(range(active + 1))
        assert set(fresh.generations()) == set(range(active + 1))
        assert verify_ledger(fresh, KEY).ok
    assert open_ledger(tmp_path, key=KEY).require_active().generation == target
    assert kills >= 10


def test_commit_log_torn_tail_ignored_garbled_line_reported(ledger):
    g1 = child(ledger.require_active(), members(1))
    ledger.activate(g1)
    inc = g1.members[0].incarnation.id
    assert ledger.record_commit(1, 4, 0, inc)
    log = ledger.root / "commits-1.log"
    with open(log, "ab") as f:
        f.write(b'{"g":1,"i":"' + inc.encode() + b'","r":0,"s":9')  # a writer killed mid-append
    assert ledger.last_committed_by_all(1) == 4
    with open(log, "ab") as f:
        f.write(b"\nnot json\n")
    assert ledger.commits(1)[1] == 2
    rep = verify_ledger(open_ledger(ledger.root.parent, key=KEY), KEY)
    assert not rep.ok and "garbled commit record" in rep.findings[0].message


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gpuguard.generation.ledger import dumps_record, parse_lines  # noqa: E402


@settings(max_examples=150, deadline=None)
@given(
    records=st.lists(
        st.dictionaries(st.text(max_size=4), st.integers(-5, 2**40) | st.text(max_size=6), max_size=3), max_size=6
    ),
    tail=st.binary(max_size=40).filter(lambda b: b"\n" not in b),
    noise=st.binary(max_size=60),
)
def test_log_format_keeps_whole_records_and_never_crashes(records, tail, noise):
    data = b"".join(dumps_record(r) for r in records)
    got, bad = parse_lines(data + tail)
    assert got == records and bad == 0
    parse_lines(noise + data)  # arbitrary bytes: counted, never raised


def test_unverified_frontier_state_is_refused_by_the_ledger(ledger):
    g1 = child(ledger.require_active(), members(1), digest="ab" * 32)
    with pytest.raises(RefusedError, match="frontier-state"):
        ledger.activate(g1, manifest_ok=False)
    ledger.activate(g1, manifest_ok=True)
    assert ledger.require_active() == g1


def test_members_on_many_hosts_warn_once_per_process(monkeypatch):
    from gpuguard.generation import ledger_dir

    monkeypatch.setattr(ledger_dir, "_warned_many_hosts", False)
    said: list[str] = []
    assert not ledger_dir.warn_many_hosts(["h1", "h1"], said.append)  # one host: a directory ledger is fine
    assert ledger_dir.warn_many_hosts(["h1", "h2"], said.append)
    assert not ledger_dir.warn_many_hosts(["h1", "h3"], said.append)
    assert len(said) == 1 and "2 hosts (h1, h2)" in said[0] and "etcd://" in said[0]
