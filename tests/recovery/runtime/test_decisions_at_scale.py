"""The coordinators' pure decisions and the certificate they issue, at 50,000 ranks (issue 29 item 5).

Not a benchmark (bench/scale.py is, on the same synthetic jobs: bench/scale_scenarios.py): a guard
against anything quadratic. At 50,000 ranks a linear pass takes a second or two on a loaded CPU; the
membership test in a tuple that `admit_survivors` had took 32 s here. The bound sits between."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import scale_scenarios as sn  # noqa: E402

RANKS = 50_000
BOUND_S = 10.0


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def test_the_in_place_decision_and_its_certificate_are_linear_in_the_ranks():
    sc = sn.in_place(RANKS)
    decided, plan = timed(lambda: sn.decide_in_place(sc))
    certified, (cert, violations) = timed(lambda: sn.certify(sc.parent, plan, "proved", plan.frontier))
    assert plan.extra["evicted"]["dead"] == list(sc.dead) and len(plan.members) == RANKS - 8
    assert plan.extra["layout"]["dp"] == RANKS // 8 - 1 and violations == [] and len(cert.members) == RANKS - 8
    assert decided < BOUND_S and certified < BOUND_S, (decided, certified)


def test_the_restart_decision_and_its_certificate_are_linear_in_the_ranks():
    sc = sn.restart(RANKS)
    decided, plan = timed(lambda: sn.decide_restart(sc))
    certified, (cert, violations) = timed(lambda: sn.certify(sc.parent, plan, plan.quiescence, plan.choice.frontier))
    assert plan.quiescence == "proved" and len(plan.members) == RANKS and violations == []
    assert cert.admitted == tuple(range(RANKS))
    assert decided < BOUND_S and certified < BOUND_S, (decided, certified)
