"""This rank's training state, replicated or sharded: chosen once, behind one interface.

The runtime's paths (activation, commit, the in-place switch) do the same things to either kind of
state: read it, put a loaded one back, hash it, restore the certified one, remember a committed
step in memory, report what is remembered, roll back to the frontier, write snapshots. How each is
done differs, so each kind is a class (`ReplicatedState` here, `ShardedState` in
`recovery.runtime.sharded_state`) and the runtime picks one when it is built: no path branches on
the kind. The model of this is torchft's `Manager(state_dict=..., load_state_dict=...)`, which
takes the strategies instead of a flag.

Lazy imports (start-up time): torch, only in the methods that run inside a training process.
"""

from __future__ import annotations

import atexit
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import DataError, GpuguardError, NoInputError, one_line
from gpuguard.foundation.inplace_files import Report
from gpuguard.generation import manifest as m
from gpuguard.generation.records import Certificate
from gpuguard.recovery.runtime.context import Context
from gpuguard.recovery.runtime.refusals import ActivationRefused
from gpuguard.recovery.runtime.switch import Eviction, StateAgreement, agree_on_state
from gpuguard.recovery.runtime.writers import ReplicatedWriter, SnapshotOutcomes
from gpuguard.recovery.snapshots import sharded as ss
from gpuguard.recovery.snapshots.measure import DATA_KEY
from gpuguard.recovery.snapshots.soundness import STOP, Expect, Policy, expect_problem, judge, of_extra
from gpuguard.recovery.snapshots.store import (
    Selection,
    SnapshotInfo,
    clone_state,
    load_snapshot,
    measured_state,
    select_restorable,
    state_digest,
)

# how long a SIGTERMed worker lets its in-flight snapshot finish: below torchrun's grace period
# between SIGTERM and SIGKILL (30 s in torch.distributed.elastic's PContext.close)
SIGTERM_FLUSH_S = 10.0

Check = Callable[[SnapshotInfo], "str | None"]


class RollbackRefused(ActivationRefused):
    """This survivor cannot hold the certified frontier state (not remembered, or another digest)."""


@dataclass
class TrainObjects:
    """What the training script handed the runtime (or `build()` made): the objects whose state it keeps."""

    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    data: Any = None  # the registered data position (`state_dict` / `load_state_dict`): `activate(data=...)`


