"""Whole-host faults on namespace hosts: gpuguard's in-place switch against a plain restart.

    python bench/hosts.py [--json] [--trials N] [--faults power-off,partition,freeze,store-host]
                          [--paths in-place,restart,restart-baseline] [--stores N]
                          [--heartbeat S] [--pg-timeout S] [--load]

Each trial brings up 3 training hosts and a control host running etcd (gpuguard.testhosts), trains
the in-place demo's workload with one worker per host, and after step MARK powers off h1 (rank 0:
the first coordinator and the snapshot writer), or partitions or freezes h3 (a partitioned or
frozen host comes back once the survivors have moved on). Rows:
- `in-place`: gpuguard (`examples.inplace_hosts`), etcd ledger and etcd coordination, lease TTL
  4 s, collective timeout 3 s. Time = fault -> the first step every survivor committed in the next
  generation (switch records' `first_commit`). `--heartbeat S` turns on the in-place peer
  heartbeat (`GPUGUARD_PEER_HEARTBEAT=S`: a peer silent for 5 x S is suspected) and
  `--pg-timeout S` sets the collective timeout of the in-place rows (default 3 s; the default of a
  deployment is 60 s, which is what a power-off waits for without the heartbeat).
- `restart`: gpuguard's restart path (`examples.restart_hosts`): one torchrun agent per host on
  `--rdzv-backend=gpuguard` (etcd), `examples.demo_train` under the Runtime, etcd ledger and leases
  (TTL 4 s), snapshots every step on the shared storage. The victim is the host of rank 2
  (power-off, partition, freeze) or of rank 0 (`store-host`: it serves that generation's activation
  store and MASTER_ADDR). Time = fault -> the first step every survivor committed in generation 2
  (`--step-log` records). `recovered`: the survivors' agents exit 0, generation 2 is a certified
  scale-down whose members restored the state the old rank 0 recorded at the frontier, every final
  state equal, and `gpu-generation verify` accepts the chain.
- `seed-recipe`: what a user runs without gpuguard, on the same hosts: torchrun agents on c10d (the
  rendezvous served by h1's agent), `demo_train --mode plain`, rank 0 checkpointing every 5 steps to
  the shared storage, torchrun restarting the workers. Victim: h3 (power-off, partition, freeze) or
  h1 (`store-host`, the c10d server's host). Time = fault -> the first step every restarted survivor
  finished. No certificate, so no semantic check beyond finishing.
- `restart-baseline`: the same workload in plain torch.distributed (`examples.plain_train`, same
  collective timeout, rank 0 checkpoints every 5 steps to the shared checkpoint storage); a
  supervisor that notices the first worker exit kills every worker and relaunches on the
  surviving hosts from the newest checkpoint. Time = fault -> the first step committed after the
  relaunch.
`recovered`: trials whose survivors finished with the oracle's parameters (and, in place, one
certified chain that `gpu-generation verify` accepts); `semantic_failures`: trials that finished
with other parameters or an invalid chain; `zombie_writes_fenced`: commit records the ledger
refused (stale generation), read before the zombie oracle runs; `steps_lost`: committed steps redone
after recovery (mean). Trials are interleaved: for each fault, trial i of every path runs before
trial i + 1 of any, so the paths share the machine's drift. `times_s`: each recovered trial's time;
`loadavg_1m`: the 1-minute load average when the fault's first trial started and when its last
ended. The restart row, when restart-baseline ran too: `ratio_to_baseline_p50` (the median of its
times over the median of the baseline's, trials where both recovered), `ratio_per_pair` (trial i
over baseline trial i) and `faster_pairs`.
`zombie_attempts` / `zombie_visible` (in-place and restart rows; summed over the trials): once the
survivors are done and the next generation is active, the zombie oracle (`examples.zombie`, the one
`tests/recovery/runtime/test_zombie_oracle.py` runs) runs as a process with the lost member's
identity (its incarnation in generation 1's certificate) and the job dir's signing key, on the lost
host once it is back (partition: healed; freeze: thawed; by then the worker itself has ended or
fenced itself) or, for power-off and store-host, as a stand-in on the first survivor (the row's
`zombie_where` says which). It holds a live lease and tries every sink `ZOMBIE_ROUNDS` times:
frontier record (2 a round), certificate, report, refusal, joining the active generation, snapshot
publish (2: through the publish check and past it; in place to the host's job dir, on the restart
path to the shared storage), heartbeats (3, judged by `PeerHeartbeat.accept` on a receiver built from
the active certificate, not by a live member). `zombie_attempts`: attempts, all sinks;
`zombie_refused`: those a sink refused or ignored;
`zombie_visible`: attempts whose effect a reader of the active generation could observe (the chain,
the frontier records, generation 1's reports and refusal, the snapshot a restore would choose,
compared before and after each attempt; an admitted join; a counted beat); `zombie_sinks`: both per
sink (and refused); `zombie_baseline` (the last trial's): what the reader saw before the first attempt
(certificates in the chain, frontier records, reports, refusal, the restore choice [step, generation]),
so a row shows there was something to disturb; `zombie_errors`: trials whose oracle did not run to the end, and why.
`breakdown_s` (the last trial's, seconds after the fault): in place, the first survivor noticing,
the certificate seen, the last first commit; restart, the last step before the fault, the torchrun agents' `worker_failed` and
`rendezvous_done` (their logs), the new workers' activation phases (`Runtime` phases) and
`first_step`; restart-baseline, `last_step_before`, `worker_exit_seen`, `relaunched`, `first_step`.
`--stores N` adds rows `group-store`: N formations of a 2-host gloo group (store, init_process_group,
one all_reduce) through a TCPStore served by rank 0 (what each in-place generation uses) and
through `recovery.rendezvous.etcd_store.EtcdStore`. `--load` runs every trial beside a bounded CPU
hog (`bench/cpu_hog.py`: 2 x cores busy loops, started before the hosts come up, killed when the trial
ends, each ending itself after HOG_SECONDS anyway); its rows say `load: true`. Needs root (real namespaces).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402
from cpu_hog import CpuHog, default_processes  # noqa: E402

from gpuguard.examples.inplace_hosts import HostJob  # noqa: E402
from gpuguard.examples.inplace_train import reference  # noqa: E402
from gpuguard.examples.restart_hosts import RestartHostJob  # noqa: E402
from gpuguard.foundation.env import PEER_HEARTBEAT_ENV  # noqa: E402
from gpuguard.testhosts import preflight, up  # noqa: E402

HOSTS = ["h1", "h2", "h3"]
ZOMBIE_WHERE = {  # where the oracle runs: the lost host once it is back, or a survivor standing in
    "power-off": "stand-in on {host} (the lost host is dark): the lost member's identity and key",
    "store-host": "stand-in on {host} (the lost host is dark): the lost member's identity and key",
    "partition": "{host}, healed: the lost member's host, its identity and key",
    "freeze": "{host}, thawed: the lost member's host, its identity and key",
}
VICTIM = {"power-off": "h1", "partition": "h3", "freeze": "h3", "store-host": "h1"}
RESTART_VICTIM_RANK = {"power-off": 2, "partition": 2, "freeze": 2, "store-host": 0}
RESTART_STEPS, RESTART_SLEEP, RESTART_TTL = 30, 0.2, 4.0
STEPS, MARK, STEP_SLEEP = 20, 6, 0.1
TTL, PG_TIMEOUT, CKPT_EVERY = 4.0, 3.0, 5  # TTL 3 s fenced healthy workers at load 5+ on 2 cores
PLAIN_PORT = 29501
ZOMBIE_ROUNDS = 2  # the oracle's rounds per trial: every sink tried twice (examples/zombie.py)
ZOMBIE_TIMEOUT_S = 120.0
HOG_SECONDS = 600.0  # longer than any trial's waits add up to; the bench kills the hog at the trial's end


def _wait(predicate: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.02)
    return predicate()


def _fault(c: Any, fault: str, host: str) -> None:
    {"power-off": c.power_off, "store-host": c.power_off, "partition": c.partition, "freeze": c.freeze}[fault](host)


def _unfault(c: Any, fault: str, host: str) -> None:
    if fault == "partition":
        c.heal(host)
    elif fault == "freeze":
        c.thaw(host)


def zombie(c: Any, job: Any, host: str, rank: int, where: str, snapshot_root: str | None = None) -> dict[str, Any]:
    """The zombie oracle (`examples.zombie`) as a process on `host`: rank `rank`'s incarnation of
    generation 1, with the job dir's key, tries every sink `ZOMBIE_ROUNDS` times once the next
    generation is active and its members are done. Its tallies, or why there are none."""
    argv = [sys.executable, "-m", "gpuguard.examples.zombie", "--job-dir", job.job_dir, "--ledger", job.url]
    argv += ["--rank", str(rank), "--generation", "1", "--rounds", str(ZOMBIE_ROUNDS), "--where", where]
    argv += ["--snapshot-root", snapshot_root] if snapshot_root else []
    try:
        out = c.run(host, argv, timeout=ZOMBIE_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - the row says why the oracle has no figures
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        return {"error": f"exit {out.returncode}: {out.stderr.strip()[-300:]}"}
    doc: dict[str, Any] = json.loads(lines[-1])
    return doc


AGENT_EVENT = re.compile(
    r"^I(\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+) \d+ torch/distributed/elastic/agent/server/api.py:\d+\] "
    r"\[default\] (Worker group FAILED|Rendezvous complete)"
)


def agent_events(log: str, since: float) -> dict[str, float]:
    """When a torchrun agent saw its worker group fail, and then completed its next rendezvous (its
    log's local-time stamps; the first of each at or after `since`, a wall time)."""
    year = time.localtime(since).tm_year
    out: dict[str, float] = {}
    for line in log.splitlines():
        m = AGENT_EVENT.match(line)
        if not m:
            continue
        hms, frac = m.group(3).split(".")
        try:
            stamp = time.strptime(f"{year}-{m.group(1)}-{m.group(2)} {hms}", "%Y-%m-%d %H:%M:%S")
        except ValueError:  # not a date (month 13, hour 25): not a line of torch's
            continue
        t = time.mktime(stamp) + float("0." + frac)
        key = "worker_failed" if m.group(4).startswith("Worker") else "rendezvous_done"
        if t >= since - 1 and key not in out and (key == "worker_failed" or "worker_failed" in out):
            out[key] = t
    return out


def _same(params: list[float] | None, ref: list[float]) -> bool:
    return bool(params) and all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(params or [], ref))


