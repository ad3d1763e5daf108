"""`gpu-recover status`: the pure decision (`recovery.operator.status.decide`) rule by rule, then the command
end to end on a real job directory with real processes as the active generation's members."""

from __future__ import annotations

import json
import os
import subprocess

import psutil

from gpuguard.generation.job import init_job, open_job_ledger
from gpuguard.generation.records import Incarnation, Member
from gpuguard.recovery.operator import audit
from gpuguard.recovery.operator.lifecycle import MemberRecord, SwitchEvidence
from gpuguard.recovery.operator.status import MemberLiveness, StatusFacts, decide
from tests.support.cli import run_cli
from tests.support.generation import child
from tests.support.processes import reap, spawn


def facts(**kw) -> StatusFacts:
    base = {
        "job_dir": "/j",
        "time": 0.0,
        "generation": 3,
        "digest": "d" * 64,
        "frontier_step": 40,
        "agents": (),
        "resume_step": 40,
        "resume_source": "snapshot of step 40",
    }
    return StatusFacts(**{**base, **kw})


def m(rank: int, state: str, detail: str = "") -> MemberLiveness:
    return MemberLiveness(rank, f"inc{rank}", "h1", 100 + rank, state, detail or state)


def test_every_member_gone_is_safe_to_resume_and_critical():
    d = decide(facts(members=(m(0, "gone"), m(1, "gone"))))
    assert d.safe_to_resume and d.state == "critical" and d.exit_code == 2
    assert d.line() == (
        "safe to resume: yes, because every member of generation 3 is gone and the certificate chain checks out; "
        "resume from step 40 (snapshot of step 40)"
    )
    assert d.job.state == "down"


def test_a_running_healthy_job_is_healthy_and_not_safe_to_resume():
    d = decide(facts(members=(m(0, "alive"), m(1, "alive")), vote={"verdict": "healthy", "reason": "ok"}))
    assert d.state == "healthy" and d.exit_code == 0 and not d.safe_to_resume
    assert "2 member(s) of generation 3 are still alive (rank 0, 1)" in d.because


def test_a_member_on_another_host_is_never_a_proof_of_quiescence():
    d = decide(facts(members=(m(0, "gone"), m(1, "unknown", "on another host (h2)"))))
    assert not d.safe_to_resume
    assert "cannot be proved gone (rank 1: on another host (h2)): quiescence is not proved" in d.because


def test_only_remote_members_is_unknown():
    d = decide(facts(members=(m(0, "unknown", "on another host (h2)"),)))
    assert d.state == "unknown" and d.exit_code == 3 and not d.safe_to_resume


def test_an_unverified_newer_generation_is_critical_and_never_safe():
    d = decide(facts(members=(m(0, "gone"),), unverified_after_active=(4,)))
    assert d.state == "critical" and not d.safe_to_resume and "[4] are stored but do not verify" in d.because


def test_no_certificate_is_unknown_and_not_safe():
    d = decide(facts(generation=None, digest=None, frontier_step=None, ledger_problem="no valid genesis certificate"))
    assert d.state == "unknown" and not d.safe_to_resume and "no verified active generation" in d.because


def test_a_partial_failure_is_critical():
    d = decide(facts(members=(m(0, "gone"), m(1, "alive")), vote={"verdict": "dead", "reason": "rank 0 dead"}))
    assert d.state == "critical" and not d.safe_to_resume
    assert d.job.state == "down" and any("rank 1 alive; rank 0 gone" in r for r in d.reasons)
    assert any(r.startswith("vote: dead") for r in d.reasons)


def test_slow_vote_and_warning_hazards_are_warnings():
    hz = ({"kind": "rdzv-id-none", "severity": "warning", "message": "--rdzv-id none"},)
    d = decide(facts(members=(m(0, "alive"),), vote={"verdict": "slow", "reason": "rank 0 slow"}, hazards=hz))
    assert d.state == "warning" and d.exit_code == 1


def test_orphaned_workers_block_a_resume():
    hz = ({"kind": "orphaned-workers", "severity": "critical", "message": "2 worker(s) outlived their agent"},)
    d = decide(facts(members=(m(0, "gone"),), hazards=hz))
    assert not d.safe_to_resume and "outlived their agent" in d.because and d.state == "critical"


def test_a_probe_that_timed_out_is_never_a_proof():
    d = decide(facts(members=(m(0, "gone"),), hazards_problem="timed out after 5 s"))
    assert not d.safe_to_resume and d.state == "critical"  # the member is gone (critical) but not proved quiescent
    d = decide(facts(members_problem="timed out after 5 s"))
    assert not d.safe_to_resume and d.state == "unknown"


