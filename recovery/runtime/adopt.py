"""Adopting the runtime in an existing training loop with a few lines: `fault_tolerant`.

    from gpuguard.recovery import fault_tolerant

    data = TokenLoader()                                           # a stateful loader, unchanged
    with fault_tolerant(build, job_dir=out, data=data) as run:     # replaces init_process_group + build()
        for step in run.steps(until=N):                            # replaces range(1, N + 1); commits each step
            loss = loss_fn(run.model(inputs), labels) ...

or, the same as a decorator: `@fault_tolerant(build)` on `def train(run): ...`.

Why a wrapper: the runtime's calls have an order a user should not have to learn (activate before
the first collective, commit after the optimizer step and never after a failed one, close outside
any `except` so gloo's sockets really close: docs/torchrun-hazards.md). `fault_tolerant` puts them
in that order around the user's loop:

- enter: `Runtime.from_env` (torchrun's environment), then `activate(build=...)`: the runtime
  forms this generation's group, `build()` makes the model, the optimizer (and an lr scheduler)
  on it (`fully_shard` needs the group), and the certified snapshot is restored into them
  (resharded by DCP at another world size). A member that cannot verify the certificate prints
  one line and exits with status 4 (the runtime does it). Passing `model=`/`optimizer=`
  (/`scheduler=`) instead of `build` suits a model that needs no group to be built (a
  replicated model whose gradients the loop all-reduces itself).
- each step: `run.steps(until)` yields the step numbers from the certified start and commits a
  step (step record, commit record, the collective sharded snapshot when due) when the loop body
  finished it and asks for the next one. A body that raised or left the loop with `break` does not
  commit that step: a restart redoes it.
- exit: a clean exit flushes the last snapshot and tears the group down (`Runtime.close`). A commit
  fenced by a newer generation prints one line and exits with status 4, as the runtime's own
  refusals do. Any other exception (a lost peer's gloo error, the user's own bug) propagates
  unchanged and the process exits non-zero, so torchrun restarts the group (`--max-restarts`) and
  the next generation resumes from the certified snapshot; a SIGTERM (torchrun stopping the
  survivors, `gpu-recover abort`) is the runtime's: the snapshot in flight finishes, bounded.

Sharded state (`sharded=True`) is the default here: the collective DCP snapshot serves FSDP2, HSDP
and DDP alike. Other keyword arguments go to `Runtime.from_env` unchanged.

Lazy imports (start-up time): the runtime (and through it torch), on entering the context only.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from gpuguard.foundation.errors import EXIT_REFUSED, EXIT_USAGE, GpuguardError

T = TypeVar("T")


@dataclass(frozen=True)
class RunSummary:
    """What one process's fault-tolerant run did, for its logs (`FaultTolerant.summary`, after exit)."""

    generation: int
    world_size: int
    start_step: int  # the first step this process ran (the certified frontier + 1)
    restored_from: str | None  # the certified snapshot restored (None: the initial state)
    last_committed: int | None  # the last step this process committed (None: none)
    snapshots: int  # collective snapshots this process took part in and saw published
    snapshot_errors: int
    snapshot_cpu_s: float  # the snapshot writer thread's CPU time


