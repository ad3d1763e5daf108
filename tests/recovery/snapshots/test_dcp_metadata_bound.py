"""Issue 28 finding 2: DCP's `.metadata` (a pickle torch loads with a plain `pickle.load` inside
`dcp.load`) is bound into the manifest and never unpickled by torch.

A `.metadata` whose unpickling would create a marker file is planted into real snapshots (replicated
and sharded): `gpu-generation verify --deep` fails naming `.metadata`, `gpu-recover restore --dry-run`
refuses it and names the previous state, selection falls back, a load refuses it in one line, and the
marker never appears. A hash-DAG `.metadata` whose digest the manifest binds (an attacker who can
rewrite the manifest too; the certificate still names the old digest, but the decoder is tested on
its own) is refused within its deadline. On main: verify and dry-run accept the payload, the load runs
it (marker written), and the hash-DAG hangs the load.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.foundation.errors import DataError
from gpuguard.foundation.unpickle import load_deadline
from gpuguard.generation import manifest as m
from gpuguard.generation.dcp_metadata import METADATA_FILE, load_metadata
from gpuguard.generation.job import open_job_ledger
from gpuguard.recovery.snapshots import store as snap
from tests.foundation.test_unpickle_deadline import hashed_dag
from tests.support.generation import child, members

pytestmark = pytest.mark.timeout(180)


class Payload:
    """What an attacker plants: unpickling it creates `marker` (plain `pickle.load` runs it)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "a"))


def plant(snapshot: Path, marker: Path) -> None:
    (snapshot / METADATA_FILE).write_bytes(pickle.dumps(Payload(marker)))


def state(seed: float) -> dict:
    import torch

    return {"model": {"w": torch.full((4, 3), seed), "b": torch.arange(3.0) + seed}, "rng": {"torch": torch.ones(2)}}


@pytest.fixture
def job(tmp_path, cli):
    """A job with a ledger whose active certificate names step 2's snapshot, and snapshots 1 and 2."""
    jd = tmp_path / "job"
    assert cli("gpu-generation", "init", "--job-dir", str(jd)).returncode == 0
    infos = [snap.save_snapshot(jd, s, state(float(s)), generation=1, owner="rank0/i") for s in (1, 2)]
    led = open_job_ledger(jd)
    mem = members(1)
    first = child(led.require_active(), mem, key=led.key)
    led.activate(first)
    led.record_commit(first.generation, 2, 0, mem[0].incarnation.id)
    led.activate(child(first, mem, key=led.key, step=2, digest=infos[1].manifest_digest), manifest_ok=True)
    return jd


def test_a_manifest_binds_the_metadata_bytes_and_a_legacy_one_reads_with_a_note(tmp_path):
    info = snap.save_snapshot(tmp_path, 3, state(3.0), generation=1, owner="rank0/i")
    manifest = m.load_manifest(info.path)
    raw = (info.path / METADATA_FILE).read_bytes()
    assert manifest.metadata == m.MetadataBinding.of(raw) and manifest.header()["schema"] == "gpuguard.manifest/2"
    assert json.loads((info.path / m.MANIFEST_FILE).read_text())["metadata"]["file"] == METADATA_FILE
    chosen = snap.select_restorable(tmp_path).chosen
    assert chosen.metadata_digest == manifest.metadata.digest and chosen.warning is None
    # the same manifest without the binding: the old format, still read, restored with a warning
    legacy = m.Manifest(manifest.generation, manifest.step, manifest.entries, 0, manifest.extra)
    m.write_manifest(legacy, info.path)
    assert m.load_manifest(info.path).digest == legacy.digest != manifest.digest
    assert m.verify_manifest(legacy, info.path) == [] and "bound to nothing" in m.legacy_note(legacy)
    chosen = snap.select_restorable(tmp_path).chosen
    assert chosen.metadata_digest is None and "gpuguard.manifest/1" in chosen.warning
    loaded = snap.load_snapshot(chosen, state(0.0))
    assert snap.state_digest(loaded) == chosen.state_digest


