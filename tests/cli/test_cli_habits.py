"""CLI habits (issue 15, item 8): every --help ends with examples that name real subcommands and
options; `-v/--debug` shows an internal error's traceback (one line otherwise); `completion SHELL`
prints the shipped script; Ctrl-C while a command is still importing is 130 with one line."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from importlib import resources
from typing import Any

import pytest
import typer

from gpuguard.cli import _app, doctor, generation, recover
from tests.support.cli import BIN, run_cli

APPS = (("gpu-doctor", doctor.app), ("gpu-generation", generation.app), ("gpu-recover", recover.app))


def _tree(prog: str, app: typer.Typer) -> dict[str, Any]:
    root = typer.main.get_command(app)
    _app.attach_examples(root, prog)
    out: dict[str, Any] = {}

    def walk(cmd: Any, path: str) -> None:
        out[path] = cmd
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, f"{path} {name}")

    walk(root, prog)
    return out


TREES = {prog: _tree(prog, app) for prog, app in APPS}
ALL = {path: cmd for tree in TREES.values() for path, cmd in tree.items()}


def test_every_command_has_examples() -> None:
    missing = sorted(path for path, cmd in ALL.items() if not (cmd.epilog or "").count("Examples:"))
    assert not missing, f"commands without examples: {missing}"
    assert not set(_app.EXAMPLES) - set(ALL), "examples for commands that do not exist"


@pytest.mark.parametrize("path", sorted(_app.EXAMPLES))
def test_each_example_names_real_subcommands_and_options(path: str) -> None:
    for line in _app.EXAMPLES[path]:
        text = line.split("  #")[0].split(" > ")[0].split(" | ")[-1]
        words = shlex.split(text)
        assert " ".join(words[: len(path.split())]) == path, line
        cmd = ALL[words[0]]
        rest = words[1:]
        while rest and rest[0] in (getattr(cmd, "commands", None) or {}):
            cmd = cmd.commands[rest.pop(0)]
        known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        for word in rest:
            if word.startswith("-") and word != "-":
                assert word.split("=")[0] in known, (line, word, sorted(known))


@pytest.mark.parametrize("argv", [["gpu-doctor", "sweep"], ["gpu-generation", "show"], ["gpu-recover", "status"]])
def test_help_prints_the_examples(argv: list[str]) -> None:
    r = run_cli(*argv, "--help")
    assert r.returncode == 0 and "Examples:" in r.stdout and f"{' '.join(argv)} --" in r.stdout


def _boom_app() -> typer.Typer:
    app = _app.make_app("gpu-test", "test")

    @app.command()
    def boom() -> None:
        raise RuntimeError("a bug")

    @app.command()
    def fine() -> None:
        print("ok")

    return app


def test_debug_shows_the_traceback_otherwise_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: Any) -> None:
    monkeypatch.delenv("GPUGUARD_DEBUG", raising=False)
    assert _app.run(_boom_app(), "gpu-test", ["boom"]) == 70
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "gpu-test: internal error: RuntimeError: a bug (-v or GPUGUARD_DEBUG=1 for a traceback)"
    ]
    for flag in ("-v", "--debug"):
        assert _app.run(_boom_app(), "gpu-test", [flag, "boom"]) == 70
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and 'raise RuntimeError("a bug")' in err
        assert err.strip().splitlines()[-1].startswith("gpu-test: internal error: RuntimeError: a bug")
        monkeypatch.delenv("GPUGUARD_DEBUG", raising=False)
    assert _app.run(_boom_app(), "gpu-test", ["-v", "fine"]) == 0


@pytest.mark.parametrize("prog", ["gpu-doctor", "gpu-generation", "gpu-recover"])
def test_completion_prints_the_shipped_scripts(prog: str) -> None:
    for shell in ("bash", "zsh", "fish"):
        r = run_cli(prog, "completion", shell)
        shipped = resources.files("gpuguard.completions").joinpath(f"{prog}.{shell}").read_text()
        assert r.returncode == 0 and r.stdout == shipped
    r = run_cli(prog, "completion", "tcsh")
    assert r.returncode == 64 and "bash, zsh, fish" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_bash_completion_from_the_command_works(tmp_path: Any) -> None:
    script = run_cli("gpu-doctor", "completion", "bash").stdout
    code = f'{script}\nCOMP_WORDS=(gpu-doctor comp); COMP_CWORD=1; _gpuguard_gpu_doctor; printf "%s\\n" "${{COMPREPLY[@]}}"'
    out = subprocess.run(["bash", "-c", code], capture_output=True, text=True, timeout=30, cwd=tmp_path).stdout.split()
    assert out == ["completion"]


SLOW_IMPORT = """
import importlib.abc, os, sys, time

class _Slow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["SLOW"] and not os.path.exists(os.environ["MARK"]):
            open(os.environ["MARK"], "w").close()
            time.sleep(5)  # "importing": the Ctrl-C lands here
        return None

sys.meta_path.insert(0, _Slow())
"""


def _interrupt(proc: subprocess.Popen[bytes]) -> tuple[int, str]:
    try:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err.decode()


@pytest.mark.parametrize(
    ("slow", "argv"),
    [
        ("typer", ["logs", "--", "-"]),  # the Typer path (`--` is not for the fast path)
        ("gpuguard.collectors.logparse", ["logs", "-"]),  # the fast path (cli._fast), which never imports typer
    ],
)
def test_ctrl_c_during_the_imports_is_130_with_one_line(tmp_path: Any, slow: str, argv: list[str]) -> None:
    """Deterministic: a sitecustomize makes one heavy import (`typer`, or the log parser on the fast
    path) take 5 s; the Ctrl-C arrives inside it. Not coverable by gpuguard's code: the first ~30-70 ms
    (interpreter start-up and `site`), before `gpuguard.cli` is imported."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_IMPORT)
    mark = tmp_path / "importing"
    env = {k: v for k, v in os.environ.items() if k != "GPUGUARD_DEBUG"}
    env.update(PYTHONPATH=str(tmp_path), MARK=str(mark), SLOW=slow)
    proc = subprocess.Popen(
        [str(BIN / "gpu-doctor"), *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    deadline = time.monotonic() + 30
    while not mark.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert mark.exists(), "the slow import was never reached"
    t0 = time.monotonic()
    rc, err = _interrupt(proc)
    assert time.monotonic() - t0 < 3  # ended at once, not after the 5 s import
    assert rc == 130 and err.strip().splitlines() == ["gpu-doctor: interrupted"], (rc, err)


@pytest.mark.parametrize("delay", [0.5, 1.0])
def test_ctrl_c_while_running_is_130_with_one_line(delay: float) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GPUGUARD_DEBUG"}
    proc = subprocess.Popen(
        [str(BIN / "gpu-doctor"), "logs", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    time.sleep(delay)  # a read of stdin that never ends
    rc, err = _interrupt(proc)
    assert rc == 130 and err.strip().splitlines() == ["gpu-doctor: interrupted"], (delay, rc, err)


def test_startup_handler_is_installed_only_for_the_console_scripts() -> None:
    code = "import signal, gpuguard.cli; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.strip() == "True"