def in_place_trial(fault: str, logs: Path, heartbeat: float = 0.0, pg_timeout: float = PG_TIMEOUT) -> dict[str, Any]:
    victim = VICTIM[fault]
    lost = HOSTS.index(victim)
    survivors = [r for r in range(len(HOSTS)) if r != lost]
    with up(len(HOSTS)) as c:
        job = HostJob.launch(
            c,
            HOSTS,
            logs,
            steps=STEPS,
            step_sleep=STEP_SLEEP,
            pg_timeout=pg_timeout,
            lease_ttl=TTL,
            faults=f"{lost}:{MARK}:before_commit:mark",
            extra_env={PEER_HEARTBEAT_ENV: f"{heartbeat:g}"} if heartbeat > 0 else None,
        )
        with job:
            if not job.wait_file(victim, f"faults/{lost}-before_commit-{MARK}.json", 90):
                fences = [ln for r in range(len(HOSTS)) for ln in job.log(r).splitlines() if "fenced itself" in ln]
                return {
                    "recovered": False,
                    "why": "never reached the fault" + (f": {'; '.join(fences)}" if fences else ""),
                }
            t_fault = time.time()
            _fault(c, fault, victim)
            if fault != "power-off":
                _wait(lambda: all(job.switch_records(HOSTS[r]) for r in survivors), 60)
                _unfault(c, fault, victim)
            codes = job.wait(list(range(len(HOSTS))), 90 + pg_timeout)
            ledger = job.ledger(HOSTS[survivors[0]])
            verified, _ = job.verify(HOSTS[survivors[0]])
            # the lost incarnation, back (thawed, healed), or a stand-in on a survivor for a host gone dark
            where = HOSTS[survivors[0]] if fault == "power-off" else victim
            ghost = zombie(c, job, where, lost, ZOMBIE_WHERE[fault].format(host=where))
        results = {r: job.result(r) for r in survivors}
        records = [rec for r in survivors for rec in job.switch_records(HOSTS[r]) if rec.get("generation") == 2]
    ref = reference(STEPS)
    finished = all(codes[r] == 0 and results[r] for r in survivors)
    good = finished and all(_same(results[r]["params"], ref) for r in survivors) and verified == 0  # type: ignore[index]
    first = [rec["phases"].get("first_commit") for rec in records]
    hist = ledger["history"]
    frontier = hist[2]["frontier"] if len(hist) > 2 else None
    before = max((s for _, _, s in ledger["commits"].get("1", [])), default=0)
    return {
        "zombie": ghost,
        "recovered": finished and len(records) == len(survivors) and None not in first,
        "semantic_failure": finished and not good,
        "fenced": int(ledger["fenced"]),
        "self_fenced": codes[lost] == 4,
        "seconds": (max(first) - t_fault) if first and None not in first else None,
        "steps_lost": (before - frontier) if frontier is not None else None,
        # fault -> the first survivor noticing, the certificate being seen, the last first commit
        "breakdown": {
            k: round(f(rec["phases"][k] for rec in records) - t_fault, 3)
            for k, f in (("detect", min), ("decided", max), ("first_commit", max))
            if records and all(rec["phases"].get(k) for rec in records)
        },
    }


