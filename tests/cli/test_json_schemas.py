"""Every `--json` document that can be produced cheaply (about 20 commands on a real file-ledger job
with three generations and a refusal, real dumps, logs and a demo node): one schema name per
document shape (two documents under one name have the same top-level keys, but for the fields
documented as optional), and one JSON type per field name wherever it appears. Times from ledger
records (`activation_time`, `start_time`) are decimal strings, exactly as the certificate stores
them; times a command measures itself are numbers (README, "Exit codes")."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import run_cli
from tests.support.cli_job import build_job, write_dumps
from tests.support.node import SAMPLE_LOG, SAMPLE_NVML

# Fields one document of a schema may have and another of the same schema not: sweep's `outputs`
# (what its output plugins did) on gpuguard.node/1.
OPTIONAL = {"gpuguard.node/1": {"outputs"}}
# Field names that mean different things in different documents and so differ in type; any other
# name has one JSON type wherever it appears (a new overload fails here).
PER_DOCUMENT = {
    "time": "when a command ran (a number) / when a refusal was recorded (a decimal string, as stored)",
    "ledger": "the ledger's URL (generation-*) / the ledger section of gpuguard.status/1",
    "members": "a certificate's members (list) / a history row's member count",
    "incarnation": "a certificate member's incarnation record / its id in gpuguard.status/1",
    "refusals": "explain's refusal records / how many there are (history, status)",
    "summary": "a sentence (actions, runbook steps) / gpuguard.events/1's counts by severity",
    "gpus": "the GPU list (node, nvml) / GPUs seen per severity (events summary)",
    "events": "the event list / how many (counts, kernel_log section)",
}
DATA_KEYED = (".sections",)  # mappings whose keys are names (node sections), not fields
LEDGER_TIMES = ("activation_time", "start_time")


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> dict[str, tuple[int, Any]]:
    tmp = tmp_path_factory.mktemp("schemas")
    docs: dict[str, tuple[int, Any]] = {}

    def doc(name: str, *args: str) -> None:
        r = run_cli(*args, "--json", timeout=120)
        assert r.stdout.strip(), f"{name}: no JSON (exit {r.returncode}): {r.stderr}"
        docs[name] = (r.returncode, json.loads(r.stdout))

    jd, init = build_job(tmp)
    docs["generation init"] = (0, init)
    j = ("--job-dir", str(jd))
    doc("generation show", "gpu-generation", "show", *j)
    doc("generation history", "gpu-generation", "history", *j)
    doc("generation verify", "gpu-generation", "verify", *j)
    doc("generation explain", "gpu-generation", "explain", *j)
    doc("recover status", "gpu-recover", "status", *j)
    doc("recover abort", "gpu-recover", "abort", *j, "--dry-run")
    doc("recover verify", "gpu-recover", "verify", *j, "--timeout", "1")
    doc("runbook list", "gpu-recover", "runbook", "list")
    doc("runbook show", "gpu-recover", "runbook", "show", "rank-failure")
    doc("runbook run", "gpu-recover", "runbook", "run", "hang", *j, "--dry-run")
    doc("diagnose job", "gpu-doctor", "diagnose", "job", *j)
    doc("diagnose torchrun", "gpu-doctor", "diagnose", "torchrun")
    node = ("--kernel-log", str(SAMPLE_LOG), "--nvml-snapshot", str(SAMPLE_NVML))
    doc("diagnose node", "gpu-doctor", "diagnose", "node", *node)
    doc("sweep", "gpu-doctor", "sweep", *node, "--state-dir", str(tmp / "state"))
    doc("logs", "gpu-doctor", "logs", str(SAMPLE_LOG))
    doc("plugins", "gpu-doctor", "plugins")
    dumps = write_dumps(tmp)
    doc("contract", "gpu-doctor", "contract", str(dumps))
    return docs


EXPECTED = {
    "generation init": "gpuguard.generation-init/1",
    "generation show": "gpuguard.generation-show/1",
    "generation history": "gpuguard.generation-history/1",
    "generation verify": "gpuguard.generation-verify/1",
    "generation explain": "gpuguard.generation-explain/1",
    "recover status": "gpuguard.status/1",
    "recover abort": "gpuguard.action/1",
    "recover verify": "gpuguard.action/1",
    "runbook list": "gpuguard.runbooks/1",
    "runbook show": "gpuguard.runbooks/1",
    "runbook run": "gpuguard.runbook-run/1",
    "diagnose job": "gpuguard.job/1",
    "diagnose torchrun": "gpuguard.torchrun-hazards/1",
    "diagnose node": "gpuguard.node/1",
    "sweep": "gpuguard.node/1",
    "logs": "gpuguard.events/1",
    "plugins": "gpuguard.plugins/1",
    "contract": "gpuguard.contract/1",
}


def test_every_document_names_its_schema(documents) -> None:
    assert {name: d["schema"] for name, (_, d) in documents.items()} == EXPECTED
    assert all(re.fullmatch(r"gpuguard\.[a-z][a-z-]*/1", s) for s in EXPECTED.values())


def test_one_schema_name_per_document_shape(documents) -> None:
    shapes: dict[str, dict[frozenset[str], list[str]]] = {}
    for name, (_, d) in documents.items():
        keys = frozenset(d) - OPTIONAL.get(d["schema"], set())
        shapes.setdefault(d["schema"], {}).setdefault(keys, []).append(name)
    mixed = {schema: list(by.values()) for schema, by in shapes.items() if len(by) > 1}
    assert mixed == {}, f"one schema name, several shapes: {mixed}"


def _fields(value: Any, path: str, out: dict[str, set[str]], where: dict[str, list[str]]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if path.endswith(DATA_KEYED) or k.isdigit() or "|" in k or ":" in k or "/" in k:
                _fields(v, f"{path}.*", out, where)  # keyed by data (a generation, "pci|code", a section)
                continue
            if v is not None:
                kind = "number" if type(v) in (int, float) else type(v).__name__
                out.setdefault(k, set()).add(kind)
                where.setdefault(f"{k}:{kind}", []).append(path)
            _fields(v, f"{path}.{k}", out, where)
    elif isinstance(value, list):
        for v in value:
            _fields(v, f"{path}[]", out, where)


def test_one_json_type_per_field_name(documents) -> None:
    types: dict[str, set[str]] = {}
    where: dict[str, list[str]] = {}
    for name, (_, d) in documents.items():
        _fields(d, name, types, where)
    clash = {
        k: {t: where[f"{k}:{t}"][:3] for t in ts} for k, ts in types.items() if len(ts) > 1 and k not in PER_DOCUMENT
    }
    assert clash == {}, json.dumps(clash, indent=1)
    seen = 0
    for k in LEDGER_TIMES:
        for kind in types.get(k, ()):
            assert kind == "str", (k, where[f"{k}:{kind}"])
            seen += 1
    assert seen == 2  # both appear (certificate, history, show's members)


def test_activation_time_is_the_certificates_decimal_string_everywhere(documents) -> None:
    show = documents["generation show"][1]
    hist = documents["generation history"][1]
    cert_time = show["certificate"]["activation_time"]
    assert isinstance(cert_time, str) and float(cert_time) > 0
    assert hist["generations"][-1]["activation_time"] == cert_time
    assert all(isinstance(g["activation_time"], str) for g in hist["generations"])


def test_the_schema_names_are_in_the_readme() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Exit codes") : readme.index("## Safety")]
    for schema in set(EXPECTED.values()):
        name = schema.removeprefix("gpuguard.").removesuffix("/1")
        assert f"`{name}`" in section, name
