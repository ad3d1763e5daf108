"""bench/hosts.py's reader of torchrun agent logs (the restart rows' `worker_failed` and
`rendezvous_done`): real lines give their times in order; any text is read without an exception."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from hosts import agent_events  # noqa: E402

LOG = """\
I1202 06:37:58.332000 2 torch/distributed/elastic/agent/server/api.py:553] [default] Rendezvous complete for workers. Result:
[rank1]: RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete
E1202 06:38:10.145000 2 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 5)
I1202 06:38:10.146000 2 torch/distributed/elastic/agent/server/api.py:942] [default] Worker group FAILED. 3/3 attempts left; will restart worker group
I1202 06:38:12.487000 2 torch/distributed/elastic/agent/server/api.py:553] [default] Rendezvous complete for workers. Result:
"""


def _at(hms: str) -> float:
    return time.mktime(time.strptime(f"2026-12-02 {hms}", "%Y-%m-%d %H:%M:%S"))


def test_the_failure_and_the_next_rendezvous_after_the_fault():
    got = agent_events(LOG, _at("06:38:07"))
    assert got == {"worker_failed": _at("06:38:10") + 0.146, "rendezvous_done": _at("06:38:12") + 0.487}


def test_a_rendezvous_before_any_failure_is_not_the_recovery():
    assert agent_events(LOG.split("[rank1]")[0], _at("06:37:50")) == {}


def test_a_stamp_that_is_no_date_is_skipped():
    line = "I1399 25:61:00.5 2 torch/distributed/elastic/agent/server/api.py:942] [default] Worker group FAILED"
    assert agent_events(line, 0.0) == {}


@given(st.text(max_size=400), st.floats(min_value=0, max_value=4e9))
def test_any_text_is_read_without_an_exception(text, since):
    assert set(agent_events(text, since)) <= {"worker_failed", "rendezvous_done"}


def test_the_restart_row_against_the_baseline_pairs_trial_by_trial_and_skips_unrecovered_pairs():
    from hosts import vs_baseline  # noqa: PLC0415 - beside the reader it tests

    ours = [{"recovered": True, "seconds": s} for s in (5.0, 6.0, 9.0)] + [{"recovered": False, "seconds": 1.0}]
    base = [{"recovered": True, "seconds": s} for s in (6.0, 5.0, 6.0, 6.0)]
    got = vs_baseline(ours, base)
    assert got["ratio_per_pair"] == [round(5 / 6, 3), 1.2, 1.5]  # the unrecovered 4th pair is left out
    assert got["ratio_to_baseline_p50"] == 1.0  # median 6.0 over median 6.0
    assert got["faster_pairs"] == 1
    assert vs_baseline([{"recovered": False}], base) == {"ratio_to_baseline_p50": None}
