"""Sharded state (FSDP2, HSDP, DDP through DCP): every rank holds, saves and restores its own shards.

What differs from replicated state (`recovery.runtime.rank_state`):
- the model may need this generation's group to be built (`fully_shard`, a device mesh), so it comes
  from `build()` once the group is up, and the restore is collective (DCP reshards to this world);
- every rank writes its own part of each snapshot, in lockstep (`ShardedSnapshotter`), and its RNG
  goes into its part, restored only at the world size that wrote it;
- the certificate carries the frontier snapshot's ownership map and the reshard plan;
- in place, each survivor remembers its own chunks and reports their sums; after a switch the model
  is rebuilt over the new world and filled from the survivors' chunks, peer to peer
  (`recovery.runtime.reshard`), checked against the certified digest before the first step.

Lazy imports (start-up time): torch.distributed, only in the methods that run inside a training process.
"""

from __future__ import annotations

import atexit
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gpuguard.foundation.errors import DataError, one_line
from gpuguard.foundation.inplace_files import Report
from gpuguard.generation.ownership import (
    describe_reshard,
    layout_from_keys,
    ownership_record,
    plan_digest,
    plan_reshard,
    predict_layout,
    reshard_problems,
    reshard_record,
    same_holding,
)
from gpuguard.generation.records import Certificate
from gpuguard.recovery.runtime import rehome as rh
from gpuguard.recovery.runtime import reshard as ir
from gpuguard.recovery.runtime.context import Context
from gpuguard.recovery.runtime.rank_state import SIGTERM_FLUSH_S, Check, RankState, RollbackRefused, TrainObjects
from gpuguard.recovery.runtime.refusals import ActivationRefused
from gpuguard.recovery.runtime.switch import Eviction
from gpuguard.recovery.runtime.writers import SnapshotOutcomes
from gpuguard.recovery.snapshots import digests, parts
from gpuguard.recovery.snapshots import sharded as ss
from gpuguard.recovery.snapshots.measure import DATA_KEY
from gpuguard.recovery.snapshots.sharded_writer import ShardedSnapshotter
from gpuguard.recovery.snapshots.soundness import Policy
from gpuguard.recovery.snapshots.store import Selection, SnapshotInfo, select_restorable

Build = Callable[[], tuple[Any, ...]]


class ReshardRefused(ActivationRefused):
    """The in-place reshard cannot happen (layouts disagree, a region has no holder, another digest)."""


