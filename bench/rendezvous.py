"""torchrun rendezvous on etcd v3 (`--rdzv-backend=gpuguard`) against torch's `c10d` backend.

    python bench/rendezvous.py [--json] [--agents 2,8,32,64] [--etcd http://HOST:PORT] [--ops 300]
                               [--restarts N [--baseline DIR]]

Agents are processes that only rendezvous: each builds its handler the way torchrun does
(`get_rendezvous_handler`), waits for a common start, calls `next_rendezvous()` (which, for both
backends, also publishes the workers' MASTER_ADDR/PORT), passes one store barrier and shuts down.
torch is imported once and the agents are forked (an `import torch` per agent would cost more
than the rendezvous on a small machine). `c10d` gets a TCPStore hosted by a separate process (a
host that is not training, torch's recommended layout); `gpuguard` gets a real etcd started here
(single member, data in a temporary directory) unless --etcd names one. Rendezvous time: from the
common start to the last agent's `next_rendezvous()` return; ratio = gpuguard / c10d in this run.

Also: store op latency p50/p99 (set, get, add, wait on a present key, compare_set) of
`EtcdStore` against `TCPStore`, one client, in process; the etcd keys each gpuguard run left right
after its agents shut down and `closed_ttl` (2 s here) later. The machine may be shared: noisy.

`--restarts N` (issue 23): the re-rendezvous of a real job. Two `torchrun` agents (--nnodes=2, one
gloo worker each, all-reducing every 50 ms), the rank-1 worker SIGKILLed; measured per trial: kill
-> the last new worker's first line (`restart_s`: detection, the agents' re-rendezvous, the spawn)
and kill -> the new group's first all-reduce done by both (`ready_s`). Variants, interleaved trial
by trial so that load hits them alike: `c10d-noshare` (torch's c10d, the first agent hosts the
store, with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: a fresh workers' store per round, as the
gpuguard handler does; with torch's default shared store the new workers race on the old group's
keys and fail, docs/torchrun-hazards.md: `--variants c10d,...` runs that too), `gpuguard` (this
tree), and with `--baseline DIR` `gpuguard@baseline` (the same torchrun with DIR, a folder holding
a `gpuguard` package, first on PYTHONPATH: e.g. a checkout of main). `--agents "" --ops 0
--restarts 5` runs only this part. Each row: median, min and max over the trials, and the
load average when the variant's trials ended.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

PREFIX = "/gpuguard-bench/rdzv"
CLOSED_TTL = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_etcd(tmp: str) -> tuple[subprocess.Popen[bytes], str]:
    etcd = shutil.which("etcd")
    if etcd is None:
        sys.exit("etcd is not installed (Debian package etcd-server), or pass --etcd http://HOST:PORT")
    port, peer = _free_port(), _free_port()
    proc = subprocess.Popen(
        [
            etcd,
            "--name=bench",
            f"--data-dir={tmp}/etcd",
            f"--listen-client-urls=http://127.0.0.1:{port}",
            f"--advertise-client-urls=http://127.0.0.1:{port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=bench=http://127.0.0.1:{peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    end = time.monotonic() + 20
    while time.monotonic() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    sys.exit("etcd did not start within 20 s")


def _agent(backend: str, endpoint: str, run_id: str, n: int, conf: dict[str, str], go: Any, out: Any) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
    from torch.distributed.elastic.utils.store import barrier

    try:
        handler = get_rendezvous_handler(
            RendezvousParameters(backend, endpoint, run_id, n, n, local_addr="127.0.0.1", **conf)
        )
        go.wait(300)
        info = handler.next_rendezvous()
        joined = time.monotonic()
        barrier(info.store, info.world_size, key_prefix="bench/done", barrier_timeout=120)
        handler.shutdown()
        out.put({"joined": joined, "rank": info.rank})
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.put({"error": f"{type(exc).__name__}: {exc}"[:500]})


def _store_host(port_out: Any, stop: Any) -> None:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    port_out.put(store.port)
    stop.wait(600)


def _round(backend: str, endpoint: str, n: int, conf: dict[str, str], timeout: float) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    run_id = f"bench-{backend}-{n}-{uuid.uuid4().hex[:8]}"
    procs = [
        ctx.Process(target=_agent, args=(backend, endpoint, run_id, n, conf, go, out), daemon=True) for _ in range(n)
    ]
    for p in procs:
        p.start()
    time.sleep(0.5 + n * 0.02)  # let every agent build its handler before the common start
    t0 = time.monotonic()
    go.set()
    got: list[dict[str, Any]] = []
    end = t0 + timeout
    while len(got) < n and time.monotonic() < end:
        try:
            got.append(out.get(timeout=max(0.1, end - time.monotonic())))
        except Exception:  # noqa: BLE001 - queue.Empty: the deadline decides
            break
    for p in procs:
        p.join(timeout=max(0.1, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    errors = [g["error"] for g in got if "error" in g]
    ok = len(got) == n and not errors
    return {
        "run_id": run_id,
        "ok": ok,
        "seconds": round(max(g["joined"] for g in got) - t0, 3) if ok else None,
        "errors": errors[:2] + ([] if len(got) == n else [f"{n - len(got)} agents did not finish in {timeout:g} s"]),
    }


RESTART_WORKER = (  # a gloo worker that records when it started (its first line) and when its group works
    "import json, os, sys, time\n"
    "start = time.time()\n"
    "out, ppid = sys.argv[1], os.getppid()\n"
    "rec = {'pid': os.getpid(), 'rank': int(os.environ['RANK']), 'start': start}\n"
    "from datetime import timedelta\n"
    "import torch, torch.distributed as dist\n"
    "dist.init_process_group('gloo', timeout=timedelta(seconds=30))\n"
    "t = torch.ones(1)\n"
    "dist.all_reduce(t)\n"
    "rec['ready'] = time.time()\n"
    "with open(f'{out}/w-{os.getpid()}.json.tmp', 'w') as f:\n"
    "    json.dump(rec, f)\n"
    "os.rename(f'{out}/w-{os.getpid()}.json.tmp', f'{out}/w-{os.getpid()}.json')\n"
    "while os.getppid() == ppid:\n"
    "    dist.all_reduce(t)\n"
    "    time.sleep(0.05)\n"
)


def _workers(out: Path) -> dict[int, dict[str, Any]]:
    found: dict[int, dict[str, Any]] = {}
    for f in out.glob("w-*.json"):
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        found[int(rec["pid"])] = rec
    return found


def _restart_trial(variant: str, endpoint: str, secret: str, baseline: str | None, tmp: str) -> dict[str, Any]:
    """One job of 2 torchrun agents; SIGKILL the rank-1 worker; time the restart (module docstring)."""
    out = Path(tempfile.mkdtemp(prefix=f"{variant.replace('@', '-')}-", dir=tmp))
    script = out / "worker.py"
    script.write_text(RESTART_WORKER)
    run_id = f"bench-restart-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "GPUGUARD_"))}
    env["PYTHONWARNINGS"] = "ignore"
    if variant.startswith("c10d"):
        rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}"]
        if variant == "c10d-noshare":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    else:
        conf = f"key_prefix={PREFIX},read_timeout=5,join_timeout=60,lease_ttl=60,closed_ttl=2,secret_file={secret}"
        rdzv = ["--rdzv-backend=gpuguard", f"--rdzv-endpoint={endpoint}", f"--rdzv-conf={conf}"]
        if variant.endswith("@baseline") and baseline:
            env["PYTHONPATH"] = baseline + os.pathsep + env.get("PYTHONPATH", "")
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    argv = [torchrun, "--nnodes=2", "--nproc-per-node=1", *rdzv, f"--rdzv-id={run_id}", "--local-addr=127.0.0.1"]
    argv += ["--max-restarts=3", str(script), str(out)]
    agents: list[subprocess.Popen[bytes]] = []
    result: dict[str, Any] = {"variant": variant, "restart_s": None, "ready_s": None, "error": None}
    try:
        for i in range(2):
            with open(out / f"agent-{i}.log", "wb") as log:
                agents.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
            time.sleep(0.5)  # c10d: the first agent hosts the store
        first = _wait_workers(out, agents, set(), 120)
        victim = next(pid for pid, rec in first.items() if rec["rank"] == 1)
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        new = _wait_workers(out, agents, set(first), 60)
        result["restart_s"] = round(max(r["start"] for r in new.values()) - t_kill, 3)
        result["ready_s"] = round(max(r["ready"] for r in new.values()) - t_kill, 3)
    except (RuntimeError, StopIteration) as exc:
        logs = " | ".join((out / f"agent-{i}.log").read_text(errors="replace")[-300:] for i in range(len(agents)))
        result["error"] = f"{exc}: {logs}"
    finally:
        workers = list(_workers(out))
        for a in agents:
            a.terminate()  # torchrun stops its workers on SIGTERM
        for a in agents:
            try:
                a.wait(timeout=30)
            except subprocess.TimeoutExpired:
                a.kill()
                a.wait(timeout=10)
        for pid in workers:  # a worker its agent did not stop
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    return result


def _wait_workers(
    out: Path, agents: list[subprocess.Popen[bytes]], old: set[int], timeout: float
) -> dict[int, dict[str, Any]]:
    """Two worker records (new ones: pids not in `old`), polled every 10 ms."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        new = {pid: rec for pid, rec in _workers(out).items() if pid not in old}
        if len(new) >= 2:
            return new
        if any(a.poll() is not None for a in agents):
            raise RuntimeError("an agent exited")
        time.sleep(0.01)
    raise RuntimeError(f"no two {'new ' if old else ''}workers within {timeout:g} s")


