"""The restart path across real namespace hosts: torchrun agents on `--rdzv-backend=gpuguard` (etcd).

Three training hosts (gpuguard.testhosts: own network, PID, mount and UTS namespaces) run one torchrun
agent each (`--nnodes=2:3`), the rendezvous, ledger, commits and leases in a real etcd on the control
host, snapshots on the shared checkpoint storage, each host's job directory private. The host of
rank 0 (whose worker serves that generation's activation store: the "store host") is powered off
mid-run. The survivors' agents must re-rendezvous on etcd, and their new workers certify generation 2
without an operator: the lost incarnation proved quiet by its expired lease, the state restored from
the shared storage equal to the one the lost rank 0 recorded at the certified step, every member on
the same state, one chain that `gpu-generation verify --ledger etcd://...` accepts. A spare host then
joins: generation 3, a certified scale-up. Skipped only where hosts cannot be made (no root).
"""

from __future__ import annotations

import pytest

from gpuguard.examples.restart_hosts import RestartHostJob
from gpuguard.generation.rules import PROOF_GONE, PROOF_LEASE
from gpuguard.testhosts import preflight, up

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

HOSTS = ["h1", "h2", "h3"]
STEPS, MARK = 40, 6


@pytest.fixture(scope="module")
def can_make_hosts() -> None:
    reason = preflight()
    if reason:
        pytest.skip(reason)


def test_the_store_host_is_powered_off_and_the_survivors_restart_certified_then_a_spare_joins(can_make_hosts, tmp_path):
    with up(len(HOSTS) + 1) as c:
        job = RestartHostJob.launch(c, HOSTS, tmp_path, steps=STEPS, sleep=0.2, spares=["h4"])
        with job:
            assert job.wait_for(lambda: job.newest_step() >= MARK, 150), job.logs()
            victim = job.rank_host(0, 1)
            assert victim is not None, job.logs()
            c.power_off(victim)
            survivors = [h for h in HOSTS if h != victim]
            g2_seen = job.wait_for(lambda: any(r["generation"] == 2 for r in job.records("resume")), 90)
            assert g2_seen, job.logs()
            job.start_agent("h4")  # a spare host joins the running job
            codes = job.wait([*survivors, "h4"], 150)
            ledger = job.ledger(survivors[0])
            verified, report = job.verify(survivors[0])
            logs = job.logs()
            records = {kind: job.records(kind) for kind in ("resume", "hashes", "final")}
            left = {h: c.pids(h) for h in [*survivors, "h4"]}
            addresses = {h: c.host(h).address for h in HOSTS}

    assert all(code == 0 for code in codes.values()), (codes, logs)
    assert ledger["generations"][:3] == [0, 1, 2], ledger["generations"]
    g1, g2 = ledger["history"][1], ledger["history"][2]
    assert len(g1["members"]) == 3 and g2["reason"] == "scale-down" and len(g2["members"]) == 2
    lost = next(m["id"] for m in g1["members"] if m["host"] == victim)
    assert g2["quiescence"] == "proved" and g2["extra"]["quiescence_by"][lost] == PROOF_LEASE, g2
    others = {m["id"] for m in g1["members"]} - {lost}
    assert all(g2["extra"]["quiescence_by"][i] == PROOF_GONE for i in others), g2
    assert sorted(m["host"] for m in g2["members"]) == sorted(survivors)
    # the certificate names the rendezvous round's agents (torch's `addr_pid_localid`): the survivors'
    agents = g2["extra"]["rendezvous_participants"]
    assert sorted(a.split("_", 1)[0] for a in agents) == sorted(addresses[h] for h in survivors), agents
    # the lost incarnation never committed after its host lost power, and never in generation 2
    assert all(i != lost for _, i, _ in ledger["commits"]["2"])

    # every member of generation 2 restored the certified state, bit for bit the one the lost rank 0 had
    resumes = [r for r in records["resume"] if r["generation"] == 2]
    assert len(resumes) == 2 and len({r["hash"] for r in resumes}) == 1, resumes
    frontier = resumes[0]["frontier_step"]
    assert frontier == g2["frontier"] >= MARK - 1
    before = {r["step"]: r["hash"] for r in records["hashes"] if r["step"] <= frontier}
    assert before.get(frontier) == resumes[0]["hash"]  # the state rank 0 of generation 1 recorded then

    # the spare's join is a certified scale-up, and the job ends with every member on one state
    last = ledger["history"][-1]
    assert last["reason"] == "scale-up" and len(last["members"]) == 3
    assert "h4" in {m["host"] for m in last["members"]}
    finals = [r for r in records["final"] if r["generation"] == last["generation"]]
    assert len(finals) == 3 and len({f["hash"] for f in finals}) == 1, finals
    assert verified == 0 and report["ok"], report
    assert all(len(pids) <= 1 for pids in left.values()), left  # nothing of the job left running


@pytest.mark.parametrize(("fault", "rank"), [("partition", 1), ("freeze", 0)])
def test_a_partitioned_or_frozen_host_is_fenced_and_never_commits_again_while_the_others_restart(
    can_make_hosts, tmp_path, fault, rank
):
    with up(len(HOSTS)) as c:
        job = RestartHostJob.launch(c, HOSTS, tmp_path, steps=STEPS, sleep=0.2)
        with job:
            assert job.wait_for(lambda: job.newest_step() >= MARK, 150), job.logs()
            victim = job.rank_host(rank, 1)
            assert victim is not None, job.logs()
            getattr(c, fault)(victim)
            survivors = [h for h in HOSTS if h != victim]
            g2_seen = job.wait_for(lambda: any(r["generation"] == 2 for r in job.records("resume")), 90)
            assert g2_seen, job.logs()
            (c.heal if fault == "partition" else c.thaw)(victim)  # it comes back, the old worker fenced
            codes = job.wait(survivors, 150)
            ledger = job.ledger(survivors[0])
            verified, report = job.verify(survivors[0])
            logs = job.logs()
            records = {kind: job.records(kind) for kind in ("resume", "final")}
            job.wait([victim], 30)
            job.kill_all()
            victim_log = job.log(victim)
            left = {h: c.pids(h) for h in HOSTS}

    assert all(code == 0 for code in codes.values()), (codes, logs)
    g1, g2 = ledger["history"][1], ledger["history"][2]
    assert len(g1["members"]) == 3 and g2["reason"] == "scale-down" and len(g2["members"]) == 2, g2
    lost = next(m["id"] for m in g1["members"] if m["host"] == victim)
    assert g2["quiescence"] == "proved" and g2["extra"]["quiescence_by"][lost] == PROOF_LEASE, g2
    # the old incarnation never commits once its host is cut off or stopped: not in generation 2 or
    # later, and in generation 1 at most the step it was in when the fault hit
    for gen, commits in ledger["commits"].items():
        if int(gen) >= 2:
            assert all(i != lost for _, i, _ in commits), (gen, commits)
    assert f"incarnation {lost[:12]}) fenced itself" in victim_log, victim_log[-3000:]
    cut = max((s for _, i, s in ledger["commits"]["1"] if i == lost), default=0)
    assert cut <= g2["frontier"] + 2, (cut, g2["frontier"])
    resumes = [r for r in records["resume"] if r["generation"] == 2]
    assert len(resumes) == 2 and len({r["hash"] for r in resumes}) == 1, resumes
    last = ledger["history"][-1]["generation"]
    finals = [r for r in records["final"] if r["generation"] == last]
    assert finals and len({f["hash"] for f in finals}) == 1, finals
    assert verified == 0 and report["ok"], report
    assert all(len(pids) <= 1 for pids in left.values()), left
