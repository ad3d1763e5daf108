"""Whether a state is sound: finite tensors, agreeing replicas, non-tensor state present and consistent.

The certificate proves that the resumed state is the one that was committed; this says whether that
state is usable. Every rank measures its own part of a state in the pass that digests it
(`recovery.snapshots.digests.measure`: per tensor chunk its NaN and infinity counts and, for replica
agreement, its additive sum; plus plain facts about the non-tensor state), and `judge` turns the
measurements of all ranks into one `Soundness` record: what was checked, the counts, and one line
per problem ("4,668 NaN tensors in replica group 1 (primaries clean)"). The record goes into the
snapshot's manifest (`extra.soundness`, under the manifest digest the certificate binds); a state
whose record says unsound is never selected (`store.select_restorable`), so the coordinator falls
back to the newest earlier sound one. Format: docs/formats/snapshots.md, "Soundness".

Pure: data in, data out (no torch, no clock, no I/O).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SOUNDNESS_SCHEMA = "gpuguard.soundness/1"
MAX_PROBLEMS = 8  # problems kept in a record (the count of the rest is said)
STOP, LOG = "stop", "log"  # what the runtime does when a snapshot it wrote is unsound


@dataclass(frozen=True)
class Policy:
    """What counts as sound (the runtime's `soundness=` option).

    `allow_inf` / `allow_nan`: fnmatch patterns of state paths (`extra.scaler.scale`,
    `*loss_scale*`) whose infinities / NaNs are expected; `replicas`: compare every replica's chunk
    sums (a digest pass over every held chunk, ~13-50 ns an element: off leaves the finiteness
    check, ~0.07 ns an element); `on_unsound`: `stop` (the rank exits with one line, status 4, at the next commit, so
    torchrun restarts the job from the newest sound state) or `log` (said, training goes on)."""

    allow_inf: tuple[str, ...] = ()
    allow_nan: tuple[str, ...] = ()
    finite: bool = True
    replicas: bool = True
    non_tensor: bool = True
    on_unsound: str = STOP

    def __post_init__(self) -> None:
        if self.on_unsound not in (STOP, LOG):
            raise ValueError(f"on_unsound must be {STOP!r} or {LOG!r}, not {self.on_unsound!r}")

    def allowed(self, path: str, nan: int, inf: int) -> bool:
        """Whether `path`'s non-finite elements are all declared."""
        ok_nan = nan == 0 or any(fnmatch.fnmatchcase(path, p) for p in self.allow_nan)
        ok_inf = inf == 0 or any(fnmatch.fnmatchcase(path, p) for p in self.allow_inf)
        return ok_nan and ok_inf

    def checked(self) -> tuple[str, ...]:
        return tuple(
            name
            for name, on in (("finite", self.finite), ("replicas", self.replicas), ("non-tensor", self.non_tensor))
            if on
        )


@dataclass(frozen=True)
class Expect:
    """The non-tensor state this job has (the runtime knows its objects): a snapshot must carry it."""

    data_keys: tuple[str, ...] | None = None  # the registered data object's state keys (None: none registered)
    rng: bool = False  # every rank's RNG state (sharded: in every part; replicated: `rng.torch`)
    scheduler: bool = False


@dataclass(frozen=True)
class Soundness:
    """One state's verdict (`gpuguard.soundness/1`): what was checked, the counts, the problems."""

    sound: bool
    checked: tuple[str, ...]
    tensors: int = 0
    elements: int = 0
    nan_tensors: int = 0
    inf_tensors: int = 0
    nonfinite_elements: int = 0
    allowed_tensors: int = 0  # tensors whose non-finite elements the policy declares
    replica_chunks: int = 0  # chunks held by more than one replica, compared
    replica_disagreements: int = 0
    optimizer_step: int | None = None
    problems: tuple[str, ...] = field(default_factory=tuple)
    more_problems: int = 0

    def line(self) -> str:
        """The verdict in one line: the first problem (and how many more), or what held."""
        if self.problems:
            more = self.more_problems + len(self.problems) - 1
            return self.problems[0] + (f" (+{more} more)" if more else "")
        return (
            f"sound: {self.tensors:,} tensors ({self.elements:,} elements) finite"
            + (f", {self.replica_chunks:,} replicated chunks agree" if "replicas" in self.checked else "")
            + (f", optimizer step {self.optimizer_step}" if self.optimizer_step is not None else "")
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SOUNDNESS_SCHEMA,
            "sound": self.sound,
            "checked": list(self.checked),
            "tensors": self.tensors,
            "elements": self.elements,
            "nan_tensors": self.nan_tensors,
            "inf_tensors": self.inf_tensors,
            "nonfinite_elements": self.nonfinite_elements,
            "allowed_tensors": self.allowed_tensors,
            "replica_chunks": self.replica_chunks,
            "replica_disagreements": self.replica_disagreements,
            "optimizer_step": self.optimizer_step,
            "problems": list(self.problems),
            "more_problems": self.more_problems,
        }

    @classmethod
    def from_dict(cls, d: Any) -> Soundness:
        """A record as written by `to_dict`; ValueError if it is not exactly one."""
        if not isinstance(d, Mapping) or d.get("schema") != SOUNDNESS_SCHEMA:
            raise ValueError(f"soundness is not a {SOUNDNESS_SCHEMA} record")
        want = set(cls(True, ()).to_dict())
        if set(d) != want:
            raise ValueError(f"soundness record keys are not {sorted(want)}")
        counts = {k: d[k] for k in want - {"schema", "sound", "checked", "problems", "optimizer_step", "more_problems"}}
        for k, v in {**counts, "more_problems": d["more_problems"]}.items():
            if not _count(v):
                raise ValueError(f"soundness {k} must be a count")
        step = d["optimizer_step"]
        if not (step is None or (isinstance(step, int) and not isinstance(step, bool))):
            raise ValueError("soundness optimizer_step must be an integer or null")
        if not isinstance(d["sound"], bool):
            raise ValueError("soundness sound must be true or false")
        checked, problems = d["checked"], d["problems"]
        if not _strings(checked) or not _strings(problems):
            raise ValueError("soundness checked and problems must be lists of strings")
        if d["sound"] == bool(problems):
            raise ValueError("soundness sound must be true exactly when there is no problem")
        return cls(
            d["sound"],
            tuple(checked),
            **counts,
            optimizer_step=step,
            problems=tuple(problems),
            more_problems=d["more_problems"],
        )


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _strings(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(s, str) for s in v)


def certificate_line(record: Any) -> str:
    """A certificate's `extra.soundness` ({step, ...the record}) in one line, for `gpu-generation show`."""
    if not isinstance(record, Mapping):
        return "unreadable soundness record"
    plain = {k: list(v) if isinstance(v, tuple) else v for k, v in record.items() if k != "step"}  # a frozen record
    try:
        verdict = Soundness.from_dict(plain)
    except ValueError as exc:
        return f"unreadable soundness record ({exc})"
    return f"step {record.get('step')}: {verdict.line()} (checked: {', '.join(verdict.checked) or 'nothing'})"


def of_extra(extra: Mapping[str, Any]) -> Soundness | None:
    """The record in a manifest's `extra` (None: none recorded, a state written before soundness
    was; ValueError: a malformed one)."""
    raw = extra.get("soundness")
    return None if raw is None else Soundness.from_dict(raw)


# ---------------------------------------------------------------- judging


def judge(measured: Sequence[Mapping[str, Any]], policy: Policy, expect: Expect | None = None) -> Soundness:
    """The verdict over every rank's measurement (`digests.measure`, rank order)."""
    problems: list[str] = []
    counts = _finite(measured, policy, problems) if policy.finite else {}
    compared, disagreements = _replicas(measured, problems) if policy.replicas else (0, 0)
    step = None
    if policy.non_tensor:
        step = _non_tensor(measured, expect or Expect(), policy, problems)
    return Soundness(
        sound=not problems,
        checked=policy.checked(),
        tensors=sum(int(m.get("tensors", 0)) for m in measured),
        elements=sum(int(m.get("elements", 0)) for m in measured),
        replica_chunks=compared,
        replica_disagreements=disagreements,
        optimizer_step=step,
        problems=tuple(problems[:MAX_PROBLEMS]),
        more_problems=max(0, len(problems) - MAX_PROBLEMS),
        **counts,
    )


def _finite(measured: Sequence[Mapping[str, Any]], policy: Policy, problems: list[str]) -> dict[str, int]:
    """NaN / infinity counts per replica group; a problem per group with undeclared ones."""
    by_group: dict[int, dict[str, list[int]]] = {}  # group -> path -> [nan, inf]
    for m in measured:
        for path, groups in (m.get("nonfinite") or {}).items():
            for g, (nan, inf) in groups.items():
                have = by_group.setdefault(int(g), {}).setdefault(path, [0, 0])
                have[0] += int(nan)
                have[1] += int(inf)
    nan_t = inf_t = elements = allowed = 0
    for g in sorted(by_group):
        bad_nan = [p for p, (nan, inf) in by_group[g].items() if nan and not policy.allowed(p, nan, 0)]
        bad_inf = [p for p, (nan, inf) in by_group[g].items() if inf and not policy.allowed(p, 0, inf)]
        allowed += sum(1 for p, (nan, inf) in by_group[g].items() if policy.allowed(p, nan, inf))
        nan_t, inf_t = nan_t + len(bad_nan), inf_t + len(bad_inf)
        elements += sum(nan + inf for nan, inf in by_group[g].values())
        for what, paths in (("NaN", bad_nan), ("infinite", bad_inf)):
            if paths:
                problems.append(f"{_tensors(len(paths))} with {what} values {_where(g, by_group, paths)}")
    return {"nan_tensors": nan_t, "inf_tensors": inf_t, "nonfinite_elements": elements, "allowed_tensors": allowed}


def _tensors(n: int) -> str:
    return f"{n:,} tensor" + ("s" if n != 1 else "")


def _where(group: int, by_group: Mapping[int, Mapping[str, Any]], paths: Iterable[str]) -> str:
    """`in replica group 1 (primaries clean: model.w)`: where, and whether replica group 0 (the
    primaries) holds them clean; for group 0 only the tensors."""
    paths = sorted(paths)
    named = ", ".join(paths[:2]) + (f", +{len(paths) - 2} more" if len(paths) > 2 else "")
    if group == 0:  # the first replica (a replicated writer's only copy)
        return f"({named})"
    clean = not any(p in by_group.get(0, {}) for p in paths)
    return f"in replica group {group} ({'primaries clean' if clean else 'primaries too'}: {named})"


def _replicas(measured: Sequence[Mapping[str, Any]], problems: list[str]) -> tuple[int, int]:
    """Every chunk held by several replica groups has one sum; a problem per disagreeing group."""
    sums: dict[str, dict[int, str]] = {}
    for m in measured:
        for key, (g, total) in (m.get("sums") or {}).items():
            sums.setdefault(key, {})[int(g)] = str(total)
    compared = disagreements = 0
    against: dict[int, list[str]] = {}
    for key, by_group in sorted(sums.items()):
        if len(by_group) < 2:
            continue
        compared += 1
        first = by_group[min(by_group)]
        bad = [g for g, s in by_group.items() if s != first]
        if bad:
            disagreements += 1
            for g in bad:
                against.setdefault(g, []).append(key.rpartition("@")[0])
    for g, keys in sorted(against.items()):
        names = sorted(set(keys))
        problems.append(
            f"replica group {g} disagrees with the primaries on {len(keys):,} chunk"
            + ("s" if len(keys) != 1 else "")
            + f" ({', '.join(names[:2])}{f', +{len(names) - 2} more' if len(names) > 2 else ''})"
        )
    return compared, disagreements


def _non_tensor(
    measured: Sequence[Mapping[str, Any]], expect: Expect, policy: Policy, problems: list[str]
) -> int | None:
    """Step, LR scheduler, grad scaler, data position and RNG: present, and the same on every rank."""
    facts = [m.get("facts") or {} for m in measured]
    if not facts:
        return None
    mine = facts[0]
    prints = {str(f.get("fingerprint")) for f in facts}
    if len(prints) > 1:
        odd = [r for r, f in enumerate(facts) if f.get("fingerprint") != mine.get("fingerprint")]
        problems.append(
            f"non-tensor state differs between ranks (rank {odd[0]} is not rank 0's: optimizer groups, "
            "scheduler or extra)"
        )
    steps = sorted({int(s) for f in facts for s in f.get("optimizer_steps") or ()})
    if len(steps) > 1:
        problems.append(f"optimizer state at {len(steps)} different steps ({', '.join(map(str, steps[:4]))})")
    lrs, last = mine.get("lrs"), mine.get("scheduler_lr")
    if expect.scheduler and last is None:
        problems.append("no LR scheduler state (a scheduler is registered)")
    if lrs is not None and last is not None and [str(x) for x in lrs] != [str(x) for x in last]:
        problems.append(f"LR scheduler's last lr {last} is not the optimizer's {lrs}")
    scale = mine.get("scaler_scale")
    if scale is not None and not _positive_finite(scale) and not _declared(policy, mine.get("scaler_path"), scale):
        problems.append(f"grad scaler scale is {scale}")
    if expect.data_keys is not None:
        have = mine.get("data_keys")
        if have is None:
            problems.append("no data-loader state (a data loader is registered)")
        elif missing := sorted(set(expect.data_keys) - set(have)):
            problems.append(f"data-loader state lacks {', '.join(missing)}")
    if expect.rng:
        without = [r for r, f in enumerate(facts) if not f.get("rng")]
        if without:
            problems.append(f"no RNG state for rank {', '.join(map(str, without[:4]))}")
    return steps[0] if len(steps) == 1 else None


def _declared(policy: Policy, path: Any, value: Any) -> bool:
    """A non-finite scale the policy declares for its path (an infinity, or a NaN)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return False
    if v != v:
        return policy.allowed(str(path), 1, 0)
    return v == float("inf") and policy.allowed(str(path), 0, 1)


def _positive_finite(x: Any) -> bool:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return False
    return v == v and v > 0 and v != float("inf")


def expect_problem(categories: Iterable[str], expect: Expect) -> str | None:
    """A stored state that lacks what this job needs (torch-free, from the manifest): its
    entries' categories (`generation.manifest.category`) must hold a data-loader and an LR scheduler
    when the job registered them. None = fine."""
    have = set(categories)
    if expect.data_keys is not None and "data-loader" not in have:
        return "no data-loader state (a data loader is registered)"
    if expect.scheduler and "lr-scheduler" not in have:
        return "no LR scheduler state (a scheduler is registered)"
    return None
