"""Readers in, vote features out: the join `diagnose job`, `watch job` and `gpu-recover status` run
before the vote.

Readers (`collectors`) and judges (`diagnostics`) never import each other, so the one place that
reads the step records, the process table and the launcher's logs and hands them to the judges'
feature extraction is here, above both (in the actor layer, so that `recovery.operator.status` can use it
as well as the CLI). The clock is read here too: the judges take `now` as data.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from gpuguard.collectors.liveness import (
    comm_errors_from_logs,
    exit_codes_from_logs,
    local_host,
    probe_process,
    with_exit_code,
)
from gpuguard.collectors.log_steps import LogJob, LogStepSpec, read_log_job, watchdog_words
from gpuguard.collectors.step_records import JobRecords, read_job
from gpuguard.diagnostics.jobevidence import hardware_from_node_reports
from gpuguard.diagnostics.jobstats import comm_errors_from_text, observe
from gpuguard.diagnostics.vote import UNREADABLE
from gpuguard.diagnostics.voters import VoteConfig
from gpuguard.foundation.jobdir import ledger_dir, ledger_url_path
from gpuguard.foundation.observations import ProcessState, RankObservation
from gpuguard.generation.job import open_job_ledger

_ALIVE = ("running", "sleeping", "disk-sleep")


RECENT_STEPS = 40  # step samples kept per rank besides its summary: the vote's window, the document's sparkline
LEDGER_TIMEOUT_S = 2.0  # the certificate is a hint for the world size: never wait long for it


def active_world(job_dir: str | os.PathLike[str], generation: int) -> int | None:
    """The number of members generation `generation`'s certificate names (None: no ledger, not readable
    within `LEDGER_TIMEOUT_S`, or no such generation). The step logs' WORLD_SIZE is torchrun's launch
    world, which an in-place switch shrinks without a new launch: after 3 -> 2 the logs still claim 3,
    and a rank 2 that is no member was reported as silent (UNKNOWN)."""
    if not any(p.exists() for p in (ledger_dir(job_dir), ledger_url_path(job_dir))):
        return None
    try:
        with open_job_ledger(Path(job_dir), timeout=LEDGER_TIMEOUT_S) as ledger:
            cert = ledger.get(generation)
    except Exception:  # noqa: BLE001 - unreadable or unreachable: the logs' claim stands
        return None
    return len(cert.members) if cert is not None and cert.members else None


def _cpu_seconds(pid: int | None) -> float | None:
    """The process's CPU time (user + system, seconds): a throttled rank's grows, a hung one's does not."""
    if pid is None:
        return None
    try:
        t = psutil.Process(pid).cpu_times()
    except (psutil.Error, OSError):
        return None
    return float(t.user + t.system)


def _elsewhere(host: str, probe: bool) -> ProcessState:
    """The process state of a rank that is not probed here: it runs on `host`, or probing is off."""
    return ProcessState("unknown", f"rank runs on {host or 'an unknown host'}, not here" if probe else "not probed")


def observe_job(
    job_dir: str | os.PathLike[str],
    **kw: Any,
) -> tuple[JobRecords, list[RankObservation]]:
    """Read the records and the process table; return (records, observations) ready for the vote: the ranks
    of the active generation only (see `observe_job_generations`; keyword arguments as there)."""
    records, current, _ = observe_job_generations(job_dir, **kw)
    return records, current


