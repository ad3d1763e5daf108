"""`gpu-recover status` names the old incarnations a certificate proved quiet by fencing (docs/fencing.md):
they may still be running while their host's lease lives, and the page says so, and until when."""

from __future__ import annotations

import json
import uuid
from urllib.parse import urlsplit

import pytest

from gpuguard.foundation.etcd import EtcdClient
from gpuguard.generation.job import init_job, open_job_ledger
from gpuguard.generation.keys import load_key
from gpuguard.generation.records import Incarnation, Member
from gpuguard.generation.rules import PROOF_FENCED, PROOF_REPORTED
from tests.support.cli import run_cli
from tests.support.generation import child

pytestmark = pytest.mark.etcd


def test_a_fenced_incarnation_may_be_running_while_its_lease_lives_then_ended(tmp_path, etcd_url):
    u = urlsplit(etcd_url)
    prefix = f"/status-fenced-{uuid.uuid4().hex}"
    init_job(tmp_path, url=f"etcd://{u.hostname}:{u.port}{prefix}")
    key = load_key(tmp_path)
    ledger = open_job_ledger(tmp_path)
    hosts = ("h1.example", "h2.example", "h3.example")  # not this host: liveness cannot be probed
    g1 = child(
        ledger.require_active(),
        tuple(Member(r, Incarnation(uuid.uuid4().hex, h, 4000 + r, 1.0 + r)) for r, h in enumerate(hosts)),
        key=key,
        reason="start",
    )
    ledger.activate(g1)
    zombie = g1.members[2].incarnation
    proofs = {m.incarnation.id: PROOF_REPORTED for m in g1.members[:2]} | {zombie.id: PROOF_FENCED}
    g2 = child(g1, g1.members[:2], key=key, extra={"switch": "in-place", "quiescence_by": proofs})
    ledger.activate(g2)
    ledger.close()

    client = EtcdClient.from_url(f"etcd://{u.hostname}:{u.port}{prefix}")
    try:
        lease = client.grant(60)
        client.put(f"{prefix}/lease/{zombie.id}", json.dumps({"rank": 2, "host": hosts[2]}), lease=lease)
        r = run_cli("gpu-recover", "status", "--job-dir", str(tmp_path), "--json", timeout=60)
        [f] = json.loads(r.stdout)["fenced_incarnations"]
        assert (f["fenced_by_generation"], f["rank"], f["incarnation"], f["host"]) == (2, 2, zombie.id, hosts[2])
        assert f["state"] == "may-be-running" and 0 < f["lease_left_s"] <= 60, f
        assert "sees generation 2 active" in f["until"]
        human = run_cli("gpu-recover", "status", "--job-dir", str(tmp_path), timeout=60).stdout
        assert f"fenced         rank 2 of generation 1 on {hosts[2]}" in human and "may still be running" in human

        assert client.revoke(lease)  # its host's lease expired: etcd dropped the key with it
        [f] = json.loads(run_cli("gpu-recover", "status", "--job-dir", str(tmp_path), "--json").stdout)[
            "fenced_incarnations"
        ]
        assert f["state"] == "ended" and f["lease_left_s"] is None and "fenced itself" in f["until"]
    finally:
        client.close()
