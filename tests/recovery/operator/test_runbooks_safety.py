"""Runbook safety (issue 15): a dry run writes nothing by any step; a step's whole process group
ends at its timeout; runbooks cannot recurse; size caps and duplicate keys. Real files, real
processes, the real console scripts."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import typer.main

from gpuguard.cli.doctor import app
from gpuguard.foundation.jobdir import ensure_job
from gpuguard.generation.job import init_job
from gpuguard.recovery.operator import runbooks
from gpuguard.recovery.operator.runbooks import Runbook, RunbookError, Step
from tests.support.cli import BIN, run_cli
from tests.support.node import fake_env, healthy_gpu, snapshot, write_json


def tree(root: Path) -> dict[str, tuple]:
    """Every entry under `root` (root included): type and mode, size, mtime, content hash, link target."""
    found: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in [".", *dirnames, *filenames]:
            path = Path(dirpath) / name
            st = os.lstat(path)
            rel = str(path.relative_to(root))
            if stat.S_ISREG(st.st_mode):
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                digest = os.readlink(path)
            else:
                digest = None
            found[rel] = (st.st_mode, st.st_size if not stat.S_ISDIR(st.st_mode) else None, st.st_mtime_ns, digest)
    return found


def _book(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path.parent / f"{tmp_path.name}-{name}.yaml"
    path.write_text(text)
    return path


def _gpuguard_processes_naming(needle: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = proc.info["cmdline"] or []
            if proc.info["status"] != psutil.STATUS_ZOMBIE and any(needle in part for part in cmd):
                found.append(proc)
        except psutil.Error:
            continue
    return found


# --- 1. a dry run writes nothing -----------------------------------------------------------------


def test_dry_run_does_not_run_a_command_that_can_write(tmp_path):
    """The reported incident: a dry run ran `gpu-doctor diagnose node --dump-nvml {job_dir}/generation.key`
    (diagnose was on the read-only list) and overwrote the signing key."""
    job = tmp_path / "job"
    init_job(job)
    key = job / "generation.key"
    key_bytes, key_mtime = key.read_bytes(), key.stat().st_mtime_ns
    snap = write_json(tmp_path / "snap.json", snapshot(healthy_gpu(0)))
    book = _book(
        tmp_path,
        "dump",
        "name: dump-key\nsteps:\n"
        "- {name: diagnose, action: diagnose}\n"
        "- {name: vote, action: command, argv: [gpu-doctor, diagnose, job, --job-dir, '{job_dir}', --json],"
        " on_failure: continue}\n"
        "- {name: dump, action: command, argv: [gpu-doctor, diagnose, node, --mode, live, --no-processes, --json,"
        " --dump-nvml, '{job_dir}/generation.key']}\n"
        "- {name: dump2, action: command, argv: [gpu-doctor, diagnose, node, --mode, live,"
        " '--dump-nvml={job_dir}/nvml.json']}\n"
        "- {name: sweep, action: command, argv: [gpu-doctor, sweep, --state-dir, '{job_dir}/state',"
        " --textfile, '{job_dir}/m.prom']}\n"
        "- {name: init, action: command, argv: [gpu-generation, init, --job-dir, '{job_dir}']}\n"
        "- {name: abort, action: abort, args: {include_active: true}}\n"
        "- {name: restore, action: restore, on_failure: continue}\n"
        "- {name: verify, action: verify}\n",
    )
    before = tree(job)
    r = run_cli(
        "gpu-recover", "runbook", "run", str(book), "--job-dir", str(job), "--dry-run", "--json", env=fake_env(snap)
    )
    assert r.returncode == 0, r.stderr
    steps = {s["name"]: s for s in json.loads(r.stdout)["steps"]}
    assert steps["vote"]["outcome"] == "done"  # read-only: really ran
    for name in ("dump", "dump2", "sweep", "init"):
        assert steps[name]["outcome"] == "dry-run" and steps[name]["summary"].startswith("would run "), steps[name]
    assert "--dump-nvml" in steps["dump"]["summary"] and "not run" in steps["dump"]["summary"]
    assert key.read_bytes() == key_bytes and key.stat().st_mtime_ns == key_mtime
    assert tree(job) == before  # nothing created, changed or removed anywhere in the job dir


def test_builtin_runbooks_dry_run_leave_the_job_dir_identical(tmp_path):
    job = tmp_path / "job"
    init_job(job)
    before = tree(job)
    for name in runbooks.builtin_names():
        r = run_cli("gpu-recover", "runbook", "run", name, "--job-dir", str(job), "--dry-run", "--json", timeout=180)
        assert json.loads(r.stdout)["dry_run"] is True, r.stderr  # a step may fail (no agent): nothing is written
    assert tree(job) == before


@pytest.mark.parametrize(
    "argv,read_only",
    [
        (["gpu-doctor", "diagnose", "job", "--job-dir", "{job_dir}", "--json"], True),
        (["gpu-doctor", "diagnose", "torchrun", "--job-dir={job_dir}"], True),
        (["gpu-doctor", "diagnose", "node", "--kernel-log", "-", "--json"], True),
        (["gpu-doctor", "logs", "-", "--min-severity", "warning"], True),
        (["gpu-doctor", "contract", "{job_dir}/traces", "--json"], True),
        (["gpu-doctor", "diagnose", "node", "--dump-nvml", "{job_dir}/generation.key"], False),
        (["gpu-doctor", "diagnose", "node", "--dump-nvml={job_dir}/x"], False),
        (["gpu-doctor", "diagnose", "node", "--json", "--force"], False),
        (["gpu-doctor", "sweep", "--textfile", "x.prom"], False),
        (["gpu-doctor", "sweep", "--state-dir", "{job_dir}"], False),
        (["gpu-doctor", "diagnose", "job", "-j", "x"], False),  # an option not on the list
        (["gpu-doctor", "watch", "job", "--job-dir", "{job_dir}"], False),
        (["gpu-doctor", "diagnose"], False),
        (["gpu-generation", "show", "--job-dir", "{job_dir}"], False),
        (["gpu-recover", "status", "--job-dir", "{job_dir}"], False),
    ],
)
def test_only_allow_listed_doctor_commands_are_read_only(argv, read_only):
    assert (runbooks.read_only_reason(argv) is None) is read_only


# --- 3. a timed-out step ends its whole process group ----------------------------------------------

_SITE = """
import os, signal, sys, time
if os.path.basename(sys.argv[0]) == "gpu-doctor" and os.environ.get("GG_TEST_PIDS"):
    with open(os.path.join(os.environ["GG_TEST_PIDS"], "child"), "w") as f:
        f.write(str(os.getpid()))
    if os.fork() == 0:  # the grandchild: ignores SIGTERM, holds none of the step's pipes
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        fd = os.open(os.devnull, os.O_RDWR)
        for i in (0, 1, 2):
            os.dup2(fd, i)
        with open(os.path.join(os.environ["GG_TEST_PIDS"], "grandchild"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(300)
        os._exit(0)
    time.sleep(300)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_step_timeout_ends_the_whole_process_group(tmp_path):
    hook, pids = tmp_path / "hook", tmp_path / "pids"
    hook.mkdir()
    pids.mkdir()
    (hook / "sitecustomize.py").write_text(_SITE)
    job = tmp_path / "job"
    ensure_job(job)
    book = _book(
        tmp_path,
        "slow",
        "name: slow\nsteps:\n"
        "- {name: slow, action: command, argv: [gpu-doctor, diagnose, torchrun, --job-dir, '{job_dir}'],"
        " args: {timeout_s: 2}}\n",
    )
    env = {
        "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "GG_TEST_PIDS": str(pids),
    }
    started = time.monotonic()
    grandchild = None
    try:
        r = run_cli("gpu-recover", "runbook", "run", str(book), "--job-dir", str(job), "--yes", "--json", env=env)
        took = time.monotonic() - started
        grandchild = int((pids / "grandchild").read_text())
        child = int((pids / "child").read_text())
        assert r.returncode == 75, r.stderr
        (step,) = json.loads(r.stdout)["steps"]
        assert step["outcome"] == "timeout" and "process group" in step["summary"]
        assert took < 2 + runbooks.COMMAND_GRACE_S + 20
        assert _gone(child), "the step's own process survived its timeout"
        assert _gone(grandchild), "a process the step forked (ignoring SIGTERM) survived the step's timeout"
    finally:
        if grandchild is not None and not _gone(grandchild):
            os.kill(grandchild, signal.SIGKILL)


def test_a_runner_ended_by_sigterm_ends_its_step_first(tmp_path):
    """SIGTERM to `gpu-recover runbook run` mid-step: the step's group goes with it, no orphan."""
    hook, pids = tmp_path / "hook", tmp_path / "pids"
    hook.mkdir()
    pids.mkdir()
    (hook / "sitecustomize.py").write_text(_SITE)
    job = tmp_path / "job"
    ensure_job(job)
    book = _book(
        tmp_path,
        "term",
        "name: term\nsteps:\n"
        "- {name: slow, action: command, argv: [gpu-doctor, diagnose, torchrun, --job-dir, '{job_dir}'],"
        " args: {timeout_s: 120}}\n",
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "GG_TEST_PIDS": str(pids),
    }
    runner = subprocess.Popen(
        [str(BIN / "gpu-recover"), "runbook", "run", str(book), "--job-dir", str(job), "--yes"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    grandchild = child = None
    try:
        end = time.monotonic() + 30
        while time.monotonic() < end and not (pids / "grandchild").exists():
            time.sleep(0.05)
        time.sleep(0.2)
        grandchild, child = int((pids / "grandchild").read_text()), int((pids / "child").read_text())
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(30) == -signal.SIGTERM
        assert _gone(child) and _gone(grandchild)
    finally:
        if runner.poll() is None:
            runner.kill()
        for pid in (child, grandchild):
            if pid is not None and not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_run_in_group_ends_a_group_that_outlives_its_leader(tmp_path):
    """A command that exits but leaves a child running in its group: that child is ended too."""
    pidfile = tmp_path / "pid"
    code = (
        "import os, signal, sys, time\n"
        "if os.fork() == 0:\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "    fd = os.open(os.devnull, os.O_RDWR)\n"
        "    [os.dup2(fd, i) for i in (0, 1, 2)]\n"
        f"    open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
        "    time.sleep(300)\n"
        "    os._exit(0)\n"
        "time.sleep(0.5)\n"
        "print('done')\n"
    )
    done = runbooks.run_in_group([sys.executable, "-c", code], timeout=30, grace=0.5)
    pid = int(pidfile.read_text())
    try:
        assert done.returncode == 0 and done.stdout.strip() == "done"
        assert _gone(pid)
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


# --- 4. runbooks cannot recurse ----------------------------------------------------------------------


def test_a_self_recursive_runbook_is_refused_and_leaves_no_process(tmp_path):
    job = tmp_path / "job"
    ensure_job(job)
    book = tmp_path.parent / f"{tmp_path.name}-self.yaml"
    book.write_text(
        "name: self\nsteps:\n"
        f"- {{name: again, action: command, argv: [gpu-recover, runbook, run, '{book}', --job-dir, '{{job_dir}}', --yes]}}\n"
    )
    before = tree(job)
    r = run_cli("gpu-recover", "runbook", "run", str(book), "--job-dir", str(job), "--yes", "--json", timeout=60)
    assert r.returncode == 4, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "runbooks cannot recurse" in r.stderr
    assert tree(job) == before
    assert _gpuguard_processes_naming(str(book)) == []
    r = run_cli("gpu-recover", "runbook", "show", str(book))
    assert r.returncode == 4 and "cannot recurse" in r.stderr


def test_mutually_recursive_runbooks_are_refused(tmp_path):
    job = tmp_path / "job"
    ensure_job(job)
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    for me, other in ((a, b), (b, a)):
        me.write_text(
            f"name: {me.stem}\nsteps:\n- {{name: diagnose, action: diagnose}}\n"
            f"- {{name: other, action: command, argv: [gpu-recover, runbook, run, '{other}',"
            " --job-dir, '{job_dir}', --yes]}\n"
        )
    r = run_cli("gpu-recover", "runbook", "run", str(a), "--job-dir", str(job), "--yes", timeout=60)
    assert r.returncode == 4 and "step 2 (other)" in r.stderr and "cannot recurse" in r.stderr
    assert not (job / "audit.log").exists()
    assert _gpuguard_processes_naming(str(tmp_path / "a.yaml")) == []
    assert _gpuguard_processes_naming(str(tmp_path / "b.yaml")) == []


def test_runbook_run_inside_a_step_is_refused_at_run_time(tmp_path):
    """Whatever form got past validation: a runbook run started in a step's environment is refused."""
    job = tmp_path / "job"
    ensure_job(job)
    before = tree(job)
    r = run_cli(
        "gpu-recover", "runbook", "run", "hang", "--job-dir", str(job), "--yes", env={"GPUGUARD_RUNBOOK_DEPTH": "1"}
    )
    assert r.returncode == 4 and "runbooks cannot recurse" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert tree(job) == before
    # a step (built here, past validation) that runs a runbook: the nested run is refused, the step fails with 4
    book = Runbook(
        "nest",
        "",
        (Step("nest", "command", argv=("gpu-recover", "runbook", "run", "hang", "--job-dir", "{job_dir}", "--yes")),),
        "test",
    )
    report = runbooks.run(book, job, dry_run=False, yes=True, confirm=None)
    assert report.exit_code == 4 and report.steps[0].outcome == "failed"
    assert "cannot recurse" in report.steps[0].summary
    records = [json.loads(x) for x in (job / "audit.log").read_text().splitlines()]
    assert {r["action"] for r in records} == {"runbook", "command"}  # hang's diagnose never ran
    assert psutil.Process().children(recursive=True) == []


# --- 5. size caps and duplicate keys -----------------------------------------------------------------


def test_a_runbook_over_one_mib_is_refused(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("name: big\nsteps: [{name: a, action: diagnose}]\n# " + "x" * (1 << 20) + "\n")
    r = run_cli("gpu-recover", "runbook", "show", str(big))
    assert r.returncode == 65 and "1 MiB" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    with pytest.raises(RunbookError, match="1 MiB"):
        runbooks.parse(big.read_text(), "big.yaml")


def test_a_fifo_is_not_read_as_a_runbook(tmp_path):
    fifo = tmp_path / "book.yaml"
    os.mkfifo(fifo)
    r = run_cli("gpu-recover", "runbook", "show", str(fifo), timeout=30)
    assert r.returncode == 65 and "not a regular file" in r.stderr


@pytest.mark.parametrize(
    "doc,message",
    [
        ("name: a\nname: b\nsteps: [{name: s, action: diagnose}]\n", "line 2: duplicate key 'name' (first at line 1)"),
        (
            "name: a\nsteps:\n- name: s\n  action: diagnose\n  action: abort\n",
            "line 5: duplicate key 'action' (first at line 4)",
        ),
        (
            "name: a\nsteps:\n- {name: s, action: abort, args: {grace_s: 1, grace_s: 30}}\n",
            "line 3: duplicate key 'grace_s'",
        ),
    ],
)
def test_duplicate_keys_are_an_error_naming_key_and_line(tmp_path, doc, message):
    with pytest.raises(RunbookError, match=message.replace("(", r"\(").replace(")", r"\)")):
        runbooks.parse(doc, "d.yaml")
    path = tmp_path / "d.yaml"
    path.write_text(doc)
    r = run_cli("gpu-recover", "runbook", "show", str(path))
    assert r.returncode == 65 and "duplicate key" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_yaml_merge_keys_may_still_override():
    book = runbooks.parse("name: m\nsteps:\n- &base {name: a, action: diagnose}\n- <<: *base\n  name: b\n", "m.yaml")
    assert [s.name for s in book.steps] == ["a", "b"]


@pytest.mark.parametrize("value", [".nan", ".inf", "-1", "1.0e+12"])
def test_step_numbers_are_finite_and_not_negative(value):
    with pytest.raises(RunbookError, match=r"step 1 \(c\): field .args.timeout_s.: must be a finite number"):
        runbooks.parse(
            f"name: n\nsteps: [{{name: c, action: command, argv: [gpu-doctor, logs, x], args: {{timeout_s: {value}}}}}]\n"
        )


def test_the_read_only_list_names_real_gpu_doctor_commands_and_options():
    """No typo and no drift: every allow-listed subcommand and option exists in gpu-doctor as built."""
    root = typer.main.get_command(app)
    for path, options in runbooks.READ_ONLY_DOCTOR.items():
        cmd = root
        for word in path:
            cmd = cmd.commands[word]  # a KeyError names a subcommand that does not exist
        real = {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)}
        assert options <= real, (path, sorted(options - real))
