"""The pure hazard rules behind `gpu-doctor diagnose torchrun`."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpuguard.collectors.torchrun import parse_torchrun_cmdline
from gpuguard.diagnostics.torchrun_hazards import assess
from gpuguard.foundation.torchrun_facts import AgentFacts, WorkerFacts

NOW = 1_000_000.0


def worker(rank=0, *, alive=True, agent_alive=True, ppid=50, steps=5, age=100.0, restart=0):
    return WorkerFacts(rank, f"inc{rank}", 100 + rank, alive, 50, agent_alive, ppid, NOW - age, steps, restart)


def kinds(a):
    return sorted(h.kind for h in a.hazards)


def test_healthy_job_has_no_hazard():
    a = assess([AgentFacts(50, {"rdzv_id": "job", "rdzv_endpoint": "h:1"})], [worker(0), worker(1)], now=NOW)
    assert kinds(a) == [] and a.verdict == "healthy" and a.exit_code == 0


def test_rdzv_id_none_from_a_real_command_line():
    opts = parse_torchrun_cmdline(["torchrun", "--rdzv-backend=c10d", "--rdzv-endpoint=h:29400", "t.py"])
    a = assess([AgentFacts(50, opts)], [worker()], now=NOW)
    assert kinds(a) == ["rdzv-id-none"] and a.exit_code == 1
    assert assess([AgentFacts(50, {"standalone": "1"})], [], now=NOW).hazards == ()


def test_orphans_agent_dead_or_reparented():
    a = assess([], [worker(0, agent_alive=False, ppid=1), worker(1, agent_alive=True, ppid=1)], now=NOW)
    (h,) = a.hazards
    assert h.kind == "orphaned-workers" and h.ranks == (0, 1) and h.pids == (100, 101)
    assert a.verdict == "orphaned" and a.exit_code == 2


def test_stuck_in_init_only_after_the_timeout_and_only_when_alive():
    young = assess([], [worker(0, steps=0, age=10)], now=NOW, init_timeout_s=60)
    assert kinds(young) == []
    old = assess(
        [], [worker(0, steps=0, age=90, restart=1), worker(1, steps=0, age=90, alive=False)], now=NOW, init_timeout_s=60
    )
    (h,) = old.hazards
    assert h.kind == "stuck-in-init" and h.ranks == (0,) and "after a restart" in h.message
    assert old.verdict == "hung"
    unknown_steps = assess([], [worker(0, steps=-1, age=900)], now=NOW)
    assert kinds(unknown_steps) == []


def test_no_live_worker_is_dead():
    assert assess([AgentFacts(50, {"rdzv_id": "j"})], [worker(0, alive=False)], now=NOW).verdict == "dead"


@given(
    st.lists(
        st.builds(
            worker,
            rank=st.integers(0, 7),
            alive=st.booleans(),
            agent_alive=st.booleans(),
            ppid=st.one_of(st.none(), st.integers(1, 60)),
            steps=st.integers(-1, 3),
            age=st.floats(0, 1e4),
            restart=st.integers(0, 3),
        ),
        max_size=8,
    )
)
def test_every_flagged_pid_is_a_live_worker(workers):
    a = assess([], workers, now=NOW, init_timeout_s=60)
    live = {w.pid for w in workers if w.alive}
    for h in a.hazards:
        assert set(h.pids) <= live and h.severity in ("warning", "critical")
    assert a.exit_code in (0, 1, 2) and a.verdict in ("orphaned", "hung", "dead", "healthy", "unknown")


def test_no_torch_on_the_doctor_and_action_paths(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; from gpuguard.cli._app import run; from gpuguard.cli import doctor, recover; "
        f"jd = {str(tmp_path)!r}; "
        "from gpuguard.foundation.jobdir import ensure_job; ensure_job(jd); "
        "codes = [run(doctor.app, 'gpu-doctor', ['diagnose', 'torchrun', '--job-dir', jd, '--json']), "
        "run(recover.app, 'gpu-recover', ['abort', '--job-dir', jd, '--dry-run', '--json']), "
        "run(recover.app, 'gpu-recover', ['runbook', 'run', 'hang', '--job-dir', jd, '--dry-run', '--json'])]; "
        "print(codes, 'torch' in sys.modules, file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stderr.strip().splitlines()[-1] == "[0, 0, 0] False", out.stderr