def restart_trial(fault: str, logs: Path) -> dict[str, Any]:
    """gpuguard's restart path across hosts: torchrun agents on the etcd rendezvous, the Runtime."""
    with up(len(HOSTS)) as c:
        job = RestartHostJob.launch(
            c, HOSTS, logs, steps=RESTART_STEPS, sleep=RESTART_SLEEP, lease_ttl=RESTART_TTL, step_log=True
        )
        with job:
            if not job.wait_for(lambda: job.newest_step() >= MARK, 150):
                return {"recovered": False, "why": "never reached the fault"}
            victim = job.rank_host(RESTART_VICTIM_RANK[fault], 1)
            if victim is None:
                return {"recovered": False, "why": "no incarnation record of the victim rank"}
            survivors = [h for h in HOSTS if h != victim]
            t_fault = time.time()
            _fault(c, fault, victim)
            job.wait_for(lambda: any(r["generation"] == 2 for r in job.records("resume")), 90)
            _unfault(c, fault, victim)
            codes = job.wait(survivors, 150)
            ledger = job.ledger(survivors[0])
            verified, _ = job.verify(survivors[0])
            where = survivors[0] if fault in ("power-off", "store-host") else victim
            ghost = zombie(
                c,
                job,
                where,
                RESTART_VICTIM_RANK[fault],
                ZOMBIE_WHERE[fault].format(host=where),
                str(job.shared / "state"),
            )
            records = {kind: job.records(kind) for kind in ("resume", "hashes", "final", "steps")}
            events = [agent_events(job.log(h), t_fault) for h in survivors]
    hist = ledger["history"]
    g2 = hist[2] if len(hist) > 2 else None
    resumes = [r for r in records["resume"] if r["generation"] == 2]
    hashes = {r["step"]: r["hash"] for r in records["hashes"]}
    last = hist[-1]["generation"]
    finals = [r for r in records["final"] if r["generation"] == last]
    finished = all(code == 0 for code in codes.values()) and bool(finals)
    good = (
        g2 is not None
        and g2["reason"] == "scale-down"
        and g2["quiescence"] == "proved"
        and len({r["hash"] for r in resumes}) == 1
        and bool(resumes)
        and hashes.get(resumes[0]["frontier_step"]) == resumes[0]["hash"]
        and len({f["hash"] for f in finals}) == 1
        and verified == 0
    )
    firsts: dict[int, float] = {}  # rank -> when it committed its first step in generation 2
    for r in records["steps"]:
        if r["generation"] == 2:
            firsts[r["rank"]] = min(firsts.get(r["rank"], r["time"]), r["time"])
    before = max((s for _, _, s in ledger["commits"].get("1", [])), default=0)
    phases = max(resumes, key=lambda r: r["phases"].get("pg_ready", 0))["phases"] if resumes else {}
    for key, pick in (("worker_failed", min), ("rendezvous_done", max)):
        if all(key in e for e in events):
            phases = {**phases, key: pick(e[key] for e in events)}
    if len(firsts) == len(survivors):
        phases = {**phases, "first_step": max(firsts.values())}
    last_before = [r["time"] for r in records["steps"] if r["generation"] == 1 and r["time"] <= t_fault]
    if last_before:  # the survivors' collective after it is the one that times out
        phases = {**phases, "last_step_before": max(last_before)}
    return {
        "zombie": ghost,
        "breakdown": {
            k: round(v - t_fault, 2) for k, v in sorted(phases.items(), key=lambda kv: kv[1]) if v >= t_fault - 1
        },
        "recovered": finished and good,
        "semantic_failure": finished and not good,
        "fenced": int(ledger["fenced"]),
        "self_fenced": False,
        "seconds": (max(firsts.values()) - t_fault) if len(firsts) == len(survivors) else None,
        "steps_lost": (before - g2["frontier"]) if g2 else None,
    }


