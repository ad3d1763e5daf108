"""Point-to-point records against the contract: each send pairs with one recv, in posting order,
per (group, sender, receiver); a lone send or recv is the hang, a size or dtype difference is a
divergence whose culprit is either side."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from gpuguard.diagnostics.collective_semantics import numel
from gpuguard.diagnostics.contract_groups import pg_order
from gpuguard.diagnostics.contract_report import (
    MISSING_PARTICIPANT,
    P2P_MISMATCH,
    Divergence,
    P2PRecord,
    Side,
    Timeline,
    TimelineKey,
    describe,
    timeline_name,
)
from gpuguard.foundation.traces import RankTrace, Signature


def check_p2p(
    p2p: Mapping[int, Sequence[P2PRecord]],
    cluster_of: Mapping[tuple[str, int, int], TimelineKey],
    by_rank: Mapping[int, RankTrace],
    wanted: Any,
) -> list[tuple[Timeline, int]]:
    """Pair each send with its recv, in order, per (group, sender, receiver): NCCL and gloo match
    point-to-point calls between two ranks of a group in the order they were posted."""
    sends: dict[TimelineKey, dict[tuple[int, int], list[tuple[int, P2PRecord]]]] = {}
    recvs: dict[TimelineKey, dict[tuple[int, int], list[tuple[int, P2PRecord]]]] = {}
    descs: dict[TimelineKey, str] = {}
    for rank, recs in sorted(p2p.items()):
        for rec in recs:
            name, pdesc, gen, _, op, src, dst = rec[:7]
            if not wanted(name, pdesc):
                continue
            key = cluster_of.get((name, gen, rank), (name, gen, None))
            descs.setdefault(key, pdesc)
            pair = (_global(key[2], src), _global(key[2], dst))
            (sends if op == "send" else recvs).setdefault(key, {}).setdefault(pair, []).append((rank, rec))
    out: list[tuple[Timeline, int]] = []
    for key in sorted(set(sends) | set(recvs), key=lambda k: (k[1], pg_order(k[0]), k[2] or ())):
        name, gen, members = key
        s_by, r_by = sends.get(key, {}), recvs.get(key, {})
        checked = 0
        found: list[tuple[int, Divergence]] = []
        ranks: set[int] = set()
        for pair in sorted(set(s_by) | set(r_by)):
            a, b = pair
            ranks.update(p for p in pair if p >= 0)
            if a not in by_rank or b not in by_rank:
                continue  # the peer's dump is missing: already partial
            ss, rr = s_by.get(pair, []), r_by.get(pair, [])
            for k in range(max(len(ss), len(rr))):
                s_rec = ss[k][1] if k < len(ss) else None
                r_rec = rr[k][1] if k < len(rr) else None
                d = _p2p_pair(name, gen, a, b, k, s_rec, r_rec)
                if d is None:
                    checked += 1
                    continue
                t = min(x[10] for x in (s_rec, r_rec) if x is not None) or (1 << 62)
                found.append((t, replace(d, pg_desc=descs[key], members=members)))
                break
        found.sort(key=lambda td: td[0])
        div = found[0][1] if found else None
        tl = Timeline(
            name, gen, tuple(sorted(ranks)), (), None, None, checked, div, descs[key], members=members, scope="p2p"
        )
        out.append((tl, found[0][0] if found else 0))
    return out


def _global(members: tuple[int, ...] | None, group_rank: int) -> int:
    """A group rank as a global rank (Flight Recorder names p2p peers by group rank)."""
    if members is None:
        return group_rank  # the default group, or no member list recorded (gloo): the same numbers
    return members[group_rank] if 0 <= group_rank < len(members) else -1


def _p2p_sig(rec: P2PRecord) -> Signature:
    op, src, dst, sizes, dtypes = rec[4], rec[5], rec[6], rec[7], rec[8]
    label = f"send {src}->{dst}" if op == "send" else f"recv {dst}<-{src}"
    return Signature(op=label, in_sizes=sizes, in_dtypes=dtypes)


def _p2p_pair(
    name: str, gen: int, a: int, b: int, k: int, s_rec: P2PRecord | None, r_rec: P2PRecord | None
) -> Divergence | None:
    where = timeline_name(name, gen)
    if s_rec is not None and r_rec is not None:
        s_sig, r_sig = _p2p_sig(s_rec), _p2p_sig(r_rec)
        same_n = numel(s_sig.in_sizes) == numel(r_sig.in_sizes)
        same_dt = s_sig.in_dtypes == r_sig.in_dtypes or not s_sig.in_dtypes or not r_sig.in_dtypes
        if same_n and same_dt:
            return None
        fld = "size" if not same_n else "dtype"
        sender = Side((a,), s_sig, s_rec[9], None)
        receiver = Side((b,), r_sig, r_rec[9], None)
        explanation = (
            f"{where}: point-to-point message {k + 1} from rank {a} to rank {b}: rank {a} sent "
            f"{describe(s_sig, shapes=True)} (p2p #{s_rec[3]}), rank {b} posted a recv of "
            f"{describe(r_sig, shapes=True)} (p2p #{r_rec[3]}): the {fld} must match; either side may be wrong."
        )
        return Divergence(
            name, gen, s_rec[3], P2P_MISMATCH, (a, b), sender, (receiver,), fld, explanation, ambiguous=True
        )
    rec = s_rec if s_rec is not None else r_rec
    assert rec is not None
    sig = _p2p_sig(rec)
    if s_rec is not None:
        issued, never = Side((a,), sig, rec[9], None), Side((b,), None, None, None)
        text = f"rank {a} sent {describe(sig, shapes=True)} (p2p #{rec[3]}) to rank {b}, which never posted its recv"
    else:
        issued, never = Side((b,), sig, rec[9], None), Side((a,), None, None, None)
        text = (
            f"rank {b} waits to receive {describe(sig, shapes=True)} (p2p #{rec[3]}) from rank {a}, which never sent it"
        )
    explanation = f"{where}: point-to-point message {k + 1}: {text}; the waiting side is blocked: this is the hang."
    return Divergence(name, gen, rec[3], MISSING_PARTICIPANT, never.ranks, issued, (never,), "presence", explanation)
