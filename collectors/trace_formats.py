"""The two per-rank collective trace formats, decoded into the checker's compact `RankTrace`:
PyTorch Flight Recorder dumps (format versions 2.x up to 2.10, `nccl:`/`gloo:`/`xccl:`/...
prefixes, several process groups, point-to-point records, `pg_config` member sets and `pg_status`)
and gpuguard's own `gpuguard.collective-trace/1`. The input is already parsed (JSON, or a pickle
through the restricted unpickler in `collectors.flight_recorder`); every field is checked here.

Why the odd columnar code: 1,024 ranks x 2,000 entries is 2 million dicts. Fields are pulled with
`operator.itemgetter` (C speed) and signatures are deduplicated per rank before the expensive
freeze into hashable tuples.
"""

from __future__ import annotations

import json
import os
import re
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import itemgetter, lt, methodcaller
from pathlib import Path
from typing import Any

from gpuguard.foundation.errors import DataError
from gpuguard.foundation.traces import COMPLETED, Interner, RankTrace, Signature, Stream

GPUGUARD_SCHEMA = "gpuguard.collective-trace/1"
FORMAT_FR_PICKLE = "fr-pickle"
FORMAT_FR_JSON = "fr-json"
FORMAT_GPUGUARD = "gpuguard"
FORMAT_GPUGUARD_RING = "gpuguard-ring"
_P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})
_RANK_RE = re.compile(r"(\d+)(?:\.(?:json|pkl|pickle|bin|dump|trace))?$")


@dataclass(frozen=True)
class Loaded:
    """One input file, loaded.

    `p2p`: the point-to-point records, as plain tuples in `diagnostics.contract.P2PRecord` order
    (pg name, pg desc, generation, p2p seq id, "send"/"recv", source group rank, destination group
    rank, shapes, dtypes, state, time created ns): the judge pairs them across ranks.
    `completed`: the last completed sequence id per process group (`pg_status`, by pg id and name).
    """

    trace: RankTrace
    entries: int
    p2p: tuple[tuple[Any, ...], ...] = ()
    completed: dict[str, int] = field(default_factory=dict)


def rank_from_name(path: Path) -> int | None:
    m = _RANK_RE.search(path.name)
    return int(m.group(1)) if m else None


def _need(cond: bool, path: Path, what: str) -> None:
    if not cond:
        raise DataError(f"{path}: not a valid collective trace: {what}")


# -- Flight Recorder -----------------------------------------------------------------------------

_FAST = itemgetter(
    "collective_seq_id",
    "process_group",
    "profiling_name",
    "input_sizes",
    "input_dtypes",
    "output_sizes",
    "output_dtypes",
    "state",
)
_SIG = itemgetter(2, 3, 4, 5, 6)


def from_fr(path: Path, doc: Any, fmt: str, interner: Interner) -> Loaded:
    _need(isinstance(doc, dict), path, "top level is not a mapping")
    # PyTorch's JSON writer leaves `entries` out when there are none (an onlyActive dump after
    # everything completed); such a dump still has its pg_config / pg_status.
    _need(
        "entries" in doc or ("version" in doc and ("pg_config" in doc or "pg_status" in doc)),
        path,
        "no 'entries' key (is this a Flight Recorder dump?)",
    )
    entries = doc.get("entries", [])
    _need(isinstance(entries, list), path, "'entries' is not a list")
    version = doc.get("version", "")
    _need(isinstance(version, str), path, "'version' is not a string")
    rank = rank_from_name(path)
    if rank is None:
        raise DataError(
            f"{path}: cannot tell the rank: Flight Recorder dumps carry none, so name the file "
            "<prefix><rank> (e.g. rank_3 or rank_3.json)"
        )
    pg_ranks = _pg_ranks(doc.get("pg_config"))
    status = _pg_status(doc.get("pg_status"), path)

    fast = _fast_stream(entries, status, interner, path)
    p2p: list[tuple[Any, ...]]
    if fast is not None:
        streams, p2p, skipped, ids = [fast], [], 0, {str(entries[0].get("pg_id")): fast.pg}
    else:
        streams, p2p, skipped, ids = _general_streams(entries, status, interner, path)
    trace = RankTrace(
        rank=rank,
        source=str(path),
        format=fmt,
        streams=tuple(streams),
        version=version,
        world_size=None,
        pg_ranks=pg_ranks,
        skipped=skipped,
    )
    return Loaded(trace, len(entries), tuple(p2p), _completed(status, ids))


