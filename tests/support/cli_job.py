"""A real file-ledger job with three generations, a refused activation, step records and a dump pair:
what the per-command CLI tests (JSON schemas, human output at 80 columns) run every command against."""

from __future__ import annotations

import json
import pickle
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpuguard.foundation.errors import RefusedError
from gpuguard.foundation.steplog import StepLog
from gpuguard.generation.job import open_job_ledger
from gpuguard.generation.keys import load_key, sign
from gpuguard.generation.records import Member
from tests.support import contract_job as jh
from tests.support.cli import run_cli
from tests.support.generation import child, members


def build_job(tmp: Path) -> tuple[Path, dict[str, Any]]:
    """`gpu-generation init`, two child generations with commits, one refused activation: (the job dir,
    init's JSON document)."""
    jd = tmp / "job"
    r = run_cli("gpu-generation", "init", "--job-dir", str(jd), "--job-id", "schemas", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    led = open_job_ledger(jd, None)
    cert = led.require_active()
    mem = members(2)
    for _ in range(2):
        nxt = child(cert, mem, key=led.key, step=cert.frontier.step, extra={"switch": "restart"})
        led.activate(nxt)
        for m in mem:
            led.record_commit(nxt.generation, cert.frontier.step + 10, m.rank, m.incarnation.id)
        cert = nxt
    new_inc = replace(cert.members[1].incarnation, id=uuid.uuid4().hex, pid=4242)
    bad = replace(child(cert, (cert.members[0], Member(1, new_inc)), key=led.key), admitted=(), signature="")
    with pytest.raises(RefusedError):
        led.activate(bad.with_signature(sign(load_key(jd), bad.signing_bytes())))
    return jd, json.loads(r.stdout)


def write_steps(jd: Path, ranks: int = 4, steps: int = 30, generation: int = 2) -> None:
    """Step records of `ranks` ranks (this process's pid: alive), each step's all-reduce marked."""
    for rank in range(ranks):
        log = StepLog(jd, rank, f"inc{rank}-{uuid.uuid4().hex[:8]}", generation=generation)
        for s in range(steps):
            log.begin_step(s)
            with log.collective(s, "all_reduce", 1 << 20):
                pass
            log.end_step(s)
        log.close()


def write_dumps(tmp: Path) -> Path:
    """Two Flight Recorder dumps whose second collective's sizes differ (a broken contract)."""
    dumps = tmp / "dumps"
    dumps.mkdir()
    for rank in range(2):
        entries = [jh.fr_entry(1), jh.fr_entry(2, sizes=((4,),) if rank else ((8,),))]
        (dumps / f"rank_{rank}").write_bytes(pickle.dumps(jh.fr_doc(entries, ranks=range(2)), protocol=2))
    return dumps
