"""The Prometheus textfile: valid exposition, HELP/TYPE on every metric, counters named *_total, no
gpu="None" labels, GPU-lost events counted; `promtool check metrics` when it is installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.cli import run_cli
from tests.support.node import SAMPLE_LOG, SAMPLE_NVML

HELDOUT = SAMPLE_LOG.parents[2] / "tests" / "data" / "heldout"


def _textfile(tmp_path, *args) -> str:
    out = tmp_path / "gpudoctor.prom"
    r = run_cli("gpu-doctor", "sweep", "--state-dir", str(tmp_path / "state"), "--textfile", str(out), *args)
    assert r.returncode in (0, 1, 2), r.stderr
    return out.read_text()


@pytest.fixture(
    params=[
        ("--kernel-log", str(SAMPLE_LOG), "--nvml-snapshot", str(SAMPLE_NVML)),
        ("--kernel-log", str(HELDOUT / "h19-device-handle-unknown.log"), "--nvml-snapshot", str(SAMPLE_NVML)),
        ("--kernel-log", str(HELDOUT / "h05-xid79-pid0.log"), "--nvml-snapshot", str(SAMPLE_NVML)),
    ],
    ids=["sample", "no-xid-faults", "gpu-lost"],
)
def textfile(request, tmp_path):
    return _textfile(tmp_path, *request.param)


def test_every_metric_has_help_and_type_and_counters_end_in_total(textfile):
    helps = set(re.findall(r"^# HELP (\S+) ", textfile, re.M))
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", textfile, re.M))
    assert helps == set(types)
    for line in textfile.splitlines():
        if line.startswith("#") or not line:
            continue
        name = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
        assert name in types, name
    for name, kind in types.items():
        assert (kind == "counter") == name.endswith("_total"), (name, kind)
    assert 'gpu="None"' not in textfile and '="None"' not in textfile
    assert list(text_string_to_metric_families(textfile))  # parses


def test_gpu_lost_events_are_counted(tmp_path):
    text = _textfile(tmp_path, "--kernel-log", str(HELDOUT / "h05-xid79-pid0.log"), "--nvml-snapshot", str(SAMPLE_NVML))
    fam = {f.name: f for f in text_string_to_metric_families(text)}["gpudoctor_gpu_lost_events"]
    assert fam.type == "counter"
    assert {s.labels["pci_bus_id"]: s.value for s in fam.samples if s.name.endswith("_total")} == {
        "0000:09:00.0": 2.0  # the Xid 79 line and the "fallen off the bus" line
    }


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_accepts_the_textfile(textfile):
    proc = subprocess.run(
        ["promtool", "check", "metrics"], input=textfile, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "" and proc.stderr.strip() == "", proc.stdout + proc.stderr


def test_replay_without_nvml_does_not_report_the_nvml_check_as_failed(tmp_path):
    r = run_cli("gpu-doctor", "diagnose", "node", "--kernel-log", str(SAMPLE_LOG), "--json")
    doc = json.loads(r.stdout)
    from prometheus_client import generate_latest

    from gpuguard.plugins.outputs import prometheus_registry

    text = generate_latest(prometheus_registry(doc)).decode()
    assert 'gpudoctor_check_status{check="nvml"}' not in text
