"""`gpu-doctor sweep`: state across runs, Prometheus textfile, webhook, Slurm drain, npd/nagios."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.cli import run_cli
from tests.support.node import SAMPLE_LOG, SAMPLE_NVML, healthy_gpu, snapshot, write_json

XID48 = "[Fri Aug 30 14:00:00 2024] NVRM: Xid (PCI:0000:61:00): 48, pid=99, name=python, An uncorrectable ECC error\n"


@pytest.fixture
def node(tmp_path):
    log = tmp_path / "kern.log"
    shutil.copy(SAMPLE_LOG, log)
    healthy = write_json(tmp_path / "healthy.json", snapshot(healthy_gpu(0, "0000:61:00.0"), healthy_gpu(1)))
    return tmp_path, log, healthy


def _sweep(tmp_path, log, snap, *args, **kw):
    return run_cli(
        "gpu-doctor",
        "sweep",
        "--kernel-log",
        str(log),
        "--nvml-snapshot",
        str(snap),
        "--state-dir",
        str(tmp_path / "state"),
        *args,
        **kw,
    )


def test_state_is_kept_and_only_new_lines_are_read(node):
    tmp_path, log, healthy = node
    prom = tmp_path / "textfile" / "gpudoctor.prom"
    prom.parent.mkdir()  # never created for you
    first = _sweep(tmp_path, log, healthy, "--json", "--textfile", str(prom))
    doc = json.loads(first.stdout)
    assert first.returncode == 2 and doc["verdict"] == "drain"  # Xid 79 on 0000:2b:00.0 in the log
    assert doc["sections"]["state"]["new_events"] == 10
    assert (tmp_path / "state" / "sweep-state.json").stat().st_mode & 0o777 == 0o600
    second = json.loads(_sweep(tmp_path, log, healthy, "--json").stdout)
    assert second["sections"]["kernel_log"]["lines_read"] == 0 and second["sections"]["state"]["new_events"] == 0
    assert second["verdict"] == "drain"  # retained: the GPU that fell off the bus does not heal by itself
    with open(log, "a") as fh:
        fh.write(XID48)
    third = json.loads(_sweep(tmp_path, log, healthy, "--json").stdout)
    assert third["sections"]["kernel_log"]["lines_read"] == 1 and third["sections"]["state"]["new_events"] == 1
    assert {g["pci_bus_id"]: g["verdict"] for g in third["gpus"]}["0000:61:00.0"] == "drain"
    assert third["xid_totals"]["0000:61:00.0|48"] == 1 and third["xid_totals"]["0000:2b:00.0|79"] == 1
    # a later sweep with --retain 0s forgets the old events: NVML says both GPUs are healthy
    fourth = json.loads(_sweep(tmp_path, log, healthy, "--json", "--retain", "0s").stdout)
    assert fourth["verdict"] == "healthy"


def test_prometheus_textfile_is_valid_and_atomic(node):
    from prometheus_client.parser import text_string_to_metric_families

    tmp_path, log, _ = node
    prom = tmp_path / "tf" / "gpudoctor.prom"
    prom.parent.mkdir()
    r = _sweep(tmp_path, log, SAMPLE_NVML, "--textfile", str(prom), "--format", "npd")
    assert r.returncode == 1 and len(r.stdout.strip()) <= 80
    families = {f.name: f for f in text_string_to_metric_families(prom.read_text())}
    verdict = {s.labels["verdict"]: s.value for s in families["gpudoctor_node_verdict"].samples}
    assert verdict["drain"] == 1.0 and verdict["healthy"] == 0.0
    pending = {s.labels["pci_bus_id"]: s.value for s in families["gpudoctor_gpu_row_remap_pending"].samples}
    assert pending["0000:10:1c.0"] == 1.0
    xids = {
        (s.labels["pci_bus_id"], s.labels["xid"]): s.value
        for s in families["gpudoctor_gpu_xid_events"].samples
        if s.name.endswith("_total")
    }
    assert xids[("0000:cb:00.0", "13")] == 3.0
    assert os.listdir(prom.parent) == ["gpudoctor.prom"]  # no temp file left beside it
    bad = _sweep(tmp_path, log, SAMPLE_NVML, "--textfile", str(tmp_path / "metrics.txt"), "--format", "nagios")
    assert bad.returncode == 2 and "only reads *.prom" in bad.stderr  # the output fails, the check does not


class _Hook(BaseHTTPRequestHandler):
    received: list = []
    fail_first = 0

    def do_POST(self):  # noqa: N802 - http.server API
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if type(self).fail_first > 0:
            type(self).fail_first -= 1
            self.send_response(503)
        else:
            type(self).received.append(json.loads(body))
            self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def hook():
    _Hook.received, _Hook.fail_first = [], 1
    server = HTTPServer(("127.0.0.1", 0), _Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/alert", _Hook
    finally:
        server.shutdown()
        server.server_close()


def test_webhook_retries_then_delivers_alertmanager_v2_alerts(node, hook):
    tmp_path, log, _ = node
    url, handler = hook
    r = _sweep(tmp_path, log, SAMPLE_NVML, "--json", "--webhook", url)
    doc = json.loads(r.stdout)
    assert doc["outputs"][0]["status"] == "ok" and "2 attempt" in doc["outputs"][0]["message"]
    payload = handler.received[0]  # Alertmanager's POST /api/v2/alerts body: a list of postable alerts
    firing = [a for a in payload if "endsAt" not in a]
    assert [a["labels"]["severity"] for a in firing] == ["critical"]
    assert firing[0]["annotations"]["verdict"] == "drain" and "verdict" not in firing[0]["labels"]


def test_unreachable_webhook_never_blocks_beyond_the_budget(node):
    tmp_path, log, _ = node
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    r = _sweep(
        tmp_path,
        log,
        SAMPLE_NVML,
        "--json",
        "--webhook",
        f"http://127.0.0.1:{port}/x",
        "--webhook-retries",
        "10",
        "--budget",
        "2",
    )
    assert time.monotonic() - start < 20
    assert r.returncode == 2  # the verdict's code: a dead notifier is a warning, not a different result
    doc = json.loads(r.stdout)
    assert doc["outputs"][0]["status"] == "failed" and "gave up" in doc["outputs"][0]["message"]
    assert "output webhook failed" in r.stderr


def test_drain_command_is_printed_or_run_without_a_shell(node):
    tmp_path, log, _ = node
    r = _sweep(tmp_path, log, SAMPLE_NVML, "--json", "--drain", "--node", "gpu17")
    cmd = json.loads(r.stdout)["drain"]["command"]
    assert cmd[:4] == ["scontrol", "update", "NodeName=gpu17", "State=DRAIN"]
    assert cmd[4].startswith("Reason=gpu-doctor: drain")
    # --run-drain: a recording scontrol on PATH proves the argv (no shell quoting involved)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "argv.json"
    fake = bindir / "scontrol"
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"if sys.argv[1] == 'show':\n    print('NodeName=gpu17 State=IDLE Reason=(null)')\n"
        f"else:\n    json.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n"
    )
    fake.chmod(0o755)
    env = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    r = _sweep(tmp_path, log, SAMPLE_NVML, "--json", "--run-drain", "--node", "gpu17", env=env)
    assert json.loads(r.stdout)["drain"]["result"] == "drained"
    assert json.loads(record.read_text()) == cmd[1:]


def test_corrupt_state_is_reported_and_the_sweep_starts_over(node):
    tmp_path, log, healthy = node
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "sweep-state.json").write_text('{"schema": "gpuguard.sweep-state/1", "cursor": {"offset"')
    r = _sweep(tmp_path, log, healthy, "--json")
    assert r.returncode == 2 and "unreadable" in r.stderr and "Traceback" not in r.stderr
    assert json.loads(r.stdout)["sections"]["kernel_log"]["lines_read"] == 19


def test_overlapping_sweeps_are_serialised(node):
    import fcntl

    tmp_path, log, healthy = node
    (tmp_path / "state").mkdir()
    with open(tmp_path / "state" / "sweep.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        r = _sweep(tmp_path, log, healthy, "--json", "--budget", "0.5")
    assert r.returncode == 75 and "another sweep holds" in r.stderr and r.stdout == ""
    assert not (tmp_path / "state" / "sweep-state.json").exists()  # nothing read, nothing recorded
    assert _sweep(tmp_path, log, healthy, "--json").returncode == 2


@settings(max_examples=80, deadline=None)
@given(
    raw=st.binary(max_size=400)
    | st.builds(
        lambda cursor, events: json.dumps(
            {"schema": "gpuguard.sweep-state/1", "cursor": cursor, "events": events, "xid_totals": {"a|1": 1}}
        ).encode(),
        st.none()
        | st.dictionaries(
            st.sampled_from(["path", "offset", "inode", "schema"]), st.integers(-2, 5) | st.text(max_size=4), max_size=4
        ),
        st.lists(
            st.dictionaries(
                st.sampled_from(["kind", "line", "fields", "seen_at"]), st.integers() | st.text(max_size=4), max_size=4
            ),
            max_size=3,
        ),
    )
)
def test_state_loader_never_raises_on_garbage(tmp_path_factory, raw):
    from gpuguard.doctor.sweep import event_from_record as _event_from_record
    from gpuguard.doctor.sweep import load_state as _load_state

    path = tmp_path_factory.mktemp("st") / "sweep-state.json"
    path.write_bytes(raw)
    state, notes = _load_state(path)
    assert state["schema"] == "gpuguard.sweep-state/1"
    if notes:
        assert state["cursor"] is None and state["events"] == [] and "unreadable" in notes[0]
    else:
        for rec in state["events"]:
            _event_from_record(rec)


def test_history_is_bounded_per_gpu_and_code():
    from gpuguard.doctor.sweep import PER_CODE_HISTORY, cap_history

    storm = [{"kind": "xid", "line": i, "fields": {"pci_bus_id": "0000:10:00.0", "xid": 13}} for i in range(500)]
    rare = [{"kind": "xid", "line": 1000, "fields": {"pci_bus_id": "0000:10:00.0", "xid": 79}}]
    kept = cap_history(rare + storm)
    assert kept[0]["fields"]["xid"] == 79  # the rare, old drain evidence survives the storm
    assert [r["line"] for r in kept[1:]] == list(range(500 - PER_CODE_HISTORY, 500))


def test_the_printed_drain_command_is_shell_quoted(tmp_path):
    """The reason has spaces and comes from log text: pasted into a shell it must stay one argument."""
    import shlex

    from gpuguard.recovery.operator.actions import drain_command, drain_command_line

    line = drain_command_line("node-7", "Xid 79 on GPU 3; $(reboot)")
    assert shlex.split(line) == drain_command("node-7", "Xid 79 on GPU 3; $(reboot)")
    res = run_cli(
        "gpu-doctor",
        "sweep",
        "--state-dir",
        str(tmp_path / "s"),
        "--kernel-log",
        str(SAMPLE_LOG),
        "--nvml-snapshot",
        str(SAMPLE_NVML),
        "--drain",
        "--format",
        "npd",
        "--node",
        "node-7",
    )
    printed = [x for x in res.stderr.splitlines() if x.startswith("gpu-doctor: drain: ")]
    assert len(printed) == 1
    argv = shlex.split(printed[0].removeprefix("gpu-doctor: drain: "))
    assert argv[:4] == ["scontrol", "update", "NodeName=node-7", "State=DRAIN"]
    assert argv[4].startswith("Reason=gpu-doctor: ")
