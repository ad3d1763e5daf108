"""The webhook against a real Alertmanager (Debian `prometheus-alertmanager`, started on loopback here):
its v2 API takes the posted alerts, the node's alert fires at its verdict's severity, and the post of a
healthy node resolves exactly the alert that fired (same labels), as does a change of severity.

Before: the sweep posted one object (Alertmanager's *outbound* v4 notification shape) to
`/api/v2/alerts`, which answers 400 to anything but an array, and its labels held the verdict and the
boot id, so a "resolved" post named another alert and the firing one stayed active.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from datetime import datetime

import pytest

from gpuguard.plugins.outputs import ALERT_NAME, post_webhook, webhook_payload
from tests.support.cli import free_port, run_cli
from tests.support.node import healthy_gpu, sample_sweep_argv, snapshot, write_json

AM = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
pytestmark = pytest.mark.skipif(AM is None, reason="Alertmanager is not installed (Debian: prometheus-alertmanager)")


@pytest.fixture
def alertmanager(tmp_path):
    port = free_port()
    cfg = tmp_path / "am.yml"
    cfg.write_text('route:\n  receiver: "null"\nreceivers:\n  - name: "null"\n')
    log = open(tmp_path / "am.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            str(AM),
            f"--config.file={cfg}",
            f"--storage.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < end and proc.poll() is None, (tmp_path / "am.log").read_text()
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def active(url: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/api/v2/alerts?active=true&silenced=false&inhibited=false", timeout=5) as r:
        return [a for a in json.load(r) if a["labels"].get("alertname") == ALERT_NAME]


def node_doc(tmp_path, name: str, *, healthy: bool) -> dict:
    if healthy:
        snap = write_json(tmp_path / f"{name}-ok.json", snapshot(healthy_gpu(0), healthy_gpu(1)))
        r = run_cli("gpu-doctor", "diagnose", "node", "--nvml-snapshot", str(snap), "--json")
    else:
        r = run_cli("gpu-doctor", "diagnose", "node", "--demo", "--json")
    doc = json.loads(r.stdout)
    assert doc["verdict"] == ("healthy" if healthy else "drain"), doc["verdict"]
    return {**doc, "node": name}  # the sweep names the node (--node); diagnose node names the host


def test_alertmanager_takes_the_alerts_and_a_healthy_node_resolves_the_one_that_fired(tmp_path, alertmanager):
    api = f"{alertmanager}/api/v2/alerts"
    drain = node_doc(tmp_path, "gpu17", healthy=False)
    assert post_webhook(api, webhook_payload(drain)).startswith("HTTP 200")
    fired = active(alertmanager)
    assert [a["labels"] for a in fired] == [{"alertname": ALERT_NAME, "node": "gpu17", "severity": "critical"}]
    assert fired[0]["annotations"]["verdict"] == "drain" and fired[0]["status"]["state"] == "active"

    degraded = {**drain, "verdict": "degraded"}  # the same node, now at warning: the critical alert ends
    post_webhook(api, webhook_payload(degraded))
    assert [a["labels"]["severity"] for a in active(alertmanager)] == ["warning"]

    healthy = node_doc(tmp_path, "gpu17", healthy=True)
    post_webhook(api, webhook_payload(healthy))
    assert active(alertmanager) == []  # resolved: the post matched the firing alert's labels exactly


def test_the_sweep_posts_to_a_real_alertmanager(tmp_path, alertmanager):
    r = run_cli(*sample_sweep_argv(tmp_path / "state"), "--webhook", f"{alertmanager}/api/v2/alerts")
    assert r.returncode == 2, r.stderr
    doc = json.loads(r.stdout)
    assert doc["outputs"][0]["status"] == "ok", r.stdout
    assert [(a["labels"]["node"], a["labels"]["severity"]) for a in active(alertmanager)] == [(doc["node"], "critical")]


def test_every_post_is_a_postable_alerts_array():
    """The shape of `postableAlerts` in Alertmanager's api/v2/openapi.yaml (v0.25): an array of objects with
    `labels` (required, string to string), `annotations` (string to string), `startsAt`/`endsAt` (RFC 3339
    date-times) and `generatorURL`; nothing else."""
    for verdict in ("healthy", "degraded", "reset", "drain", "unknown"):
        body = webhook_payload({"verdict": verdict, "node": "n", "summary": "s", "identity": {"boot_id": "b"}}, now=0)
        assert isinstance(body, list) and body
        for alert in body:
            assert set(alert) <= {"labels", "annotations", "startsAt", "endsAt", "generatorURL"}
            assert alert["labels"] and all(isinstance(v, str) for v in alert["labels"].values())
            assert all(isinstance(v, str) for v in alert["annotations"].values())
            for key in ("startsAt", "endsAt"):
                if key in alert:
                    datetime.fromisoformat(alert[key].replace("Z", "+00:00"))
            assert set(alert["labels"]) == {"alertname", "node", "severity"}  # never the verdict or the boot
        firing = [a for a in body if "endsAt" not in a]
        assert len(firing) == (0 if verdict == "healthy" else 1)
