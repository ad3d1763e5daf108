"""The Kubernetes drain (`doctor.drain.drain_kubernetes_node`, `--drain-via kubernetes`): a taint and a reason
annotation through `kubectl` argvs (never a shell), a node someone else holds left alone, printed unless asked to run.

No Kubernetes API server runs here, so `kubectl` is the one boundary faked: a recording `kubectl` on PATH
answers `get node NAME -o json` with the Node object the test writes and records every other argv, so the
tests prove what would have run (as tests/doctor/test_drain.py does for `scontrol`). The real `kubectl`
argument forms used are `kubectl taint nodes NODE KEY=VALUE:EFFECT --overwrite` and
`kubectl annotate nodes NODE KEY=VALUE --overwrite`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from gpuguard.doctor.drain import (
    DRAIN_PREFIX,
    REASON_ANNOTATION,
    TAINT,
    drain_kubernetes_node,
    foreign_hold,
    kubernetes_commands,
)
from gpuguard.foundation.errors import EXIT_CRITICAL, EXIT_OK, EXIT_REFUSED
from tests.support.cli import run_cli
from tests.support.node import SAMPLE_LOG, SAMPLE_NVML


def node_json(unschedulable: bool = False, reason: str | None = None) -> str:
    notes = {} if reason is None else {REASON_ANNOTATION: reason}
    return json.dumps(
        {"kind": "Node", "metadata": {"name": "gpu17", "annotations": notes}, "spec": {"unschedulable": unschedulable}}
    )


@pytest.fixture
def kubectl(tmp_path, monkeypatch):
    """Install a fake kubectl; returns (configure(node=..., rc=...), recorded argvs)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record, config = tmp_path / "argv.jsonl", tmp_path / "config.json"
    fake = bindir / "kubectl"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"cfg = json.load(open({str(config)!r}))\n"
        "if sys.argv[1] == 'get':\n"
        "    print(cfg['node'])\n"
        "    sys.exit(0)\n"
        f"open({str(record)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "sys.exit(cfg['rc'])\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")

    def configure(node: str = node_json(), rc: int = 0) -> None:
        config.write_text(json.dumps({"node": node, "rc": rc}))

    def recorded() -> list[list[str]]:
        return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []

    configure()
    return configure, recorded


def test_the_commands_are_argvs_with_a_bounded_one_line_reason():
    taint, annotate = kubernetes_commands("gpu17", "drain: GPU fell off the bus\n$(rm -rf /); x" + "x" * 300)
    assert taint == ["kubectl", "taint", "nodes", "gpu17", "gpuguard.io/gpu-health=drain:NoSchedule", "--overwrite"]
    assert annotate[:4] == ["kubectl", "annotate", "nodes", "gpu17"] and annotate[-1] == "--overwrite"
    assert annotate[4].startswith(f"{REASON_ANNOTATION}={DRAIN_PREFIX} drain: GPU") and "\n" not in annotate[4]
    assert len(annotate[4]) == len(REASON_ANNOTATION) + 1 + 200


@pytest.mark.parametrize(
    "node,theirs",
    [
        (node_json(), None),
        (node_json(reason="gpu-doctor: drain: Xid 79"), None),
        (node_json(unschedulable=True, reason="gpu-doctor: drain: Xid 79"), None),  # our own, set before
        (node_json(unschedulable=True), "cordoned by someone else"),
        (node_json(reason="bad DIMM, ticket 4711"), f"{REASON_ANNOTATION} set by someone else (bad DIMM, ticket 4711)"),
        ("not json", "its description is not JSON"),
        ("[1]", "its description is not a Node object"),
    ],
)
def test_a_hold_someone_else_set_is_told_from_our_own(node, theirs):
    assert foreign_hold(node) == theirs


def test_drain_taints_and_annotates_once_nobody_else_holds_the_node(kubectl):
    configure, recorded = kubectl
    r = drain_kubernetes_node("gpu17", "drain: Xid 79")
    assert (r.outcome, r.exit_code, r.summary) == ("done", EXIT_OK, "drained")
    assert recorded() == [c[1:] for c in kubernetes_commands("gpu17", "drain: Xid 79")]
    configure(node_json(unschedulable=True))
    r = drain_kubernetes_node("gpu17", "drain: Xid 79")
    assert (r.outcome, r.exit_code) == ("refused", EXIT_REFUSED) and "cordoned by someone else" in r.summary
    assert len(recorded()) == 2  # nothing more ran
    configure(rc=1)
    r = drain_kubernetes_node("gpu17", "drain: Xid 79")
    assert r.outcome == "failed" and r.exit_code == EXIT_CRITICAL and r.summary.startswith("failed: kubectl taint")


def test_without_kubectl_it_says_so_and_runs_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no kubectl anywhere
    assert shutil.which("kubectl") is None
    r = drain_kubernetes_node("gpu17", "drain: Xid 79")
    assert (r.outcome, r.summary) == ("failed", "not run: kubectl is not installed")


def test_the_sweep_prints_by_default_and_runs_with_run_drain(tmp_path, kubectl):
    _, recorded = kubectl
    argv = ["sweep", "--kernel-log", str(SAMPLE_LOG), "--nvml-snapshot", str(SAMPLE_NVML), "--json"]
    env = {"PATH": os.environ["PATH"]}
    dry = run_cli(
        "gpu-doctor",
        *argv,
        "--state-dir",
        str(tmp_path / "a"),
        "--drain",
        "--drain-via",
        "kubernetes",
        "--node",
        "gpu17",
        env=env,
    )
    drain = json.loads(dry.stdout)["drain"]
    assert drain["via"] == "kubernetes" and drain["ran"] is False and drain["result"] is None
    assert drain["commands"][0][-2] == TAINT and recorded() == []  # printed, nothing run
    ran = run_cli(
        "gpu-doctor",
        *argv,
        "--state-dir",
        str(tmp_path / "b"),
        "--run-drain",
        "--drain-via",
        "kubernetes",
        "--node",
        "gpu17",
        env=env,
    )
    assert json.loads(ran.stdout)["drain"]["result"] == "drained"
    assert [a[0] for a in recorded()] == ["taint", "annotate"]
    bad = run_cli("gpu-doctor", *argv, "--state-dir", str(tmp_path / "c"), "--drain-via", "k8s")
    assert bad.returncode == 64 and "expected slurm or kubernetes" in bad.stderr
