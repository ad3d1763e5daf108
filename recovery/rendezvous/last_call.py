"""End a re-rendezvous's last call once every agent known to be alive has joined (issue 23).

Why: torch's join op, once `min_nodes` participants are in, waits `last_call_timeout` for more
before it marks the round complete. torch reads that setting as a whole number of seconds, so the
only value below 1 s is 0, which would cut a round while live agents are still on their way. After
a lost host the survivors have all joined within tens of milliseconds, and the last call then waits
its full second for a node that is gone: most of what the restart path paid beyond a plain
relaunch (`bench/hosts.py`, restart against restart-baseline).

The rule (`may_end_last_call`), checked by a participant each time torch's join op would wait:
- this agent has completed a round before: a re-rendezvous. At a job's first start agents come up
  seconds apart, and torch's last call is what lets the late ones into the first round;
- the round is open, with min_nodes..max_nodes participants, and torch has set its deadline: torch
  itself would complete this round, only later;
- every agent known to be alive is a participant. Known to be alive: an agent whose newest heartbeat
  in any state this agent has read (`HeartbeatMemory`, not only the state in hand) is younger than
  torch's own expiry, keep_alive_interval x keep_alive_max_attempt (the sanitizer's rule). The
  memory matters: an agent's exit op deletes its heartbeat, so a survivor between its exit and its
  join is absent from the state, and must be waited for, not taken for dead. An agent on the wait
  or redundancy list is alive and not a participant: the last call runs as torch's.

Then the op answers MARK_RENDEZVOUS_COMPLETE where torch's answered SYNC or KEEP_ALIVE; the write
is torch's own compare-and-set, so a concurrent change re-runs the op on the newer state.

What it gives up: an agent that has never written to the state before the round completes (a spare
host starting at that moment) joins the round after, from the wait list, as any agent that arrives
after a round completed (torch's agents restart their workers to take it in). `--rdzv-conf
last_call_early=0` keeps torch's full last call.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    _Action,
    _RendezvousContext,
    _RendezvousJoinOp,
)
from torch.distributed.elastic.utils.logging import get_logger

Op = Callable[[_RendezvousContext, float], _Action]
# in torch's rendezvous logger tree, at torchrun's LOGLEVEL: the line lands in the agent's log
# beside torch's own "Rendezvous complete" (a logger of our own has no handler in the agent)
log = get_logger("torch.distributed.elastic.rendezvous.gpuguard_last_call")


class HeartbeatMemory:
    """The newest heartbeat time of each agent seen in any state read; forgets the expired ones."""

    def __init__(self) -> None:
        self._newest: dict[Hashable, datetime] = {}

    def observe(self, heartbeats: Mapping[Any, datetime]) -> None:
        for node, beat in heartbeats.items():
            if isinstance(beat, datetime) and (node not in self._newest or beat > self._newest[node]):
                self._newest[node] = beat

    def alive(self, now: datetime, expiry: timedelta) -> set[Hashable]:
        """Agents whose newest heartbeat seen is younger than `expiry` at `now`."""
        oldest = now - expiry
        self._newest = {n: b for n, b in self._newest.items() if b >= oldest}
        return set(self._newest)


def may_end_last_call(state: Any, settings: RendezvousSettings, alive: set[Hashable]) -> bool:
    """Whether the open round in `state` may complete now: torch would complete it at its deadline,
    and every agent in `alive` is already a participant."""
    participants = state.participants
    return (
        not state.complete
        and not state.closed
        and state.deadline is not None
        and settings.min_nodes <= len(participants) <= settings.max_nodes
        and alive <= set(participants)
    )


class EarlyLastCall:
    """Wraps the ops that torch's join loop runs for one handler: every op feeds the heartbeat memory;
    the join op, once this handler has completed a round, ends the last call by `may_end_last_call`."""

    def __init__(self, settings: RendezvousSettings, enabled: bool = True) -> None:
        self.settings = settings
        self.enabled = enabled
        self.rounds_done = 0  # rounds this handler completed: the first one keeps torch's last call
        self.memory = HeartbeatMemory()
        self.ended_early = 0  # rounds this handler marked complete before torch's deadline

    def wrap(self, op: Op) -> Op:
        join = isinstance(op, _RendezvousJoinOp)

        def watched(ctx: _RendezvousContext, deadline: float) -> _Action:
            self.memory.observe(ctx.state.last_heartbeats)
            action = op(ctx, deadline)
            if (
                join
                and self.enabled
                and self.rounds_done > 0
                and action in (_Action.SYNC, _Action.KEEP_ALIVE)
                and ctx.node in ctx.state.participants
                and may_end_last_call(ctx.state, self.settings, self._alive())
            ):
                self.ended_early += 1
                log.info(
                    "rendezvous %s: marking round %s complete before its last call ends: all %d live agents joined",
                    self.settings.run_id,
                    ctx.state.round,
                    len(ctx.state.participants),
                )
                return _Action.MARK_RENDEZVOUS_COMPLETE
            return action

        return watched

    def _alive(self) -> set[Hashable]:
        expiry = self.settings.keep_alive_interval * self.settings.keep_alive_max_attempt
        return self.memory.alive(datetime.now(timezone.utc), expiry)
