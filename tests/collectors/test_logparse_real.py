"""Real log excerpts (shared/real-logs, odd-numbered files): each gives the events its INDEX row describes.

The expectations below were written by reading each file (line numbers, codes, PCI addresses, ranks,
sequence numbers, exit codes), not by running the parser. Every file is checked for the exact list of
(line, kind) - so nothing is invented - and for the fields of each event. Both the line parser and the
fast file scanner must agree.
"""

from __future__ import annotations

import io
import time

import pytest

from gpuguard.collectors.logparse import iter_events  # noqa: E402
from gpuguard.collectors.logscan import LogScan, iter_file_events  # noqa: E402
from tests.support.cli import REAL_LOGS

XID_13 = {"xid": 13, "pci_bus_id": "0000:cb:00.0", "pid": None, "process": None}
WT_055 = {"op": "ALLREDUCE", "timeout_ms": 1800000}

# file -> [(line, kind, fields that must match)]
EXPECTED: dict[str, list[tuple[int, str, dict]]] = {
    "001-xid.log": [
        (2, "xid", {**XID_13, "gpc": 7, "tpc": 7, "sm": 0, "severity": "warning"}),
        (3, "xid", XID_13),
        (4, "xid", XID_13),
        (
            5,
            "xid",
            {
                "xid": 109,
                "pci_bus_id": "0000:cb:00.0",
                "pid": 1797828,
                "process": "pt_main_thread",
                "channel": 8,
                "severity": "critical",
            },
        ),
    ],
    "003-xid.log": [(3, "gpu_lost", {"pci_bus_id": "0000:b3:00.0", "uptime_s": 1843.308145, "severity": "critical"})],
    "005-xid.log": [
        (1, "gpu_identity", {"pci_bus_id": "0000:08:00.0", "uuid": "GPU-UID"}),
        (2, "xid", {"xid": 31, "pci_bus_id": "0000:08:00.0", "pid": 169800, "process": "chrome", "channel": 0x23}),
        (3, "xid", {"xid": 31, "pci_bus_id": "0000:08:00.0", "pid": 174421, "process": "chrome"}),
    ],
    "007-xid.log": [
        (2, "gpu_identity", {"pci_bus_id": "0000:01:00.0", "uuid": "GPU-4e391288-897c-ba5d-6944-dfbea55ebcfa"}),
        (3, "gpu_identity", {"pci_bus_id": "0000:01:00.0", "serial": "0"}),
        (
            4,
            "xid",
            {
                "xid": 31,
                "pci_bus_id": "0000:01:00.0",
                "pid": 13705,
                "process": "UnrealEditor",
                "channel": 12,
                "uptime_s": 365.969681,
            },
        ),
    ],
    "009-xid.log": [
        (2, "xid", {"xid": 145, "pci_bus_id": None, "nvlink_unit": "RLW_RXPIPE", "nvlink_fatal": False, "link": 11}),
        (3, "xid", {"xid": 137, "pci_bus_id": None}),
    ],
    "011-xid.log": [
        *[
            (
                n,
                "xid",
                {
                    "xid": 45,
                    "pci_bus_id": "0000:61:00.0",
                    "pid": 1496200,
                    "process": "distprovers-gpu",
                    "channel": 0x9 + n,
                },
            )
            for n in range(1, 7)
        ],
        (7, "hung_task", {"task": "cache_mgr_event", "pid": 620917, "blocked_s": 120}),
    ],
    "013-xid.log": [
        (1, "gpu_identity", {"pci_bus_id": "0000:2b:00.0", "uuid": "GPU-0b11d014-1685-04bd-26ed-5fc0bc1c44ae"}),
        (2, "xid", {"xid": 79, "pci_bus_id": "0000:2b:00.0", "pid": None, "severity": "critical"}),
        (3, "gpu_lost", {"pci_bus_id": "0000:2b:00.0"}),
    ],
    "015-xid.log": [
        (
            1,
            "xid",
            {"xid": 149, "pci_bus_id": "0009:01:00.0", "link": 1, "nvlink_fatal": True, "uptime_s": 171167.620236},
        ),
        (2, "xid", {"xid": 154, "pci_bus_id": "0009:01:00.0", "recovery_action_from": 0, "recovery_action_to": 4}),
        (3, "xid", {"xid": 149, "pci_bus_id": "0008:01:00.0", "link": 1}),
        (4, "xid", {"xid": 154, "pci_bus_id": "0019:01:00.0", "recovery_action_from": 4, "recovery_action_to": 1}),
        (5, "xid", {"xid": 149, "pci_bus_id": "0009:01:00.0", "link": 0, "intr_info": "0x021405c6"}),
        (6, "xid", {"xid": 149, "pci_bus_id": "0009:01:00.0", "link": 15}),
        (7, "xid", {"xid": 149, "pci_bus_id": "0008:01:00.0", "link": 14}),
        (8, "xid", {"xid": 154, "pci_bus_id": "0018:01:00.0", "recovery_action": "gpu_reset"}),
        (9, "xid", {"xid": 154, "pci_bus_id": "0008:01:00.0", "recovery_action": "gpu_reset"}),
    ],
    "017-xid.log": [
        (1, "gpu_lost", {"pci_bus_id": "0000:01:00.0", "uptime_s": 269.516977}),
        (3, "xid", {"xid": 3, "pci_bus_id": "0000:01:00.0", "pid": None}),
    ],
    "019-ecc.log": [
        (1, "cuda_error", {"error": "uncorrectable ECC error encountered", "severity": "critical"}),
        (6, "cuda_error", {"error": "uncorrectable ECC error encountered", "rank": 1, "via_watchdog": True}),
    ],
    "021-ecc.log": [
        (1, "cuda_error", {"error": "uncorrectable ECC error encountered", "cuda_code": 39, "severity": "critical"})
    ],
    "023-ecc.log": [(1, "xid", {"xid": 63, "pci_bus_id": "0000:10:1c.0", "pid": 1896, "remap_pending": True})],
    "025-cuda.log": [
        (2, "cuda_error", {"error": "an illegal memory access was encountered", "rank": 2, "severity": "warning"})
    ],
    "027-cuda.log": [
        (1, "cuda_error", {"error": "an illegal memory access was encountered"}),
        (2, "watchdog_abort", {"rank": 0, "pg": 2}),
    ],
    "029-cuda.log": [(1, "xid", {"xid": 109, "pci_bus_id": "0000:01:00.0", "pid": 4124, "process": "python"})],
    "031-cuda.log": [
        (1, "cuda_error", {"error": "unspecified launch failure", "cuda_code": 4}),
        (3, "cuda_error", {"error": "unspecified launch failure", "cuda_code": 4}),
    ],
    "033-nccl.log": [
        (1, "nccl_warn", {"host": None, "ib_status": 12, "vendor_err": 129, "location": "transport/net_ib.cu:781"})
    ],
    "035-nccl.log": [
        (1, "nccl_warn", {"message": "Call to ibv_reg_mr_iova2 failed with error Cannot allocate memory"})
    ],
    "037-nccl.log": [
        (7, "nccl_warn", {"host": "hai-a100-3", "pid": 376586, "device": 2, "message": "Call to ibv_create_qp failed"})
    ],
    "039-nccl.log": [
        (1, "nccl_warn", {"host": "kp-ddp-worker-0", "pid": 3468, "ib_status": 12, "peer": "10.216.210.236<54862>"}),
        (6, "nccl_warn", {"host": "kp-ddp-worker-0", "ib_status": 12, "vendor_err": 129}),
    ],
    "041-nccl.log": [
        (1, "nccl_warn", {"host": "a100-st-p4d24xlarge-22", "pid": 183006, "device": 1}),
        (7, "nccl_warn", {"location": "proxy.cc:1119"}),
        (8, "nccl_warn", {"location": "misc/socket.cc:538"}),
    ],
    "043-nccl.log": [
        (1, "nccl_error", {"nccl_result": 6, "nccl_version": "2.18.5"}),
        (2, "nccl_error", {"result": "ncclRemoteError", "nccl_result": 6}),
    ],
    "045-nccl.log": [
        (1, "nccl_error", {"error": "unhandled system error", "nccl_result": 2}),
        (3, "nccl_error", {"result": "ncclSystemError"}),
    ],
    "047-nccl.log": [
        (1, "nccl_error", {"nccl_result": 1, "rank": 7, "nccl_version": "2.20.5"}),
        (2, "nccl_error", {"result": "ncclUnhandledCudaError", "rank": 7}),
        (4, "cuda_error", {"error": "invalid argument", "cuda_code": 1, "rank": 7}),
    ],
    "049-nccl.log": [(4, "nccl_error", {"result": "ncclInternalError", "nccl_result": 3})],
    "051-watchdog.log": [
        (
            1,
            "watchdog_timeout",
            {
                "seq": 1580,
                "op": "ALLREDUCE",
                "numel_in": 466119168,
                "numel_out": 466119168,
                "timeout_ms": 600000,
                "elapsed_ms": 600060,
                "rank": 0,
            },
        ),
        (2, "watchdog_timeout", {"seq": 1580, "elapsed_ms": 600067, "rank": 4}),
        (3, "watchdog_failure", {"seq": 1580, "last_enqueued": 1582, "last_completed": 1579, "rank": 0, "pg": 1}),
        (4, "watchdog_failure", {"seq": 1580, "rank": 3}),
    ],
    "053-watchdog.log": [
        (1, "watchdog_timeout", {"seq": 808, "numel_in": 9801523, "elapsed_ms": 600020, "rank": 1}),
        (
            2,
            "watchdog_failure",
            {"seq": 808, "last_enqueued": 811, "last_completed": 807, "rank": 1, "pg": 0, "pg_name": "default_pg"},
        ),
        (3, "watchdog_timeout", {"seq": 808, "elapsed_ms": 600030, "rank": 0}),
        (4, "watchdog_failure", {"seq": 808, "rank": 0}),
    ],
    "055-watchdog.log": [
        (1, "watchdog_timeout", {**WT_055, "seq": 96120, "elapsed_ms": 25624887, "rank": 0}),
        (2, "watchdog_timeout", {**WT_055, "seq": 96117, "elapsed_ms": 25625613, "rank": 0}),
        (3, "watchdog_timeout", {**WT_055, "seq": 96125, "elapsed_ms": 25625593, "rank": 0}),
        (4, "watchdog_timeout", {**WT_055, "seq": 96125, "rank": 0}),
        (5, "watchdog_timeout", {**WT_055, "seq": 64088, "elapsed_ms": 25625251, "rank": 7}),
    ],
    "057-watchdog.log": [
        (1, "watchdog_hang", {"rank": 1, "queued_work": 103}),
        (3, "watchdog_hang", {"rank": 1, "stuck_s": 600}),
        (4, "watchdog_hang", {"rank": 0, "queued_work": 84}),
        (5, "watchdog_hang", {"rank": 2, "queued_work": 103}),
    ],
    "059-watchdog.log": [(2, "watchdog_hang", {"stuck_s": 480}), (12, "watchdog_abort", {"rank": 6})],
    "061-watchdog.log": [
        (1, "watchdog_hang", {"rank": 0, "pg": 3, "queued_work": 121}),
        (2, "watchdog_hang", {"rank": 1}),
        (3, "watchdog_hang", {"rank": 7, "reason": "first process group without watchdog heartbeat"}),
        (4, "watchdog_hang", {"rank": 6}),
        (5, "watchdog_hang", {"rank": 6, "reason": "heartbeat monitor timed out"}),
        (6, "watchdog_hang", {"rank": 7}),
        (7, "watchdog_hang", {"rank": 2, "stuck_s": 600}),
    ],
    "063-watchdog.log": [
        (1, "watchdog_failure", {"seq": 1, "last_enqueued": 1, "last_completed": -1, "rank": 1}),
        (3, "watchdog_abort", {"rank": 1}),
        (
            4,
            "watchdog_timeout",
            {"seq": 1, "op": "COALESCED", "numel_in": None, "timeout_ms": 1800000, "elapsed_ms": 1800014, "rank": 1},
        ),
    ],
    "065-watchdog.log": [
        (2, "watchdog_failure", {"seq": 120049, "last_enqueued": 120051, "last_completed": 120048, "rank": 5}),
        (5, "watchdog_abort", {"rank": 3}),
    ],
    "067-gloo.log": [(1, "gloo_error", {"peer": "192.168.70.92:25266"})],
    "069-gloo.log": [(1, "gloo_error", {"op": "send", "timeout_ms": 1800000})],
    "071-gloo.log": [(3, "gloo_error", {"op": "recv", "timeout_ms": 1800000})],
    "073-torchrun.log": [
        (
            10,
            "worker_failure",
            {
                "rank": 1,
                "local_rank": 1,
                "exitcode": -6,
                "signal": "SIGABRT",
                "pid": 2385923,
                "host": "neptun.informatik.uni-kl.de",
            },
        ),
        (17, "worker_failure", {"rank": 2, "local_rank": 2, "exitcode": -6, "signal": "SIGABRT", "pid": 2385924}),
        (26, "worker_failure", {"rank": 0, "local_rank": 0, "exitcode": -6, "pid": 2385922, "root_cause": True}),
    ],
    "075-torchrun.log": [(1, "worker_failure", {"local_rank": 0, "exitcode": -9, "signal": "SIGKILL", "pid": 31631})],
    "077-torchrun.log": [
        (1, "worker_stop", {"pid": 5938, "signal": "SIGTERM"}),
        (2, "worker_failure", {"local_rank": 2, "exitcode": 1, "signal": None, "pid": 5939}),
    ],
    "079-torchrun.log": [
        (
            1,
            "rendezvous",
            {
                "phase": "complete",
                "restart_count": 0,
                "master_addr": "tristanr-arch2",
                "master_port": 48089,
                "group_rank": 0,
                "group_world_size": 2,
            },
        )
    ],
    "081-torchrun.log": [(1, "rendezvous_error", {}), (2, "worker_stop", {"pid": 3494, "signal": "SIGTERM"})],
    "083-torchrun.log": [(1, "rendezvous_error", {"endpoint": "192.0.0.1:1234"}), (2, "rendezvous_error", {})],
    "085-torchrun.log": [
        (1, "rendezvous_error", {"endpoint": "::ffff:0.104.99.143:47389", "errno": 110}),
        (2, "rendezvous_error", {"errno": 110}),
        (3, "rendezvous_error", {"endpoint": "0.104.99.143:47389", "errno": 110}),
        (4, "rendezvous_error", {}),
    ],
    "087-torchrun.log": [(1, "rendezvous", {"phase": "start"})],
    "089-other.log": [(1, "config_error", {}), (2, "config_error", {})],
    "091-other.log": [(2, "cuda_error", {"error": "CUDA-capable device(s) is/are busy or unavailable"})],
    "093-other.log": [(1, "xid", {"xid": 69, "gpu_uuid": "GPU-7540a9b3-eeb9-1214-1526-f93c9ea826a8"})],
    "095-other.log": [
        (1, "cuda_error", {"error": "no CUDA-capable device is detected"}),
        (2, "cuda_error", {"error": "no CUDA-capable device is detected"}),
        (3, "gpu_lost", {"pci_bus_id": "0000:03:00.0"}),
    ],
    "097-other.log": [(2, "host_hw_error", {"hw_severity": "recoverable"})],
    "099-other.log": [(2, "driver_error", {"error": "Driver/library version mismatch", "severity": "critical"})],
    "101-other.log": [
        (1, "pcie_degraded", {"pci_bus_id": "0000:04:00.0", "limited_at": "0000:01:00.0", "uptime_s": 10.735323}),
        (3, "pcie_degraded", {"pci_bus_id": "0000:8b:00.0"}),
    ],
}