def seed_recipe_trial(fault: str, logs: Path) -> dict[str, Any]:
    """The seed recipe on the same hosts: torchrun's c10d rendezvous (h1's agent), plain training."""
    victim = "h1" if fault == "store-host" else "h3"
    survivors = [h for h in HOSTS if h != victim]
    with up(len(HOSTS)) as c:
        job = RestartHostJob.launch(
            c, HOSTS, logs, steps=RESTART_STEPS, sleep=RESTART_SLEEP, step_log=True, seed_recipe=True
        )
        with job:
            if not job.wait_for(lambda: max((r["step"] for r in job.records("steps")), default=0) >= MARK, 150):
                return {"recovered": False, "why": "never reached the fault"}
            before = max(r["step"] for r in job.records("steps"))
            t_fault = time.time()
            _fault(c, fault, victim)
            codes = job.wait(survivors, 150)
            _unfault(c, fault, victim)
            records = {kind: job.records(kind) for kind in ("resume", "steps")}
    resumed = {r["rank"]: r for r in records["resume"] if r["restart_count"] >= 1}
    firsts = []
    for rank, res in resumed.items():
        after = [s["time"] for s in records["steps"] if s["rank"] == rank and s["time"] > res["time"]]
        if after:
            firsts.append(min(after))
    finished = all(code == 0 for code in codes.values())
    start = min((r["start_step"] for r in resumed.values()), default=None)
    return {
        "recovered": finished and len(firsts) == len(survivors),
        "semantic_failure": False,
        "fenced": 0,
        "self_fenced": False,
        "seconds": (max(firsts) - t_fault) if finished and len(firsts) == len(survivors) else None,
        "steps_lost": (before - (start - 1)) if start is not None else None,
        "why": "" if finished else f"agents exited {codes}",
    }