def _general_streams(
    entries: list, status: dict[str, tuple[int, int]], interner: Interner, path: Path
) -> tuple[list[Stream], list[tuple[Any, ...]], int, dict[str, str]]:
    """Any dump, entry by entry: several process groups, p2p records apart, coalesced groups merged.
    Returns the streams, the p2p records, how many entries were skipped, and pg names by pg id."""
    rows = _rows(entries, path)
    skipped = 0
    p2p: list[tuple[Any, ...]] = []
    if any(r[8] for r in rows):
        keep = []
        for e, r in zip(entries, rows):
            if not r[8]:
                keep.append(r)
                continue
            rec = _p2p_record(e, r, path)
            if rec is None:
                skipped += _op_name(r[2]) != "coalesced"  # the group's marker carries no message
            else:
                p2p.append(rec)
        rows = keep
    groups: dict[tuple[str, str, Any, int], list[tuple]] = {}
    if rows and all(r[1] == rows[0][1] for r in rows):
        groups[rows[0][1]] = rows
    else:
        for r in rows:
            groups.setdefault(r[1], []).append(r)
    streams = []
    for key, grp in groups.items():
        seqs = [r[0] for r in grp]
        if any(a >= b for a, b in zip(seqs, seqs[1:])):
            grp = _merge_coalesced(sorted(grp, key=itemgetter(0)))
            seqs = [r[0] for r in grp]
        sig_ids, sites = _intern_with_sites([(*_SIG(r), r[9]) for r in grp], interner, path)
        columns = (seqs, sig_ids, sites, [r[7] for r in grp], [r[10] for r in grp])
        streams.append(_stream(key, columns, status, {r[2] for r in grp}))
    ids = {str(k[2]): k[0] for k in {r[1] for r in rows}}
    return streams, p2p, skipped, ids


def _completed(status: dict[str, tuple[int, int]], names_by_id: dict[str, str]) -> dict[str, int]:
    """Last completed seq per pg, under its pg_status key and, where the entries tell, its name."""
    out = {k: done for k, (done, _) in status.items() if done >= 0}
    for pg_id, name in names_by_id.items():
        if pg_id in out:
            out.setdefault(name, out[pg_id])
    return out


def _p2p_record(e: Any, r: tuple, path: Path) -> tuple[Any, ...] | None:
    """`nccl:send 0->1` / `nccl:recv 1<-0` (group ranks) as a P2PRecord; None when unparseable."""
    tail = r[2].split(":", 1)[1] if ":" in r[2] else r[2]
    parts = tail.split(" ")
    op = parts[0]
    try:
        if op in ("send", "isend") and len(parts) == 2 and "->" in parts[1]:
            a, b = parts[1].split("->")
            src, dst, sizes, dtypes, kind = int(a), int(b), r[3], r[4], "send"
        elif op in ("recv", "irecv") and len(parts) == 2 and "<-" in parts[1]:
            b, a = parts[1].split("<-")
            src, dst, sizes, dtypes, kind = int(a), int(b), r[5], r[6], "recv"
        else:
            return None
        shapes, dts = _shapes(sizes), _dtypes(dtypes)
    except (TypeError, ValueError):
        raise DataError(f"{path}: not a valid collective trace: bad peers, sizes or dtypes in {r[2]!r}") from None
    seq = e.get("p2p_seq_id") if isinstance(e, dict) else None
    seq = _int_id(seq)
    name, desc, _pg_id, gen = r[1]
    return (name, desc, gen, seq if seq is not None else -1, kind, src, dst, shapes, dts, str(r[7]), r[10])