def test_genesis_has_nothing_to_wait_for():
    d = decide(facts(generation=0, frontier_step=0))
    assert d.safe_to_resume and d.state == "healthy" and "has no members" in d.because


# --- end to end ----------------------------------------------------------------------------------


def _activate(jd, procs: list[subprocess.Popen], remote: int = 0) -> str:
    led = open_job_ledger(jd)
    parent = led.require_active()
    mem = [
        Member(r, Incarnation(f"inc-{p.pid}", os.uname().nodename, p.pid, psutil.Process(p.pid).create_time()))
        for r, p in enumerate(procs)
    ]
    mem += [Member(len(procs) + i, Incarnation(f"far{i}", "far-away-host", 4242, 1.0)) for i in range(remote)]
    cert = child(parent, tuple(mem), key=led.key, step=0, extra={"evicted": {"dead": [5], "killed": []}})
    led.activate(cert)
    return cert.digest()


def test_status_page_and_json_on_a_real_job(tmp_path):
    jd = tmp_path / "job"
    init_job(jd)
    alive, dead = spawn(), spawn()
    try:
        digest = _activate(jd, [alive, dead], remote=1)
        reap(dead)
        audit.append(jd, audit.new_record("abort", "done", 0, detail={"summary": "terminated 1 process(es)"}))
        r = run_cli("gpu-recover", "status", "--job-dir", str(jd), "--json", timeout=60)
        assert r.returncode == 2, r.stderr  # a member gone while another lives: critical
        doc = json.loads(r.stdout)
        assert doc["schema"] == "gpuguard.status/1" and doc["state"] == "critical"
        assert doc["ledger"]["active_generation"] == 1 and doc["ledger"]["certificate_digest"] == digest
        states = {x["rank"]: (x["state"], x["detail"]) for x in doc["members"]}
        assert states[0][0] == "alive" and states[1] == ("gone", "gone")
        assert states[2] == ("unknown", "on another host (far-away-host)")
        assert doc["evicted"] == [{"generation": 1, "dead": [5], "killed": []}]
        assert doc["ledger"]["fenced_commits"] == 0 and doc["ledger"]["refusals"] == 0
        assert [a["action"] for a in doc["audit_tail"]] == ["abort"]
        assert doc["safe_to_resume"] is False and "still alive (rank 0)" in doc["because"]
        page = run_cli("gpu-recover", "status", "--job-dir", str(jd), timeout=60)
        assert page.returncode == 2
        lines = page.stdout.splitlines()
        assert any(line.startswith("generation     1 (certificate " + digest[:12]) for line in lines)
        assert any("unknown: on another host (far-away-host)" in line for line in lines)
        assert "evicted        generation 1: dead [5], killed []" in lines
        assert lines[-1].startswith("safe to resume: no, because 1 member(s) of generation 1 are still alive")
        follow = run_cli(
            "gpu-recover", "status", "--job-dir", str(jd), "--follow", "--interval", "0.1", "--count", "2", "--json"
        )
        assert follow.returncode == 2 and len(follow.stdout.splitlines()) == 2
    finally:
        reap(alive, dead)