def _plain(c: Any, hosts: list[str], ckpt: str, logs: Path, name: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "GPUGUARD_"))}
    env.update(
        {
            "WORLD_SIZE": str(len(hosts)),
            "MASTER_ADDR": c.host(hosts[0]).address,
            "MASTER_PORT": str(PLAIN_PORT),
            "GPUGUARD_PG_TIMEOUT": str(PG_TIMEOUT),
            "INPLACE_STEPS": str(STEPS),
            "INPLACE_STEP_SLEEP": str(STEP_SLEEP),
            "PLAIN_CKPT_EVERY": str(CKPT_EVERY),
            "PLAIN_CKPT_DIR": ckpt,
            "PYTHONWARNINGS": "ignore",
        }
    )
    procs = {}
    for rank, h in enumerate(hosts):
        with open(logs / f"{name}-{h}.log", "wb") as log:
            procs[h] = c.exec(
                h,
                [sys.executable, "-m", "gpuguard.examples.plain_train"],
                env={**env, "RANK": str(rank)},
                inherit_env=False,
                stdout=log,
                stderr=log,
            )
    return procs


def baseline_trial(fault: str, logs: Path) -> dict[str, Any]:
    victim = VICTIM[fault]
    survivors = [h for h in HOSTS if h != victim]
    name = f"plain-{uuid.uuid4().hex[:8]}"
    with up(len(HOSTS)) as c:
        ckpt = Path(c.shared_path) / name  # the shared checkpoint storage, same path inside and out
        progress = ckpt / "progress"
        first = _plain(c, HOSTS, str(ckpt), logs, name)
        procs = dict(first)
        try:
            if not _wait(lambda: (progress / f"{MARK}-w3").exists(), 90):
                return {"recovered": False, "why": "never reached the fault"}
            t_fault = time.time()
            _fault(c, fault, victim)
            # the supervisor: the first worker to exit (its collective timed out) means the job is broken
            _wait(lambda: any(first[h].poll() is not None for h in survivors), 60)
            t_exit = time.time()
            done = [int(p.name.split("-")[0]) for p in progress.glob("*-w3")]
            t_last = float((progress / f"{max(done)}-w3").read_text()) if done else None
            for h in survivors:
                first[h].kill()
            for h in survivors:
                first[h].wait(timeout=10)
            again = _plain(c, survivors, str(ckpt), logs, name + "-again")
            t_again = time.time()
            procs.update({f"{h}-again": p for h, p in again.items()})
            t_first = _wait(lambda: sorted(progress.glob("*-w2")), 90)
            for p in again.values():
                p.wait(timeout=90)
            _unfault(c, fault, victim)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
        result = json.loads((ckpt / "result.json").read_text()) if (ckpt / "result.json").exists() else {}
        steps_w2 = sorted(int(p.name.split("-")[0]) for p in progress.glob("*-w2"))
        first_time = float((progress / f"{steps_w2[0]}-w2").read_text()) if steps_w2 else None
        shutil.rmtree(ckpt, ignore_errors=True)
    finished = bool(result) and all(p.returncode == 0 for p in again.values())
    return {
        "recovered": finished and bool(t_first),
        "semantic_failure": finished and not _same(result.get("params"), reference(STEPS)),
        "fenced": 0,
        "self_fenced": False,
        "seconds": (first_time - t_fault) if first_time is not None else None,
        "steps_lost": (max(done) - (steps_w2[0] - 1)) if done and steps_w2 else None,
        "breakdown": {
            **({"last_step_before": round(t_last - t_fault, 2)} if t_last is not None else {}),
            "worker_exit_seen": round(t_exit - t_fault, 2),
            "relaunched": round(t_again - t_fault, 2),
            **({"first_step": round(first_time - t_fault, 2)} if first_time is not None else {}),
        },
    }


