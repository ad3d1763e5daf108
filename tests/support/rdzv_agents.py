"""N processes that only rendezvous through torchrun's handler registry: the concurrent-join test's agents.

    python tests/support/rdzv_agents.py --n 16 --endpoint HOST:PORT --run-id R [--backend gpuguard]
           [--conf key=value,...] [--timeout 60]

Run it as a script, not with `python -m`: torch's dynamic rendezvous calls `inspect.stack()` on
every state change, and under runpy each call scans all of `sys.modules` (64 agents on 2 cores
then miss a 60 s deadline).

torch is imported once here and the agents are forked from this process (an `import torch` per
agent would cost more than the rendezvous on a small machine). Each agent builds its handler the
way torchrun does (`get_rendezvous_handler`), waits for the common start, calls `next_rendezvous()`,
reads the workers' MASTER_ADDR/MASTER_PORT from the returned store, passes a store barrier, and
shuts the handler down. One JSON line on stdout: `{"agents": [...], "seconds": ...}`; exit 1 if any
agent failed or the whole thing ran past --timeout (the agents are killed then).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
from torch.distributed.elastic.utils.store import barrier


def _conf(text: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in text.split(",") if kv)


def _agent(i: int, args: argparse.Namespace, go: Any, out: Any) -> None:
    try:
        params = RendezvousParameters(
            args.backend, args.endpoint, args.run_id, args.n, args.n, local_addr="127.0.0.1", **_conf(args.conf)
        )
        handler = get_rendezvous_handler(params)
        go.wait(args.timeout)
        t0 = time.monotonic()
        info = handler.next_rendezvous()
        t1 = time.monotonic()
        boot = info.bootstrap_store_info
        barrier(info.store, info.world_size, key_prefix="test/done", barrier_timeout=args.timeout)
        handler.shutdown()
        out.put(
            {
                "agent": i,
                "pid": os.getpid(),
                "rank": info.rank,
                "world": info.world_size,
                "master": f"{boot.master_addr}:{boot.master_port}",
                "use_agent_store": handler.use_agent_store,
                "start": t0,
                "joined": t1,
            }
        )
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails
        out.put({"agent": i, "error": traceback.format_exc()[-2000:]})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--backend", default="gpuguard")
    ap.add_argument("--conf", default="")
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    ctx = mp.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_agent, args=(i, args, go, out), daemon=True) for i in range(args.n)]
    for p in procs:
        p.start()
    t0 = time.monotonic()
    go.set()
    results: list[dict[str, Any]] = []
    end = t0 + args.timeout
    while len(results) < args.n and time.monotonic() < end:
        try:
            results.append(out.get(timeout=max(0.1, end - time.monotonic())))
        except Exception:  # noqa: BLE001 - queue.Empty: the deadline decides
            break
    for p in procs:
        p.join(timeout=max(0.1, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    doc = {"agents": sorted(results, key=lambda r: r["agent"]), "seconds": time.monotonic() - t0}
    print(json.dumps(doc))
    ok = len(results) == args.n and not any("error" in r for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