def _restart_rows(
    variants: list[str], trials: int, endpoint: str, secret: str, baseline: str | None, tmp: str
) -> list[dict[str, Any]]:
    got: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    load: dict[str, float] = {}
    for _ in range(trials):
        for v in variants:
            got[v].append(_restart_trial(v, endpoint, secret, baseline, tmp))
            load[v] = os.getloadavg()[0]
    rows = []
    for v in variants:
        ok = [t for t in got[v] if t["error"] is None]
        row: dict[str, Any] = {"bench": "restart", "variant": v, "trials": len(got[v]), "ok": len(ok)}
        for key in ("restart_s", "ready_s"):
            vals = sorted(t[key] for t in ok)
            row[key] = round(statistics.median(vals), 3) if vals else None
            row[key.replace("_s", "_min_s")] = vals[0] if vals else None
            row[key.replace("_s", "_max_s")] = vals[-1] if vals else None
        row["restart_trials_s"] = [t["restart_s"] for t in got[v]]  # in trial order (None: failed): paired by index
        row["load1"] = round(load[v], 2)
        row["errors"] = "; ".join(t["error"][:300] for t in got[v] if t["error"]) or None
        rows.append(row)
    return rows


def _count_keys(endpoint: str, prefix: str) -> int:
    from gpuguard.foundation.etcd import EtcdClient, parse_endpoints

    with EtcdClient(parse_endpoints(endpoint), timeout=5) as conn:
        return int(conn.range(prefix, "bench count", prefix=True, count_only=True).get("count", 0))


