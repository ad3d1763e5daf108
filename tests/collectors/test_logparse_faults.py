"""GPU faults without an Xid, old and odd Xid formats, hardware causes in application errors (issue 14).

The lines are the real forms (public bug threads, tests/data/heldout/expectations.yaml names them);
property tests cover what a parser change must never do: drop an odd code, read a non-ASCII digit
as a code, or give the fast scanner and the line parser different events.
"""

from __future__ import annotations

import io

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.collectors.logparse import iter_events, parse_line
from gpuguard.collectors.logrules_kernel import normalize_pci
from gpuguard.collectors.logscan import LogScan
from gpuguard.foundation import xid_catalog as catalog


def _one(text: str):
    ev = parse_line(text, 1)
    assert ev is not None, text
    return ev


def test_init_failures_name_the_gpu():
    ev = _one("[  885.242168] NVRM: GPU 0000:0a:00.0: RmInitAdapter failed! (0x24:0x72:1568)")
    assert (ev.kind, ev.fields["fault"], ev.fields["pci_bus_id"]) == ("gpu_fault", "init_failed", "0000:0a:00.0")
    assert ev.fields["init_code"] == "0x24:0x72:1568" and ev.severity == "critical"
    ev = _one("[  885.242457] NVRM: GPU 0000:0a:00.0: rm_init_adapter failed, device minor number 5")
    assert ev.fields["minor"] == 5 and ev.fields["fault"] == "init_failed"
    assert _one("No devices were found").fields == {
        "fault": "init_failed",
        "pci_bus_id": None,
        "message": ("nvidia-smi: No devices were found"),
    }
    ev = _one("Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error")
    assert (ev.fields["fault"], ev.fields["pci_bus_id"]) == ("unreachable", "0000:3b:00.0")
    # "GPU is lost" stays the GPU-lost event (Xid 79 equivalent)
    assert _one("Unable to determine the device handle for GPU 0000:3B:00.0: GPU is lost").kind == "gpu_lost"


def test_pcie_aer_on_the_gpu_and_on_its_port():
    ev = _one("[ 8921.442103] pcieport 0000:3a:00.0: AER: Uncorrected (Non-Fatal) error received: 0000:3b:00.0")
    assert ev.fields == {
        "fault": "pcie_nonfatal",
        "pci_bus_id": "0000:3a:00.0",
        "device": "port",
        "error_source": "0000:3b:00.0",
        "uptime_s": 8921.442103,
    }
    ev = _one("pcieport 0000:00:02.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer, id=0010")
    assert ev.fields["fault"] == "pcie_fatal" and ev.severity == "critical"
    ev = _one("nvidia 0000:07:00.0: PCIe Bus Error: severity=Correctable, type=Data Link Layer, (Transmitter ID)")
    assert (ev.fields["fault"], ev.fields["device"], ev.severity) == ("pcie_corrected", "gpu", "info")
    assert _one("nvidia 0000:03:00.0: AER: can't recover (no error_detected callback)").fields["fault"] == "pcie_fatal"
    # other devices' AER lines (audio function, USB) are not GPU evidence
    assert parse_line("snd_hda_intel 0000:03:00.1: AER: can't recover (no error_detected callback)", 1) is None
    assert parse_line("xhci_hcd 0000:97:00.0: PCIe Bus Error: severity=Uncorrectable (Non-Fatal)", 1) is None


def test_fabric_manager_failures():
    ev = _one("systemd[1]: nvidia-fabricmanager.service: Control process exited, code=exited, status=1/FAILURE")
    assert ev.fields["fault"] == "fabric_manager" and ev.severity == "warning"
    ev = _one(
        "nv-fabricmanager[4177]: request to query NVSwitch device information from NVSwitch driver failed with "
        "error:WARNING Nothing to do [NV_WARN_NOTHING_TO_DO]"
    )
    assert ev.severity == "info" and "not needed" in ev.diagnosis
    assert parse_line("systemd[1]: Starting NVIDIA fabric manager service...", 1) is None