def _int_id(v: Any) -> int | None:
    """Sequence ids are integers, written as strings by some versions' JSON."""
    if type(v) is int:
        return v
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    return None


_COLS = {
    k: itemgetter(k)
    for k in ("collective_seq_id", "process_group", "profiling_name", "state", "is_p2p", "frames", "time_created_ns")
}
_GET_TIME = methodcaller("get", "time_created_ns")
_SIG5 = itemgetter("profiling_name", "input_sizes", "input_dtypes", "output_sizes", "output_dtypes")
_SIG6 = itemgetter("profiling_name", "input_sizes", "input_dtypes", "output_sizes", "output_dtypes", "frames")
_NONE = type(None)
_NO_SITE = -1


def _fast_stream(entries: list, status: dict[str, tuple[int, int]], interner: Interner, path: Path) -> Stream | None:
    """The common dump (one process group, no p2p, ascending seqs) in whole-column operations, or None."""
    if not entries:
        return None
    try:
        seqs = list(map(_COLS["collective_seq_id"], entries))
        pgvs = list(map(_COLS["process_group"], entries))
        names = list(map(_COLS["profiling_name"], entries))
        raw_states = list(map(_COLS["state"], entries))
        p2p = list(map(_COLS["is_p2p"], entries))
    except (KeyError, TypeError, AttributeError):
        return None
    try:  # optional keys: itemgetter when every entry has them (faster), else dict.get
        sigs = list(map(_SIG6, entries))
    except KeyError:
        sigs = list(map(_SIG5, entries))
    try:
        times = list(map(_COLS["time_created_ns"], entries))
    except KeyError:
        times = list(map(_GET_TIME, entries))
    first = entries[0]
    try:  # type checks on the few distinct values, not on every entry
        uniq_names, uniq_states = set(names), set(raw_states)
    except TypeError:
        return None
    if (
        "reset_epoch" in first
        or "generation" in first
        or set(map(type, seqs)) != {int}
        or not all(type(x) is str for x in uniq_names | uniq_states)
        or any(p2p)
        or any(_op_name(n) in _P2P_OPS for n in uniq_names)
        or pgvs.count(pgvs[0]) != len(pgvs)
        or not all(map(lt, seqs, seqs[1:]))
        or not set(map(type, times)) <= {int, _NONE}
    ):
        return None
    pgv = pgvs[0]
    key = _pg_key(tuple(pgv) if isinstance(pgv, list) else pgv, first.get("pg_id"), 0, path)
    sig_ids, sites = _intern_with_sites(sigs, interner, path)
    if None in times:
        times = [t or 0 for t in times]
    return _stream(key, (seqs, sig_ids, sites, raw_states, times), status, uniq_names)


def _stream(
    key: tuple[str, str, Any, int],
    columns: tuple[list[int], list[int], list[int] | None, list[str], list[int]],
    status: dict[str, tuple[int, int]],
    names: Iterable[str],
) -> Stream:
    """One process group's stream from its columns (seqs ascending): `pg_status` says what completed
    (and started) whatever the entries' own state; empty frame lists give no call sites."""
    name, desc, pg_id, gen = key
    seqs, sig_ids, sites, states, times = columns
    st = status.get(str(pg_id)) or status.get(name)
    if st is not None:
        done, started = st
        k = bisect_right(seqs, done)
        states = [COMPLETED] * k + [
            ("started" if s <= started and x == "scheduled" else x) for s, x in zip(seqs[k:], states[k:])
        ]
    if sites is not None and all(i == _NO_SITE for i in sites):
        sites = None
    return Stream(
        pg=name,
        generation=gen,
        seqs=seqs,
        sig_ids=sig_ids,
        states=states,
        site_ids=sites,
        times_ns=times,
        pg_desc=desc,
        states_reliable=_states_reliable(names),
    )


