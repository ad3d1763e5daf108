"""`gpu-doctor diagnose node --dump-nvml` (issue 15): a new file only (73 if it exists, unless
--force), never a missing directory created (66), never a write through a link (65); one line."""

from __future__ import annotations

import json
import os

import pytest

from tests.support.cli import run_cli
from tests.support.node import SAMPLE_LOG, fake_env, healthy_gpu, snapshot, write_json


@pytest.fixture
def snap(tmp_path):
    return write_json(tmp_path / "snap.json", snapshot(healthy_gpu(0)))


def _dump(snap, target, *extra):
    return run_cli(
        "gpu-doctor",
        "diagnose",
        "node",
        "--mode",
        "live",
        "--kernel-log",
        str(SAMPLE_LOG),
        "--no-processes",
        "--json",
        "--dump-nvml",
        str(target),
        *extra,
        env=fake_env(snap),
    )


def _one_line(r):
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_a_new_file_is_written(tmp_path, snap):
    target = tmp_path / "dump.json"
    r = _dump(snap, target)
    assert r.returncode in (0, 1, 2), r.stderr
    assert json.loads(target.read_text())["gpus"][0]["uuid"] == "GPU-test-0"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_an_existing_file_is_not_overwritten_without_force(tmp_path, snap):
    target = tmp_path / "generation.key"
    target.write_bytes(b"secret")
    os.chmod(target, 0o600)
    mtime = target.stat().st_mtime_ns
    r = _dump(snap, target)
    assert r.returncode == 73 and "exists" in r.stderr and "--force" in r.stderr
    _one_line(r)
    assert target.read_bytes() == b"secret" and target.stat().st_mtime_ns == mtime
    assert r.stdout == ""  # refused before the diagnosis, not after it
    r = _dump(snap, target, "--force")
    assert r.returncode in (0, 1, 2), r.stderr
    assert json.loads(target.read_text())["schema"] == "gpuguard.nvml/1"


def test_a_missing_directory_is_not_created(tmp_path, snap):
    target = tmp_path / "no" / "such" / "dump.json"
    r = _dump(snap, target)
    assert r.returncode == 66 and "no directory" in r.stderr
    _one_line(r)
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("force", [False, True])
def test_no_write_through_a_link(tmp_path, snap, force):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    link = tmp_path / "dump.json"
    link.symlink_to(victim)
    extra = ("--force",) if force else ()
    r = _dump(snap, link, *extra)
    assert r.returncode == 65 and "symbolic link" in r.stderr
    _one_line(r)
    assert victim.read_bytes() == b"keep" and link.is_symlink()
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "created-through-link")
    r = _dump(snap, dangling, *extra)
    assert r.returncode == 65 and not (tmp_path / "created-through-link").exists()
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "linked").symlink_to(real)
    r = _dump(snap, tmp_path / "linked" / "dump.json", *extra)
    assert r.returncode == 65 and "symbolic link" in r.stderr
    assert list(real.iterdir()) == []


def test_a_directory_or_a_device_is_never_replaced(tmp_path, snap):
    folder = tmp_path / "dir"
    folder.mkdir()
    r = _dump(snap, folder, "--force")
    assert r.returncode == 73 and "is a directory" in r.stderr
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = _dump(snap, fifo, "--force")
    assert r.returncode == 73 and "not a regular file" in r.stderr
    assert fifo.exists() and not fifo.is_file()
