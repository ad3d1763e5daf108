"""The attempt token: one name every worker of one torchrun rendezvous round agrees on.

Why: torchrun (torch 2.13, shared store) hands every restarted worker the same agent-hosted
TCPStore, where the dead attempt's gloo keys are still waiting to be read (measured: 1 of 9
restarts resumed). `TORCHELASTIC_RESTART_COUNT` cannot name an attempt: membership restarts do not
bump it. The rendezvous `round` can: it goes up by one at every re-rendezvous, for every node, and
the agent keeps it in `torch.rendezvous.<run_id>` on the rendezvous endpoint. Workers are not told
the endpoint, so we read it from `GPUGUARD_RDZV_ENDPOINT` or the agent's own command line, and
decode the state with `recovery.rendezvous` (restricted unpickler, torch-free store client).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

from gpuguard.collectors.torchrun import parse_torchrun_cmdline
from gpuguard.foundation.env import RDZV_ENDPOINT_ENV
from gpuguard.recovery.rendezvous import read_state
from gpuguard.recovery.tcpstore import StoreClient, parse_endpoint


@dataclass(frozen=True)
class Attempt:
    """`token` names the attempt in store keys; `source` says how it was derived (for the logs)."""

    token: str
    round: int | None
    source: str


def _read_round(endpoint: str, run_id: str, timeout_s: float) -> int | None:

    host, port = parse_endpoint(endpoint)
    if port == 0:
        return None
    with StoreClient(host, port, timeout_s) as client:
        state, _ = read_state(client, run_id)
    rnd = getattr(state, "round", None)
    return rnd if isinstance(rnd, int) else None


def current_attempt(env: dict[str, str] | None = None, timeout_s: float = 5.0) -> Attempt:
    """This worker's attempt token (see the module docstring), falling back loudly."""
    env = dict(os.environ if env is None else env)
    master_port = env.get("MASTER_PORT", "0")
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    endpoint = env.get(RDZV_ENDPOINT_ENV)
    source = RDZV_ENDPOINT_ENV
    if not endpoint:
        try:
            opts = parse_torchrun_cmdline(psutil.Process(os.getppid()).cmdline()) or {}
            endpoint = opts.get("rdzv_endpoint")
            run_id = env.get("TORCHELASTIC_RUN_ID") or opts.get("rdzv_id", "none")
            source = "agent command line"
        except (psutil.Error, OSError):  # no agent (plain python), or it is gone
            endpoint = None
    if endpoint:
        try:
            rnd = _read_round(endpoint, run_id, timeout_s)
        except Exception:  # noqa: BLE001 - unreachable endpoint: fall back below
            rnd = None
        if rnd is not None:
            return Attempt(f"r{rnd}-p{master_port}", rnd, f"rendezvous round via {source}")
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return Attempt(
        f"c{restart}-p{master_port}",
        None,
        "restart count (rendezvous round unreadable: membership restarts may reuse a namespace; "
        f"set {RDZV_ENDPOINT_ENV}=host:port)",
    )