FAILURE_KINDS = {"worker_failure", "worker_restart", "worker_group_failed", "rendezvous_error"}


def test_every_odd_numbered_real_log_has_expectations():
    files = sorted(p.name for p in REAL_LOGS.glob("*.log") if int(p.name[:3]) % 2 == 1)
    assert files == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_log_events(name):
    path = REAL_LOGS / name
    with open(path, "rb") as fh:
        events = list(iter_events(fh, source=name))
    assert [(e.line, e.kind) for e in events] == [(line, kind) for line, kind, _ in EXPECTED[name]]
    for event, (_, _, fields) in zip(events, EXPECTED[name]):
        doc = event.to_json()
        for key, value in fields.items():
            assert doc.get(key, "<missing>") == value, (name, event.line, key, doc)
        assert event.diagnosis
        assert event.severity in ("info", "warning", "critical")
    fast = [e.to_json() for e in iter_file_events(path, source=name)]
    assert fast == [e.to_json() for e in events]


@pytest.mark.parametrize("name", ["079-torchrun.log", "087-torchrun.log"])
def test_healthy_torchrun_lines_give_no_failure(name):
    with open(REAL_LOGS / name, "rb") as fh:
        events = list(iter_events(fh))
    assert events and not [e for e in events if e.kind in FAILURE_KINDS or e.severity != "info"]