STORE_PROBE = (  # one rank of a 2-host gloo group formed REPEAT times through the chosen store
    "import json, socket, sys, time\n"
    "from datetime import timedelta\n"
    "import torch, torch.distributed as dist\n"
    "kind, rank, addr, etcd = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]\n"
    "out = []\n"
    "for i in range(int(sys.argv[5])):\n"
    "    t = time.perf_counter()\n"
    "    if kind == 'tcpstore':  # as coord_etcd does: the client dials only once the server listens\n"
    "        if rank == 1:\n"
    "            for _ in range(30000):\n"
    "                try:\n"
    "                    socket.create_connection((addr, 29600 + i), timeout=1).close()\n"
    "                    break\n"
    "                except OSError:\n"
    "                    time.sleep(0.001)\n"
    "        store = dist.TCPStore(addr, 29600 + i, is_master=rank == 0, wait_for_workers=False,\n"
    "                              timeout=timedelta(seconds=30))\n"
    "    else:\n"
    "        from gpuguard.recovery.rendezvous.etcd_store import EtcdStore\n"
    "        store = EtcdStore.connect(etcd, f'probe-{sys.argv[6]}-{i}', store_timeout=30.0)\n"
    "    dist.init_process_group('gloo', store=dist.PrefixStore('pg', store), rank=rank, world_size=2,\n"
    "                            timeout=timedelta(seconds=30))\n"
    "    x = torch.ones(1)\n"
    "    dist.all_reduce(x)\n"
    "    out.append(time.perf_counter() - t)\n"
    "    dist.destroy_process_group()\n"
    "    del store\n"
    "print(json.dumps(out))\n"
)