def _states_reliable(names: Iterable[str]) -> bool:
    """gloo's recorder completes entries late (after wait() returns) and on failure too."""
    return not any(n.startswith("gloo:") for n in names)


def _rows(entries: list, path: Path) -> list[tuple]:
    """(seq, pg key, profiling_name, in_sizes, in_dtypes, out_sizes, out_dtypes, state, p2p, frames, t)."""
    out = []
    get_extra = _extra_getter
    try:
        fast = list(map(_FAST, entries))
        extra = list(map(get_extra, entries))
    except (KeyError, TypeError):
        return [_row_slow(i, e, path) for i, e in enumerate(entries)]
    pg_cache: dict[Any, tuple] = {}
    try:
        for f, (pg_id, p2p, frames, t, gen) in zip(fast, extra):
            seq, pgv, name = f[0], f[1], f[2]
            if type(seq) is not int or type(name) is not str:
                return [_row_slow(i, e, path) for i, e in enumerate(entries)]
            ck = (tuple(pgv) if type(pgv) is list else pgv, pg_id, gen)
            key = pg_cache.get(ck)
            if key is None:
                key = pg_cache[ck] = _pg_key(ck[0], pg_id, gen, path)
            is_p2p = bool(p2p) or _op_name(name) in _P2P_OPS
            out.append((seq, key, name, f[3], f[4], f[5], f[6], f[7], is_p2p, frames, t if type(t) is int else 0))
    except TypeError:  # an unhashable process_group: let the tolerant path name the problem
        return [_row_slow(i, e, path) for i, e in enumerate(entries)]
    return out


def _extra_getter(e: dict) -> tuple:
    return (
        e.get("pg_id"),
        e.get("is_p2p"),
        e.get("frames"),
        e.get("time_created_ns"),
        e.get("reset_epoch", e.get("generation", 0)),
    )


def _pg_key(pgv: Any, pg_id: Any, gen: Any, path: Path) -> tuple[str, str, Any, int]:
    if isinstance(pgv, (list, tuple)) and len(pgv) == 2:
        name, desc = str(pgv[0]), str(pgv[1])
    elif pgv is None and pg_id is not None:
        name, desc = str(pg_id), ""
    else:
        raise DataError(
            f"{path}: not a valid collective trace: 'process_group' is {type(pgv).__name__}, expected (name, desc)"
        )
    if desc == "undefined":
        desc = ""
    if not isinstance(gen, int):
        raise DataError(f"{path}: not a valid collective trace: reset epoch is not an integer")
    return (name, desc, pg_id, gen)


def _row_slow(i: int, e: Any, path: Path) -> tuple:
    """Tolerant per-entry path: older format versions (2.0-2.2) and malformed input."""
    if not isinstance(e, dict):
        raise DataError(f"{path}: not a valid collective trace: entry {i} is {type(e).__name__}, not a mapping")
    seq = _int_id(e.get("collective_seq_id", e.get("seq_id")))
    if seq is None:
        raise DataError(f"{path}: not a valid collective trace: entry {i} has no integer collective_seq_id")
    name = e.get("profiling_name")
    if not isinstance(name, str):
        raise DataError(f"{path}: not a valid collective trace: entry {i} has no profiling_name")
    pgv = e.get("process_group")
    key = _pg_key(
        tuple(pgv) if isinstance(pgv, list) else pgv, e.get("pg_id"), e.get("reset_epoch", e.get("generation", 0)), path
    )
    is_p2p = bool(e.get("is_p2p")) or _op_name(name) in _P2P_OPS
    t = e.get("time_created_ns") or 0
    return (
        seq,
        key,
        name,
        e.get("input_sizes"),
        e.get("input_dtypes"),
        e.get("output_sizes"),
        e.get("output_dtypes"),
        str(e.get("state", "scheduled")),
        is_p2p,
        e.get("frames"),
        t if isinstance(t, int) else 0,
    )


def _op_name(profiling_name: str) -> str:
    name = profiling_name.split(":", 1)[1] if ":" in profiling_name else profiling_name
    return name.split(" ", 1)[0]


