"""`gpu-generation` end to end through the installed console script, on both ledger backends."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from gpuguard.foundation.errors import RefusedError
from gpuguard.generation.job import open_job_ledger
from gpuguard.generation.records import Member
from tests.support.cli import REPO, free_port
from tests.support.generation import child, members

SETPRIV = shutil.which("setpriv")
AS_NOBODY = [SETPRIV, "--reuid=nobody", "--regid=nogroup", "--clear-groups"] if SETPRIV else None


def j(result):
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def grow(job: Path, url: str | None = None, n: int = 2):
    """Activate `n` generations after genesis, with commits, through the library (as a runtime would)."""
    led = open_job_ledger(job, url)
    cert = led.require_active()
    mem = members(2)
    for _ in range(n):
        nxt = child(cert, mem, key=led.key, step=cert.frontier.step, extra={"switch": "restart"})
        led.activate(nxt)
        for m in mem:
            led.record_commit(nxt.generation, cert.frontier.step + 10, m.rank, m.incarnation.id)
        cert = nxt
    return led, cert


@pytest.fixture(params=["dir", "etcd"])
def job(request, tmp_path, cli):
    """An initialized job on each backend; the etcd one records its ledger URL in the job dir."""
    url = None
    if request.param == "etcd":
        u = urlsplit(request.getfixturevalue("etcd_url"))
        url = f"etcd://{u.hostname}:{u.port}/cli-{uuid.uuid4().hex}"
    jd = tmp_path / "job"
    args = ["gpu-generation", "init", "--job-dir", str(jd), "--job-id", "train-42", "--json"]
    doc = j(cli(*args, *(["--ledger", url] if url else [])))
    assert doc["schema"] == "gpuguard.generation-init/1" and doc["certificate"]["generation"] == 0
    return jd, url


def test_init_show_history_verify_explain(job, cli):
    jd, url = job
    assert stat.S_IMODE(os.stat(jd / "generation.key").st_mode) == 0o600
    led, cert = grow(jd, None, n=2)  # no URL: found from what init recorded
    show = j(cli("gpu-generation", "show", "--job-dir", str(jd), "--json"))
    assert show["schema"] == "gpuguard.generation-show/1" and show["digest"] == cert.digest()
    assert show["certificate"]["generation"] == 2 and len(show["certificate"]["members"]) == 2
    text = cli("gpu-generation", "show", env={"GPUGUARD_JOB_DIR": str(jd)})
    assert text.returncode == 0 and "active generation 2" in text.stdout and "quiescence proved" in text.stdout
    hist = j(cli("gpu-generation", "history", "--job-dir", str(jd), "--json"))
    assert hist["schema"] == "gpuguard.generation-history/1" and hist["active_generation"] == 2
    assert [g["generation"] for g in hist["generations"]] == [0, 1, 2]
    ver = j(cli("gpu-generation", "verify", "--job-dir", str(jd), "--json"))
    assert ver["ok"] and ver["checked"] == [0, 1, 2]
    one = j(cli("gpu-generation", "verify", "--job-dir", str(jd), "--generation", "1", "--json"))
    assert one["ok"] and one["checked"] == [1]
    # a refused activation: a reused rank passed off as the old member
    from dataclasses import replace

    from gpuguard.generation.keys import load_key, sign

    new_inc = replace(cert.members[1].incarnation, id=uuid.uuid4().hex, pid=4242)
    bad = child(cert, (cert.members[0], Member(1, new_inc)), key=led.key, step=cert.frontier.step)
    bad = replace(bad, admitted=(), signature="")
    bad = bad.with_signature(sign(load_key(jd), bad.signing_bytes()))
    with pytest.raises(RefusedError):
        led.activate(bad)
    exp = cli("gpu-generation", "explain", "--job-dir", str(jd))
    assert exp.returncode == 0 and "members-admitted" in exp.stdout and "rank 1" in exp.stdout
    ej = j(cli("gpu-generation", "explain", "--job-dir", str(jd), "--json"))
    assert ej["refusals"][0]["violations"][0] == {
        "rule": "members-admitted",
        "member": 1,
        "message": ej["refusals"][0]["violations"][0]["message"],
    }
    assert j(cli("gpu-generation", "show", "--job-dir", str(jd), "--json"))["certificate"]["generation"] == 2


def test_tampered_certificate_fails_verify_naming_the_record(tmp_path, cli):
    jd = tmp_path / "job"
    assert cli("gpu-generation", "init", "--job-dir", str(jd)).returncode == 0
    grow(jd, n=2)
    path = jd / "ledger" / "gen-1.json"
    orig = path.read_bytes()
    for pos in (5, len(orig) // 2, len(orig) - 3):
        data = bytearray(orig)
        data[pos] ^= 0x01
        path.write_bytes(bytes(data))
        res = cli("gpu-generation", "verify", "--job-dir", str(jd))
        assert res.returncode == 2 and "gen-1.json" in res.stdout and "FAIL" in res.stdout, res
    path.write_bytes(orig)
    assert cli("gpu-generation", "verify", "--job-dir", str(jd)).returncode == 0
    path.write_bytes(orig[:40])  # truncated ledger file
    res = cli("gpu-generation", "verify", "--job-dir", str(jd), "--json")
    doc = json.loads(res.stdout)
    assert (
        res.returncode == 2
        and doc["findings"][0]["rule"] == "encoding"
        and "gen-1.json" in doc["findings"][0]["record"]
    )
    # show stops at the end of the valid chain rather than trusting a damaged record, and says so (exit 2)
    res = cli("gpu-generation", "show", "--job-dir", str(jd), "--json")
    doc = json.loads(res.stdout)
    assert res.returncode == 2 and doc["certificate"]["generation"] == 0
    assert doc["active"] is False and doc["unverified_after_active"] == [1, 2]


def test_certificate_signed_with_another_key_fails_verify(tmp_path, cli):
    jd, other = tmp_path / "job", tmp_path / "other"
    for d in (jd, other):
        assert cli("gpu-generation", "init", "--job-dir", str(d), "--job-id", "same").returncode == 0
    shutil.copy(other / "ledger" / "gen-0.json", jd / "ledger" / "gen-0.json")
    res = cli("gpu-generation", "verify", "--job-dir", str(jd))
    assert res.returncode == 2 and "signature" in res.stdout and "gen-0.json" in res.stdout


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path_factory.mktemp("ck")
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "loader": {"index": 3}}, checkpoint_id=path)
    return path


def test_verify_deep_rehashes_the_frontier_state(tmp_path, cli, small_checkpoint):
    from gpuguard.generation.manifest import build_manifest, write_manifest

    jd = tmp_path / "job"
    assert cli("gpu-generation", "init", "--job-dir", str(jd)).returncode == 0
    ck = jd / "checkpoints" / "step-0"
    shutil.copytree(small_checkpoint, ck)
    led = open_job_ledger(jd)
    g0 = led.require_active()
    mem = members(1)
    man = build_manifest(ck, step=0, generation=1, owners={0: mem[0]})
    write_manifest(man, ck)
    led.activate(child(g0, mem, key=led.key, step=0, digest=man.digest), manifest_ok=True)
    deep = j(cli("gpu-generation", "verify", "--job-dir", str(jd), "--deep", "--json"))
    assert deep["ok"] and deep["deep"]["manifests"] == 1 and deep["deep"]["objects"] == len(man.entries)
    # corrupt one shard byte: verify (no --deep) still passes, --deep names the object
    target = next(e for e in man.entries if e.spec.fqn == "model.weight")
    with open(ck / target.spec.file, "r+b") as f:
        f.seek(target.spec.byte_offset + 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    assert cli("gpu-generation", "verify", "--job-dir", str(jd)).returncode == 0
    res = cli("gpu-generation", "verify", "--job-dir", str(jd), "--deep")
    assert res.returncode == 2 and "model.weight" in res.stdout and "digest mismatch" in res.stdout
    # a flipped byte in the manifest: named, and the frontier's state can no longer be found
    mpath = ck / "gpuguard.manifest.json"
    data = bytearray(mpath.read_bytes())
    data[len(data) // 3] ^= 0x02
    mpath.write_bytes(bytes(data))
    res = cli("gpu-generation", "verify", "--job-dir", str(jd), "--deep", "--json")
    doc = json.loads(res.stdout)
    assert res.returncode == 2 and any(f["record"] == str(mpath) for f in doc["findings"])
    assert any(f["rule"] == "frontier-state" and "no manifest" in f["message"] for f in doc["findings"])
    # a missing shard
    write_manifest(man, ck)
    (ck / target.spec.file).unlink()
    res = cli("gpu-generation", "verify", "--job-dir", str(jd), "--deep")
    assert res.returncode == 2 and "storage file missing" in res.stdout


def test_unreachable_etcd_exit_75_and_nothing_written(tmp_path, cli):
    jd = tmp_path / "job"
    res = cli(
        "gpu-generation",
        "init",
        "--job-dir",
        str(jd),
        "--ledger",
        f"etcd://127.0.0.1:{free_port()}/x",
        "--timeout",
        "1",
        timeout=30,
    )
    assert res.returncode == 75 and "unreachable" in res.stderr and res.stderr.count("\n") == 1
    assert not jd.exists()


def test_missing_job_and_usage_errors(tmp_path, cli):
    res = cli("gpu-generation", "show", "--job-dir", str(tmp_path / "nope"))
    assert res.returncode == 66 and "no gpuguard job at" in res.stderr and "Traceback" not in res.stderr
    assert cli("gpu-generation", "verify", "--job-dir", str(tmp_path / "nope")).returncode == 66
    assert cli("gpu-generation", "show").returncode == 64
    assert cli("gpu-generation", "init", "--job-dir", str(tmp_path), "--ledger", "ftp://x").returncode == 64


@pytest.mark.skipif(AS_NOBODY is None, reason="setpriv (util-linux) is required")
def test_ledger_without_write_permission(cli):
    """As root, mode bits do not bind: run the real CLI and a real activation as `nobody` instead."""
    base = Path(tempfile.mkdtemp(prefix="gpuguard-perm-"))
    try:
        os.chmod(base, 0o755)
        env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO)}  # tests.support for the child
        # 1. init where nobody may not create anything
        p = subprocess.run(
            [*AS_NOBODY, str(Path(sys.executable).parent / "gpu-generation"), "init", "--job-dir", str(base / "job")],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert p.returncode == 77 and "permission denied" in p.stderr and not (base / "job").exists()
        # 2. an existing root-owned ledger; nobody can read the key but not write the ledger
        jd = base / "job2"
        assert cli("gpu-generation", "init", "--job-dir", str(jd)).returncode == 0
        os.chmod(jd, 0o755)
        os.chown(jd / "generation.key", 65534, 65534)
        before = sorted(os.listdir(jd / "ledger"))
        script = (
            "import sys\n"
            "from tests.support.generation import child, members\n"
            "from gpuguard.generation.job import open_job_ledger\n"
            "from gpuguard.foundation.errors import GpuguardError\n"
            f"led = open_job_ledger({str(jd)!r})\n"
            "try:\n    led.activate(child(led.require_active(), members(1), key=led.key))\n"
            "except GpuguardError as e:\n    print(e); sys.exit(e.exit_code)\n"
        )
        p = subprocess.run(
            [*AS_NOBODY, sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env, cwd="/"
        )
        assert p.returncode == 77 and "permission denied" in p.stdout, p
        assert sorted(os.listdir(jd / "ledger")) == before
        # 3. root does not trust a key another user owns (they could have planted it), until it is root's again
        res = cli("gpu-generation", "verify", "--job-dir", str(jd))
        assert res.returncode == 77 and "another user's key" in res.stderr
        os.chown(jd / "generation.key", 0, 0)
        assert cli("gpu-generation", "verify", "--job-dir", str(jd)).returncode == 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_verify_and_show_never_import_torch(tmp_path, cli):
    jd = tmp_path / "job"
    assert cli("gpu-generation", "init", "--job-dir", str(jd)).returncode == 0
    code = (
        "import sys\nfrom gpuguard.cli._app import run\nfrom gpuguard.cli.generation import app\n"
        f"for argv in (['verify', '--deep', '--job-dir', {str(jd)!r}], ['show', '--job-dir', {str(jd)!r}],"
        f" ['history', '--job-dir', {str(jd)!r}]):\n"
        "    assert run(app, 'gpu-generation', argv) == 0\n"
        "print('torch' in sys.modules)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip().splitlines()[-1] == "False", p


def test_show_and_history_tell_an_in_place_switch_from_a_restart(tmp_path, cli):
    jd = tmp_path / "job"
    j(cli("gpu-generation", "init", "--job-dir", str(jd), "--json"))
    led, cert = grow(jd, None, n=1)  # generation 1: a restart
    survivor = cert.members[1]  # rank 0's node is lost: rank 1 carries on, renumbered to rank 0
    switched = child(
        cert,
        (Member(0, survivor.incarnation),),
        key=led.key,
        step=cert.frontier.step,
        extra={
            "switch": "in-place",
            "phases": {"detect": 0.044, "certify": 0.051},
            "layout": {"dp": 2, "tp": 1, "pp": 1},
            "previous_layout": {"dp": 3, "tp": 1, "pp": 1},
        },
    )
    led.activate(switched)
    show = cli("gpu-generation", "show", "--job-dir", str(jd))
    assert show.returncode == 0, show.stderr
    assert "switch         in-place" in show.stdout
    assert "phases         certify 0.051s, detect 0.044s" in show.stdout  # canonical (sorted) order
    assert "layout         dp=3 x tp=1 x pp=1 -> dp=2 x tp=1 x pp=1" in show.stdout
    assert "(same incarnation, renumbered from rank 1)" in show.stdout
    assert "new incarnation" not in show.stdout
    hist = j(cli("gpu-generation", "history", "--job-dir", str(jd), "--json"))
    assert [g["switch"] for g in hist["generations"]] == [None, "restart", "in-place"]
    text = cli("gpu-generation", "history", "--job-dir", str(jd)).stdout.splitlines()
    assert " restart " in text[3] and " in-place " in text[4]