def test_old_xid_formats_without_the_pci_prefix():
    ev = _one("kernel: NVRM: Xid (0003:00): 8, Channel 00000001")
    assert (ev.fields["xid"], ev.fields["pci_bus_id"]) == (8, "0000:03:00.0")
    ev = _one("kernel: NVRM: Xid (0000:03:00): 13, 0001 00000000 000090c0 00001b0c 00000000 00000000")
    assert (ev.fields["xid"], ev.fields["pci_bus_id"]) == (13, "0000:03:00.0")


def test_pending_remap_and_drain_and_reset_calibration():
    ev = _one(
        "NVRM: Xid (PCI:0000:4e:00): 63, pid=244061, name=python, Row Remapper: New row marked for remapping, reset gpu to activate."
    )
    assert ev.fields["remap_pending"] is True and ev.fields["catalog_severity"] == "reset"
    ev = _one("NVRM: Xid (PCI:0000:c1:00): 154, GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)")
    assert ev.fields["catalog_severity"] == "drain"


def test_hardware_causes_inside_application_errors():
    ev = _one("[rank5]: RuntimeError: CUDA error: uncorrectable ECC error encountered")
    assert (ev.kind, ev.fields["fault"], ev.fields["rank"], ev.severity) == (
        "cuda_error",
        "ecc_uncorrectable",
        5,
        "critical",
    )
    assert "nvidia-smi -q -d ECC,ROW_REMAPPER" in ev.diagnosis
    ev = _one(
        "[Rank 2] NCCL watchdog thread terminated with exception: CUDA error: uncorrectable NVLink error detected during the execution"
    )
    assert ev.fields["fault"] == "nvlink_uncorrectable" and "nvidia-smi nvlink -e" in ev.diagnosis
    ev = _one("node1:123:456 [0] transport.cc:100 NCCL WARN Cuda failure 'uncorrectable ECC error encountered'")
    assert ev.kind == "nccl_warn" and ev.fields["fault"] == "ecc_uncorrectable" and ev.severity == "critical"
    assert _one("RuntimeError: CUDA error: system not yet initialized").fields["fault"] == "fabric_not_initialized"


