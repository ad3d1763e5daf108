"""`gpu-doctor`: what broke, and is it dead or only slow.

The console script's module, kept lean: `main` runs `gpu-doctor logs` and `gpu-doctor diagnose node`
with plain arguments through `cli._fast` (no typer, no other command module: start-up time, a cron
sweep on every node), and everything else - help, completion, errors, the other commands - through
the full Typer app of `cli.doctor_app`, which `app` (and the other `*_app` names) load on first use.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

PROG = "gpu-doctor"
_APPS = ("app", "diagnose_app", "watch_app", "plan_app")


def main() -> NoReturn:
    """The console-script entry point."""
    from gpuguard.cli._fast import try_fast

    code = try_fast(PROG, sys.argv[1:])
    if code is None:
        from gpuguard.cli._app import run
        from gpuguard.cli.doctor_app import app

        code = run(app, PROG)
    sys.exit(code)


def __getattr__(name: str) -> Any:
    """`from gpuguard.cli.doctor import app`: the Typer app, built on first use."""
    if name in _APPS:
        from gpuguard.cli import doctor_app

        return getattr(doctor_app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    main()
