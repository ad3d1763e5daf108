"""`--output prometheus` / `--output json` with path=: written through the one output writer
(foundation.outfile): a link at the name or as the directory is refused and its target untouched,
a missing directory is never created, an old file is replaced by a new inode (atomic rename), and
a failed output is one line while the node's verdict keeps its exit code. Real sweeps, real files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.cli import run_cli
from tests.support.node import sample_sweep_argv

OUTPUTS = {"prometheus": "gpudoctor.prom", "json": "doc.json"}


def _sweep(tmp_path: Path, name: str, path: Path):
    r = run_cli(*sample_sweep_argv(tmp_path / "state", name, options=(f"{name}.path={path}",)))
    assert r.returncode == 2, r.stderr  # the sample node's verdict (drain), whatever the output did
    assert "Traceback" not in r.stderr
    result = {o["name"]: o for o in json.loads(r.stdout)["outputs"]}[name]
    return result, r


def _valid(name: str, text: str) -> bool:
    if name == "prometheus":
        return "gpudoctor_node_verdict" in {f.name for f in text_string_to_metric_families(text)}
    return json.loads(text)["schema"] == "gpuguard.node/1"


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_output_file_is_replaced_atomically_by_a_new_inode(tmp_path: Path, name: str) -> None:
    out = tmp_path / "out" / OUTPUTS[name]
    out.parent.mkdir()
    result, _ = _sweep(tmp_path, name, out)
    assert result["status"] == "ok" and _valid(name, out.read_text())
    first = os.stat(out).st_ino
    out.chmod(0o644)
    result, _ = _sweep(tmp_path, name, out)
    assert result["status"] == "ok" and _valid(name, out.read_text())
    assert os.stat(out).st_ino != first  # renamed into place, never rewritten in place
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temp file left


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_a_link_at_the_name_is_refused_and_its_target_untouched(tmp_path: Path, name: str) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    out = tmp_path / "out" / OUTPUTS[name]
    out.parent.mkdir()
    out.symlink_to(victim)
    result, r = _sweep(tmp_path, name, out)
    assert result["status"] == "failed" and "symbolic link" in result["message"], result
    assert victim.read_text() == "precious\n" and out.is_symlink()
    assert f"output {name} failed" in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_a_linked_directory_is_refused(tmp_path: Path, name: str) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "linked").symlink_to(real)
    result, _ = _sweep(tmp_path, name, tmp_path / "linked" / OUTPUTS[name])
    assert result["status"] == "failed" and "symbolic link" in result["message"], result
    assert list(real.iterdir()) == []


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_a_missing_directory_is_never_created(tmp_path: Path, name: str) -> None:
    out = tmp_path / "absent" / "deeper" / OUTPUTS[name]
    result, _ = _sweep(tmp_path, name, out)
    assert result["status"] == "failed" and "not created for you" in result["message"], result
    assert not (tmp_path / "absent").exists()


def test_a_directory_at_the_name_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out" / "gpudoctor.prom"
    out.mkdir(parents=True)
    result, _ = _sweep(tmp_path, "prometheus", out)
    assert result["status"] == "failed" and "is a directory" in result["message"], result
