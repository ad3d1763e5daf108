"""Every line format of docs/log-formats.md (kernel driver, communication and launcher lines) that the
real-log fixtures do not already cover, plus the timestamp prefixes (dmesg, dmesg -T, syslog, journalctl
short-iso, ISO-8601, glog, Talos)."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.collectors.logparse import iter_events, parse_line
from gpuguard.collectors.logrules_kernel import normalize_pci
from gpuguard.collectors.logtime import line_time, utc


@pytest.mark.parametrize(
    "line, fields",
    [
        # very old drivers: no `PCI:` prefix
        ("NVRM: Xid (0000:03:00): 14, Channel 00000001", {"xid": 14, "pci_bus_id": "0000:03:00.0", "pid": None}),
        # old: no pid/name
        (
            "NVRM: Xid (PCI:0000:01:00): 32, Channel ID 00000005 intr 00008000",
            {"xid": 32, "pid": None, "process": None},
        ),
        # pid unknown (interrupt context)
        (
            "NVRM: Xid (PCI:0000:a1:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
            {"xid": 79, "pci_bus_id": "0000:a1:00.0", "pid": None, "process": None, "severity": "critical"},
        ),
        # non-zero PCI domain, GSP timeout with the RPC text
        (
            "NVRM: Xid (PCI:0001:6c:00): 119, pid=10200, name=NvmlTaskRunner, Timeout after 45s of waiting for RPC response "
            "from GPU5 GSP! Expected function 76 (GSP_RM_CONTROL) sequence 24174 (0x20801322 0x808).",
            {
                "xid": 119,
                "pci_bus_id": "0001:6c:00.0",
                "pid": 10200,
                "process": "NvmlTaskRunner",
                "severity": "critical",
            },
        ),
        # upper-case hex from an injection test, NVLink error
        (
            "NVRM: Xid (PCI:0000:D8:00): 74, pid='<unknown>', name=<unknown>, NVLink: fatal error detected on link 14(0x100000, 0x0)",
            {"xid": 74, "pci_bus_id": "0000:d8:00.0"},
        ),
        # sympathetic 45 naming its cause
        (
            "NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149",
            {"xid": 45, "caused_by": 149, "channel": 1, "severity": "info"},
        ),
        # contained ECC error
        (
            "NVRM: Xid (PCI:0000:9b:00): 94, pid=1234, name=python3, Contained ECC error",
            {"xid": 94, "severity": "warning"},
        ),
        # unknown future code: needs review, never info
        (
            "NVRM: Xid (PCI:0000:9b:00): 999, something new",
            {"xid": 999, "severity": "warning", "catalog_severity": "review"},
        ),
        # Talos prefix
        (
            "192.168.11.119: kern: warning: [2026-04-22T21:27:51.291660856Z]: NVRM: Xid (PCI:0000:01:00): 62, pid=1, name=x, PMU halt",
            {"xid": 62, "timestamp": pytest.approx(utc(2026, 4, 22, 21, 27, 51) + 0.291660)},
        ),
    ],
)
def test_xid_line_variants(line, fields):
    ev = parse_line(line, 3)
    assert ev is not None and ev.kind == "xid" and ev.line == 3
    doc = ev.to_json()
    for key, value in fields.items():
        assert doc.get(key, "<missing>") == value, (key, doc)


@pytest.mark.parametrize(
    "line, kind, fields",
    [
        (
            "nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up",
            "sxid",
            {"sxid": 20034, "pci_bus_id": "0000:06:00.0", "fatal": True, "severity": "critical"},
        ),
        (
            "nvidia-nvswitch3: SXid (PCI:0000:88:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error",
            "sxid",
            {"sxid": 12028, "fatal": False, "severity": "warning"},
        ),
        ("NVRM: GPU 0000:2b:00.0: GPU has fallen off the bus.", "gpu_lost", {"pci_bus_id": "0000:2b:00.0"}),
        ("NVRM: GPU at 0000:01:00.0 has fallen off the bus.", "gpu_lost", {"pci_bus_id": "0000:01:00.0"}),
        (
            "NVRM: nvAssertOkFailedNoLog: Assertion failed: Reset required [NV_ERR_RESET_REQUIRED] (0x00000062) returned from "
            "_kgspRpcRecvPoll",
            "gpu_reset_required",
            {"severity": "critical"},
        ),
        (
            "gpu-bql-144-103:18553:18611 [0] include/socket.h:360 WARN Call to connect failed : Connection timed out",
            "nccl_warn",
            {"host": "gpu-bql-144-103", "pid": 18553, "device": 0},
        ),
        (
            "[0] node0:13571:13571 [0] transport/net_ib.cc:1295 (ncclIbTest) NCCL WARN NET/IB : Got completion from peer "
            "10.0.0.2<45763> with error 4, opcode 1, len 21938, vendor err 81",
            "nccl_warn",
            {"host": "node0", "ib_status": 4, "ib_status_name": "LOC_PROT_ERR", "vendor_err": 81},
        ),
        (
            "[rank3]:[E ProcessGroupNCCL.cpp:1182] [Rank 1] Work WorkNCCL(SeqNum=2521, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
            "Timeout(ms)=1000) timed out in blocking wait.",
            "watchdog_timeout",
            {"seq": 2521, "op": "ALLREDUCE", "timeout_ms": 1000, "elapsed_ms": None, "rank": 1, "blocking_wait": True},
        ),
        (
            "[PG ID 12 PG GUID 99(EXPERT_MODEL_PARALLEL_GROUP) Rank 4] Exception (either an error or timeout) detected by "
            "watchdog at work: 5, last enqueued NCCL work: 6, last completed NCCL work: 4.",
            "watchdog_failure",
            {"seq": 5, "rank": 4, "pg": 12, "pg_name": "EXPERT_MODEL_PARALLEL_GROUP"},
        ),
        (
            "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:10895",
            "gloo_error",
            {"peer": "127.0.0.1:10895"},
        ),
        (
            "E0801 13:23:20.000000 32974 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: -11) "
            "local_rank: 3 (pid: 33054) of binary: /usr/bin/python",
            "worker_failure",
            {"local_rank": 3, "exitcode": -11, "signal": "SIGSEGV"},
        ),
        (
            "[default] Worker group FAILED. 3/3 attempts left; will restart worker group",
            "worker_restart",
            {"attempts_left": 3, "max_restarts": 3},
        ),
        (
            "INFO:torch.distributed.elastic.rendezvous.dynamic_rendezvous:The node 'n1_1_0' has joined round 2 of the "
            "rendezvous 'job' as rank 1 in a world of size 2.",
            "rendezvous",
            {"phase": "joined", "round": 2, "group_rank": 1, "group_world_size": 2},
        ),
        ("Timed out after 901 seconds waiting for clients. 1/2 clients joined", "rendezvous_error", {}),
        (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
            "cuda_error",
            {"error": "CUDA out of memory", "cuda_code": 2, "severity": "warning"},
        ),
        ("RuntimeError: CUDA error: unknown error", "cuda_error", {"error": "unknown error", "severity": "critical"}),
        (
            "CUDA_ERROR_ECC_UNCORRECTABLE",
            "cuda_error",
            {"error": "CUDA_ERROR_ECC_UNCORRECTABLE", "severity": "critical"},
        ),
    ],
)
def test_other_line_formats(line, kind, fields):
    ev = parse_line(line, 1)
    assert ev is not None and ev.kind == kind, ev
    doc = ev.to_json()
    for key, value in fields.items():
        assert doc.get(key, "<missing>") == value, (key, doc)


def test_multi_line_fallen_off_bus_only_joins_adjacent_lines():
    lines = [
        "NVRM: The NVIDIA GPU 0000:b3:00.0",
        "NVRM: (PCI ID: 10de:26b5) installed in this system has",
        "NVRM: fallen off the bus and is not responding to commands.",
    ]
    assert [e.fields["pci_bus_id"] for e in iter_events(lines)] == ["0000:b3:00.0"]
    far = [lines[0], *["x"] * 5, lines[2]]
    assert [e.fields["pci_bus_id"] for e in iter_events(far)] == [None]
    assert parse_line(lines[2], 1).fields["pci_bus_id"] is None  # alone: the GPU is unknown, still GPU lost


def test_rendezvous_result_block_collects_its_values_and_flushes_at_end():
    lines = [
        "[default] Rendezvous complete for workers. Result:",
        "  restart_count=1",
        "  master_addr=h0",
        "  master_port=29500",
        "  group_rank=1",
        "  group_world_size=2",
    ]
    evs = list(iter_events(lines))
    assert [(e.line, e.kind) for e in evs] == [(1, "rendezvous")]
    assert evs[0].fields["restart_count"] == 1 and evs[0].fields["group_world_size"] == 2
    two = list(iter_events(lines + lines))
    assert [e.line for e in two] == [1, 7]


@pytest.mark.parametrize(
    "text, pci",
    [
        ("PCI:0000:CB:00", "0000:cb:00.0"),
        ("0000:01:00", "0000:01:00.0"),
        ("00000000:10:1C.0", "0000:10:1c.0"),
        ("01:00.0", "0000:01:00.0"),
        ("0009:01:00", "0009:01:00.0"),
        ("...", None),
        ("", None),
    ],
)
def test_normalize_pci(text, pci):
    assert normalize_pci(text) == pci


@given(
    st.integers(0, 0xFFFF),
    st.integers(0, 0xFF),
    st.integers(0, 0x1F),
    st.integers(0, 7),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
@settings(max_examples=50, deadline=None)
def test_normalize_pci_round_trip(dom, bus, dev, fn, prefix, upper, with_fn):
    text = f"{dom:04x}:{bus:02x}:{dev:02x}" + (f".{fn}" if with_fn else "")
    text = ("PCI:" if prefix else "") + (text.upper() if upper else text)
    assert normalize_pci(text) == f"{dom:04x}:{bus:02x}:{dev:02x}.{fn if with_fn else 0}"


@given(st.text(max_size=40))
@settings(max_examples=50, deadline=None)
def test_normalize_pci_never_raises(text):
    out = normalize_pci(text)
    assert out is None or (out.count(":") == 2 and out == out.lower() and out[-2] == ".")


def test_timestamp_prefixes(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        assert line_time("[ 1843.308145] NVRM: x") == (None, 1843.308145)
        assert line_time("[Fri Aug 30 11:11:22 2024] NVRM: x") == (utc(2024, 8, 30, 11, 11, 22), None)
        assert line_time("Nov 29 08:22:38 host kernel: NVRM: x", year=2025) == (utc(2025, 11, 29, 8, 22, 38), None)
        assert line_time("Dec 23 23:30:56 rescue kernel: [ 179.437927] NVRM", year=2024) == (
            utc(2024, 12, 23, 23, 30, 56),
            179.437927,
        )
        assert line_time("2024-11-29T08:22:38+0100 host kernel: NVRM: x")[0] == utc(2024, 11, 29, 7, 22, 38)
        assert line_time("2024-11-29T08:22:38.5+01:00 host kernel: x")[0] == utc(2024, 11, 29, 7, 22, 38) + 0.5
        assert line_time("[2024-05-08 08:47:31,877] torch")[0] == pytest.approx(utc(2024, 5, 8, 8, 47, 31) + 0.877)
        assert line_time("[rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607]", year=2025)[0] == pytest.approx(
            utc(2025, 3, 21, 2, 7, 8) + 0.408271
        )
        assert line_time("[1668693503.473099] [ampere:1:0] UCX")[0] == 1668693503.473099
        assert line_time("no time here") == (None, None)
        assert line_time("Feb 31 99:99:99 nonsense") == (None, None)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


@pytest.mark.parametrize(
    "line",
    [
        "mlx5_core 0000:01:00.0: Reset required",  # another driver's reset
        "2024-01-01 12:00:00 WARN  o.a.k.c.NetworkClient - connection lost",  # a Java WARN, not NCCL
        "[I socket.cpp:480] [c10d] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
        '  File "/opt/torch/lib/third_party/gloo/gloo/allreduce.py", line 12, in run',
        "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.",
        "hai-a100-3:376586:377443 [4] NCCL INFO external/nccl_archive/src/init.cc:310 -> 2",
        "[default] worker group successfully finished. Waiting 300 seconds for other agents to finish.",
        "I0601 20:17:03.073000 616467 api.py:677] [default] Starting worker group",
        "Driver Version                            : 510.73.08",
        "exitcode handling enabled for local_rank workers",
    ],
)
def test_look_alike_lines_are_not_events(line):
    assert parse_line(line, 1) is None