def _merge_coalesced(rows: list[tuple]) -> list[tuple]:
    """Entries sharing a sequence id are one coalesced collective: merge them into one row."""
    out: list[tuple] = []
    i = 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and rows[j + 1][0] == rows[i][0]:
            j += 1
        if i == j:
            out.append(rows[i])
        else:
            part = rows[i : j + 1]
            ops = [_op_name(r[2]) for r in part if _op_name(r[2]) != "coalesced"]
            prefix = part[0][2].split(":", 1)[0] + ":" if ":" in part[0][2] else ""
            cat = lambda k, part=part: [x for r in part if _op_name(r[2]) != "coalesced" for x in (r[k] or [])]  # noqa: E731
            states = {r[7] for r in part}
            out.append(
                (
                    rows[i][0],
                    rows[i][1],
                    f"{prefix}coalesced[{','.join(ops)}]",
                    cat(3),
                    cat(4),
                    cat(5),
                    cat(6),
                    "scheduled" if "scheduled" in states else part[-1][7],
                    False,
                    part[0][9],
                    part[0][10],
                )
            )
        i = j + 1
    return out


def _intern_with_sites(raw: list[tuple], interner: Interner, path: Path) -> tuple[list[int], list[int] | None]:
    """Raw (name, sizes, dtypes, ..., [frames]) tuples -> global signature ids (and call-site ids when
    a 6th element, the frames list, is present).

    Deduplicates with `list.index`, i.e. equality in C: the writer shares frame dicts between
    entries, so comparing two stacks is a few identity checks, and no per-entry hashing is needed.
    """
    uniq: list[tuple] = []
    local: list[int] = []
    append, index = local.append, uniq.index
    for s in raw:
        try:
            append(index(s))
        except ValueError:
            append(len(uniq))
            uniq.append(s)
    gmap = [interner.sig(_freeze(s[:5], path)) for s in uniq]
    sig_ids = [gmap[i] for i in local]
    if not uniq or len(uniq[0]) < 6:
        return sig_ids, None
    smap = [interner.site(_format_frames(s[5]) if isinstance(s[5], list) else None) for s in uniq]
    return sig_ids, [smap[i] for i in local]


def _freeze(s: tuple, path: Path) -> Signature:
    name, insz, indt, outsz, outdt = s
    try:
        return Signature(
            op=_op_name(name),
            in_sizes=_shapes(insz),
            in_dtypes=_dtypes(indt),
            out_sizes=_shapes(outsz),
            out_dtypes=_dtypes(outdt),
        )
    except (TypeError, ValueError):
        raise DataError(f"{path}: not a valid collective trace: bad sizes or dtypes in a {name!r} entry") from None


def _shapes(v: Any) -> tuple[tuple[int, ...], ...] | None:
    if v is None:
        return None
    out = tuple(tuple(int(d) for d in shape) for shape in v)
    return out


def _dtypes(v: Any) -> tuple[str, ...] | None:
    if v is None:
        return None
    if isinstance(v, str) or not all(isinstance(x, str) for x in v):
        raise TypeError("dtypes")
    return tuple(v)


def _format_frames(frames: list) -> str | None:
    user = []
    for f in frames:
        if not isinstance(f, dict):
            continue
        fn = str(f.get("filename", ""))
        if "/torch/" in fn or fn.startswith("<"):
            continue
        user.append(f"{os.path.basename(fn)}:{f.get('line')} {f.get('name', '?')}")
        if len(user) == 3:
            break
    return " < ".join(user) if user else None


