"""The attempt token: one name every worker of one torchrun rendezvous round agrees on.

Why: torchrun (torch 2.13, shared store) hands every restarted worker the same agent-hosted
TCPStore, where the dead attempt's gloo keys are still waiting to be read (measured: 1 of 9
restarts resumed). `TORCHELASTIC_RESTART_COUNT` cannot name an attempt: membership restarts do not
bump it. The rendezvous `round` can: it goes up by one at every re-rendezvous, for every node, and
the agent keeps it in `torch.rendezvous.<run_id>` on the rendezvous endpoint (c10d's TCPStore) or
under `<prefix>/<run id>/state` on etcd (the `gpuguard` backend). Workers are not told the endpoint,
so we read it from `GPUGUARD_RDZV_ENDPOINT` or the agent's own command line (which also names the
backend and its --rdzv-conf), and decode the state with `recovery.rendezvous.state` (restricted
unpickler, torch-free clients).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from gpuguard.collectors.torchrun import parse_torchrun_cmdline
from gpuguard.foundation.env import RDZV_ENDPOINT_ENV
from gpuguard.foundation.errors import GpuguardError
from gpuguard.recovery.rendezvous.state import Endpoint, bind_round, endpoint_of, open_client, read_state


@dataclass(frozen=True)
class Attempt:
    """`token` names the attempt in store keys; `source` says how it was derived (for the logs).

    `rendezvous` is where the round was read (None when it was not): the coordinator binds the
    round to the generation it activates there (`record_round`).
    """

    token: str
    round: int | None
    source: str
    rendezvous: Endpoint | None = None
    # the round's agents as torch names them (`addr_pid_localid`), in group-rank order
    participants: tuple[str, ...] = ()


def _read_round(ep: Endpoint, timeout_s: float) -> tuple[int | None, tuple[str, ...]]:
    if ep.backend == "c10d" and ep.port == 0:
        return None, ()
    with open_client(ep, timeout_s) as client:
        state, _ = read_state(client, ep.run_id)
    rnd = getattr(state, "round", None)
    members = getattr(state, "participants", None) or {}
    agents = tuple(repr(n) for n, _ in sorted(members.items(), key=lambda kv: kv[1]))
    return (rnd, agents) if isinstance(rnd, int) else (None, ())


def _locate(env: dict[str, str]) -> tuple[Endpoint | None, str]:
    """The rendezvous (endpoint, backend and conf of the agent) and how it was found."""
    try:
        opts = parse_torchrun_cmdline(psutil.Process(os.getppid()).cmdline()) or {}
    except (psutil.Error, OSError):  # no agent (plain python), or it is gone
        opts = {}
    endpoint = env.get(RDZV_ENDPOINT_ENV)
    source = RDZV_ENDPOINT_ENV
    if not endpoint:
        endpoint, source = opts.get("rdzv_endpoint"), "agent command line"
    if not endpoint:
        return None, source
    run_id = env.get("TORCHELASTIC_RUN_ID") or opts.get("rdzv_id", "none")
    try:
        ep = endpoint_of(endpoint, run_id, backend=opts.get("rdzv_backend"), conf=opts.get("rdzv_conf"))
    except GpuguardError:  # a backend we cannot read (static, etcd-v2) or a malformed endpoint
        return None, source
    return ep, source


def current_attempt(env: dict[str, str] | None = None, timeout_s: float = 5.0) -> Attempt:
    """This worker's attempt token (see the module docstring), falling back loudly."""
    env = dict(os.environ if env is None else env)
    master_port = env.get("MASTER_PORT", "0")
    ep, source = _locate(env)
    if ep is not None:
        try:
            rnd, agents = _read_round(ep, timeout_s)
        except Exception:  # noqa: BLE001 - unreachable endpoint: fall back below
            rnd, agents = None, ()
        if rnd is not None:
            return Attempt(f"r{rnd}-p{master_port}", rnd, f"rendezvous round via {source}", ep, agents)
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return Attempt(
        f"c{restart}-p{master_port}",
        None,
        "restart count (rendezvous round unreadable: membership restarts may reuse a namespace; "
        f"set {RDZV_ENDPOINT_ENV}=host:port)",
    )


def record_round(
    attempt: Attempt | None,
    generation: int,
    digest: str,
    job_id: str = "",
    log: Callable[[str], None] | None = None,
    timeout_s: float = 5.0,
) -> bool:
    """Bind the attempt's rendezvous round to the generation activated in it (best effort: the
    certificate already names the round; a store that is gone costs a warning, not the job)."""
    if attempt is None or attempt.round is None or attempt.rendezvous is None:
        return False
    try:
        bind_round(attempt.rendezvous, attempt.round, generation, digest, job_id, timeout_s)
    except Exception as exc:  # noqa: BLE001 - any failure: the activation stands
        if log is not None:
            log(f"warning: could not bind rendezvous round {attempt.round} to generation {generation}: {exc}")
        return False
    return True