PCI = "PCI:0000:3b:00"
_tokens = st.text(
    alphabet=st.characters(
        blacklist_categories=("Cs",), blacklist_characters=",\n\r\t \x0b\x0c\x1c\x1d\x1e\x1f\x85\u2028\u2029"
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(_tokens)
def test_an_xid_code_is_1_to_6_ascii_digits_and_nothing_else_is_dropped(token):
    line = f"NVRM: Xid ({PCI}): {token}, pid=12, name=python, something"
    events = list(iter_events([line]))
    if any(c.isspace() for c in token):
        return  # whitespace is a separator, not part of a token
    assert len(events) == 1, token  # never silently dropped
    ev = events[0]
    if token.isascii() and token.isdigit() and len(token) <= 6:
        assert ev.fields["xid"] == int(token)
    else:
        assert ev.fields["xid"] is None and ev.fields["xid_raw"] == token[:40]
        assert ev.severity == "warning" and "needs review" in ev.diagnosis
        assert catalog.resolution_for([ev]).severity == "review"


@given(st.sampled_from(["١٣", "٧٩", "１３", "߁߃", "໑໓"]))
def test_non_ascii_digits_are_never_codes(digits):
    ev = _one(f"NVRM: Xid ({PCI}): {digits}, pid=1, name=x, msg")
    assert ev.fields["xid"] is None and ev.fields["xid_raw"] == digits


@given(st.integers(1, 999999), st.data())
def test_a_line_cut_inside_its_code_is_never_read_as_a_shorter_code(code, data):
    """Every driver format puts a comma after the code; a line that ends on the code may have been cut
    there ("...): 1" of 145): needs review, never Xid 1."""
    digits = str(code)
    cut = data.draw(st.integers(1, len(digits)))
    ev = _one(f"kernel: NVRM: Xid ({PCI}): {digits[:cut]}")
    assert ev.fields["xid"] is None and ev.fields["xid_raw"] == digits[:cut]
    assert "may be cut" in ev.diagnosis and catalog.resolution_for([ev]).severity == "review"
    assert _one(f"kernel: NVRM: Xid ({PCI}): {digits}, pid=1, name=x, msg").fields["xid"] == code


@given(st.integers(0, 0xFF), st.integers(0, 0x1F), st.sampled_from(["{:04x}:{:02x}", "{:x}:{:x}", "{:04X}:{:02X}"]))
def test_old_bus_device_addresses_normalise(bus, dev, form):
    assert normalize_pci(form.format(bus, dev)) == f"0000:{bus:02x}:{dev:02x}.0"


FAULT_LINES = [
    "[ 12.5] NVRM: GPU 0000:17:00.0: RmInitAdapter failed! (0x23:0x65:1417)",
    "[ 12.5] NVRM: GPU 0000:17:00.0: rm_init_adapter failed, device minor number 0",
    "pcieport 0000:3a:00.0: AER: Uncorrected (Non-Fatal) error received: 0000:3b:00.0",
    "nvidia 0000:3b:00.0: PCIe Bus Error: severity=Uncorrected (Non-Fatal), type=Transaction Layer, (Requester ID)",
    "nv-fabricmanager[1]: something failed",
    "Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error",
    "NVRM: Xid (0003:00): 8, Channel 00000001",
    "NVRM: Xid (PCI:0000:65:00): 1234567, pid=900, name=python, unexpected code",
    "ordinary line without anything",
    "[rank1]: RuntimeError: CUDA error: uncorrectable ECC error encountered",
]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(FAULT_LINES), max_size=30), st.integers(16, 4096))
def test_fast_scanner_and_line_parser_agree_on_the_new_rules(lines, chunk):
    data = ("\n".join(lines) + "\n").encode()
    slow = [(e.line, e.kind, dict(e.fields)) for e in iter_events(lines)]
    fast = [(e.line, e.kind, dict(e.fields)) for e in LogScan(io.BytesIO(data), chunk_size=chunk)]
    assert fast == slow


_KL_WORDS = st.sampled_from(
    ["NVRM", "Xid", "AER: x", "PCIe Bus Error", "fabric", "abric", "no", "XID", "uncorrectable", "plain", "N", "\r"]
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(_KL_WORDS, max_size=5).map(" ".join), max_size=40))
def test_kernel_log_candidates_are_exactly_the_lines_holding_a_keyword(lines):
    from gpuguard.collectors import kernel_log

    block = ("\n".join(lines) + "\n").encode()
    out: list[tuple[int, bytes]] = []
    kernel_log._scan_block(block, 1, out)
    want = [(n, ln.encode()) for n, ln in enumerate(lines, 1) if any(k in ln.encode() for k in kernel_log.KEYWORDS)]
    assert out == want


def test_markers_fit_the_scanners_simd_prefilter():
    """ahocorasick_rs's Teddy prefilter takes at most 64 patterns; one more makes `gpu-doctor logs` ~2x
    slower on a 1 GiB log (bench/logs.py). Share markers between rules instead of adding new ones."""
    from gpuguard.collectors.logparse import MARKERS

    assert len(MARKERS) <= 64


def test_a_port_error_names_the_gpu_on_the_buses_below_it():
    lines = [
        "[    0.512] pci 0000:3a:00.0: PCI bridge to [bus 3b]",
        "[ 8921.442103] pcieport 0000:3a:00.0: AER: Uncorrected (Fatal) error received: 0000:3a:00.0",
    ]
    (ev,) = iter_events(lines)
    assert ev.line == 2 and ev.fields["buses_below"] == [0x3B, 0x3B]
    data = ("\n".join(lines) + "\n").encode()
    assert [e.fields for e in LogScan(io.BytesIO(data))] == [ev.fields]