def test_a_replaced_metadata_is_refused_by_verify_deep_restore_and_load_and_never_runs(job, cli, tmp_path):
    marker = tmp_path / "pwned"
    step2 = job / "snapshots" / "step-2"
    plant(step2, marker)

    res = cli("gpu-generation", "verify", "--job-dir", str(job), "--deep")
    assert res.returncode == 2, res.stdout + res.stderr
    assert METADATA_FILE in res.stdout and "replaced or corrupted" in res.stdout

    res = cli("gpu-recover", "restore", "--job-dir", str(job), "--dry-run", "--json")
    doc = json.loads(res.stdout)
    assert doc["details"]["chosen"]["step"] == 1, res.stdout
    [why] = [r["reason"] for r in doc["details"]["rejected"] if r["step"] == 2]
    assert why.startswith(f"corrupt: {METADATA_FILE}: BLAKE3 ") and "\n" not in why

    sel = snap.select_restorable(job)
    assert sel.chosen.step == 1 and METADATA_FILE in sel.rejected[0].reason
    unverified = snap.SnapshotInfo(2, step2, "snapshots")  # a caller that skipped the selection
    with pytest.raises(DataError, match=r"\.metadata: BLAKE3 .* replaced or corrupted"):
        snap.load_snapshot(unverified, state(0.0))
    assert not marker.exists()
    assert not list(tmp_path.rglob("pwned"))


LOAD_SCRIPT = """
import sys, time
from pathlib import Path
from gpuguard.foundation.errors import GpuguardError
from gpuguard.recovery.snapshots import store as snap
import torch
path = Path(sys.argv[1])
t = time.monotonic()
try:
    snap.load_snapshot(snap.SnapshotInfo(2, path, "snapshots"), {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}, "rng": {"torch": torch.zeros(2)}})
    print("LOADED")
except GpuguardError as exc:
    print(f"REFUSED {time.monotonic() - t:.2f} {exc}")
"""


def test_a_hash_dag_metadata_whose_digest_the_manifest_binds_is_refused_within_its_deadline(job):
    step2 = job / "snapshots" / "step-2"
    dag = hashed_dag(60, "dict key")
    (step2 / METADATA_FILE).write_bytes(dag)
    manifest = m.load_manifest(step2)
    rebound = m.Manifest(
        manifest.generation, manifest.step, manifest.entries, 0, manifest.extra, m.MetadataBinding.of(dag)
    )
    m.write_manifest(rebound, step2)
    assert m.verify_manifest(rebound, step2) == []  # the attacker rewrote the manifest too
    deadline = load_deadline(len(dag))
    t = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT, str(step2)], capture_output=True, text=True, timeout=deadline + 60
    )
    took = time.monotonic() - t
    assert proc.returncode == 0, proc.stderr[-2000:]
    [line] = proc.stdout.splitlines()
    assert line.startswith("REFUSED") and "unreadable DCP metadata" in line and METADATA_FILE in line, line
    # the deadline is the decoder's CPU time: a loaded host stretches the wall time, a hang never ends
    assert "took more than" in line and float(line.split()[1]) < 10 * deadline and took < deadline + 60


FIFO_SCRIPT = """
import sys
from gpuguard.foundation.errors import GpuguardError
from gpuguard.generation.dcp_metadata import load_metadata
try:
    load_metadata(sys.argv[1])
except GpuguardError as exc:
    print(type(exc).__name__, exc)
"""


