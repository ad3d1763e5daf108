"""The Xid catalog: every documented code, severities, Xid 154 authority, sympathetic codes, NVLink5 decode."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.foundation import gpu_faults
from gpuguard.foundation import xid_catalog as catalog
from gpuguard.foundation.events import Event


def xid(code: int, **fields) -> Event:
    return Event("xid", 1, "", {"xid": code, **fields})


def test_every_code_from_1_to_172_is_documented():
    assert set(catalog.all_codes()) == set(range(1, 173))
    for code in catalog.all_codes():
        info = catalog.lookup(code)
        assert info.known and info.meaning and info.category and info.action
        assert info.severity in catalog.SEVERITIES


@pytest.mark.parametrize(
    "code, severity, immediate",
    [
        (13, "warning", "RESTART_APP"),  # graphics engine exception: the app
        (31, "warning", "RESTART_APP"),  # MMU fault
        (48, "drain", "WORKFLOW_XID_48"),  # double-bit ECC
        (63, "info", "IGNORE"),  # row remap recorded
        (64, "reset", "RESET_GPU"),  # remap failure
        (79, "drain", "RESTART_BM"),  # fallen off the bus
        (94, "warning", "RESTART_APP"),  # contained ECC
        (95, "reset", "RESET_GPU"),  # uncontained ECC
        (109, "reset", "RESET_GPU"),
        (119, "reset", "RESET_GPU"),  # GSP RPC timeout
        (54, "drain", "CHECK_MECHANICALS"),
        (151, "drain", "RESTART_VM"),
    ],
)
def test_catalog_buckets_map_to_gpuguard_severity(code, severity, immediate):
    info = catalog.lookup(code)
    assert (info.severity, info.immediate) == (severity, immediate)


def test_unused_codes_keep_legacy_meaning_and_need_review():
    info = catalog.lookup(3)
    assert info.immediate == "CONTACT_SUPPORT" and info.severity == "review"
    assert "push buffer" in info.meaning


@given(st.integers(min_value=173, max_value=10**6) | st.integers(max_value=0))
@settings(max_examples=50, deadline=None)
def test_unknown_codes_need_review_never_healthy(code):
    info = catalog.lookup(code)
    assert not info.known
    assert info.severity == "review"
    assert catalog.event_severity(info.severity) != "info"
    assert catalog.resolution_for([xid(code)]).severity == "review"


def test_xid154_parsing_and_authority():
    change = catalog.parse_xid154("GPU recovery action changed from 0x4 (Drain and Reset) to 0x1 (GPU Reset Required)")
    assert change is not None
    before, after = change
    assert (before.code, before.name, after.code, after.name) == (4, "drain_and_reset", 1, "gpu_reset")
    assert after.severity == "reset"
    # A drain-level Xid before the 154 is covered by the driver's (authoritative) action.
    res = catalog.resolution_for([xid(48), xid(154, recovery_action_to=1)])
    assert res.severity == "reset" and res.recovery_action == "gpu_reset"
    # 154 back to None: recovered.
    res = catalog.resolution_for([xid(149, nvlink_severity="reset"), xid(154, recovery_action_to=0)])
    assert res.severity == "info" and res.recovery_action == "none"
    # Something that happens after the last 154 still counts.
    res = catalog.resolution_for([xid(154, recovery_action_to=0), Event("gpu_lost", 2, "", {"pci_bus_id": None})])
    assert res.severity == "drain"
    # Node reboot from the driver is a drain.
    assert catalog.resolution_for([xid(154, recovery_action_to=2)]).severity == "drain"


def test_sympathetic_codes_attach_to_their_primary():
    res = catalog.resolution_for([xid(149, nvlink_severity="reset"), xid(45, caused_by=149)])
    assert res.primary == (149,) and (45, 149) in res.sympathetic and res.severity == "reset"
    res = catalog.resolution_for([xid(48), xid(172)])
    assert res.primary == (48,) and (172, 48) in res.sympathetic
    # A solo 45 keeps its own severity (restart the app), it is not silently dropped.
    solo = catalog.resolution_for([xid(45)])
    assert solo.primary == (45,) and solo.severity == "warning"
    # Every Xid after the GPU fell off the bus is an echo of the loss.
    lost = catalog.resolution_for([Event("gpu_lost", 1, "", {}), xid(3)])
    assert lost.primary == (79,) and (3, 79) in lost.sympathetic and lost.severity == "drain"


def test_no_events_is_healthy_and_other_kinds_are_ignored():
    assert catalog.resolution_for([]).severity == "info"
    assert catalog.resolution_for([Event("nccl_warn", 1, "", {})]).severity == "info"


def test_nvlink5_decode():
    dec = catalog.decode_nvlink5("NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 (0x021425c6 0x00000000 0x00000000)")
    assert dec is not None
    assert (dec["unit"], dec["fatal"], dec["link"], dec["severity"]) == ("NETIR_LINK_EVT", True, 1, "reset")
    assert dec["subcode_v2"] == 0x021425C6 & 0x7F and dec["subcode_v1"] == (0x021425C6 >> 5) & 0x1F
    benign = catalog.decode_nvlink5("RLW_RXPIPE Nonfatal XC0 i0 Link 11 (...)")
    assert benign is not None and benign["severity"] == "info" and "intr_info" not in benign
    assert catalog.decode_nvlink5("no structured payload") is None


def test_severity_scale_is_ordered():
    assert catalog.worst(["info", "drain", "warning"]) == "drain"
    assert catalog.worst(["reset", "review"]) == "reset"
    assert [catalog.event_severity(s) for s in catalog.SEVERITIES] == [
        "info",
        "warning",
        "warning",
        "critical",
        "critical",
    ]


ACTION_NAMES = {0: "None", 1: "GPU Reset Required", 2: "Node Reboot Required", 3: "Drain P2P", 4: "Drain and Reset"}


@given(st.sampled_from(sorted(ACTION_NAMES)), st.sampled_from(sorted(ACTION_NAMES)), st.booleans())
@settings(max_examples=30, deadline=None)
def test_xid154_round_trip(before, after, hex_form):
    fmt = (lambda c: f"0x{c:x}") if hex_form else str
    line = f"GPU recovery action changed from {fmt(before)} ({ACTION_NAMES[before]}) to {fmt(after)} ({ACTION_NAMES[after]})"
    change = catalog.parse_xid154(line)
    assert change is not None
    assert (change[0].code, change[1].code) == (before, after)
    assert change[1].printed == ACTION_NAMES[after]


@given(st.text(max_size=200))
@settings(max_examples=30, deadline=None)
def test_payload_parsers_never_raise_on_garbage(text):
    catalog.parse_xid154(text)
    catalog.decode_nvlink5(text)


@given(
    st.sampled_from(["NETIR_LINK_EVT", "RLW_RXPIPE", "SAW_MVB", "MSE_WATCHDOG", "NETIR_BER_EVENT"]),
    st.booleans(),
    st.integers(min_value=-1, max_value=63),
    st.integers(min_value=0, max_value=2**32 - 1),
)
@settings(max_examples=30, deadline=None)
def test_nvlink5_round_trip(unit, fatal, link, intr):
    text = f"{unit}  {'Fatal' if fatal else 'Nonfatal'}   XC0 i0 Link {link:02d} (0x{intr:08x} 0x00000000 0x0)"
    dec = catalog.decode_nvlink5(text)
    assert dec is not None
    assert (dec["unit"], dec["fatal"], dec["link"], dec["intr_info"]) == (unit, fatal, link, f"0x{intr:08x}")
    assert dec["severity"] == "reset" if fatal else dec["severity"] in ("info", "warning")


codes = st.sampled_from([13, 31, 43, 45, 48, 63, 64, 79, 94, 95, 109, 119, 149, 171, 172, 999])


@given(st.lists(codes, max_size=8), st.sampled_from(sorted(catalog.RECOVERY_ACTIONS)))
@settings(max_examples=30, deadline=None)
def test_last_xid154_decides_when_nothing_follows(history, action):
    res = catalog.resolution_for([xid(c) for c in history] + [xid(154, recovery_action_to=action)])
    assert res.severity == catalog.RECOVERY_ACTIONS[action][1]


@given(st.lists(codes, min_size=1, max_size=8), codes)
@settings(max_examples=30, deadline=None)
def test_an_echo_never_raises_the_severity(history, primary):
    base = catalog.resolution_for([xid(c) for c in history] + [xid(primary)])
    echoed = catalog.resolution_for([xid(c) for c in history] + [xid(primary), xid(45, caused_by=primary)])
    assert catalog.severity_rank(echoed.severity) <= catalog.severity_rank(base.severity)


def test_resolution_buckets_per_code_with_their_source():
    assert {c: catalog.lookup(c).resolution for c in (13, 46, 63, 79, 48, 5, 154)} == {
        13: "restart_app",
        46: "reset_gpu",
        63: "ignore",
        79: "reboot_node",
        48: "reboot_node",
        5: "contact_support",
        154: "ignore",
    }
    assert catalog.lookup(13).source.startswith("NVIDIA Xid catalog")
    assert catalog.lookup(171).source.startswith("gpuguard") and "Xid 48" in catalog.lookup(171).source
    assert all(catalog.lookup(c).resolution in catalog.RESOLUTIONS for c in catalog.all_codes())
    assert all(f.resolution in catalog.RESOLUTIONS and f.source for f in gpu_faults.FAULTS.values())
    assert gpu_faults.fault("no_such_fault").severity == "review"


def test_calibration_pending_remap_drain_and_reset_contained_ecc():
    assert catalog.xid_severity(63, {"remap_pending": True}) == "reset"
    assert catalog.xid_severity(63, {}) == "info"
    assert catalog.resolution_for([xid(154, recovery_action_to=4)]).severity == "drain"  # Drain and Reset
    assert catalog.resolution_for([xid(154, recovery_action_to=3)]).severity == "drain"  # Drain P2P
    assert catalog.lookup(95).severity == "reset" and "ROW_REMAPPER" in catalog.lookup(94).action


def test_a_sympathetic_code_naming_its_primary_counts_the_primary():
    res = catalog.resolution_for([xid(45, caused_by=149), xid(45, caused_by=149)])
    assert res.severity == "reset" and res.inferred == (149,) and "inferred Xid 149" in res.reason
    # the primary in the log: it is judged itself, nothing inferred
    res = catalog.resolution_for([xid(48), xid(45, caused_by=48)])
    assert res.inferred == () and res.severity == "drain"


def test_unreadable_codes_need_review():
    res = catalog.resolution_for([Event("xid", 1, "", {"xid": None, "xid_raw": "0x1f"})])
    assert res.severity == "review" and "0x1f" in res.reason


def test_incidents_are_gpu_code_pid_and_time_window():
    def ev(line, pid=7, ts=None, code=13):
        return Event("xid", line, "", {"xid": code, "pci_bus_id": "0000:3b:00.0", "pid": pid}, timestamp=ts)

    assert catalog.count_incidents([ev(n, ts=1000.0 + n * 0.1) for n in range(8)]) == 1
    assert catalog.count_incidents([ev(n) for n in range(8)]) == 1  # untimed, adjacent
    assert catalog.count_incidents([ev(n, pid=n) for n in range(5)]) == 5
    assert catalog.count_incidents([ev(1, ts=0.0), ev(2, ts=60.0)]) == 2