def test_status_writes_nothing_escapes_record_text_and_follow_ends_on_ctrl_c(tmp_path):
    import signal
    import time

    from tests.support.cli import BIN

    jd = tmp_path / "job"
    init_job(jd)
    audit.append(jd, audit.new_record("abort", "done", 0, detail={"summary": "x \x1b]0;owned\x07\x1b[2J"}))
    before = sorted((p.name, p.stat().st_size) for p in jd.rglob("*"))
    page = run_cli("gpu-recover", "status", "--job-dir", str(jd), timeout=60)
    assert page.returncode == 0, page.stderr  # genesis: healthy, nothing has run yet
    assert "\x1b" not in page.stdout and "x \\x1b]0;owned\\x07\\x1b[2J" in page.stdout
    assert sorted((p.name, p.stat().st_size) for p in jd.rglob("*")) == before
    proc = subprocess.Popen(
        [str(BIN / "gpu-recover"), "status", "--job-dir", str(jd), "--follow", "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(3.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err  # Ctrl-C ends --follow with the last page's code
    assert out.count("safe to resume: yes") >= 2


def test_a_silent_ledger_is_bounded_by_the_probe_deadline(tmp_path):
    """An etcd that accepts the connection and never answers: the page still comes, unknown (3)."""
    import socket
    import time

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # connections complete in the backlog; nothing ever reads or answers
    try:
        jd = tmp_path / "job"
        jd.mkdir()
        (jd / "ledger.url").write_text(f"etcd://127.0.0.1:{silent.getsockname()[1]}/x\n")
        t0 = time.monotonic()
        r = run_cli("gpu-recover", "status", "--job-dir", str(jd), "--probe-timeout", "1", "--json", timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        silent.close()
    assert r.returncode == 3, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ledger"]["active_generation"] is None and doc["ledger"]["problem"] == "timed out after 1 s"
    assert doc["safe_to_resume"] is False
    assert elapsed < 15, elapsed


# --- the job's lifecycle, state by state (pure) ----------------------------------------------------


def test_members_gone_with_the_agent_alive_is_a_restart_not_a_resume():
    d = decide(facts(members=(m(0, "gone"), m(1, "gone")), agents=(4242,), new_workers=((0, 7), (1, 8))))
    assert d.job.state == "restarting (agent alive)" and d.state == "warning" and d.exit_code == 1
    assert not d.safe_to_resume and "a second copy would split it" in d.because and "resume from step 40" in d.because
    assert "2 new worker(s) started by the agent, not yet in a generation (rank 0, 1)" in d.job.evidence
    assert "torchrun agent pid 4242 alive" in d.job.evidence


def test_every_member_closed_cleanly_is_finished_and_healthy():
    closed = {0: MemberRecord(True, 14), 1: MemberRecord(True, 14)}
    d = decide(facts(members=(m(0, "gone"), m(1, "gone")), records=closed, vote={"verdict": "dead", "reason": "x"}))
    assert d.job.state == "finished" and d.state == "healthy" and d.exit_code == 0 and d.safe_to_resume
    assert "every member closed its step log in generation 3 at step 14" in d.job.evidence
    assert d.because.startswith("the job finished cleanly in generation 3; a new run would resume from step 40")


def test_one_member_without_a_clean_close_is_down():
    records = {0: MemberRecord(True, 14), 1: MemberRecord(False, 13)}
    d = decide(facts(members=(m(0, "gone"), m(1, "gone")), records=records))
    assert d.job.state == "down" and d.state == "critical"
    assert "rank 1 ended without closing its step log (no clean exit)" in d.job.evidence


def test_survivor_reports_are_a_switch_in_place():
    sw = SwitchEvidence(reported=(1, 2), committed={1: 9, 2: 9})
    d = decide(facts(members=(m(0, "gone"), m(1, "alive"), m(2, "alive")), switch=sw))
    assert d.job.state == "switching in place" and d.state == "warning" and not d.safe_to_resume
    assert "in-place reports of generation 3 from rank 1, 2" in d.job.evidence
    refused = decide(facts(members=(m(0, "gone"), m(1, "alive")), switch=SwitchEvidence((1,), refused="TP group")))
    assert refused.job.state == "down" and any("was refused: TP group" in e for e in refused.job.evidence)


def test_every_member_alive_is_running_and_an_unreadable_process_table_is_said():
    d = decide(facts(members=(m(0, "alive"),), agents=None))
    assert d.job.state == "running" and "torchrun agents: unknown" in d.job.evidence[-1]
    assert decide(facts(generation=0, frontier_step=0, agents=(7,))).job.state == "starting (agent alive)"
    assert decide(facts(generation=0, frontier_step=0)).job.state == "not started"


def test_follow_waits_for_a_job_dir_that_does_not_exist_yet(tmp_path):
    import threading

    jd = tmp_path / "later"
    timer = threading.Timer(1.5, lambda: init_job(jd))
    timer.start()
    try:
        r = run_cli("gpu-recover", "status", "--job-dir", str(jd), "--follow", "--count", "1", "--interval", "0.2")
    finally:
        timer.cancel()
    assert r.returncode == 0, r.stderr
    assert "no such directory); waiting up to 600 s for it to appear" in r.stderr and "not started" in r.stdout
    never = run_cli("gpu-recover", "status", "--job-dir", str(tmp_path / "never"), "--follow", "--wait", "0.5")
    assert never.returncode == 66 and never.stderr.strip().endswith("after waiting 0.5 s")
    assert (
        run_cli("gpu-recover", "status", "--job-dir", str(tmp_path / "never")).returncode == 66
    )  # no --follow: no wait
