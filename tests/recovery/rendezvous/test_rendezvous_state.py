"""The rendezvous state codec: torch's pickles decode with the restricted unpickler, ours load in torch."""

from __future__ import annotations

import base64
import os
import pickle
from datetime import datetime, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.collectors.torchrun import parse_torchrun_cmdline
from gpuguard.foundation.errors import DataError
from gpuguard.recovery.rendezvous import state as R


def _torch_state():
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    s = _RendezvousState()
    a, b = _NodeDesc("host-a", 11, 0), _NodeDesc("host-b", 22, 1)
    s.round, s.complete = 7, True
    s.participants = {a: 0, b: 1}
    s.wait_list = {_NodeDesc("host-c", 33, 0)}
    s.last_heartbeats = {a: datetime(2026, 1, 1, tzinfo=timezone.utc), b: datetime.now(timezone.utc)}
    return s


def test_torch_written_state_decodes_without_torch_classes():
    raw = base64.b64encode(pickle.dumps(_torch_state()))
    state = R.decode_state(raw)
    assert isinstance(state, R.RendezvousState) and state.round == 7 and state.complete
    assert {repr(n): r for n, r in state.participants.items()} == {"host-a_11_0": 0, "host-b_22_1": 1}
    assert [repr(n) for n in state.wait_list] == ["host-c_33_0"]
    assert R.decode_state(R.NULL_SENTINEL) is None


def test_our_encoding_is_what_torchs_agent_reads():
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    state = R.decode_state(base64.b64encode(pickle.dumps(_torch_state())))
    fake = R.NodeDesc("gpuguard-rendezvous-x", 99, 0)
    state.wait_list.add(fake)
    state.last_heartbeats[fake] = datetime.now(timezone.utc)
    loaded = pickle.loads(base64.b64decode(R.encode_state(state)))  # what the agent does
    assert type(loaded) is _RendezvousState and loaded.round == 7
    assert _NodeDesc("gpuguard-rendezvous-x", 99, 0) in loaded.wait_list
    assert _NodeDesc("host-a", 11, 0) in loaded.participants
    # and it decodes back to the same thing
    again = R.decode_state(R.encode_state(state))
    assert again.to_json(now=datetime(2027, 1, 1, tzinfo=timezone.utc)) == state.to_json(
        now=datetime(2027, 1, 1, tzinfo=timezone.utc)
    )


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_malicious_pickle_is_refused():
    with pytest.raises(DataError, match="not allowed"):
        R.decode_state(base64.b64encode(pickle.dumps(_Evil())))
    with pytest.raises(DataError):
        R.decode_state(base64.b64encode(pickle.dumps({"round": 1})))
    with pytest.raises(DataError, match="base64"):
        R.decode_state(b"!!not base64!!")


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=400))
def test_garbage_never_crashes(data):
    for raw in (data, base64.b64encode(data)):
        try:
            state = R.decode_state(raw)
        except DataError:
            continue
        assert state is None or isinstance(state, R.RendezvousState)


@pytest.mark.parametrize(
    "argv,expected",
    [
        (
            [
                "/v/bin/python3",
                "/v/bin/torchrun",
                "--nnodes=1",
                "--rdzv-endpoint",
                "h:29500",
                "--rdzv_id=job7",
                "t.py",
                "--rdzv-id=trainer-arg",
            ],
            {"nnodes": "1", "rdzv_endpoint": "h:29500", "rdzv_id": "job7"},
        ),
        (["torchrun", "--standalone", "--nproc-per-node=4", "t.py"], {"standalone": "1"}),
        (
            ["python", "-m", "torch.distributed.run", "--rdzv-backend", "c10d", "--rdzv-endpoint=x:1", "t.py"],
            {"rdzv_backend": "c10d", "rdzv_endpoint": "x:1"},
        ),
        (["timeout", "60", "torchrun", "--rdzv-id=a", "t.py"], None),
        (["python", "train.py"], None),
    ],
)
def test_torchrun_cmdline(argv, expected):
    assert parse_torchrun_cmdline(argv) == expected


@given(st.binary(max_size=120))
def test_any_lease_value_is_live_or_takeable(raw):
    lease = R._parse_lease(raw)
    assert lease is None or (isinstance(lease["round"], int) and lease["expires"] > 0)
    assert R._parse_lease(R._lease_value("me", 3, 60))["round"] == 3
    assert R._parse_lease(R._lease_value("me", 3, -1)) is None  # expired: takeable