def store_rows(repeat: int) -> list[dict[str, Any]]:
    """Group formation (store + init_process_group + one all_reduce) across two hosts, per store."""
    rows = []
    with up(2) as c:
        etcd = c.etcd_url.replace("http://", "")
        for kind in ("tcpstore", "etcd_store"):
            tag = uuid.uuid4().hex[:6]
            procs = [
                c.exec(
                    h,
                    [sys.executable, "-c", STORE_PROBE, kind, str(r), c.host("h1").address, etcd, str(repeat), tag],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for r, h in enumerate(("h1", "h2"))
            ]
            outs = [p.communicate(timeout=300) for p in procs]
            times = [max(a, b) for a, b in zip(*(json.loads(o.strip().splitlines()[-1]) for o, _ in outs))]
            rows.append(
                {
                    "case": "group-store",
                    "store": kind,
                    "trials": len(times),
                    "p50_s": round(statistics.median(times), 4),
                    "p90_s": round(_quantile(times, 0.9) or 0.0, 4),
                }
            )
    return rows


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def zombie_columns(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """The oracle's figures over the trials that ran it (none: the path has no oracle)."""
    runs = [t["zombie"] for t in trials if "zombie" in t]
    if not runs:
        return {}
    done = [z for z in runs if "sinks" in z]
    sinks: dict[str, dict[str, int]] = {}
    for z in done:
        for name, tally in z["sinks"].items():
            agg = sinks.setdefault(name, {"attempts": 0, "refused": 0, "visible": 0})
            for k in agg:
                agg[k] += tally[k]
    return {
        "zombie_attempts": sum(z["attempts"] for z in done) if done else None,
        "zombie_refused": sum(z["refused"] for z in done) if done else None,
        "zombie_visible": sum(z["visible"] for z in done) if done else None,
        "zombie_sinks": sinks,
        "zombie_where": sorted({z["where"] for z in done}),
        **({"zombie_baseline": done[-1].get("baseline")} if done else {}),
        **({"zombie_errors": [z["error"] for z in runs if "error" in z]} if len(done) < len(runs) else {}),
    }


def row(fault: str, path: str, trials: list[dict[str, Any]]) -> dict[str, Any]:
    secs = [t["seconds"] for t in trials if t.get("recovered") and t.get("seconds") is not None]
    lost = [t["steps_lost"] for t in trials if t.get("steps_lost") is not None]
    return {
        "fault": fault,
        "path": path,
        "trials": len(trials),
        "recovered": sum(1 for t in trials if t.get("recovered")),
        "semantic_failures": sum(1 for t in trials if t.get("semantic_failure")),
        "zombie_writes_fenced": sum(int(t.get("fenced") or 0) for t in trials),
        "self_fenced": sum(1 for t in trials if t.get("self_fenced")),
        **zombie_columns(trials),
        "steps_lost": round(statistics.mean(lost), 2) if lost else None,
        "p50_s": round(statistics.median(secs), 3) if secs else None,
        "p90_s": round(_quantile(secs, 0.9) or 0.0, 3) if secs else None,
        "times_s": [round(x, 3) for x in secs],
        **(
            {"why_not": [t.get("why") or "see logs" for t in trials if not t.get("recovered")]}
            if not all(t.get("recovered") for t in trials)
            else {}
        ),
        **({"breakdown_s": trials[-1]["breakdown"]} if trials and trials[-1].get("breakdown") else {}),
    }


def vs_baseline(ours: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    """The restart row against restart-baseline in the same run: the ratio of the medians (the
    done-when's figure), and trial by trial (trial i of each ran back to back)."""
    pairs = [
        (a["seconds"], b["seconds"])
        for a, b in zip(ours, base, strict=False)
        if a.get("recovered") and b.get("recovered") and a.get("seconds") and b.get("seconds")
    ]
    if not pairs:
        return {"ratio_to_baseline_p50": None}
    return {
        "ratio_to_baseline_p50": round(
            statistics.median(a for a, _ in pairs) / statistics.median(b for _, b in pairs), 3
        ),
        "ratio_per_pair": [round(a / b, 3) for a, b in pairs],
        "faster_pairs": sum(1 for a, b in pairs if a < b),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--faults", default="power-off,partition,freeze,store-host")
    ap.add_argument("--paths", default="in-place,restart,seed-recipe,restart-baseline")
    ap.add_argument("--stores", type=int, default=0, metavar="N", help="also time N group formations per store")
    ap.add_argument("--load", action="store_true", help="run every trial beside a CPU hog of 2 x cores")
    ap.add_argument("--heartbeat", type=float, default=0.0, metavar="S", help="in-place rows: peer heartbeat every S s")
    ap.add_argument(
        "--pg-timeout", type=float, default=PG_TIMEOUT, metavar="S", help="in-place rows: collective timeout"
    )
    args = ap.parse_args(argv)
    if args.heartbeat < 0 or args.pg_timeout <= 0:
        print("--heartbeat must be >= 0 and --pg-timeout > 0", file=sys.stderr)
        return 64
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    bad = [f for f in faults if f not in VICTIM]
    if bad:
        print(f"unknown fault(s) {bad}: choose from {', '.join(VICTIM)}", file=sys.stderr)
        return 64
    reason = preflight()
    if reason:
        print(f"bench/hosts.py: {reason}", file=sys.stderr)
        return 69
    logs = Path(tempfile.mkdtemp(prefix="gpuguard-bench-hosts-"))
    results = []
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    trial = {
        "in-place": functools.partial(in_place_trial, heartbeat=args.heartbeat, pg_timeout=args.pg_timeout),
        "restart": restart_trial,
        "seed-recipe": seed_recipe_trial,
        "restart-baseline": baseline_trial,
    }
    if [p for p in paths if p not in trial]:
        print(f"unknown path(s) in {args.paths!r}: choose from {', '.join(trial)}", file=sys.stderr)
        return 64
    for fault in faults:
        # in place and in the baseline, rank 0's host is the power-off row's victim already
        here = [p for p in paths if fault != "store-host" or p in ("restart", "seed-recipe")]
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in here}
        load_start = os.getloadavg()[0]
        for _ in range(max(1, args.trials)):
            for path in here:  # interleaved: trial i of every path before trial i + 1 of any
                with CpuHog(default_processes(), HOG_SECONDS) if args.load else contextlib.nullcontext():
                    runs[path].append(trial[path](fault, logs))
        loadavg = [load_start, os.getloadavg()[0]]
        rows = {path: {**row(fault, path, runs[path]), "load": args.load, "loadavg_1m": loadavg} for path in here}
        if "in-place" in rows:
            rows["in-place"].update(peer_heartbeat_s=args.heartbeat or None, pg_timeout_s=args.pg_timeout)
        if "restart" in rows and "restart-baseline" in rows:
            rows["restart"].update(vs_baseline(runs["restart"], runs["restart-baseline"]))
        results.extend(rows.values())
    if args.stores:
        results += store_rows(args.stores)
    notes = [
        f"3 training hosts x 1 worker (gloo over the hosts' links), etcd on a control host; {STEPS} steps, "
        f"fault after step {MARK}; lease TTL {TTL:g} s (fence margin {TTL / 2:g} s), collective timeout {PG_TIMEOUT:g} s "
        f"(in-place rows: {args.pg_timeout:g} s, peer heartbeat "
        + (f"every {args.heartbeat:g} s, suspect after 5 misses)" if args.heartbeat else "off)"),
        f"victims: power-off {VICTIM['power-off']} (rank 0), partition/freeze {VICTIM['partition']} (healed/thawed "
        "after the survivors moved on)",
        f"restart-baseline: plain torch.distributed, checkpoint every {CKPT_EVERY} steps on shared storage, "
        "kill all + relaunch on the survivors from the newest checkpoint once the first worker exits",
        f"logs: {logs}",
    ]
    if args.load:
        notes.append(f"load: every trial ran beside {default_processes()} busy loops (2 x {os.cpu_count()} cores)")
    emit("hosts", results, args.json, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