class FaultTolerant:
    """The runtime around one training loop, as a context manager or a decorator (module
    docstring). One use per process.

    `build() -> (model, optimizer[, lr scheduler])` is called once this generation's group is up;
    `job_dir` defaults to GPUGUARD_JOB_DIR; `data`: the data position, an object with `state_dict` /
    `load_state_dict` (a `StatefulDataLoader`, `recovery.runtime.data.SampleStream`), restored with
    the state; `runtime_options` go to `Runtime.from_env`."""

    def __init__(
        self,
        build: Callable[[], tuple[Any, ...]] | None = None,
        *,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        job_dir: str | Path | None = None,
        sharded: bool = True,
        data: Any = None,
        **runtime_options: Any,
    ) -> None:
        if (build is None) == (model is None):
            raise GpuguardError("fault_tolerant() needs either build or model (not both)", exit_code=EXIT_USAGE)
        self._build, self._model, self._optimizer, self._scheduler = build, model, optimizer, scheduler
        self._job_dir, self._sharded, self._options = job_dir, sharded, runtime_options
        self._data = data  # the data position (`state_dict` / `load_state_dict`): snapshotted, restored
        self.runtime: Any = None  # the Runtime, once entered (state_hash, collective, counters)
        self.state: Any = None  # the runtime's TrainState (generation, frontier, restored digest)
        self.last_committed: int | None = None
        self.summary: RunSummary | None = None
        self._used = False

    # ---------------------------------------------------------------- the context
    def __enter__(self) -> FaultTolerant:
        from gpuguard.recovery.runtime.runtime import Runtime  # noqa: PLC0415 - lazy: torch only in a training process

        if self._used:
            raise GpuguardError("a fault_tolerant() run is entered once per process", exit_code=EXIT_USAGE)
        self._used = True
        self.runtime = Runtime.from_env(self._job_dir, sharded=self._sharded, **self._options)
        if self._build is not None:
            built = self.runtime.activate(build=self._build, data=self._data) if self._sharded else None
            self.state = built if built is not None else self._activate_built()
        else:
            self.state = self.runtime.activate(self._model, self._optimizer, self._scheduler, data=self._data)
        if self.state.model is None:
            self.state.model, self.state.optimizer = self._model, self._optimizer
        if self.state.scheduler is None:
            self.state.scheduler = self._scheduler
        return self

    def _activate_built(self) -> Any:
        """Replicated mode has no group before activation: build() must not need one."""
        assert self._build is not None
        built = tuple(self._build())
        self._model, self._optimizer = built[0], built[1]
        self._scheduler = built[2] if len(built) > 2 else None
        return self.runtime.activate(self._model, self._optimizer, self._scheduler, data=self._data)

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        from gpuguard.recovery.runtime.runtime import FencedError  # noqa: PLC0415 - lazy, as in __enter__

        if isinstance(exc, FencedError):
            rt = self.runtime
            print(f"gpuguard: rank {rt.rank} (incarnation {rt.incarnation.id[:12]}) stops: {exc}", file=sys.stderr)
            sys.stderr.flush()
            os._exit(EXIT_REFUSED)  # like the runtime's refusals: nothing of this generation may follow
        if exc is None:
            self.runtime.close()  # outside any `except`: the group's sockets really close
        self.summary = self._summary()  # returns None: an exception propagates

    def _summary(self) -> RunSummary:
        c, rt = self.runtime.counters, self.runtime
        return RunSummary(
            generation=int(self.state.generation),
            world_size=int(rt.world_size),
            start_step=int(self.state.start_step),
            restored_from=self.state.restored_from,
            last_committed=self.last_committed,
            snapshots=c.snapshots,
            snapshot_errors=c.snapshot_errors,
            snapshot_cpu_s=c.snapshot_cpu_s,
        )

    def __call__(self, fn: Callable[..., T]) -> Callable[..., T]:
        """The decorator form: `fn(run, *args, **kwargs)` runs inside the context."""

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> T:
            with self as run:
                return fn(run, *args, **kwargs)

        return wrapped

    # ---------------------------------------------------------------- the loop
    @property
    def model(self) -> Any:
        """The model, restored (what `build()` made, or the one passed in)."""
        return self.state.model

    @property
    def optimizer(self) -> Any:
        return self.state.optimizer

    @property
    def scheduler(self) -> Any:
        """The lr scheduler (build()'s third item, or the one passed in; None without one), restored."""
        return self.state.scheduler

    @property
    def start_step(self) -> int:
        """The first step to run: the certified frontier + 1 (1 on a fresh job)."""
        return int(self.state.start_step)

    @property
    def rank(self) -> int:
        return int(self.runtime.rank)

    @property
    def world_size(self) -> int:
        return int(self.runtime.world_size)

    def steps(self, until: int | None = None) -> Iterator[int]:
        """Step numbers from `start_step` to `until` (inclusive; None: forever); each is committed
        when the loop body has finished it and asks for the next (not after a raise or `break`)."""
        if self.state is None:
            raise GpuguardError("steps() outside `with fault_tolerant(...)`", exit_code=EXIT_USAGE)
        for step in self.runtime.steps(self.state, until=until):
            yield step
            self.runtime.commit(step)
            self.last_committed = step


# the name a loop uses (`with fault_tolerant(build) as run:`); the class is the same thing
fault_tolerant = FaultTolerant
