"""Command-line front ends: thin shells over collectors, diagnostics, generation and recovery.

Lazy imports (start-up time), in every command module: a command imports what it runs inside its
own function, so `gpu-doctor diagnose node` never pays for the ledger, the runtime or rich tables
it does not use (the sweep runs from cron on every node).
"""

import os as _os
import signal as _signal
import sys as _sys

_PROGS = ("gpu-doctor", "gpu-generation", "gpu-recover")


def _interrupted_at_startup(signum: int, frame: object) -> None:
    """Ctrl-C while the command is still importing: one line and 130, never a KeyboardInterrupt
    traceback from deep inside an import. `cli._app.run` puts the default handler back."""
    prog = _os.path.basename(_sys.argv[0]) if _sys.argv else "gpuguard"
    _os.write(2, f"{prog}: interrupted\n".encode())
    _os._exit(130)


# Only when this process is one of the three console scripts (never in a library or test process),
# and only from the main thread (signal handlers can only be set there).
if _sys.argv and _os.path.basename(_sys.argv[0]) in _PROGS:
    try:
        _signal.signal(_signal.SIGINT, _interrupted_at_startup)
    except ValueError:  # pragma: no cover - not the main thread
        pass
