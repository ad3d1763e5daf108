"""Race and crash drivers shared by the directory and etcd ledger tests (run in child processes)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from tests.support.generation import KEY, child, members


def _racer(job_dir: str, url: str | None, rounds: int, start, ready, results) -> None:
    from gpuguard.foundation.errors import RefusedError
    from gpuguard.generation.ledger_open import open_ledger

    ledger = open_ledger(job_dir, url, key=KEY)
    mem = members(2)
    for _ in range(rounds):
        start.wait()  # the previous round is over: everybody reads the same parent
        parent = ledger.require_active()
        cert = child(parent, mem, reason="operator")
        ready.wait()  # ... and then all race for generation parent + 1
        try:
            ledger.activate(cert)
            results.put((parent.generation, 1))
        except RefusedError:
            results.put((parent.generation, 0))


def race(job_dir: Path, url: str | None, *, racers: int = 16, rounds: int = 100) -> dict[int, int]:
    """Winners per parent generation after `rounds` rounds of `racers` processes activating at once."""
    ctx = mp.get_context("fork")
    start, ready = ctx.Barrier(racers), ctx.Barrier(racers)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_racer, args=(str(job_dir), url, rounds, start, ready, results), daemon=True)
        for _ in range(racers)
    ]
    for p in procs:
        p.start()
    winners: dict[int, int] = {}
    try:
        for _ in range(racers * rounds):
            parent, won = results.get(timeout=60)
            winners[parent] = winners.get(parent, 0) + won
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return winners


WRITER = r"""
import sys
from tests.support.generation import KEY, child, members
from gpuguard.generation.ledger_open import open_ledger
ledger = open_ledger({job_dir!r}, {url!r}, key=KEY)
mem = members(2)
while True:
    parent = ledger.require_active()
    if parent.generation >= {target}:
        break
    ledger.activate(child(parent, mem, reason="operator"))
    print(parent.generation + 1, flush=True)
"""


def writer_source(job_dir: Path, url: str | None, target: int) -> str:
    return WRITER.format(job_dir=str(job_dir), url=url, target=target)