def test_a_fifo_metadata_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / METADATA_FILE)
    proc = subprocess.run(
        [sys.executable, "-c", FIFO_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=30
    )
    assert proc.stdout.startswith("DataError") and "not a regular file" in proc.stdout, proc.stdout + proc.stderr


def test_a_linked_metadata_is_refused(tmp_path):
    info = snap.save_snapshot(tmp_path, 1, state(1.0), generation=1, owner="rank0/i")
    real = tmp_path / "elsewhere"
    (info.path / METADATA_FILE).rename(real)
    (info.path / METADATA_FILE).symlink_to(real)
    with pytest.raises(DataError, match="symbolic link"):
        load_metadata(info.path)
    assert "symbolic link" in m.verify_manifest(m.load_manifest(info.path), info.path)[0]


SHARDED_SCRIPT = """
import sys, time, pickle, torch, torch.distributed as dist
from pathlib import Path
from gpuguard.foundation.errors import GpuguardError
from gpuguard.recovery.snapshots import parts
from gpuguard.recovery.snapshots import sharded as ss
job, what, marker = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", store=dist.FileStore(str(job / "store"), 1), rank=0, world_size=1)
g = ss.new_snapshot_group(20)
live = {"model": {"w": torch.zeros(6)}}
if what == "save":
    for step in (1, 2):
        ss.save_sharded(job, step, {"model": {"w": torch.arange(6.0) + step}}, group=g, generation=1, incarnation="i")
    print("SAVED")
elif what == "select":
    sel = parts.select_sharded(job)
    print("CHOSEN", sel.chosen.step if sel.chosen else None, [r.reason for r in sel.rejected])
    loaded = ss.load_sharded(sel.chosen, live, group=g)
    print("LOADED", loaded["model"]["w"].tolist())
else:
    info = ss.SnapshotInfo(2, job / "snapshots" / "step-2", "snapshots")
    t = time.monotonic()
    try:
        ss.load_sharded(info, live, group=g)
        print("LOADED")
    except GpuguardError as exc:
        print(f"REFUSED {time.monotonic() - t:.2f} {exc}")
sys.stdout.flush()
import os
os._exit(0)
"""


def sharded(job: Path, what: str, marker: Path, timeout: float = 90) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED_SCRIPT, str(job), what, str(marker)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout.splitlines()


def test_a_sharded_snapshot_binds_its_metadata_and_refuses_a_replaced_or_hash_dag_one(tmp_path):
    marker = tmp_path / "pwned"
    assert sharded(tmp_path, "save", marker) == ["SAVED"]
    step2 = tmp_path / "snapshots" / "step-2"
    manifest = m.load_manifest(step2)
    assert manifest.metadata == m.MetadataBinding.of((step2 / METADATA_FILE).read_bytes())
    plant(step2, marker)
    assert METADATA_FILE in m.verify_manifest(manifest, step2)[0]
    chosen, loaded = sharded(tmp_path, "select", marker)
    assert chosen.startswith("CHOSEN 1 ") and "corrupt: .metadata: BLAKE3" in chosen, chosen
    assert loaded == "LOADED [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]"
    [line] = sharded(tmp_path, "load", marker)
    assert line.startswith("REFUSED") and "replaced or corrupted" in line, line
    assert not marker.exists()
    dag = hashed_dag(60, "dict key")
    (step2 / METADATA_FILE).write_bytes(dag)
    m.write_manifest(
        m.Manifest(manifest.generation, 2, manifest.entries, 0, manifest.extra, m.MetadataBinding.of(dag)), step2
    )
    [line] = sharded(tmp_path, "load", marker, timeout=load_deadline(len(dag)) + 90)
    assert line.startswith("REFUSED") and "unreadable DCP metadata" in line, line
    assert "took more than" in line and float(line.split()[1]) < 10 * load_deadline(len(dag))
    assert not marker.exists()


_hex = st.text("0123456789abcdef", min_size=64, max_size=64)


@settings(max_examples=200, deadline=None)
@given(
    doc=st.fixed_dictionaries({"file": st.just(".metadata"), "bytes": st.integers(0, 2**40), "digest": _hex})
    | st.dictionaries(
        st.sampled_from(["file", "bytes", "digest", "extra"]),
        st.none() | st.integers(-5, 5) | st.booleans() | st.text(max_size=70) | _hex,
    )
)
def test_a_metadata_binding_round_trips_or_is_refused_as_a_value_error(doc):
    try:
        binding = m.MetadataBinding.from_dict(doc)
    except ValueError:
        return
    assert binding.to_dict() == doc