class ShardedState(RankState):
    """Sharded state behind the `RankState` interface (see the module docstring)."""

    sharded = True
    restores_before_group = False
    layout_step = 1  # the new world holds its chunks in another layout (map version +1)

    def __init__(self, objects: TrainObjects, build: Build | None, policy: Policy | None = None) -> None:
        super().__init__(objects, policy)
        self.build = build
        self.group: Any = None  # the snapshot group (gloo, its own timeout)
        self.writer: ShardedSnapshotter | None = None
        self.ownership_map_version = 0
        self._shards: OrderedDict[int, ir.Remembered] = OrderedDict()  # step -> my chunks
        # the policy "keep the HSDP layout if possible" (`InPlaceRuntime(shrink="keep-layout")`), and
        # the ranks per replica of the model built (None: not HSDP on one mesh, or the policy is off)
        self.keep_layout = False
        self.replica: int | None = None

    # ------------------------------------------------------------------ the state
    def state_dict(self) -> dict[str, Any]:
        """model / optim (`get_state_dict`: DTensors stay sharded) / sched / extra.

        No RNG state here: a per-rank RNG tensor cannot live in a resharded checkpoint (DCP stores
        a plain tensor once, as a replica); each rank's RNG goes into its part (`snapshot`).
        A read: an optimizer that has not stepped is recorded fresh (`ss.read_state_dicts`)."""
        return self._state(optimizer_state=True, read=True)

    def load_template(self) -> dict[str, Any]:
        """`state_dict` with a fresh optimizer's state created, as DCP's load needs (it overwrites it)."""
        return self._state(optimizer_state=True)

    def initial(self) -> bool:
        """The optimizer has not stepped yet: its state does not exist, and reading it would create it."""
        opt = self.objects.optimizer
        return opt is not None and not opt.state

    def memory_state(self) -> dict[str, Any]:
        """The state read without changing it: `state_dict`, but before the optimizer's first step (the
        initial state) without the optimizer, whose state a read would create by a zero step (AdamW's
        step count: the training would change); a fresh optimizer is then that state's optimizer."""
        return self._state(optimizer_state=not self.initial(), read=True)

    def _state(self, *, optimizer_state: bool, read: bool = False) -> dict[str, Any]:
        o = self.objects
        state = ss.model_state(o.model, o.optimizer, extra=o.extra or None, optimizer_state=optimizer_state, read=read)
        if o.scheduler is not None:
            state["sched"] = o.scheduler.state_dict()
        if o.data is not None:  # one global position (docs/formats/sharded-snapshots.md, "Data position")
            state[DATA_KEY] = o.data.state_dict()
        return state

    def apply(self, loaded: Mapping[str, Any]) -> None:
        o = self.objects
        ss.apply_model_state(o.model, o.optimizer, loaded)
        if o.scheduler is not None and "sched" in loaded:
            o.scheduler.load_state_dict(loaded["sched"])
        for k, v in (loaded.get("extra") or {}).items():
            if k in o.extra and hasattr(o.extra[k], "copy_") and o.extra[k] is not v:
                o.extra[k].copy_(v)
        if o.data is not None and DATA_KEY in loaded:
            o.data.load_state_dict(loaded[DATA_KEY])

    def digest(self) -> str:
        """Collective over the default group: the layout-independent digest, equal at any world size
        (of `memory_state`: taking it never changes the training, the initial state included)."""
        return digests.state_digest_sharded(self.memory_state())

    def prepare(self, opened: Any, pg_timeout_s: float) -> None:
        """The snapshot group, then `build()` -> (model, optimizer[, lr scheduler]) over the new group
        (FSDP2, a device mesh: their groups' sockets are tracked, so a teardown can shut them)."""
        self.group = opened.track(lambda: ss.new_snapshot_group(pg_timeout_s))
        if self.build is not None:
            built = tuple(opened.track(self.build))
            self.objects.model, self.objects.optimizer = built[0], built[1]
            if len(built) > 2:  # the scheduler needs the optimizer build() made: snapshotted with it
                self.objects.scheduler = built[2]
        self.replica = rh.replica_size(self.objects.model) if self.keep_layout else None

    def replica_ranks(self) -> int | None:
        return self.replica

    # ------------------------------------------------------------------ the store
    def select(self, root: Any, bound: int | None, check: Check | None = None, **options: Any) -> Selection:
        """Verified, sound, passing `check`, with every member's part present and unaltered
        (`parts_problem`), and holding what this job needs (`expect_check`)."""

        def both(info: SnapshotInfo) -> str | None:
            for rule in (check, parts.parts_problem, self.expect_check):
                problem = rule(info) if rule is not None else None
                if problem is not None:
                    return problem
            return None

        return select_restorable(root, bound, check=both, **options)

    def load(self, ctx: Context, info: SnapshotInfo, cert: Certificate) -> str | None:
        """Collective: load the certified state into this world's model (resharded by DCP), checked
        against the stored chunks; with a reshard plan in the certificate, check that the plan it
        certified (predicted) is the one this world's real layout needs."""
        live = self.load_template()
        loaded, digest = ss.load_sharded_checked(info, live, group=self.group, policy=self.policy)
        self.apply(loaded)
        _, self.rng_restore = parts.restore_rng(info.path, ctx.rank, ctx.world_size)  # after build()'s seeding
        if ctx.rank == 0:
            ctx.log(self.rng_restore)
        certified_plan = cert.extra.get("reshard")
        if isinstance(certified_plan, Mapping):
            stored = parts.snapshot_layout(info.path)
            actual = ss.current_layout(live, cert.ownership_map_version, self.group)
            plan = plan_reshard(stored, actual)
            held = plan_digest(plan) == certified_plan.get("plan_digest")
            self.reshard = {"certified_plan_held": held, "plan_digest": plan_digest(plan)}
            if not held:
                lines = describe_reshard(stored, actual, plan, step=info.step)
                self.reshard["lines"] = lines
                if ctx.rank == 0:
                    ctx.log("the certified reshard plan was a prediction that did not hold; what was read:")
                    for line in lines:
                        ctx.log(f"  {line}")
        return digest

    def certificate_facts(
        self, parent: Certificate, selection: Selection, frontier: Any, world_size: int
    ) -> tuple[int, dict[str, Any]]:
        """The frontier snapshot's ownership map for the certificate and the reshard plan of this
        restart (this world's layout predicted: the group does not exist yet; `load` checks the
        prediction). (ownership map version, extra keys)."""
        chosen = selection.chosen
        if (
            not frontier.state_manifest_digest
            or chosen is None
            or chosen.manifest_digest != frontier.state_manifest_digest
        ):
            return parent.ownership_map_version, {}
        old = parts.snapshot_layout(chosen.path)
        extra: dict[str, Any] = {"ownership_map": ownership_record(old.ownership())}
        extra.update(self.soundness_extra(chosen, frontier))
        extra["rng"] = parts.rng_restore_plan(chosen.path, world_size)[1]
        new = predict_layout(old, world_size, old.version)
        if new is None:
            extra["reshard"] = None
            extra["reshard_note"] = "the new layout is not predictable (not FSDP2 Shard(0)): DCP reshards on load"
            return max(parent.ownership_map_version, old.version) + 1, extra
        if not same_holding(old, new) or parent.ownership_map_version != old.version:
            new = predict_layout(old, world_size, max(parent.ownership_map_version, old.version) + 1)
            assert new is not None
        lost = range(world_size, old.world_size)
        extra["reshard"] = reshard_record(old, new, plan_reshard(old, new), step=chosen.step, lost=lost)
        return new.version, extra

    # ------------------------------------------------------------------ the in-place memory
    def remember(self, step: int) -> None:
        """My chunks only, copied; their sums are computed when a report needs them. Before the
        optimizer's first step the state is the initial one (`memory_state`, without the optimizer):
        a failure before the first commit switches in place from it, digest-checked like any other."""
        initial = self.initial()
        self._shards[step] = ir.remember(self.memory_state(), initial=initial)
        while len(self._shards) > 2:  # the frontier is the newest commit or the one before: two suffice
            self._shards.popitem(last=False)

    def report(self) -> tuple[dict[int, str], dict[int, Any]]:
        sums = {s: ir.chunk_sums(mem) for s, mem in self._shards.items()}
        return {s: ir.digest_of(c) for s, c in sums.items()}, sums

    def roll_back(self, frontier: int, committed: int | None, want: str | None) -> ir.Remembered:
        """The state is rebuilt from the survivors' chunks once the new group is up: keep the frontier's."""
        mem = self._shards.get(frontier)
        if mem is None:
            raise RollbackRefused(f"no local sharded state of frontier step {frontier} (have {sorted(self._shards)})")
        while self._shards and next(reversed(self._shards)) > frontier:
            self._shards.popitem(last=True)
        return mem

    def agree(self, reports: Iterable[Report], frontier: int) -> ir.ShardedAgreement:
        return ir.agree_on_sharded_state(list(reports), frontier)

    def switch_extra(self, agreement: Any, eviction: Eviction) -> dict[str, Any]:
        return {
            "sharded_state": {
                "chunks": agreement.chunks,
                "replicated": agreement.replicated,
                "lost": sorted(eviction.lost),
            }
        }

    def leave_group(self) -> None:
        # a save in flight is a collective of the failed group: it fails at the latest at the group's
        # timeout, and a late publish is fenced (the ledger moved on). Waiting for it here would
        # delay this survivor's report past the coordinator's grace period: leave it to end alone.
        if self.writer is not None:
            self.writer.abandon()
            self.writer = None
        # the model's device mesh holds the failed group's subgroups: while anything references them
        # their sockets stay open and a peer blocked on this rank waits for the group timeout.
        # Drop them (the state is in `_shards`, as plain tensors) so that destroying the group frees them.
        # Keeping the HSDP layout keeps them: the switch moves them to the new mesh (`rehome`); the
        # failed group's sockets are shut all the same (`InPlaceRuntime._teardown`), so no peer waits.
        if self.replica is None:
            self.objects.model = self.objects.optimizer = self.objects.scheduler = None
        self.group = None

    def _rehome(self, opened: Any, timeout_s: float, world: int, mem: ir.Remembered) -> bool:
        """HSDP's layout kept: the snapshot group, then the model and optimizer this survivor kept moved
        to the new world's mesh, nothing rebuilt. False when they cannot be (another mesh; the frontier
        is the initial state, whose optimizer is a fresh one): `build()` makes new ones, same shards.
        Every member answers the same (the same model, the same certified frontier): both are collective."""
        o = self.objects
        if o.model is None or mem.initial:
            return False
        try:
            old = rh.replica_mesh(o.model)
        except ValueError:
            return False
        self.group = opened.track(lambda: ss.new_snapshot_group(timeout_s))
        rh.rehome(o.model, o.optimizer, opened.track(lambda: rh.new_mesh(old, world)))
        return True

    def rebuild_in_place(
        self, ctx: Context, cert: Certificate, parent: Certificate, mem: ir.Remembered, opened: Any, timeout_s: float
    ) -> str | None:
        """Collective over the new group: build the model over the new world, fill it from the
        survivors' chunks of the frontier (peer to peer) and check it has the certified digest.
        None when done; the failure text when the group broke (switch again); ReshardRefused otherwise."""
        import torch.distributed as dist

        mine = [m.rank for m in parent.members if m.incarnation.id == ctx.incarnation.id]
        kept = bool(cert.extra.get("layout_kept"))
        try:
            rebuilt = not (kept and self._rehome(opened, timeout_s, ctx.world_size, mem))
            if rebuilt:
                self.prepare(opened, timeout_s)
            # the initial state: the new optimizer is fresh, as the frontier's was (nothing of it to fill)
            live = self.memory_state() if mem.initial else self.load_template()
            every: list[Any] = [None] * ctx.world_size
            dist.all_gather_object(every, {"old_rank": mine[0], "old": mem.held(), "new": ir.held_by(live)})
        except RuntimeError as exc:  # a peer gone while the new group builds: switch again
            return f"building generation {cert.generation} failed: {one_line(exc, 200)}"
        survivors = {int(e["old_rank"]): i for i, e in enumerate(every)}
        held_old = {int(e["old_rank"]): e["old"] for e in every}
        # a chunk "written" by its lowest surviving holder: the one that sends it (`describe_reshard`)
        writers: dict[str, int] = {}
        for r in sorted(held_old):
            for k in held_old[r]:
                writers.setdefault(k, r)
        try:  # every rank computes the same layouts and plan from the same gathered facts
            old = layout_from_keys(parent.ownership_map_version, len(parent.members), held_old, writers)
            new = layout_from_keys(
                cert.ownership_map_version, ctx.world_size, {i: e["new"] for i, e in enumerate(every)}
            )
        except ValueError as exc:  # two survivors disagree on a chunk's geometry
            raise ReshardRefused(f"in-place reshard of generation {cert.generation}: {exc}") from None
        plan = plan_reshard(old, new, survivors=survivors, in_memory=True)
        problems = reshard_problems(new, plan) + [
            f"{t.region.fqn}: no survivor holds it" for t in plan if t.source == "checkpoint"
        ]
        if problems:
            raise ReshardRefused(f"in-place reshard of generation {cert.generation}: {problems[0]}")
        try:
            others, stats = ir.transfer(plan, mem, live, rank=ctx.rank, timeout_s=timeout_s)
            self.apply(ir.put_back(live, others))
            got = self.digest()
        except RuntimeError as exc:  # gloo: a peer gone during the transfer
            return f"shard transfer of generation {cert.generation} failed: {one_line(exc, 200)}"
        except DataError as exc:  # the rebuilt model has no place for a region (another model): not in place
            raise ReshardRefused(f"in-place reshard of generation {cert.generation}: {exc}") from None
        want = cert.extra.get("sharded_state_digest")
        if got != want:
            raise ReshardRefused(
                f"the state rebuilt in place has digest {got[:16]}…, generation {cert.generation} certified {str(want)[:16]}…"
            )
        lost = sorted(set(range(len(parent.members))) - set(survivors))
        self.reshard = {
            "in_place": True,
            "layout_kept": kept,
            "rebuilt": rebuilt,
            "plan_digest": plan_digest(plan),
            "reads": len(plan),
            "elements_moved": sum(t.region.numel for t in plan if t.source != "local"),
            "elements": sum(t.region.numel for t in plan),
            "mine": {"copied": stats.copied, "received": stats.received, "sent": stats.sent},
            "lines": describe_reshard(old, new, plan, step=cert.frontier.step, survivors=survivors, lost=lost),
        }
        self.ownership_map_version = cert.ownership_map_version
        if ctx.rank == 0:
            for line in self.reshard["lines"]:
                ctx.log(f"  {line}")
        return None

    # ------------------------------------------------------------------ the writer (every rank, collective)
    def start_writer(self, ctx: Context, outcomes: SnapshotOutcomes, options: Any, frontier: Any = None) -> None:
        hook = ctx.fault_hook
        generation = int(ctx.generation or 0)
        outcomes = self.watch(ctx, outcomes)

        def done(step: int, info: Any, error: BaseException | None) -> None:
            """The writer thread, after each collective save (every rank): counters; rank 0 prunes."""
            writer = self.writer
            if writer is not None:
                ctx.counters.snapshot_cpu_s = writer.cpu_s
                if writer.broken is not None and isinstance(error, RuntimeError):
                    ctx.log(f"sharded snapshots off for generation {ctx.generation}: their group failed")
            why = None if error is None else one_line(error)
            shown = info.snapshot(ctx.generation) if info is not None else None
            if shown is not None and frontier is not None:  # every member submitted it after its commit
                frontier.record(generation, step, "snapshot")
            outcomes(step, shown, why, publisher=ctx.rank == 0)

        self.writer = ShardedSnapshotter(
            ctx.snapshot_root,
            generation=generation,
            incarnation=ctx.incarnation.id,
            group=self.group,
            still_current=ctx.still_current,  # only the coordinator (rank 0) calls it
            before_publish=(lambda step, _dir: hook("snapshot", step)) if hook else None,
            ownership_map_version=lambda: self.ownership_map_version,
            on_done=done,
            policy=self.policy,
            expect=self.expect(),
            every=max(1, options.snapshot_every),
            cpu_budget=options.snapshot_budget,
            max_wait=max(30.0, 2 * options.pg_timeout_s),
        )
        # a worker that dies of a collective error (peer gone) still lets its last save end
        atexit.register(self.writer.flush, SIGTERM_FLUSH_S)

    def snapshot(self, step: int, every: int, step_s: float) -> None:
        """Every rank, the same steps (`due` agrees): the save is collective. A snapshot found
        unsound stops every rank at the same step (each got the same outcome, and a due step first
        waits for the snapshot in flight, as `submit` would: `check_sound`)."""
        self.check_sound()
        if self.writer is None:
            return
        self.writer.every = max(1, every)
        if every and self.writer.due(step):
            self.writer.flush(self.writer.max_wait)  # `submit` waits for it too (and says if it is stuck)
            self.check_sound()
            self.writer.submit(step, self.state_dict, rng=parts.rng_state(), step_s=step_s)

    def flush(self, timeout: float) -> bool:
        """In effect a collective wait: every rank's writer is in the same save."""
        return True if self.writer is None else bool(self.writer.flush(timeout))

    def close_writer(self, ctx: Context, timeout: float) -> None:
        if self.writer is not None:
            self.writer.close(timeout)
            ctx.counters.snapshot_cpu_s = self.writer.cpu_s

    def drop_groups(self) -> None:
        if self.writer is not None:
            self.writer.group = None
        self.group = None
