"""Sentences and metavars a person reads (issue 26, item 6): no `<str>` / `<float range>` metavars, no
"no a generation newer than 2", no "diagnose: diagnose: done" when a runbook step is named after its
action. Each assertion failed on the code before the fix."""

from __future__ import annotations

import re

import pytest

from gpuguard.cli import _app
from tests.support.cli import every_command, run_cli
from tests.support.cli_job import build_job

TYPER_METAVAR = re.compile(r"<(str|int|float|path|list\[\w+\]|\w+ range)>")


@pytest.mark.parametrize(("path", "cmd"), every_command(), ids=lambda v: v if isinstance(v, str) else "")
def test_no_typer_placeholder_metavars(path, cmd):
    ctx = _app._click().Context(cmd, info_name=path, terminal_width=200, max_content_width=200)
    assert TYPER_METAVAR.findall(cmd.get_help(ctx)) == [], path


def test_metavars_name_the_value():
    r = run_cli("gpu-recover", "demo", "--help")
    assert "--timeout S" in r.stdout and "--workers N" in r.stdout and "--job-dir DIR" in r.stdout
    assert "--rdzv-endpoint HOST:PORT" in r.stdout and "--scenario restart|node-loss|fsdp|hsdp" in r.stdout


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    jd, _ = build_job(tmp_path_factory.mktemp("sentences"))
    return jd


def test_verify_timeout_sentence(job):
    r = run_cli("gpu-recover", "verify", "--job-dir", str(job), "--newer-than", "9", "--timeout", "0.2")
    assert r.returncode != 0
    assert "no generation newer than 9 within 0.2 s" in r.stderr, r.stderr
    assert "no a generation" not in r.stderr


def test_runbook_step_named_after_its_action_is_said_once(job):
    r = run_cli("gpu-recover", "runbook", "run", "hang", "--job-dir", str(job), "--dry-run", timeout=120)
    assert "  diagnose: " in r.stdout, r.stdout + r.stderr
    assert "diagnose: diagnose" not in r.stdout and "abort: abort" not in r.stdout
