"""`python -m tests.support.call module:function ARG...`: call one library function as a command would
(for file kinds only the runtime reads): a GpuguardError is one stderr line and its exit code.
Arguments made of digits are ints, the others paths."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from gpuguard.foundation.errors import GpuguardError


def main(argv: list[str]) -> int:
    module, _, name = argv[0].partition(":")
    fn = getattr(importlib.import_module(module), name)
    args = [int(a) if a.isdigit() else Path(a) for a in argv[1:]]
    try:
        print(repr(fn(*args))[:200])
    except GpuguardError as exc:
        print(f"call: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
