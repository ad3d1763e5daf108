"""Which host a replayed log's lines name (`collectors.loghost`): syslog and journal host fields, NCCL's
host prefix; nothing invented from lines that name none."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.collectors.loghost import describe, hosts, syslog_host
from gpuguard.foundation.events import Event


@pytest.mark.parametrize(
    "line,host",
    [
        ("Nov 29 08:22:38 gpu-node-17 kernel: NVRM: Xid (PCI:0000:3b:00): 79, ...", "gpu-node-17"),
        ("Mar  5 01:02:03 dgx-a100-07 nvidia-persistenced[2210]: device 0000:07:00.0 ...", "dgx-a100-07"),
        ("2024-11-29T08:22:38+0000 gpu-node-17 kernel: NVRM: ...", "gpu-node-17"),
        ("<4>Nov  9 08:22:38 n1 kernel: pcieport 0000:00:02.0: AER: ...", "n1"),
        ("Mar 21 21:42:01 kernel: NVRM: GPU0 _kgspRpcRecvPoll: GSP RM heartbeat timed out", None),  # --no-hostname
        ("[74785.660366] pcieport 0000:00:02.0: AER: Corrected error received: id=0010", None),  # dmesg
        ("[Fri Aug 30 11:43:09 2024] NVRM: Xid (PCI:0000:cb:00): 13, ...", None),  # dmesg -T
    ],
)
def test_syslog_host(line, host):
    assert syslog_host(line) == host


def test_hosts_most_named_first_and_described():
    events = [
        Event("xid", 1, "Nov 29 08:22:38 a kernel: NVRM: Xid"),
        Event("xid", 2, "Nov 29 08:22:39 b kernel: NVRM: Xid"),
        Event("xid", 3, "Nov 29 08:22:40 b kernel: NVRM: Xid"),
        Event("nccl_warn", 4, "b:1:2 [0] NCCL WARN x", {"host": "b"}),
    ]
    assert hosts(events) == ["b", "a"]
    assert describe(["b", "a"]) == "b, a (several hosts)"
    assert describe(["b"]) == "b" and describe([]) == "host unknown"


@given(st.text(max_size=200))
def test_any_line_gives_a_plain_host_or_none(text):
    host = syslog_host(text)
    assert host is None or (host[:1].isalnum() and " " not in host and not host.endswith(":"))
