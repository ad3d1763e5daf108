"""Shell completions: the committed scripts match the live command tree, and bash really completes."""

from __future__ import annotations

import shutil
import subprocess

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


def _bash_complete(script: str, *words: str) -> list[str]:
    line = " ".join(words)
    code = (
        f"{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; "
        f"_gpuguard_gpu_doctor; printf '%s\\n' \"${{COMPREPLY[@]}}\""
    )
    out = subprocess.run(
        [shutil.which("bash") or "/bin/bash", "--norc", "--noprofile", "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_bash_completes_subcommands_and_options(fresh):
    script = fresh["gpu-doctor.bash"]
    assert _bash_complete(script, "gpu-doctor", "diagnose", "no") == ["node"]
    opts = _bash_complete(script, "gpu-doctor", "diagnose", "--json", "node", "--kernel-log", "x", "--nv")
    assert opts == ["--nvml-snapshot", "--nvml-timeout"]
    assert "sweep" in _bash_complete(script, "gpu-doctor", "")


def test_generator_check_mode(tmp_path):
    assert generate.main(["--out", str(tmp_path)]) == 0
    assert generate.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "gpu-doctor.fish").write_text("# old\n")
    assert generate.main(["--check", "--out", str(tmp_path)]) == 1