class RankState(ABC):
    """One rank's state and its snapshot writer (see the module docstring)."""

    sharded: bool
    restores_before_group: bool  # replicated: load before the group forms; sharded: the load is collective

    def __init__(self, objects: TrainObjects, policy: Policy | None = None) -> None:
        self.objects = objects
        self.policy = policy if policy is not None else Policy()  # what a sound state is (`soundness`)
        self.reshard: dict[str, Any] | None = None  # sharded: the certified reshard plan and whether it held
        self.rng_restore: str | None = None  # sharded: what happened to the RNG states, in words
        self.unsound: str | None = None  # a snapshot this rank's writer found unsound: why (the next commit stops)
        self._ctx: Context | None = None

    # ------------------------------------------------------------------ soundness
    def expect(self) -> Expect:
        """The non-tensor state this job has, which every snapshot of it must carry."""
        o = self.objects
        data = o.data.state_dict() if o.data is not None else None
        return Expect(
            data_keys=tuple(sorted(map(str, data))) if data is not None else None,
            rng=True,
            scheduler=o.scheduler is not None,
        )

    def expect_check(self, info: SnapshotInfo) -> str | None:
        """A stored state that lacks what this job's objects need (a data position, an LR scheduler):
        refused at selection, before anything loads it (the manifest's categories, torch-free)."""
        try:
            manifest = m.load_manifest(info.path)
        except (DataError, NoInputError) as exc:
            return str(exc)
        return expect_problem((m.category(e.spec.fqn) for e in manifest.entries), self.expect())

    def watch(self, ctx: Context, outcomes: SnapshotOutcomes) -> SnapshotOutcomes:
        """`outcomes`, telling this state of a written snapshot that is unsound (`check_sound`)."""
        self._ctx = ctx

        def unsound(step: int, why: str) -> None:
            if self.unsound is None:
                self.unsound = f"snapshot step {step} is unsound: {why}"

        outcomes.on_unsound = unsound
        return outcomes

    def check_sound(self) -> None:
        """After a snapshot was found unsound: with `on_unsound="stop"` this rank stops (one line,
        status 4), so torchrun restarts the job from the newest sound state; else it is said once."""
        why, self.unsound = self.unsound, None
        if why is None or self._ctx is None:
            return
        if self.policy.on_unsound == STOP:
            self._ctx.refuse("stops", f"{why}; the job restarts from the newest sound state")
        self._ctx.log(f"{why} (on_unsound=log: training goes on)")

    def soundness_extra(self, chosen: SnapshotInfo | None, frontier: Any) -> dict[str, Any]:
        """The certificate's `soundness`: the certified state's record (its manifest's), with its step."""
        if (
            chosen is None
            or not frontier.state_manifest_digest
            or chosen.manifest_digest != frontier.state_manifest_digest
        ):
            return {}
        try:
            verdict = of_extra(m.load_manifest(chosen.path).extra)
        except (GpuguardError, ValueError):
            return {}
        return {} if verdict is None else {"soundness": {"step": chosen.step, **verdict.to_dict()}}

    # ------------------------------------------------------------------ the state
    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The state as `torch.distributed.checkpoint` saves it: reading it never changes the training."""

    def load_template(self) -> dict[str, Any]:
        """The state DCP loads a snapshot into (its optimizer's state created if fresh: overwritten)."""
        return self.state_dict()

    @abstractmethod
    def apply(self, loaded: Mapping[str, Any]) -> None:
        """Put a loaded state into the live objects."""

    @abstractmethod
    def digest(self) -> str:
        """The digest snapshots and certificates bind (sharded: a collective over the default group)."""

    # ------------------------------------------------------------------ the store
    @abstractmethod
    def select(self, root: Any, bound: int | None, check: Check | None = None, **options: Any) -> Selection:
        """The newest verified snapshot of this kind at or below `bound` that passes `check`
        (`select_restorable`'s options: `expected_manifest_digest`, `max_tries`)."""

    def restore(self, ctx: Context, cert: Certificate) -> tuple[str, str | None]:
        """Load the certified frontier state: (snapshot path, loaded digest). A state that fails to
        load is marked, so the next activation falls back to an older one instead of failing again."""
        frontier = cert.frontier
        selection = self.select(
            ctx.snapshot_root, frontier.step, expected_manifest_digest=frontier.state_manifest_digest
        )
        info = certified(selection, frontier.step)
        if info.warning and ctx.rank == 0:
            ctx.log(f"restoring step {info.step}: {info.warning}")
        try:
            digest = self.load(ctx, info, cert)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
                jobdir.mark_unrestorable(
                    ctx.snapshot_root,
                    step=info.step,
                    path=info.path,
                    manifest_digest=info.manifest_digest,
                    reason=one_line(exc),
                )
            raise
        return str(info.path), digest

    @abstractmethod
    def load(self, ctx: Context, info: SnapshotInfo, cert: Certificate) -> str | None:
        """Load `info` into the live objects and check it; the loaded state's digest."""

    def certificate_facts(
        self, parent: Certificate, selection: Selection, frontier: Any, world_size: int
    ) -> tuple[int, dict[str, Any]]:
        """The restart coordinator's facts for this kind: (ownership map version, certificate extra)."""
        return parent.ownership_map_version, self.soundness_extra(selection.chosen, frontier)

    def prepare(self, opened: Any, pg_timeout_s: float) -> None:
        """Once this generation's group is up, before a collective restore (sharded: build the model)."""
        return None  # nothing to do for this kind

    # ------------------------------------------------------------------ the in-place memory
    @abstractmethod
    def remember(self, step: int) -> None:
        """Keep a copy of this committed step in memory (the in-place switch rolls back to it)."""

    @abstractmethod
    def report(self) -> tuple[dict[int, str], dict[int, Any]]:
        """What a survivor reports of its memory: (step -> digest, step -> chunk sums)."""

    @abstractmethod
    def roll_back(self, frontier: int, committed: int | None, want: str | None) -> Any:
        """Hold the frontier state (certified digest `want`) before joining; what a rebuild needs, or None."""

    @abstractmethod
    def agree(self, reports: Iterable[Report], frontier: int) -> Any:
        """The coordinator: the state every kept survivor holds, with one digest, or why not."""

    def switch_extra(self, agreement: Any, eviction: Eviction) -> dict[str, Any]:
        """Certificate extra of an in-place switch for this kind."""
        return {}

    layout_step = 0  # an in-place switch of this kind changes the ownership map version by this much

    def replica_ranks(self) -> int | None:
        """Ranks per HSDP replica when the in-place switch may keep the layout (drop damaged replicas
        whole, move nothing); None: it re-partitions the state over every survivor."""
        return None  # replicated state: every rank is a replica already

    def leave_group(self) -> None:
        """The generation's group failed: drop what holds it (sharded: the writer, the model)."""
        return None  # nothing to do for this kind

    # ------------------------------------------------------------------ the snapshot writer
    @abstractmethod
    def start_writer(self, ctx: Context, outcomes: SnapshotOutcomes, options: Any, frontier: Any = None) -> None:
        """Start (or keep) this generation's snapshot writer; `frontier` (a `FrontierAgreement`) is told
        of each snapshot every member took part in."""

    def meets_at(self, step: int, every: int) -> bool:
        """Whether every member meets on the control group after committing `step`, so that the
        frontier record can be raised to it (`recovery.runtime.frontier`): the same answer on every member."""
        return False

    @abstractmethod
    def snapshot(self, step: int, every: int, step_s: float) -> None:
        """After the commit of `step`: hand a due snapshot to the writer (never waits for the disk)."""

    @abstractmethod
    def flush(self, timeout: float) -> bool:
        """Wait, bounded, until no snapshot is pending or being written; False on timeout."""

    @abstractmethod
    def close_writer(self, ctx: Context, timeout: float) -> None:
        """Flush the last snapshot and stop the writer (its figures go to the counters)."""

    def settle_writer(self) -> None:
        """Before the generation changes in place: a queued snapshot of the old one finishes or is fenced."""
        return None  # nothing to do for this kind

    def drop_groups(self) -> None:
        """After the process group is destroyed: drop the last references to its subgroups, while the
        interpreter is whole (a gloo group freed during finalization can abort a finished process)."""
        return None  # nothing to do for this kind


def certified(selection: Selection, step: int) -> SnapshotInfo:
    """The selected snapshot, which must be the certified step's: ActivationRefused with the reason otherwise."""
    info = selection.chosen
    if info is None or info.step != step:
        why = "; ".join(f"step {r.step}: {r.reason}" for r in selection.rejected if r.step == step)
        raise ActivationRefused(f"certified state of step {step} not found or does not verify ({why or 'missing'})")
    return info


class ReplicatedState(RankState):
    """Every rank holds the whole state (DDP, or a model the loop all-reduces): rank 0 writes it."""

    sharded = False
    restores_before_group = True

    def __init__(self, objects: TrainObjects, keep_local: int = 3, policy: Policy | None = None) -> None:
        super().__init__(objects, policy)
        self.keep_local = max(2, keep_local)
        self._local: OrderedDict[int, tuple[dict[str, Any], str]] = OrderedDict()
        self.writer: ReplicatedWriter | None = None

    def state_dict(self) -> dict[str, Any]:
        """model / optim / sched / rng / extra, as DCP saves it: a read that never changes the training
        (a fresh optimizer is recorded fresh, `read_state_dicts`), for digests, memory and snapshots."""
        return self._state(template=False)

    def load_template(self) -> dict[str, Any]:
        """The state DCP loads into: a fresh optimizer's state created (by torch's zero step), so that
        the template holds every key the snapshot has; the load overwrites it."""
        return self._state(template=True)

    def _state(self, *, template: bool) -> dict[str, Any]:
        import torch
        from torch.distributed.checkpoint.state_dict import get_state_dict

        o = self.objects
        if o.optimizer is not None:
            msd, osd = get_state_dict(o.model, o.optimizer) if template else ss.read_state_dicts(o.model, o.optimizer)
        else:
            msd, osd = o.model.state_dict(), {}
        state: dict[str, Any] = {"model": msd, "rng": {"torch": torch.get_rng_state()}}
        if o.optimizer is not None:
            state["optim"] = osd
        if o.scheduler is not None:
            state["sched"] = o.scheduler.state_dict()
        if o.extra:
            state["extra"] = o.extra
        if o.data is not None:
            state[DATA_KEY] = o.data.state_dict()
        return state

    def apply(self, loaded: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        o = self.objects
        if o.optimizer is not None:
            set_state_dict(o.model, o.optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        else:
            o.model.load_state_dict(loaded["model"])
        self._apply_rest(loaded)

    def _apply_rest(self, loaded: Mapping[str, Any]) -> None:
        """All but model and optimizer: LR scheduler, RNG, extra, data position."""
        import torch

        o = self.objects
        if o.scheduler is not None and "sched" in loaded:
            o.scheduler.load_state_dict(loaded["sched"])
        torch.set_rng_state(loaded["rng"]["torch"])
        for k, v in (loaded.get("extra") or {}).items():
            if k in o.extra and hasattr(o.extra[k], "copy_"):
                o.extra[k].copy_(v)
        if o.data is not None and DATA_KEY in loaded:
            o.data.load_state_dict(loaded[DATA_KEY])

    def digest(self) -> str:
        return state_digest(self.state_dict())

    def memory_digest(self, state: dict[str, Any] | None = None) -> str:
        """Digest of what every data-parallel replica holds identically (model + optimizer)."""
        state = state if state is not None else self.state_dict()
        return state_digest({k: state[k] for k in ("model", "optim") if k in state})

    def select(self, root: Any, bound: int | None, check: Check | None = None, **options: Any) -> Selection:
        """Verified, sound (`select_restorable`), passing `check`, and holding what this job needs."""

        def both(info: SnapshotInfo) -> str | None:
            problem = check(info) if check is not None else None
            return problem if problem is not None else self.expect_check(info)

        return select_restorable(root, bound, check=both, **options)

    def load(self, ctx: Context, info: SnapshotInfo, cert: Certificate) -> str | None:
        """Load `info`, then one pass over the loaded state: its digest must be the snapshot's and,
        under the policy, every tensor finite (a snapshot written before soundness was recorded)."""
        self.apply(load_snapshot(info, self.load_template()))
        loaded, measured = measured_state(self.state_dict())
        if loaded != info.state_digest:
            raise ActivationRefused(
                f"loaded state digest {loaded[:16]} differs from the snapshot's "
                f"{str(info.state_digest)[:16]} (step {info.step})"
            )
        if self.policy.finite:
            verdict = judge(
                [measured], Policy(self.policy.allow_inf, self.policy.allow_nan, replicas=False, non_tensor=False)
            )
            if not verdict.sound:
                raise ActivationRefused(f"the restored state of step {info.step} is not sound: {verdict.line()}")
        return loaded

    # ------------------------------------------------------------------ in-place memory
    def remember(self, step: int) -> None:
        snap = clone_state(self.state_dict())
        self._local[step] = (snap, self.memory_digest(snap))
        while len(self._local) > self.keep_local:
            self._local.popitem(last=False)

    def report(self) -> tuple[dict[int, str], dict[int, Any]]:
        return {s: d for s, (_, d) in self._local.items()}, {}

    def roll_back(self, frontier: int, committed: int | None, want: str | None) -> None:
        """Hold the frontier's state. Model and optimizer already the frontier's (the failed step did
        not update them) stay; the rest is put back all the same: the failed step had moved the data
        position (and the RNG), so its redo would take the next step's samples instead of its own."""
        if committed == frontier and self.memory_digest() == want:
            if frontier in self._local:
                self._apply_rest(clone_state(self._local[frontier][0]))
            return None
        if frontier not in self._local:
            raise RollbackRefused(f"no local state of frontier step {frontier} (have {sorted(self._local)})")
        self.apply(clone_state(self._local[frontier][0]))  # a fresh copy: the optimizer may alias what it loads
        got = self.memory_digest()
        if want is not None and got != want:
            raise RollbackRefused(f"local state of step {frontier} has digest {got[:12]}, certified {str(want)[:12]}")
        while self._local and next(reversed(self._local)) > frontier:
            self._local.popitem(last=True)
        return None

    def agree(self, reports: Iterable[Report], frontier: int) -> StateAgreement:
        return agree_on_state(reports, frontier)

    # ------------------------------------------------------------------ the writer (rank 0 only)
    def meets_at(self, step: int, every: int) -> bool:
        """The snapshot steps (rank 0 writes them alone: a meeting proves every member committed them)."""
        return bool(every) and step % every == 0

    def start_writer(self, ctx: Context, outcomes: SnapshotOutcomes, options: Any, frontier: Any = None) -> None:
        if ctx.rank == 0 and self.writer is None:
            self.writer = ReplicatedWriter(ctx, self.watch(ctx, outcomes), self.policy, self.expect())
            # a worker that dies of a collective error (peer gone) still finishes its last snapshot
            atexit.register(self.writer.flush, SIGTERM_FLUSH_S)

    def snapshot(self, step: int, every: int, step_s: float) -> None:
        self.check_sound()
        if self.writer is not None and every and step % every == 0:
            self.writer.submit(step, clone_state(self.state_dict()))

    def flush(self, timeout: float) -> bool:
        return True if self.writer is None else self.writer.flush(timeout)

    def close_writer(self, ctx: Context, timeout: float) -> None:
        if self.writer is not None:
            self.writer.close(timeout)
            ctx.counters.skipped_snapshots = self.writer.skipped

    def settle_writer(self) -> None:
        # a snapshot queued in the old generation is stamped with it (the writer reads the generation
        # when it writes): let it finish, or be fenced, before the generation changes
        self.flush(timeout=10.0)
