"""Which timelines a process-group name stands for: member sets from `pg_config` split one name
into disjoint groups (`split_group`), ranks that disagree about the members are a divergence of
their own, and without member sets (gloo) classes of ranks that never issued one matching entry are
taken as separate groups."""

from __future__ import annotations

from collections.abc import Mapping

from gpuguard.diagnostics.contract_report import (
    MEMBERSHIP_MISMATCH,
    MISSING_PARTICIPANT,
    STATE_MISMATCH,
    Divergence,
    Side,
    Timeline,
    format_ranks,
    timeline_name,
)
from gpuguard.foundation.traces import RankTrace, Signature, Stream


def name_shared_by_disjoint_groups(t: Timeline, streams: Mapping[int, Stream | None]) -> list[list[int]] | None:
    """Without member sets, two groups sharing a name look like one group that diverges. Ranks that
    fall into classes (2+ ranks each) which agree within and differ from each other at *every*
    sequence id are those groups; one wrong rank, or ranks that agreed before, are a divergence."""
    d = t.divergence
    if d is None or d.kind in (MISSING_PARTICIPANT, STATE_MISMATCH) or any(s is None for s in streams.values()):
        return None
    classes: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for r, s in streams.items():
        assert s is not None
        classes.setdefault((tuple(s.seqs), tuple(s.sig_ids)), []).append(r)
    if len(classes) < 2 or any(len(v) < 2 for v in classes.values()):
        return None
    keys = list(classes)
    for i, (seqs_a, ids_a) in enumerate(keys):
        col_a = dict(zip(seqs_a, ids_a))
        for seqs_b, ids_b in keys[i + 1 :]:
            if any(col_a.get(q) == v for q, v in zip(seqs_b, ids_b)):
                return None  # they issued one identical entry: one group
    return sorted(sorted(v) for v in classes.values())


def done_through(status: Mapping[str, int] | None, name: str) -> int | None:
    if not status:
        return None
    return status.get(name)


def group_label(name: str, members: tuple[int, ...] | None) -> str:
    return name if members is None else f"{name} [{format_ranks(members)}]"


def clusters_by_members(
    name: str, streams: Mapping[int, Stream | None], by_rank: Mapping[int, RankTrace]
) -> list[tuple[tuple[int, ...] | None, list[int], dict[tuple[int, ...], list[int]] | None]]:
    """Split one group name into timelines by member set (`pg_config`): disjoint groups that share
    a name (`split_group`, per-rank one-member groups) never talk to each other. Overlapping but
    different member sets are one group whose ranks disagree about its members: `clash`."""
    views: dict[int, tuple[int, ...] | None] = {r: by_rank[r].pg_ranks.get(name) for r in streams}
    known = {v for v in views.values() if v is not None}
    if not known:
        return [(None, sorted(streams), None)]
    # union overlapping member sets
    comps: list[set[int]] = []
    comp_views: list[set[tuple[int, ...]]] = []
    for v in sorted(known):
        hit = [i for i, c in enumerate(comps) if c & set(v)]
        merged, mviews = set(v), {v}
        for i in reversed(hit):
            merged |= comps.pop(i)
            mviews |= comp_views.pop(i)
        comps.append(merged)
        comp_views.append(mviews)
    out: list[tuple[tuple[int, ...] | None, list[int], dict[tuple[int, ...], list[int]] | None]] = []
    placed: set[int] = set()
    for comp, cviews in zip(comps, comp_views):
        ranks_here = sorted(r for r, v in views.items() if (v is not None and v in cviews) or (v is None and r in comp))
        placed.update(ranks_here)
        clash = None
        if len(cviews) > 1:
            clash = {v: sorted(r for r in ranks_here if views[r] == v) for v in sorted(cviews)}
        out.append((tuple(sorted(comp)), ranks_here, clash))
    rest = sorted(set(streams) - placed)
    if rest:
        out.append((None, rest, None))
    return out


def membership_timeline(name: str, gen: int, pg_desc: str, clash: dict[tuple[int, ...], list[int]]) -> Timeline:
    groups = sorted(clash.items(), key=lambda kv: (-len(kv[1]), kv[1][:1]))
    sides = [
        Side(tuple(ranks), Signature(op=f"members [{format_ranks(view)}]"), None, None)
        for view, ranks in groups
        if ranks
    ]
    everyone = tuple(sorted(r for _, ranks in groups for r in ranks))
    explanation = timeline_name(name, gen) + ": its ranks disagree about its members: "
    explanation += "; ".join(
        f"rank(s) {format_ranks(ranks)} say [{format_ranks(view)}]" for view, ranks in groups if ranks
    )
    explanation += " (pg_config): the group was created with different rank lists, so its collectives cannot match."
    majority, others = sides[0], tuple(sides[1:])
    div = Divergence(
        name,
        gen,
        0,
        MEMBERSHIP_MISMATCH,
        tuple(sorted(r for s in others for r in s.ranks)),
        majority,
        others,
        "members",
        explanation,
        ambiguous=len(sides) > 1 and len(sides[0].ranks) == len(sides[1].ranks),
        pg_desc=pg_desc,
    )
    return Timeline(name, gen, everyone, (), None, None, 0, div, pg_desc, scope="membership")


def pg_order(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)