def _latencies(store: Any, ops: int) -> dict[str, tuple[float, float]]:
    def timed(fn: Any) -> tuple[float, float]:
        lat = []
        for i in range(ops):
            t0 = time.perf_counter()
            fn(i)
            lat.append(time.perf_counter() - t0)
        lat.sort()
        return lat[len(lat) // 2] * 1e3, lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3

    store.set("present", "x")
    return {
        "set": timed(lambda i: store.set(f"k{i % 16}", b"v" * 64)),
        "get": timed(lambda i: store.get("present")),
        "add": timed(lambda i: store.add("counter", 1)),
        "wait": timed(lambda i: store.wait(["present"], timedelta(seconds=5))),
        "compare_set": timed(lambda i: store.compare_set("cas", str(i).encode() if i else b"", str(i + 1).encode())),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--agents", default="2,8,32,64")
    ap.add_argument("--etcd", default=None, help="http://HOST:PORT of an etcd to use (default: start one)")
    ap.add_argument("--ops", type=int, default=300)
    ap.add_argument("--timeout", type=float, default=180)
    ap.add_argument("--restarts", type=int, default=0, help="trials of the 2-agent kill-and-restart job (0: none)")
    ap.add_argument("--baseline", default=None, help="a folder holding another `gpuguard` package to compare")
    ap.add_argument("--variants", default=None, help="restart variants (default c10d-noshare,gpuguard[,@baseline])")
    args = ap.parse_args()

    import torch.distributed  # noqa: F401 - imported once, before the agents are forked

    tmp = tempfile.mkdtemp(prefix="gg-bench-rdzv-")
    etcd_proc = None
    if args.etcd:
        endpoint = args.etcd.split("://", 1)[-1].rstrip("/")
    else:
        etcd_proc, endpoint = _start_etcd(tmp)
    rows: list[dict[str, Any]] = []
    notes = [f"{os.cpu_count()} CPUs; agents are forked processes that only rendezvous; one machine, loopback"]
    try:
        small = {"last_call_timeout": "1", "join_timeout": str(int(args.timeout)), "read_timeout": "10"}
        secret = os.path.join(tmp, "rdzv.secret")  # the rendezvous secret the backend signs its state with
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, secrets.token_hex(32).encode() + b"\n")
        os.close(fd)
        gg_conf = {**small, "key_prefix": PREFIX, "closed_ttl": str(CLOSED_TTL), "store_timeout": "120"}
        gg_conf["secret_file"] = secret
        ctx = mp.get_context("fork")
        gg_runs: list[str] = []
        for n in [int(x) for x in args.agents.split(",") if x]:
            port_q, stop = ctx.Queue(), ctx.Event()
            host = ctx.Process(target=_store_host, args=(port_q, stop), daemon=True)
            host.start()
            port = port_q.get(timeout=60)
            c10d = _round("c10d", f"127.0.0.1:{port}", n, {**small, "is_host": "false"}, args.timeout)
            stop.set()
            host.join(timeout=10)
            gg = _round("gpuguard", endpoint, n, gg_conf, args.timeout)
            run_prefix = f"{PREFIX}/{gg['run_id']}/"
            gg_runs.append(run_prefix)
            left = _count_keys(endpoint, run_prefix) if gg["ok"] else None
            ratio = round(gg["seconds"] / c10d["seconds"], 3) if gg["ok"] and c10d["ok"] else None
            rows.append(
                {
                    "bench": "rendezvous",
                    "agents": n,
                    "c10d_s": c10d["seconds"],
                    "gpuguard_s": gg["seconds"],
                    "ratio": ratio,
                    "etcd_keys_left": left,
                    "errors": "; ".join(c10d["errors"] + gg["errors"]) or None,
                }
            )
        time.sleep(CLOSED_TTL + 2.5)  # etcd expires leases with a granularity of about a second
        later = sum(_count_keys(endpoint, p) for p in gg_runs)
        notes.append(f"etcd keys left by all gpuguard runs {CLOSED_TTL + 2.5:g} s after the last one: {later}")

        if args.restarts > 0:
            variants = ["c10d-noshare", "gpuguard", *(["gpuguard@baseline"] if args.baseline else [])]
            if args.variants:
                variants = [v for v in args.variants.split(",") if v]
            known = {"c10d", "c10d-noshare", "gpuguard", "gpuguard@baseline"}
            if not set(variants) <= known or ("gpuguard@baseline" in variants and not args.baseline):
                sys.exit(f"--variants: some of {sorted(known)} (gpuguard@baseline needs --baseline)")
            rows += _restart_rows(variants, args.restarts, endpoint, secret, args.baseline, tmp)
            notes.append(
                "restart: 2 torchrun agents (--nnodes=2, 1 gloo worker each), the rank-1 worker SIGKILLed; "
                "c10d-noshare = torch's c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; "
                "restart_s = kill -> the last new worker's first line, ready_s = kill -> the new group's first "
                "all-reduce; median (min, max) over the trials, variants interleaved"
            )
        if args.ops > 0:
            from torch.distributed import TCPStore

            from gpuguard.recovery.rendezvous.etcd_store import EtcdStore

            ees = EtcdStore.connect(endpoint, f"bench-ops-{uuid.uuid4().hex[:8]}", key_prefix=PREFIX, lease_ttl=30)
            tcp = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
            lat_e, lat_t = _latencies(ees, args.ops), _latencies(tcp, args.ops)
            for op in lat_e:
                rows.append(
                    {
                        "bench": "store_op",
                        "op": op,
                        "etcd_p50_ms": round(lat_e[op][0], 3),
                        "etcd_p99_ms": round(lat_e[op][1], 3),
                        "tcpstore_p50_ms": round(lat_t[op][0], 3),
                        "tcpstore_p99_ms": round(lat_t[op][1], 3),
                        "ratio_p50": round(lat_e[op][0] / lat_t[op][0], 1),
                    }
                )
            ees.lease.revoke() if ees.lease else None
            notes.append(
                "store ops: one client in this process; EtcdStore talks HTTP/JSON to etcd's v3 gateway "
                "(each write is a raft commit), TCPStore is torch's C++ client and server"
            )
        notes.append(
            f"median gpuguard/c10d ratio: {statistics.median([r['ratio'] for r in rows if r.get('ratio')] or [0])}"
        )
    finally:
        if etcd_proc is not None:
            etcd_proc.terminate()
            try:
                etcd_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                etcd_proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    emit("rendezvous", rows, args.json, notes=notes)


if __name__ == "__main__":
    main()
