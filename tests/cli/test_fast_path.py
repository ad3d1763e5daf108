"""The typer-free start of `gpu-doctor logs` and `diagnose node` (`cli._fast`) behaves as the Typer app.

Its option table must mirror the Typer signatures (a drift fails here, not in production); for any
command line it accepts it passes the command function exactly what typer passes (hypothesis, over a
vocabulary of real and odd tokens); it hands everything else (help, unknown options, missing values,
completion) to typer; and the two paths print the same bytes and exit alike on real inputs. Its whole
point, no typer import, is checked in a real process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.cli import _app, _fast, doctor, doctor_logs, doctor_node
from tests.support.cli import REPO

SAMPLE_LOG = REPO / "collectors" / "data" / "sample-kern.log"
SAMPLE_NVML = REPO / "collectors" / "data" / "sample-nvml.json"
ROOT = typer.main.get_command(doctor.app)


def _click_command(words: tuple[str, ...]) -> Any:
    cmd = ROOT
    for word in words:
        cmd = cmd.commands[word]
    return cmd


@pytest.mark.parametrize("command", _fast.COMMANDS, ids=lambda c: " ".join(c.words))
def test_option_table_mirrors_the_typer_signature(command: _fast.Command) -> None:
    click_cmd = _click_command(command.words)
    seen: dict[str, tuple[str, str, Any]] = {}
    for param in click_cmd.params:
        if param.param_type_name == "argument":
            assert param.name == command.positional and param.nargs == -1 and param.required
            continue
        for spelling in param.opts:
            seen[spelling] = (param.name, "flag" if param.is_flag else "value", True)
        for spelling in param.secondary_opts:
            seen[spelling] = (param.name, "flag", False)
        default = param.default
        assert command.defaults[param.name] == (list(default) if param.multiple else default), param.name
        if not param.is_flag:
            kind = command.options[param.opts[0]].kind
            annotation = param.type_descriptor.annotation
            expected = _fast.MULTI if param.multiple else _fast.FLOAT if annotation is float else _fast.STR
            assert annotation in (float, str, list[str]), param.name
            assert kind == expected, param.name
    if command.positional is None:
        assert all(p.param_type_name != "argument" for p in click_cmd.params)
    mine = {
        spelling: (
            opt.param,
            "flag" if opt.kind == _fast.FLAG else "value",
            opt.value if opt.kind == _fast.FLAG else True,
        )
        for spelling, opt in command.options.items()
    }
    assert mine == seen
    assert set(command.defaults) == {p.name for p in click_cmd.params} - {command.positional}


def _typer_kwargs(monkeypatch: pytest.MonkeyPatch, command: _fast.Command, argv: list[str]) -> dict[str, Any] | None:
    """What the Typer app passes the command function for `argv` (None: it did not call it)."""
    module, _, name = command.target.partition(":")
    got: dict[str, Any] = {}

    def record(*args: Any, **kwargs: Any) -> int:
        if args:
            kwargs = {command.positional or "args": list(args[0]), **kwargs}
        got.update(kwargs)
        return 0

    owner = doctor_logs if module.endswith("doctor_logs") else doctor_node
    monkeypatch.setattr(owner, name, record)
    code = _app.run(doctor.app, "gpu-doctor", [*command.words, *argv])
    monkeypatch.undo()
    if not got:
        return None
    assert code == 0
    return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in got.items()}


# Plain pieces (an option and its value, a flag, a file) with, now and then, an odd token: most command
# lines are ones the fast path takes, so the comparison runs on many, and some are not.
VALUES = ["x.log", "-", "2h", "c.yaml", "nagios", "replay", "3", "1e-3", " 4 ", "0x1", "1_0", "", "é.log"]
ODD = ["-h", "--help", "--", "--nope", "-j", "nan", "inf", "abc", "-1", "--json=1", "--demo=1", "-x.log"]


def _pieces(command: _fast.Command) -> st.SearchStrategy[list[str]]:
    options = sorted(command.options)
    flag = st.sampled_from([o for o in options if command.options[o].kind == _fast.FLAG]).map(lambda o: [o])
    valued = [o for o in options if command.options[o].kind != _fast.FLAG]
    value = st.tuples(st.sampled_from(valued), st.sampled_from(VALUES)).flatmap(
        lambda p: st.sampled_from([[p[0], p[1]], [f"{p[0]}={p[1]}"]])
    )
    odd = st.sampled_from(ODD).map(lambda t: [t])
    pieces = [flag, value, flag, value, odd]
    if command.positional is not None:
        pieces += [st.sampled_from(VALUES).map(lambda v: [v])] * 2
    return st.lists(st.one_of(*pieces), max_size=7).map(lambda parts: [t for part in parts for t in part])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_what_the_fast_path_accepts_it_parses_as_typer_does(monkeypatch: pytest.MonkeyPatch, data: Any) -> None:
    command = data.draw(st.sampled_from(_fast.COMMANDS))
    argv = data.draw(_pieces(command))
    found = _fast.match([*command.words, *argv])
    if found is None:
        return  # typer's to parse, with its own help and errors
    assert found[0] is command
    assert _typer_kwargs(monkeypatch, command, argv) == found[1], argv


@pytest.mark.parametrize(
    "argv",
    [
        ["logs"],
        ["logs", "--help"],
        ["logs", "-h", "x.log"],
        ["logs", "x.log", "--bogus"],
        ["logs", "x.log", "--min-severity"],
        ["logs", "--", "x.log"],
        ["logs", "-x", "x.log"],
        ["-v", "logs", "x.log"],
        ["diagnose", "node", "--timeout", "nan"],
        ["diagnose", "node", "--timeout", "abc"],
        ["diagnose", "node", "--kernel-log", "--json"],
        ["diagnose", "node", "extra"],
        ["diagnose", "node", "--json=yes"],
        ["diagnose", "job", "--job-dir", "x"],
        ["sweep", "--json"],
        [],
    ],
)
def test_anything_not_plain_goes_to_typer(argv: list[str]) -> None:
    assert _fast.match(argv) is None


def test_shell_completion_goes_to_typer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("_GPU_DOCTOR_COMPLETE", "bash_complete")
    assert _fast.match(["logs", "x.log"]) is None


def _both(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[tuple[int, str, str], tuple[int, str, str]]:
    fast = _fast.try_fast("gpu-doctor", argv)
    assert fast is not None, argv
    f = (fast, *capsys.readouterr())
    slow = _app.run(doctor.app, "gpu-doctor", argv)
    return f, (slow, *capsys.readouterr())


def _logs_cases(tmp: Path) -> list[list[str]]:
    quiet = tmp / "quiet.log"
    quiet.write_text("[    1.0] Linux version 6.8.0\n")
    return [
        ["logs", str(SAMPLE_LOG)],
        ["logs", "--json", str(SAMPLE_LOG), str(quiet)],
        ["logs", str(SAMPLE_LOG), "--min-severity=critical", "--json"],
        ["logs", str(quiet)],
        ["logs", "--min-severity", "loud", str(quiet)],  # the command's own usage error (64)
        ["logs", str(tmp / "missing.log")],  # 66
        ["logs", str(tmp)],  # a directory: 66
    ]


def test_logs_prints_and_exits_as_typer_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in _logs_cases(tmp_path):
        fast, slow = _both(capsys, argv)
        assert fast == slow, argv


def _stable(out: str) -> str:
    """A node document without what changes between two runs (the clock)."""
    try:
        doc = json.loads(out)
    except ValueError:
        return re.sub(r"duration=[0-9.]+s", "duration=Ts", out)
    for key in ("generated_at", "generated_at_unix", "duration_s"):
        doc.pop(key, None)
    return json.dumps(_without_since(doc), sort_keys=True)


def _without_since(value: object) -> object:
    """`--since 3650d` is printed as the absolute time it stands for: two runs either side of a
    second's boundary differ there (this test failed so under load), and nowhere else."""
    if isinstance(value, dict):
        return {k: _without_since(v) for k, v in value.items() if k != "since"}
    if isinstance(value, list):
        return [_without_since(v) for v in value]
    return value


