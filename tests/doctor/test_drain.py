"""The Slurm drain (`doctor.drain.drain_node`, the sweep's action): its argv, never a shell, a foreign reason left alone.

A recording `scontrol` on PATH stands in for Slurm: it prints what `show node` is told to and
records every other argv, so the tests prove what would have run.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from gpuguard.doctor.drain import DRAIN_PREFIX, drain_command, drain_node, foreign_reason
from gpuguard.foundation.errors import EXIT_CRITICAL, EXIT_OK, EXIT_REFUSED, EXIT_TEMPFAIL


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    """Install a fake scontrol; returns (configure(show=..., rc=..., stderr=..., sleep=...), recorded argvs)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "argv.jsonl"
    config = tmp_path / "config.json"
    fake = bindir / "scontrol"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, sys, time\n"
        f"cfg = json.load(open({str(config)!r}))\n"
        "if sys.argv[1] == 'show':\n"
        "    print(cfg['show'])\n"
        "    sys.exit(0)\n"
        "time.sleep(cfg['sleep'])\n"
        f"open({str(record)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "sys.stderr.write(cfg['stderr'])\n"
        "sys.exit(cfg['rc'])\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")

    def configure(
        show: str = "NodeName=gpu17 State=IDLE Reason=(null)", rc: int = 0, stderr: str = "", sleep: float = 0
    ):
        config.write_text(json.dumps({"show": show, "rc": rc, "stderr": stderr, "sleep": sleep}))

    def recorded() -> list[list[str]]:
        return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []

    configure()
    return configure, recorded


def test_drain_command_is_one_argv_with_a_bounded_one_line_reason():
    cmd = drain_command("gpu17", "drain: GPU 0000:2b:00.0 fell off the bus\nsecond line" + "x" * 300)
    assert cmd[:4] == ["scontrol", "update", "NodeName=gpu17", "State=DRAIN"]
    assert cmd[4].startswith(f"Reason={DRAIN_PREFIX} drain: GPU 0000:2b:00.0") and "\n" not in cmd[4]
    assert len(cmd[4]) == len("Reason=") + 200


@pytest.mark.parametrize(
    "show,theirs",
    [
        ("NodeName=gpu17 State=IDLE Reason=(null) Comment=(null)", None),
        ("NodeName=gpu17 State=IDLE Reason= Comment=x", None),
        ("NodeName=gpu17 State=IDLE", None),
        ("NodeName=gpu17 State=DRAIN Reason=gpu-doctor: drain: Xid 79 [root@2024-08-30]", None),
        (
            "NodeName=gpu17 State=DRAIN Reason=bad DIMM, ticket 4711 [admin@2024-08-30T10:00:00] Comment=x",
            "bad DIMM, ticket 4711 [admin@2024-08-30T10:00:00]",
        ),
        ("NodeName=gpu17 State=DRAIN Reason=maintenance", "maintenance"),
    ],
)
def test_foreign_reason_is_told_from_our_own(show, theirs):
    assert foreign_reason(show) == theirs


def test_a_drain_someone_else_set_is_left_alone(scontrol):
    configure, recorded = scontrol
    configure(show="NodeName=gpu17 State=DRAIN Reason=bad DIMM, ticket 4711 [admin@2024-08-30T10:00:00]")
    result = drain_node("gpu17", "drain: Xid 79")
    assert result.outcome == "refused" and result.exit_code == EXIT_REFUSED
    assert (
        result.summary
        == "not run: node already has a reason set by someone else (bad DIMM, ticket 4711 [admin@2024-08-30T10:00:00])"
    )
    assert recorded() == []  # scontrol update never ran


def test_an_undrained_node_or_our_own_drain_is_drained_with_the_exact_argv(scontrol):
    configure, recorded = scontrol
    result = drain_node("gpu17", "drain: Xid 79")
    assert (result.outcome, result.exit_code, result.summary) == ("done", EXIT_OK, "drained")
    configure(show="NodeName=gpu17 State=DRAIN Reason=gpu-doctor: drain: Xid 48")
    assert drain_node("gpu17", "drain: Xid 79").summary == "drained"  # ours: updated, not refused
    assert recorded() == [drain_command("gpu17", "drain: Xid 79")[1:]] * 2
    assert result.details["command"] == drain_command("gpu17", "drain: Xid 79")


def test_failures_are_one_line_results_not_exceptions(scontrol, tmp_path, monkeypatch):
    configure, _ = scontrol
    configure(rc=1, stderr="slurm_update error: Invalid node name specified\nmore\n")
    result = drain_node("nosuch", "drain: Xid 79")
    assert result.outcome == "failed" and result.exit_code == EXIT_CRITICAL
    assert result.summary == "failed: exit 1 slurm_update error: Invalid node name specified"
    configure(sleep=5)
    result = drain_node("gpu17", "drain: Xid 79", timeout_s=0.5)
    assert (result.outcome, result.exit_code) == ("timeout", EXIT_TEMPFAIL)
    assert result.summary == "failed: scontrol timed out after 0.5 s"
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert drain_node("gpu17", "drain: Xid 79").summary == "not run: scontrol is not installed"


def test_the_operator_uses_the_doctors_drain():
    """`gpu-recover` (the operator's room) imports the drain from the doctor: one drain, not two."""
    from gpuguard.doctor import drain
    from gpuguard.recovery.operator import actions

    assert (actions.drain_node, actions.drain_command, actions.foreign_reason) == (
        drain.drain_node,
        drain.drain_command,
        drain.foreign_reason,
    )
