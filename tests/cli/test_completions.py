"""Shell completions: the committed scripts match the live command tree, and bash really completes,
values included (issue 26, item 6): after `--format` its choices, after `--kernel-log` files, after
`--state-dir` directories, after `runbook show` the bundled runbooks, and after a free value
(`--interval`) nothing, where the old scripts offered every option (bash inserted a bare `-`)."""

from __future__ import annotations

import os
import pty
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from gpuguard.completions import generate


@pytest.fixture(scope="module")
def fresh():
    return generate.scripts()


def test_committed_scripts_are_not_stale(fresh):
    stale = [
        name
        for name, text in fresh.items()
        if not (generate.HERE / name).exists() or (generate.HERE / name).read_text() != text
    ]
    assert not stale, f"stale completion scripts {stale}: run python -m gpuguard.completions.generate"


def test_every_command_path_is_offered(fresh):
    for prog, module in generate.PROGRAMS:
        for node in generate.tree(module):
            for name, _ in node.subcommands:
                for shell in generate.SHELLS:
                    assert name in fresh[f"{prog}.{shell}"], (prog, shell, name)
    assert "/diagnose/node" in fresh["gpu-doctor.bash"] and "-l kernel-log" in fresh["gpu-doctor.fish"]


BASH = shutil.which("bash") or "/bin/bash"


def _bash_complete(script: str, *words: str, cwd: str | Path = "/", fn: str = "_gpuguard_gpu_doctor") -> list[str]:
    line = " ".join(f"'{w}'" for w in words)
    code = f"{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; {fn}; printf '%s\\n' \"${{COMPREPLY[@]}}\""
    out = subprocess.run(
        [BASH, "--norc", "--noprofile", "-c", code], capture_output=True, text=True, timeout=30, cwd=cwd
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_bash_completes_subcommands_and_options(fresh):
    script = fresh["gpu-doctor.bash"]
    assert _bash_complete(script, "gpu-doctor", "diagnose", "no") == ["node"]
    opts = _bash_complete(script, "gpu-doctor", "diagnose", "--json", "node", "--kernel-log", "x", "--nv")
    assert opts == ["--nvml-snapshot", "--nvml-timeout"]
    assert "sweep" in _bash_complete(script, "gpu-doctor", "")


def test_bash_completes_values(fresh, tmp_path):
    (tmp_path / "kern.log").write_text("")
    (tmp_path / "state").mkdir()
    script = fresh["gpu-doctor.bash"]
    assert _bash_complete(script, "gpu-doctor", "diagnose", "node", "--format", "") == [
        "human",
        "json",
        "npd",
        "nagios",
    ]
    assert _bash_complete(script, "gpu-doctor", "sweep", "--drain-via", "k") == ["kubernetes"]
    assert _bash_complete(script, "gpu-doctor", "logs", "--min-severity", "") == ["info", "warning", "critical"]
    assert _bash_complete(script, "gpu-doctor", "diagnose", "node", "--kernel-log", "k", cwd=tmp_path) == ["kern.log"]
    assert _bash_complete(script, "gpu-doctor", "sweep", "--state-dir", "", cwd=tmp_path) == ["state"]
    assert _bash_complete(script, "gpu-doctor", "watch", "job", "--interval", "") == []  # a number: nothing
    assert _bash_complete(script, "gpu-doctor", "completion", "") == ["bash", "zsh", "fish"]
    # an option's value is never taken for a subcommand
    assert _bash_complete(script, "gpu-doctor", "sweep", "--node", "plan", "--dr") == ["--drain", "--drain-via"]
    recover = fresh["gpu-recover.bash"]
    books = _bash_complete(recover, "gpu-recover", "runbook", "show", "", cwd=tmp_path, fn="_gpuguard_gpu_recover")
    assert {"hang", "node-drain", "rank-failure", "kern.log"} <= set(books)
    assert _bash_complete(recover, "gpu-recover", "demo", "--scenario", "n", fn="_gpuguard_gpu_recover") == [
        "node-loss"
    ]


def _typed_in_bash(script: str, keys: str, cwd: Path, timeout: float = 30) -> str:
    """Type `keys` into an interactive bash (on a pty, readline's own TAB completion, the script installed
    as the README says, `gpu-doctor` a function that prints its arguments) and return what it printed."""
    rc = cwd / "rc"
    rc.write_text(f"PS1='$ '\n{script}\ngpu-doctor() {{ printf ARGS:; printf '%s|' \"$@\"; echo; }}\n")
    master, slave = pty.openpty()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TERM": "dumb", "HOME": str(cwd), "INPUTRC": "/dev/null"}
    proc = subprocess.Popen(
        [BASH, "--noprofile", "--rcfile", str(rc), "-i"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=cwd,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    out = b""
    end = time.monotonic() + timeout
    try:
        os.write(master, keys.encode() + b"\nexit\n")  # readline reads it in order: TAB completes in place
        while time.monotonic() < end:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: bash exited
                    break
                if not data:
                    break
                out += data
            elif proc.poll() is not None:
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        os.close(master)
    return out.decode("utf-8", "replace")


def test_tab_in_a_real_interactive_bash_completes_values(fresh, tmp_path):
    (tmp_path / "kern.log").write_text("")
    typed = _typed_in_bash(
        fresh["gpu-doctor.bash"], "gpu-doctor diagnose node --format na\t --kernel-log ke\t", tmp_path
    )
    assert "ARGS:diagnose|node|--format|nagios|--kernel-log|kern.log|" in typed, typed
    typed = _typed_in_bash(fresh["gpu-doctor.bash"], "gpu-doctor watch job --interval \t5", tmp_path)
    assert "ARGS:watch|job|--interval|5|" in typed, typed  # the old script made it "--interval -5"


def test_generator_check_mode(tmp_path):
    assert generate.main(["--out", str(tmp_path)]) == 0
    assert generate.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "gpu-doctor.fish").write_text("# old\n")
    assert generate.main(["--check", "--out", str(tmp_path)]) == 1
