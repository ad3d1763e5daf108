"""Reading a torchrun job's rendezvous state from outside: gpuguard's torch-free reader vs torch's client.

    python bench/rendezvous_read.py [--json] [--runs N]

One real c10d TCPStore (torch's server) holds a rendezvous state written by torch's own pickler,
exactly as an agent writes it. Each method runs in a fresh interpreter (what an operator command or
a cron probe pays): `gpuguard` = `recovery.rendezvous.state.read` (raw socket + restricted unpickler);
`torch` = `TCPStore(is_master=False).get` + `pickle.loads` (the baseline a user would write).
Also the in-process read latency of the torch-free client.
"""

from __future__ import annotations

import argparse
import base64
import pickle
import statistics
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

RUN_ID = "bench"

GPUGUARD = (
    "from gpuguard.recovery.rendezvous.state import Endpoint, read; import sys; "
    "st = read(Endpoint('127.0.0.1', int(sys.argv[1]), 'bench')); assert st.round == 3"
)
TORCH = (
    "import sys, pickle, base64; from datetime import timedelta; from torch.distributed import TCPStore; "
    "s = TCPStore('127.0.0.1', int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=5)); "
    "st = pickle.loads(base64.b64decode(s.get('torch.rendezvous.bench'))); assert st.round == 3"
)


def _serve():
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    state = _RendezvousState()
    state.round, state.complete = 3, True
    for i in range(4):
        node = _NodeDesc(f"node-{i}", 1000 + i, 0)
        state.participants[node] = i
        state.last_heartbeats[node] = datetime.now(timezone.utc)
    store.set(f"torch.rendezvous.{RUN_ID}", base64.b64encode(pickle.dumps(state)))
    return store


def _wall(code: str, port: int) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code, str(port)],
        check=True,
        timeout=120,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    store = _serve()
    port = store.port
    rows = []
    walls = {}
    for name, code in (("gpuguard", GPUGUARD), ("torch", TORCH)):
        _wall(code, port)  # warm the page cache
        runs = [_wall(code, port) for _ in range(args.runs)]
        walls[name] = statistics.median(runs)
        rows.append(
            {
                "method": name,
                "runs": args.runs,
                "process_wall_p50_s": round(walls[name], 4),
                "process_wall_max_s": round(max(runs), 4),
            }
        )
    for row in rows:
        row["ratio_vs_torch"] = round(row["process_wall_p50_s"] / walls["torch"], 4)

    from gpuguard.recovery.rendezvous.state import read_state
    from gpuguard.recovery.rendezvous.tcpstore import StoreClient

    with StoreClient("127.0.0.1", port, 5.0) as client:
        lat = []
        for _ in range(200):
            t0 = time.perf_counter()
            read_state(client, RUN_ID)
            lat.append(time.perf_counter() - t0)
    lat.sort()
    rows.append(
        {
            "method": "gpuguard in-process read",
            "runs": len(lat),
            "read_p50_ms": round(lat[len(lat) // 2] * 1e3, 3),
            "read_p99_ms": round(lat[int(len(lat) * 0.99)] * 1e3, 3),
        }
    )
    emit(
        "rendezvous_read",
        rows,
        args.json,
        notes=["fresh interpreter per run: what a CLI call or cron probe pays; the machine may be shared (noisy)"],
    )
    store.delete_key(f"torch.rendezvous.{RUN_ID}")  # keeps the server alive until here


if __name__ == "__main__":
    main()
