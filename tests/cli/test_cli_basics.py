"""The three commands exist, print versions, and keep usage errors apart from health codes."""

from __future__ import annotations

import pytest

from gpuguard import __version__
from gpuguard.foundation.errors import EXIT_USAGE

COMMANDS = ["gpu-doctor", "gpu-generation", "gpu-recover"]


@pytest.mark.parametrize("command", COMMANDS)
def test_version(cli, command):
    res = cli(command, "--version")
    assert res.returncode == 0
    assert res.stdout.strip() == f"{command} {__version__}"


@pytest.mark.parametrize("command", COMMANDS)
def test_help(cli, command):
    res = cli(command, "--help")
    assert res.returncode == 0
    assert "Usage" in res.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_unknown_option_is_a_usage_error_not_critical(cli, command):
    res = cli(command, "--no-such-option")
    assert res.returncode == EXIT_USAGE
    assert "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
