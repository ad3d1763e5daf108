"""Output files and directories that cannot clobber (issue 15): `sweep --textfile` and `--state-dir`
never write through a link, never create a missing parent, replace atomically, and, run as root,
refuse a directory another user owns or group/others may write; a job dir or key likewise (77).
Real files and the real CLI; the root cases chown real directories to `nobody`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gpuguard.doctor import sweep
from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import DataError, NoInputError, PermissionDeniedError
from gpuguard.generation import keys
from tests.support.cli import run_cli
from tests.support.node import SAMPLE_LOG, SAMPLE_NVML

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the ownership rules apply to root only")


def _sweep(tmp: Path, *args: str, state: Path | None = None):
    log = tmp / "kern.log"
    if not log.exists():
        shutil.copy(SAMPLE_LOG, log)
    return run_cli(
        "gpu-doctor",
        "sweep",
        "--kernel-log",
        str(log),
        "--nvml-snapshot",
        str(SAMPLE_NVML),
        "--state-dir",
        str(state or tmp / "state"),
        "--json",
        *args,
        timeout=60,
    )


def _failed_output(r, needle: str) -> None:
    """A textfile that cannot be written fails that output (stderr, JSON), never the check."""
    import json

    assert r.returncode in (0, 1, 2), r.stderr
    outputs = {o["name"]: o for o in json.loads(r.stdout)["outputs"]}
    assert outputs["prometheus"]["status"] == "failed" and needle in outputs["prometheus"]["message"]
    assert needle in r.stderr


def test_textfile_through_a_link_is_refused_and_the_target_untouched(tmp_path: Path) -> None:
    (tmp_path / "tf").mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "tf" / "gpu.prom").symlink_to(victim)
    r = _sweep(tmp_path, "--textfile", str(tmp_path / "tf" / "gpu.prom"))
    _failed_output(r, "is a symbolic link")
    assert victim.read_text() == "precious\n" and (tmp_path / "tf" / "gpu.prom").is_symlink()
    linked = tmp_path / "linked"
    linked.symlink_to(tmp_path / "tf", target_is_directory=True)
    r = _sweep(tmp_path, "--textfile", str(linked / "new.prom"))
    _failed_output(r, "symbolic link")
    assert not (tmp_path / "tf" / "new.prom").exists()


def test_textfile_directory_is_never_created(tmp_path: Path) -> None:
    prom = tmp_path / "missing" / "deeper" / "gpu.prom"
    r = _sweep(tmp_path, "--textfile", str(prom))
    _failed_output(r, "not created for you")
    assert not (tmp_path / "missing").exists()


def test_textfile_is_replaced_atomically(tmp_path: Path) -> None:
    (tmp_path / "tf").mkdir()
    prom = tmp_path / "tf" / "gpu.prom"
    prom.write_text("old\n")
    inode = prom.stat().st_ino
    r = _sweep(tmp_path, "--textfile", str(prom))
    assert r.returncode in (0, 1, 2) and "gpudoctor_node_verdict" in prom.read_text()
    assert prom.stat().st_ino != inode  # a new file renamed over the old name, not a rewrite in place
    assert os.listdir(prom.parent) == ["gpu.prom"]


def test_state_dir_rules(tmp_path: Path) -> None:
    r = _sweep(tmp_path, state=tmp_path / "no" / "such" / "state")
    assert r.returncode == 66 and "not created for you" in r.stderr and not (tmp_path / "no").exists()
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "linkstate").symlink_to(real, target_is_directory=True)
    r = _sweep(tmp_path, state=tmp_path / "linkstate")
    assert r.returncode == 65 and "symbolic link" in r.stderr and os.listdir(real) == []
    (tmp_path / "afile").write_text("x")
    r = _sweep(tmp_path, state=tmp_path / "afile")
    assert r.returncode == 73 and "not a directory" in r.stderr
    ok = _sweep(tmp_path, state=tmp_path / "fresh")
    assert ok.returncode in (0, 1, 2) and (tmp_path / "fresh").stat().st_mode & 0o777 == 0o700
    for r in (_sweep(tmp_path, state=p) for p in (tmp_path / "no" / "such" / "state", tmp_path / "linkstate")):
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_state_file_and_lock_links_are_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    victim = tmp_path / "victim.json"
    victim.write_text("{}")
    (state / sweep.STATE_FILE).symlink_to(victim)
    with pytest.raises(DataError, match="symbolic link"):
        sweep.load_state(state / sweep.STATE_FILE)
    (state / sweep.STATE_FILE).unlink()
    (state / sweep.LOCK_FILE).symlink_to(victim)
    with pytest.raises(DataError, match="symbolic link"):
        with sweep.SweepLock(state, wait=0):
            pass
    assert victim.read_text() == "{}"
    with pytest.raises(NoInputError, match="not created for you"):
        with sweep.SweepLock(tmp_path / "a" / "b", wait=0):
            pass


# -- as root: directories another user controls ------------------------------------------------------


@as_root
def test_as_root_a_textfile_or_state_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    r = _sweep(tmp_path, "--textfile", str(theirs / "gpu.prom"))
    _failed_output(r, "owned by")
    assert not (theirs / "gpu.prom").exists()
    r = _sweep(tmp_path, state=theirs)
    assert r.returncode == 77 and "owned by" in r.stderr and "sudo -u" in r.stderr
    assert os.listdir(theirs) == []
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp
    r = _sweep(tmp_path, "--textfile", str(shared / "gpu.prom"))
    _failed_output(r, "writable by group or others")
    r = _sweep(tmp_path, state=shared)
    assert r.returncode == 77 and "chmod go-w" in r.stderr


@as_root
def test_as_root_dump_nvml_into_another_users_directory_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    r = run_cli(
        "gpu-doctor",
        "diagnose",
        "node",
        "--kernel-log",
        str(SAMPLE_LOG),
        "--nvml-snapshot",
        str(SAMPLE_NVML),
        "--dump-nvml",
        str(theirs / "snap.json"),
    )
    assert r.returncode == 77 and "owned by" in r.stderr and os.listdir(theirs) == []


def _job(tmp: Path) -> Path:
    job = tmp / "job"
    job.mkdir()
    jobdir.ensure_job(job, "j1")
    return job


@as_root
def test_as_root_a_job_dir_of_another_user_is_refused_with_the_fix(tmp_path: Path) -> None:
    job = _job(tmp_path)
    assert jobdir.require_job_dir(job) == job
    os.chown(job, NOBODY, NOBODY)
    with pytest.raises(PermissionDeniedError, match=r"owned by nobody \(uid 65534\).*sudo -u nobody"):
        jobdir.require_job_dir(job)
    r = run_cli("gpu-recover", "status", "--job-dir", str(job))
    assert r.returncode == 77 and "owned by nobody" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    os.chown(job, 0, 0)
    job.chmod(0o775)
    with pytest.raises(PermissionDeniedError, match="chmod go-w"):
        jobdir.require_job_dir(job)
    job.chmod(0o755)
    assert jobdir.require_job_dir(job) == job


@as_root
def test_as_root_a_key_in_a_directory_another_user_controls_is_refused(tmp_path: Path) -> None:
    job = _job(tmp_path)
    keys.create_key(job)
    assert len(keys.load_key(job)) == keys.KEY_BYTES
    os.chown(job, NOBODY, NOBODY)
    with pytest.raises(PermissionDeniedError, match="owned by nobody"):
        keys.load_key(job)
    other = tmp_path / "other"
    other.mkdir()
    other.chmod(0o777)
    with pytest.raises(PermissionDeniedError, match="writable by group or others"):
        keys.create_key(other)
    assert not (other / keys.KEY_FILE).exists()
    r = run_cli("gpu-generation", "show", "--job-dir", str(job))
    assert r.returncode == 77 and "owned by nobody" in r.stderr