def _pg_ranks(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Members per process group from `pg_config`; gloo registers under '' with stale ranks: ignored."""
    out: dict[str, tuple[int, ...]] = {}
    if not isinstance(cfg, dict):
        return out
    for key, val in cfg.items():
        if not key or not isinstance(val, dict):
            continue
        ranks = val.get("ranks")
        if isinstance(ranks, str):
            try:
                ranks = json.loads(ranks)  # '[0, 1, 2, 3]': never eval() it
            except ValueError:
                continue
        if isinstance(ranks, list) and ranks and all(type(r) is int for r in ranks):
            out[str(key)] = tuple(ranks)
    return out


def _pg_status(st: Any, path: Path) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    if not isinstance(st, dict):
        return out
    for key, val in st.items():
        if not isinstance(val, dict):
            continue
        try:  # the JSON dump writes these numbers as strings
            done = int(val.get("last_completed_collective", -1))
            started = int(val.get("last_started_collective", -1))
        except (TypeError, ValueError):
            raise DataError(f"{path}: not a valid collective trace: pg_status of {key!r} is not numeric") from None
        out[str(key)] = (done, started)
    return out


# -- gpuguard's own trace ------------------------------------------------------------------------


def from_gpuguard(path: Path, doc: dict, interner: Interner) -> Loaded:
    rank: Any  # checked by _need below, which mypy does not see narrowing
    entries: Any
    rank, gen, entries = doc.get("rank"), doc.get("generation", 0), doc.get("entries")
    _need(type(rank) is int and rank >= 0, path, "'rank' is not a non-negative integer")
    _need(type(gen) is int, path, "'generation' is not an integer")
    _need(isinstance(entries, list), path, "'entries' is not a list")
    world = doc.get("world_size")
    _need(world is None or type(world) is int, path, "'world_size' is not an integer")
    per_pg: dict[tuple[str, int], list[tuple]] = {}
    for i, e in enumerate(entries):
        _need(isinstance(e, dict), path, f"entry {i} is not a mapping")
        seq, pg, op = e.get("seq"), e.get("pg"), e.get("op")
        _need(type(seq) is int, path, f"entry {i}: 'seq' is not an integer")
        _need(isinstance(pg, str) and isinstance(op, str), path, f"entry {i}: 'pg' and 'op' must be strings")
        count, dtype, red = e.get("count"), e.get("dtype"), e.get("reduce_op")
        _need(count is None or type(count) is int, path, f"entry {i}: 'count' is not an integer")
        _need(dtype is None or isinstance(dtype, str), path, f"entry {i}: 'dtype' is not a string")
        _need(red is None or isinstance(red, str), path, f"entry {i}: 'reduce_op' is not a string")
        site, t = e.get("call_site"), e.get("time_ns") or 0
        egen = e.get("generation", gen)
        _need(type(egen) is int, path, f"entry {i}: 'generation' is not an integer")
        sig = Signature(op=op, in_dtypes=(dtype,) if dtype else None, count=count, reduce_op=red)
        state = str(e.get("state") or ("completed" if e.get("completed_ns") else "scheduled"))
        per_pg.setdefault((pg, egen), []).append(
            (seq, sig, state, site if isinstance(site, str) else None, t if isinstance(t, int) else 0)
        )
    streams = []
    for (pg, egen), rows in per_pg.items():
        rows.sort(key=itemgetter(0))
        for a, b in zip(rows, rows[1:]):
            if a[0] == b[0]:
                raise DataError(
                    f"{path}: duplicate sequence id {a[0]} on pg {pg!r} generation {egen}: a trace "
                    "records each collective once, so this file is corrupt or was edited"
                )
        streams.append(
            Stream(
                pg=pg,
                generation=egen,
                seqs=[r[0] for r in rows],
                sig_ids=[interner.sig(r[1]) for r in rows],
                states=[r[2] for r in rows],
                site_ids=[interner.site(r[3]) for r in rows],
                times_ns=[r[4] for r in rows],
            )
        )
    dropped = doc.get("dropped", 0)
    trace = RankTrace(
        rank=rank,
        source=str(path),
        format=FORMAT_GPUGUARD,
        streams=tuple(streams),
        version=GPUGUARD_SCHEMA,
        world_size=world,
        skipped=0,
        dropped=dropped if type(dropped) is int else 0,
    )
    return Loaded(trace, len(entries))
