"""YAML runbooks: schema errors name the step and field; dry-run; confirmation; resume from the audit log."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.foundation.jobdir import ensure_job
from gpuguard.recovery.operator import runbooks  # noqa: E402
from gpuguard.recovery.operator.runbooks import RunbookError  # noqa: E402
from tests.support.cli import run_cli
from tests.support.processes import reap, record, spawn


def test_builtin_runbooks_are_valid_and_listed(cli):
    assert runbooks.builtin_names() == ["hang", "node-drain", "rank-failure"]
    r = cli("gpu-recover", "runbook", "list", "--json")
    assert r.returncode == 0
    books = {b["name"]: b["steps"] for b in json.loads(r.stdout)["runbooks"]}
    assert books["rank-failure"] == ["diagnose", "vote", "abort", "rendezvous", "restore", "verify"]
    r = cli("gpu-recover", "runbook", "show", "hang")
    assert r.returncode == 0 and "when:       diagnose.verdict == hung or diagnose.verdict == orphaned" in r.stdout


def test_list_shows_descriptions_and_show_reads_as_prose(cli):
    """`list` says what each runbook is for; `show` prints steps, conditions and arguments in words
    (the raw form is --json), never Python reprs."""
    r = cli("gpu-recover", "runbook", "list")
    assert r.returncode == 0
    assert "hang: diagnose -> abort -> restore -> verify" in r.stdout
    assert "Workers are alive but make no progress" in r.stdout  # the description, on its own line
    assert "This node is being drained" in r.stdout
    r = cli("gpu-recover", "runbook", "show", "hang")
    lines = r.stdout.splitlines()
    assert lines[0] == "runbook hang (builtin:hang)"
    assert "  1. diagnose" in lines and "       when:       always" in lines
    assert "       init timeout (s): 60" in lines and "       grace (s):  10" in lines
    assert "  2. abort" in lines and "       include active: true" in lines
    assert "       waits for:  a generation newer than the one active at step diagnose" in lines
    assert "       on failure: stop the run" in lines
    assert "{'" not in r.stdout and "':" not in r.stdout  # no dict reprs
    raw = json.loads(cli("gpu-recover", "runbook", "show", "hang", "--json").stdout)
    (book,) = raw["runbooks"]
    assert book["steps"][1]["args"] == {"grace_s": 10, "include_active": True}


@pytest.mark.parametrize(
    "doc,message",
    [
        ("[1, 2]", "a runbook is a mapping"),
        ("name: x\nsteps: []", "field 'steps'"),
        ("name: Bad Name\nsteps: [{name: a, action: diagnose}]", "field 'name'"),
        ("name: x\nsteps: [{name: a, action: reboot}]", "step 1 (a): field 'action'"),
        (
            "name: x\nsteps: [{name: a, action: diagnose}, {name: a, action: abort}]",
            "step 2 (a): field 'name': duplicate",
        ),
        (
            "name: x\nsteps: [{name: a, action: abort, when: 'a.verdict == dead'}]",
            "step 1 (a): field 'when': refers to 'a'",
        ),
        (
            "name: x\nsteps: [{name: a, action: diagnose}, {name: b, action: abort, when: 'a.verdict =='}]",
            "step 2 (b): field 'when'",
        ),
        ("name: x\nsteps: [{name: a, action: abort, args: {grace_s: fast}}]", "step 1 (a): field 'args.grace_s'"),
        ("name: x\nsteps: [{name: a, action: abort, args: {shell: 'rm -rf /'}}]", "step 1 (a): field 'args.shell'"),
        ("name: x\nsteps: [{name: a, action: command, argv: [bash, -c, ls]}]", "step 1 (a): field 'argv'"),
        ("name: x\nsteps: [{name: a, action: verify, newer_than: z}]", "step 1 (a): field 'newer_than'"),
        ("name: x\nsteps: [{name: a, action: diagnose, run: ls}]", "step 1 (a): unknown field"),
        ("name: x\nsteps: [{name: a, action: diagnose}]\nextra: 1", "unknown top-level"),
        ("name: x\nsteps: [{name: a, action: !!python/object/apply:os.system [ls]}]", "not valid YAML"),
        ("name: [unclosed", "not valid YAML at line 1"),
    ],
)
def test_schema_errors_name_the_step_and_field(doc, message):
    with pytest.raises(RunbookError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        runbooks.parse(doc, "t.yaml")


def test_cli_reports_a_bad_runbook_in_one_line(tmp_path, cli):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsteps: [{name: a, action: reboot}]\n")
    r = cli("gpu-recover", "runbook", "show", str(bad))
    assert r.returncode == 65 and len(r.stderr.strip().splitlines()) == 1 and "field 'action'" in r.stderr
    r = cli("gpu-recover", "runbook", "run", "no-such-book", "--job-dir", str(tmp_path), "--yes")
    assert r.returncode == 66


_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=12))
_values = st.recursive(
    _scalars,
    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)),
    max_leaves=12,
)
_stepish = st.fixed_dictionaries(
    {},
    optional={
        "name": st.one_of(st.sampled_from(["diagnose", "abort", "a", "b"]), _scalars),
        "action": st.one_of(
            st.sampled_from(["diagnose", "abort", "rendezvous", "restore", "verify", "command"]), _scalars
        ),
        "when": st.one_of(st.sampled_from(["diagnose.verdict == dead", "a.outcome == done", "x ==", "[("]), _scalars),
        "args": st.one_of(
            st.dictionaries(st.sampled_from(["grace_s", "step", "ranks", "bad"]), _values, max_size=2), _values
        ),
        "argv": st.one_of(st.lists(st.sampled_from(["gpu-doctor", "ls", "--json"]), max_size=3), _values),
        "newer_than": _scalars,
        "on_failure": st.one_of(st.sampled_from(["stop", "continue"]), _scalars),
    },
)


@settings(max_examples=150, deadline=None)
@given(
    st.one_of(
        _values,
        st.fixed_dictionaries(
            {"name": st.one_of(st.just("x"), _scalars), "steps": st.one_of(st.lists(_stepish, max_size=4), _values)}
        ),
    )
)
def test_any_document_is_a_runbook_or_one_clear_error(doc):
    try:
        book = runbooks.parse(yaml.safe_dump(doc), "h.yaml")
    except RunbookError as exc:
        assert str(exc).startswith("h.yaml: ") and "\n" not in str(exc)
        return
    assert book.steps and all(s.action in runbooks.ACTION_ARGS for s in book.steps)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_text_is_a_runbook_or_one_clear_error(text):
    try:
        runbooks.parse(text, "h.yaml")
    except RunbookError as exc:
        assert str(exc).startswith("h.yaml: ")


def test_dry_run_and_missing_confirmation_change_nothing(tmp_path, cli):
    proc = spawn()
    try:
        record(tmp_path, proc, 0)
        book = tmp_path.parent / f"{tmp_path.name}-kill.yaml"
        book.write_text("name: kill\nsteps:\n- {name: diagnose, action: diagnose}\n- {name: abort, action: abort}\n")
        r = cli("gpu-recover", "runbook", "run", str(book), "--job-dir", str(tmp_path), "--dry-run", "--json")
        assert r.returncode == 0, r.stderr
        assert [s["outcome"] for s in json.loads(r.stdout)["steps"]] == ["done", "dry-run"]
        assert not (tmp_path / "audit.log").exists() and proc.poll() is None
        r = cli("gpu-recover", "runbook", "run", str(book), "--job-dir", str(tmp_path), "--json", input="")
        assert r.returncode == 4 and proc.poll() is None
        assert [s["outcome"] for s in json.loads(r.stdout)["steps"]] == ["done", "refused"]
    finally:
        reap(proc)


def test_interrupted_run_resumes_from_the_audit_log(tmp_path):
    proc = spawn()
    book = tmp_path.parent / f"{tmp_path.name}-resume.yaml"
    book.write_text(
        "name: resume-me\nsteps:\n"
        "- {name: diagnose, action: diagnose}\n"
        "- {name: abort, action: abort, when: 'diagnose.live_workers > 0', args: {grace_s: 2}}\n"
        "- {name: verify, action: verify, args: {timeout_s: 60}}\n"
    )
    cmd = [
        str(Path(sys.executable).parent / "gpu-recover"),
        "runbook",
        "run",
        str(book),
        "--job-dir",
        str(tmp_path),
        "--yes",
        "--json",
    ]
    runner = None
    try:
        record(tmp_path, proc, 0)
        runner = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        audit = tmp_path / "audit.log"
        end = time.monotonic() + 60
        while time.monotonic() < end and not (audit.exists() and '"action":"abort"' in audit.read_text()):
            time.sleep(0.1)
        assert proc.wait(10) == -15  # the abort step really ran
        runner.send_signal(signal.SIGKILL)  # interrupted while verify waits for a certificate
        runner.wait(10)
        from gpuguard.generation.job import init_job

        init_job(tmp_path)  # the certificate verify was waiting for
        r = run_cli(*["gpu-recover", "runbook", "run", str(book), "--job-dir", str(tmp_path), "--yes", "--json"])
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert [(s["name"], s["outcome"], s["resumed"]) for s in doc["steps"]] == [
            ("diagnose", "done", True),
            ("abort", "done", True),
            ("verify", "done", False),
        ]
        records = [json.loads(x) for x in audit.read_text().splitlines()]
        assert sum(1 for a in records if a["action"] == "abort") == 1  # not repeated
        assert {a["run_id"] for a in records} == {doc["run_id"]}
        # finished: the next run is a new one
        r = run_cli("gpu-recover", "runbook", "run", str(book), "--job-dir", str(tmp_path), "--yes", "--json")
        again = json.loads(r.stdout)
        assert again["run_id"] != doc["run_id"] and again["steps"][1]["outcome"] == "skipped"
    finally:
        if runner is not None and runner.poll() is None:
            runner.kill()
        reap(proc)


def test_command_steps_run_gpuguard_scripts_without_a_shell(tmp_path, cli):
    book = tmp_path.parent / f"{tmp_path.name}-cmd.yaml"
    book.write_text(
        "name: doctor-then-abort\nsteps:\n"
        "- {name: doctor, action: command, argv: [gpu-doctor, diagnose, torchrun, --job-dir, '{job_dir}', --json]}\n"
        "- {name: abort, action: abort, when: doctor.verdict == orphaned}\n"
    )
    ensure_job(tmp_path)
    r = cli("gpu-recover", "runbook", "run", str(book), "--job-dir", str(tmp_path), "--yes", "--json")
    assert r.returncode == 0, r.stderr
    steps = json.loads(r.stdout)["steps"]
    assert [(s["name"], s["outcome"]) for s in steps] == [("doctor", "done"), ("abort", "skipped")]
    (cmd,) = [json.loads(x) for x in (tmp_path / "audit.log").read_text().splitlines() if '"command"' in x]
    assert cmd["args"]["argv"][0] == "gpu-doctor" and cmd["detail"]["verdict"] == "unknown"
