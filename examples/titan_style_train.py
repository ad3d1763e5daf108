"""The torchtitan-style FSDP2 loop of `titan_style_plain`, made fault tolerant with `fault_tolerant`.

    torchrun --nproc-per-node=2 --max-restarts=1 ... -m gpuguard.examples.titan_style_train --out DIR --steps 8 \
        [--kill R:S] [--final]

`main()` is the plain loop's with the lines adoption changes (README, sharded state, counts them):
the `with fault_tolerant(build, job_dir=..., data=data)` block replaces `init_process_group` and
`build()` (the runtime forms each generation's group, then builds the model, optimizer and lr
scheduler on it and restores them, and the stateful loader's position with them), and
`run.steps(until=...)` replaces the `range` (it commits each finished step; every rank snapshots its
shards, and the loader's position, in the background). A SIGKILLed rank
(`--kill R:S`) makes torchrun restart the group, and the restarted generation resumes from the
certified sharded snapshot: its final parameters equal the plain loop's fault-free ones, bitwise at
the same world size (`tests/examples/test_titan_style.py`). DIR is also the gpuguard job directory.
"""

from __future__ import annotations

import gc
import os

from gpuguard.examples.demo_train import Faults
from gpuguard.examples.titan_style_plain import POINT, TokenLoader, build, parse_args, train_step, write_final
from gpuguard.recovery import fault_tolerant


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    faults = Faults(a.out, int(os.environ["RANK"]), a.kill)
    data = TokenLoader()
    with fault_tolerant(build, job_dir=a.out, data=data) as run:
        model, optimizer, scheduler = run.model, run.optimizer, run.scheduler
        for step in run.steps(until=a.steps):
            faults(POINT, step)
            inputs, labels = next(data)
            train_step(model, optimizer, scheduler, inputs, labels)
        if a.final:
            write_final(model, a.out)
    return 0


if __name__ == "__main__":
    code = main()
    # FSDP's modules keep the process group alive past destroy_process_group; freed at interpreter
    # finalization, gloo can abort the process (SIGABRT after a clean run, seen in CI): free it now
    gc.collect()
    raise SystemExit(code)
