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
from collections.abc import Iterable
from typing import Any

import psutil

from gpuguard.collectors.liveness import (
    comm_errors_from_logs,
    exit_codes_from_logs,
    local_host,
    probe_process,
    with_exit_code,
)
from gpuguard.collectors.log_steps import LogStepSpec, read_log_steps
from gpuguard.collectors.step_records import JobRecords, read_job
from gpuguard.diagnostics.jobevidence import hardware_from_node_reports
from gpuguard.diagnostics.jobstats import comm_errors_from_text, observe
from gpuguard.diagnostics.vote import UNREADABLE
from gpuguard.diagnostics.voters import VoteConfig
from gpuguard.foundation.observations import ProcessState, RankObservation

_ALIVE = ("running", "sleeping", "disk-sleep")


def _cpu_seconds(pid: int | None) -> float | None:
    """The process's CPU time (user + system, seconds): a throttled rank's grows, a hung one's does not."""
    if pid is None:
        return None
    try:
        t = psutil.Process(pid).cpu_times()
    except (psutil.Error, OSError):
        return None
    return float(t.user + t.system)


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
    node_reports: Iterable[dict[str, Any]] = (),
    launcher_logs: Iterable[str | os.PathLike[str]] = (),
    outlier_cap_k: float = VoteConfig.outlier_cap_k,
) -> tuple[JobRecords, list[RankObservation], list[tuple[int, RankObservation]]]:
    """Read the records and the process table; return (records, current, superseded).

    `current`: the observations of the active generation (the newest one any rank has written in), ready for
    the vote. A rank whose newest incarnation belongs to an earlier generation is not part of it: it is in
    `superseded` as (its generation, observation), to be reported apart, never as waiting on the new ranks;
    below the active generation's WORLD_SIZE such a rank is also in `current` without records (it has not
    started in the active generation yet).

    With `logs` and `log_spec`, ranks that wrote no StepLog records are read from training logs instead.

    Ages use the monotonic clock for ranks written on this host (immune to wall-clock jumps), the wall
    clock otherwise; processes are probed only on this host (a pid means nothing elsewhere).
    """
    records = read_job(job_dir, max_steps=history)
    stepped = set(records.ranks)  # ranks with StepLog records (they carry a generation; training logs do not)
    if log_spec is not None:
        from_logs = read_log_steps(logs, log_spec, max_steps=history)
        merged = {r: s for r, s in {**from_logs, **records.ranks}.items() if r not in records.unusable}
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
    world = max(
        (s.world_size or 0 for r, s in records.ranks.items() if r in stepped and s.generation == active), default=0
    )
    superseded: list[tuple[int, RankObservation]] = []
    for series in records.ranks.values():
        local = series.host == here and now_wall is None
        proc = (
            probe_process(series.pid, series.start_time, series.start_wall)
            if (probe and local)
            else ProcessState(
                "unknown", f"rank runs on {series.host or 'an unknown host'}, not here" if probe else "not probed"
            )
        )
        proc = with_exit_code(proc, series.pid, codes)
        ce = comm_errors_from_text(series.rank, (*series.errors, *comm.get(series.rank, ())))
        cpu = _cpu_seconds(series.pid) if probe and local and proc.state in _ALIVE else None
        ob = observe(
            series,
            now_wall=now_w,
            now_mono=now_m if local else None,
            process=proc,
            window=window,
            history=history,
            hardware=hardware.get(series.rank, ()),
            comm_errors=ce,
            cpu_s=cpu,
            outlier_cap_k=outlier_cap_k,
        )
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
    for rank in records.silent_ranks[:100_000]:
        out.append(
            RankObservation(
                rank=rank,
                has_records=False,
                notes=(f"WORLD_SIZE is {records.expected_world} but rank {rank} wrote no records",),
            )
        )
    out.sort(key=lambda o: o.rank)
    return records, out, superseded