def test_diagnose_node_prints_and_exits_as_typer_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train = tmp_path / "train.log"
    train.write_text("RuntimeError: CUDA error: uncorrectable ECC error encountered\n")
    cases = [
        ["diagnose", "node", "--json", "--kernel-log", str(SAMPLE_LOG)],
        ["diagnose", "node", "--json", "--kernel-log", str(SAMPLE_LOG), "--nvml-snapshot", str(SAMPLE_NVML)],
        ["diagnose", "node", "--format", "nagios", "--kernel-log", str(SAMPLE_LOG), "--timeout=5"],
        ["diagnose", "node", "--format", "npd", "--log", str(train), "--no-processes"],
        ["diagnose", "node", "--json", "--log", str(train), "--log", str(SAMPLE_LOG), "--since", "3650d"],
        ["diagnose", "node", "--format", "yaml", "--kernel-log", str(SAMPLE_LOG)],  # 64, from the command
        ["diagnose", "node", "--json", "--kernel-log", str(tmp_path / "missing.log"), "--mode", "replay"],
    ]
    for argv in cases:
        (fc, fo, fe), (sc, so, se) = _both(capsys, argv)
        assert (fc, _stable(fo), fe) == (sc, _stable(so), se), argv


PROBE = """
import atexit, sys
atexit.register(lambda: print("typer-imported" if "typer" in sys.modules else "typer-absent", file=sys.stderr))
from gpuguard.cli.doctor import main
sys.argv = ["gpu-doctor", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize(
    "argv",
    [["logs", "--json", str(SAMPLE_LOG)], ["diagnose", "node", "--json", "--kernel-log", str(SAMPLE_LOG)]],
)
def test_the_fast_path_never_imports_typer(argv: list[str]) -> None:
    res = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert json.loads(res.stdout)["schema"]
    assert res.stderr.strip().endswith("typer-absent"), res.stderr


def test_help_still_comes_from_typer() -> None:
    res = subprocess.run([sys.executable, "-c", PROBE, "logs", "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "Usage: gpu-doctor logs" in res.stdout and "Examples:" in res.stdout
    assert res.stderr.strip().endswith("typer-imported")
