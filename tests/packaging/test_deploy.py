"""The deployment files (deploy/): the DaemonSet manifest, the systemd units and the Slurm / NHC checks,
validated offline (YAML, required fields, the command's options against the real `--help`), and run
where they can run here (the health-check script over a real sweep)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.cli import BIN, REPO, run_cli
from tests.support.node import SAMPLE_LOG, SAMPLE_NVML, healthy_gpu, sample_sweep_argv, snapshot, write_json

DEPLOY = REPO / "deploy"


def _options(*command: str) -> set[str]:
    """The long options `gpu-doctor <command> --help` lists."""
    r = run_cli("gpu-doctor", *command, "--help", env={"COLUMNS": "300"})
    assert r.returncode == 0, r.stderr
    return set(re.findall(r"(--[a-z][a-z-]+)", r.stdout))


def _systemd(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file's sections and keys (systemd allows a key more than once)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"{path.name}: not a key=value line: {raw!r}"
        current.setdefault(key, []).append(value)
    return sections


def _used_options(argv: list[str]) -> set[str]:
    return {a.split("=")[0] for a in argv if a.startswith("--")}


def test_the_daemonset_is_a_valid_daemonset():
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "gpu-doctor-daemonset.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    ds = kinds["DaemonSet"]
    assert ds["apiVersion"] == "apps/v1" and ds["metadata"]["name"] and ds["metadata"]["namespace"] == "gpuguard"
    assert kinds["Namespace"]["metadata"]["name"] == "gpuguard"
    spec = ds["spec"]
    template = spec["template"]
    labels = template["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()  # the API server refuses anything else
    pod = template["spec"]
    (container,) = pod["containers"]
    assert container["name"] and container["image"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        assert mount["name"] in volumes and mount["mountPath"].startswith("/")
    assert volumes["kmsg"]["hostPath"] == {"path": "/dev/kmsg", "type": "CharDevice"}
    assert all(
        v["hostPath"]["type"] in ("CharDevice", "DirectoryOrCreate", "Directory", "File") for v in volumes.values()
    )
    assert container["securityContext"]["capabilities"]["add"] == ["SYSLOG"]
    assert container["resources"]["limits"]["memory"]
    argv = container["command"]
    assert argv[:3] == ["gpu-doctor", "watch", "node"]
    assert _used_options(argv) <= _options("watch", "node")
    state = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "state")
    assert argv[argv.index("--state-dir") + 1] == state  # the state survives a pod restart on the host
    textfile = argv[argv.index("--textfile") + 1]
    assert any(textfile.startswith(m["mountPath"] + "/") for m in container["volumeMounts"]) and textfile.endswith(
        ".prom"
    )


def test_the_watch_unit_runs_the_watcher_and_stops_it_with_sigterm():
    unit = _systemd(DEPLOY / "systemd" / "gpu-doctor-watch.service")
    svc = unit["Service"]
    argv = svc["ExecStart"][0].split()
    assert argv[0].endswith("/gpu-doctor") and argv[1:4] == ["watch", "node", "--state-dir"]
    assert _used_options(argv) <= _options("watch", "node")
    assert svc["Type"] == ["simple"] and svc["KillSignal"] == ["SIGTERM"] and svc["Restart"] == ["on-failure"]
    assert set(svc["RestartPreventExitStatus"][0].split()) == {"64", "65", "66", "73", "77"}
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_the_sweep_oneshot_treats_verdicts_as_success_and_its_timer_runs_it():
    svc = _systemd(DEPLOY / "systemd" / "gpu-doctor-sweep.service")["Service"]
    assert svc["Type"] == ["oneshot"] and svc["SuccessExitStatus"] == ["1 2 3"]
    argv = svc["ExecStart"][0].split()
    assert argv[1] == "sweep" and _used_options(argv) <= _options("sweep")
    timer = _systemd(DEPLOY / "systemd" / "gpu-doctor-sweep.timer")
    assert timer["Timer"]["Unit"] == ["gpu-doctor-sweep.service"] and timer["Timer"]["OnUnitActiveSec"]
    assert timer["Install"]["WantedBy"] == ["timers.target"]


def test_the_slurm_health_check_runs_a_real_sweep(tmp_path):
    script = DEPLOY / "slurm" / "gpu-doctor-healthcheck.sh"
    assert os.access(script, os.X_OK)
    assert subprocess.run(["bash", "-n", str(script)], timeout=30).returncode == 0
    assert subprocess.run(["bash", "-n", str(DEPLOY / "slurm" / "gpuguard.nhc")], timeout=30).returncode == 0
    (tmp_path / "state").mkdir()
    log = tmp_path / "kern.log"
    shutil.copy(SAMPLE_LOG, log)
    bindir = tmp_path / "bin"  # no scontrol here: the drain is reported "not run", never a failure
    bindir.mkdir()
    env = {
        **os.environ,
        "GPU_DOCTOR": str(BIN / "gpu-doctor"),
        "GPUGUARD_STATE_DIR": str(tmp_path / "state"),
        "SLURMD_NODENAME": "gpu17",
        "PATH": f"{bindir}{os.pathsep}/usr/bin:/bin",
    }
    r = subprocess.run(
        [str(script), "--kernel-log", str(log), "--nvml-snapshot", str(SAMPLE_NVML)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout.startswith("GPU CRITICAL - drain"), (r.stdout, r.stderr)
    assert "gpu-doctor: drain: scontrol update NodeName=gpu17 State=DRAIN" in r.stderr


# --- Prometheus alert rules and the Grafana dashboard ------------------------------------------------------

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (.ci/setup: Debian prometheus)")


def _exported_metrics(tmp_path: Path) -> set[str]:
    """The metric families a real sweep writes into its textfile (the names the rules and panels may use)."""
    out = tmp_path / "text"
    out.mkdir(mode=0o700)
    r = run_cli(*sample_sweep_argv(tmp_path / "state"), "--textfile", str(out / "g.prom"), "--quiet")
    assert r.returncode == 2, r.stderr
    return set(re.findall(r"^# TYPE (\w+) ", (out / "g.prom").read_text(), re.M))


def _metrics_in(expr: str) -> set[str]:
    return set(re.findall(r"\b(gpudoctor_\w+)", expr))


@needs_promtool
def test_the_alert_rules_check_and_pass_their_unit_tests(tmp_path):
    rules = DEPLOY / "prometheus" / "gpuguard-alerts.yml"
    check = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "SUCCESS: 7 rules found" in check.stdout, check.stdout + check.stderr
    unit = subprocess.run(
        [PROMTOOL, "test", "rules", "gpuguard-alerts.test.yml"],
        cwd=rules.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unit.returncode == 0, unit.stdout + unit.stderr
    exported = _exported_metrics(tmp_path)
    doc = yaml.safe_load(rules.read_text())
    for rule in doc["groups"][0]["rules"]:
        assert _metrics_in(rule["expr"]) <= exported, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]


@needs_promtool
def test_the_grafana_dashboard_is_importable_and_every_query_parses(tmp_path):
    dash = json.loads((DEPLOY / "grafana" / "gpuguard-dashboard.json").read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:  # 24 columns, no two panels on one cell
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        cells |= mine
    exported = _exported_metrics(tmp_path)
    rules = []
    for p in dash["panels"]:
        for t in p["targets"]:
            assert _metrics_in(t["expr"]) <= exported, p["title"]
            expr = t["expr"].replace("$instance", ".*")  # the template variable, as "All" sends it
            rules.append({"record": f"gpuguard:panel_{p['id']}_{t['refId']}", "expr": expr})
    parsed = tmp_path / "panels.yml"
    parsed.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    check = subprocess.run([PROMTOOL, "check", "rules", str(parsed)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr  # promtool parses every panel's PromQL


# --- Slurm Prolog and Epilog -------------------------------------------------------------------------------


def _slurm_env(tmp_path: Path) -> dict[str, str]:
    bindir = tmp_path / "bin"  # no scontrol: a drain is reported "not run", never a failure
    bindir.mkdir(exist_ok=True)
    (tmp_path / "state").mkdir(exist_ok=True)
    return {
        **os.environ,
        "GPU_DOCTOR": str(BIN / "gpu-doctor"),
        "GPUGUARD_STATE_DIR": str(tmp_path / "state"),
        "SLURMD_NODENAME": "gpu17",
        "SLURM_JOB_ID": "4711",
        "PATH": f"{bindir}{os.pathsep}/usr/bin:/bin",
    }


def test_the_prolog_fails_on_a_bad_gpu_and_passes_a_healthy_node(tmp_path):
    script = DEPLOY / "slurm" / "gpu-doctor-prolog.sh"
    assert os.access(script, os.X_OK) and subprocess.run(["bash", "-n", str(script)], timeout=30).returncode == 0
    env = _slurm_env(tmp_path)
    evidence = ["--kernel-log", str(SAMPLE_LOG), "--nvml-snapshot", str(SAMPLE_NVML), "--since", "100000d"]
    bad = subprocess.run([str(script), *evidence], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1 and bad.stderr.startswith("gpu-doctor prolog, job 4711: GPU CRITICAL - drain"), bad
    healthy = write_json(tmp_path / "healthy.json", snapshot(healthy_gpu(0), healthy_gpu(1)))
    empty = tmp_path / "empty.log"
    empty.write_text("")
    ok = subprocess.run(
        [str(script), "--kernel-log", str(empty), "--nvml-snapshot", str(healthy)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert ok.returncode == 0 and ok.stderr.startswith("gpu-doctor prolog, job 4711: GPU OK - 2 GPUs healthy"), ok


def test_the_epilog_drains_with_gpu_doctors_reason_and_exits_0(tmp_path):
    script = DEPLOY / "slurm" / "gpu-doctor-epilog.sh"
    assert os.access(script, os.X_OK) and subprocess.run(["bash", "-n", str(script)], timeout=30).returncode == 0
    log = tmp_path / "kern.log"
    shutil.copy(SAMPLE_LOG, log)
    r = subprocess.run(
        [str(script), "--kernel-log", str(log), "--nvml-snapshot", str(SAMPLE_NVML)],
        capture_output=True,
        text=True,
        env=_slurm_env(tmp_path),
        timeout=120,
    )
    assert r.returncode == 0, r
    assert r.stderr.startswith("gpu-doctor epilog, job 4711: ") and "GPU CRITICAL - drain" in r.stderr
    assert "gpu-doctor: drain: scontrol update NodeName=gpu17 State=DRAIN" in r.stderr
