"""A post-mortem rule the live vote cannot make: a rank whose own NCCL watchdog timed out is stuck.

Why: the vote judges progress against a rank's own learned step period and confirms a hang over
checks. A training log read after the fact has no second check, and a rank known only from its
watchdog lines has no step history, so ranks 0 and 1 that both print "Watchdog caught collective
operation timeout ... ran for 600020 milliseconds" read as a "job-wide pause" and the job as healthy.
The watchdog is the job's own hang detector and its timeout is the bound the job chose: the
collective did not complete. Where the vote found whom the rank waited for (`blocked_by`), the rank
is that rank's victim and keeps its verdict; where it did not, the rank is hung in that collective and
so is the job: no rank in these logs was missing from it.

Pure (data in, data out): `doctor.job_diagnosis` applies it to the vote over ranks read from logs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from gpuguard.diagnostics.vote import JobVerdict, RankVerdict
from gpuguard.diagnostics.voters import HEALTHY, HUNG, SLOW


def _where(t: Mapping[str, Any]) -> str:
    return f"{t.get('op') or 'collective'} #{t.get('seq')}"


def judge_timeouts(job: JobVerdict, timeouts: Mapping[int, Mapping[str, Any]]) -> JobVerdict:
    """The vote with every timed-out rank it left healthy or slow, waiting for nobody, made `hung`."""
    stuck: list[int] = []
    ranks: list[RankVerdict] = []
    for r in job.ranks:
        t = timeouts.get(r.rank)
        if t is None or r.blocked_by or r.verdict not in (HEALTHY, SLOW):
            ranks.append(r)
            continue
        stuck.append(r.rank)
        if t.get("kind") == "watchdog_timeout":
            seen = f"timed out in {_where(t)} after {float(t.get('elapsed_ms') or 0) / 1000:.0f} s"
        else:  # watchdog_failure: "detected by watchdog at work: N, ... last completed NCCL work: M"
            seen = f"stopped it at work #{t.get('seq')} (last completed {t.get('last_completed')})"
        why = f"its NCCL watchdog {seen} and no rank in these logs was missing from it: the collective did not complete"
        ranks.append(replace(r, verdict=HUNG, reason=why))
    if not stuck or job.verdict not in (HEALTHY, SLOW):
        return replace(job, ranks=tuple(ranks)) if stuck else job
    counts: dict[str, int] = {}
    for r in ranks:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    first = next((timeouts[r] for r in stuck if timeouts[r].get("kind") == "watchdog_timeout"), timeouts[stuck[0]])
    where = _where(first)
    shown = ", ".join(str(r) for r in stuck[:8]) + (" …" if len(stuck) > 8 else "")
    reason = (
        f"{where} failed in the NCCL watchdog on rank(s) {shown} and no rank in these logs arrived late: "
        "a rank whose log is not here, or the collective itself (network, NCCL)"
    )
    steps = (
        f"gather every rank's log: the rank whose last SeqNum is below {first.get('seq')} stopped first",
        "with Flight Recorder dumps (TORCH_NCCL_TRACE_BUFFER_SIZE): gpu-doctor contract DUMPS names the "
        "missing participant",
        "check the network of the ranks' hosts (NCCL_DEBUG=INFO, ib counters) if every rank is in it",
    )
    return replace(job, verdict=HUNG, reason=reason, ranks=tuple(ranks), counts=counts, next_steps=steps)
