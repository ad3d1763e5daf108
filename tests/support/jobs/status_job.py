"""The demo job (`gpuguard.examples.demo_train`) with a gate, for the `gpu-recover status` tests.

While the file named by STATUS_JOB_HOLD exists, a restarted worker (TORCHELASTIC_RESTART_COUNT > 0)
waits before it imports torch and activates (bounded: 300 s), so the test sees torchrun's restart
in progress for as long as it needs: the old generation's members gone, the agent alive, the new
workers started and not yet in a generation. Nothing else differs from the demo job.
"""

from __future__ import annotations

import os
import sys
import time

HOLD_ENV = "STATUS_JOB_HOLD"
MAX_HOLD_S = 300.0


def main() -> int:
    gate = os.environ.get(HOLD_ENV, "")
    if gate and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        end = time.monotonic() + MAX_HOLD_S
        while os.path.exists(gate) and time.monotonic() < end:
            time.sleep(0.1)
    from gpuguard.examples.demo_train import main as demo_main

    return demo_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