def test_absolute_timestamps_from_real_prefixes(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        with open(REAL_LOGS / "001-xid.log", "rb") as fh:  # dmesg -T: [Fri Aug 30 11:43:14 2024]
            last = list(iter_events(fh))[-1]
        assert last.timestamp == 1725018194.0
        with open(REAL_LOGS / "077-torchrun.log", "rb") as fh:  # [2024-05-08 08:47:31,877]
            assert list(iter_events(fh))[-1].timestamp == pytest.approx(1715158051.877)
        with open(REAL_LOGS / "017-xid.log", "rb") as fh:  # syslog without a year, given one
            ev = list(iter_events(fh, year=2020))[0]
        assert ev.timestamp == 1579347485.0 and ev.fields["uptime_s"] == 269.516977
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_scanner_cursor_resumes_at_the_next_line():
    data = (REAL_LOGS / "015-xid.log").read_bytes()
    half = data.index(b"\n", len(data) // 2) + 1
    first = LogScan(io.BytesIO(data[:half]))
    head = list(first)
    assert first.offset == half
    rest = list(LogScan(io.BytesIO(data), start_offset=first.offset, start_line=first.next_line))
    whole = list(iter_file_events(io.BytesIO(data)))
    assert [e.to_json() for e in head + rest] == [e.to_json() for e in whole]