def observe_job_generations(
    job_dir: str | os.PathLike[str],
    *,
    window: int = 20,
    history: int = 2000,
    now_wall: float | None = None,
    probe: bool = True,
    logs: Iterable[str | os.PathLike[str]] = (),
    log_spec: LogStepSpec | None = None,
    log_job: LogJob | None = None,
    node_reports: Iterable[dict[str, Any]] = (),
    launcher_logs: Iterable[str | os.PathLike[str]] = (),
    outlier_cap_k: float = VoteConfig.outlier_cap_k,
    on_progress: Callable[[int, int], None] | None = None,
) -> tuple[JobRecords, list[RankObservation], list[tuple[int, RankObservation]]]:
    """Read the records and the process table; return (records, current, superseded).

    `current`: the observations of the active generation (the newest one any rank has written in), ready for
    the vote. A rank whose newest incarnation belongs to an earlier generation is not part of it: it is in
    `superseded` as (its generation, observation), to be reported apart, never as waiting on the new ranks;
    below the active generation's world (its certificate's members, else WORLD_SIZE) such a rank is also in
    `current` without records (it has not started in the active generation yet).

    With `logs` (or `log_job`, the logs already read), ranks that wrote no StepLog records are read from the training logs instead
    (`collectors.log_steps`: steps with `log_spec`, watchdog timeouts, each rank's last line), judged as of
    the logs' newest timestamp: a post-mortem log is judged as it ended, not by how old the file is.

    Memory does not grow with the ranks' steps: each rank's history is a bounded summary
    (`foundation.step_summary`), and only its last RECENT_STEPS samples are kept. `on_progress(done, total)`
    is called as the step logs are read.

    Ages use the monotonic clock for ranks written on this host (immune to wall-clock jumps), the wall
    clock otherwise; processes are probed only on this host (a pid means nothing elsewhere).
    """
    # bounded: each rank's last `history` steps as a summary, its last RECENT_STEPS (or `window`) as samples
    records = read_job(job_dir, max_steps=max(window, RECENT_STEPS), history=history, on_progress=on_progress)
    stepped = set(records.ranks)  # ranks with StepLog records (they carry a generation; training logs do not)
    logs = tuple(logs)
    if log_job is None and logs:
        log_job = read_log_job(logs, log_spec, max_steps=history)
    post_mortem = None  # the newest timestamp of the logs: the "now" of the ranks read from them
    timeouts: dict[int, dict[str, object]] = {}
    if log_job is not None:
        from_logs, post_mortem, timeouts = log_job, log_job.end_wall, log_job.timeouts
        merged = {r: s for r, s in {**from_logs.ranks, **records.ranks}.items() if r not in records.unusable}
        records = JobRecords(records.job_dir, dict(sorted(merged.items())), records.skipped_files, records.unusable)
    hardware = hardware_from_node_reports(node_reports, {r: (s.host, s.local_rank) for r, s in records.ranks.items()})
    codes = exit_codes_from_logs(launcher_logs)
    comm = comm_errors_from_logs([*logs, *launcher_logs])
    here = local_host()
    now_w = time.time() if now_wall is None else now_wall
    now_m = time.monotonic()
    out = []
    gens = {s.generation for r, s in records.ranks.items() if r in stepped}
    active = max(gens) if gens else 0
    claimed = max(
        (s.world_size or 0 for r, s in records.ranks.items() if r in stepped and s.generation == active), default=0
    )
    certified = active_world(job_dir, active) if active > 0 else None
    world = claimed if certified is None else certified
    superseded: list[tuple[int, RankObservation]] = []
    elsewhere: dict[str, ProcessState] = {}  # one (frozen) state per remote host, not one per rank
    for series in records.ranks.values():
        from_log = series.rank not in stepped
        local = series.host == here and now_wall is None
        if from_log and post_mortem is not None:
            proc = ProcessState("unknown", "read from its log, post-mortem: judged as of the log's last line")
        elif probe and local:
            proc = probe_process(series.pid, series.start_time, series.start_wall)
        else:
            proc = elsewhere.get(series.host) or elsewhere.setdefault(series.host, _elsewhere(series.host, probe))
        proc = with_exit_code(proc, series.pid, codes)
        ce = comm_errors_from_text(series.rank, (*series.errors, *comm.get(series.rank, ())))
        cpu = _cpu_seconds(series.pid) if probe and local and proc.state in _ALIVE else None
        ob = observe(
            series,
            now_wall=post_mortem if from_log and post_mortem is not None else now_w,
            now_mono=now_m if local else None,
            process=proc,
            window=window,
            history=history,
            hardware=hardware.get(series.rank, ()),
            comm_errors=ce,
            cpu_s=cpu,
            outlier_cap_k=outlier_cap_k,
        )
        if from_log and series.rank in timeouts:
            words = watchdog_words(timeouts[series.rank])
            ob = replace(ob, notes=(*ob.notes, f"{words}: a victim of the rank(s) it waited for"))
        if series.generation == active or series.rank not in stepped:
            out.append(ob)
            continue
        superseded.append((series.generation, ob))
        if series.rank < world:
            out.append(
                RankObservation(
                    rank=series.rank,
                    has_records=False,
                    notes=(
                        f"no records in the active generation {active} yet; its generation {series.generation} "
                        "incarnation is superseded (reported apart)",
                    ),
                )
            )
    for rank, why in records.unusable.items():
        # never hung or dead on records we could not read: unknown, with the reason
        out.append(RankObservation(rank=rank, has_records=False, notes=(f"{UNREADABLE}: {why}",)))
    silent = [r for r in range(world) if r not in records.ranks and r not in records.unusable]
    why = f"generation {active} has {world} members" if certified is not None else f"WORLD_SIZE is {world}"
    for rank in silent[:100_000]:
        out.append(RankObservation(rank=rank, has_records=False, notes=(f"{why} but rank {rank} wrote no records",)))
    out.sort(key=lambda o: o.rank)
    return records, out, superseded
