"""Pasted `nvidia-smi` output (`collectors.nvidia_smi`): `-q` reports into NVML snapshots, the table's
`ERR!` into events; real formats (tests/data/node-evidence) and generated reports (hypothesis)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.collectors import nvidia_smi, nvml

DATA = Path(__file__).resolve().parents[1] / "data" / "node-evidence"


def test_an_excerpt_of_one_gpu_is_a_partial_snapshot_with_its_counters():
    snap = nvidia_smi.parse_query((DATA / "smi-q-remap-pending.txt").read_text())
    assert snap is not None and snap["complete"] is False  # "Attached GPUs : 8", one block pasted
    (gpu,) = snap["gpus"]
    assert gpu["index"] is None and gpu["pci_bus_id"] == "0000:10:1c.0" and gpu["name"] == "NVIDIA A100-SXM4-80GB"
    assert gpu["remapped_rows"] == {"correctable": 1, "uncorrectable": 0, "pending": True, "failure": False}
    assert gpu["ecc"]["volatile_corrected"] == 177 and gpu["ecc"]["volatile_uncorrected"] == 0
    assert gpu["retired_pages"] is None  # N/A on Ampere
    assert snap["driver_version"] == "510.73.08"
    nvml.validate_snapshot(snap)  # the same document `--nvml-snapshot` accepts


def test_a_whole_report_gives_indices_reset_status_and_identity():
    snap = nvidia_smi.parse_query((DATA / "smi-q-uncorrectable.txt").read_text())
    assert snap["complete"] is True
    (gpu,) = snap["gpus"]
    assert (gpu["index"], gpu["serial"], gpu["uuid"]) == (
        0,
        "1654922012345",
        "GPU-5c3e0f1a-2b7d-4e6f-9a8b-0c1d2e3f4a5b",
    )
    assert gpu["ecc"]["volatile_uncorrected"] == 2 and gpu["ecc"]["volatile_uncorrected_dram"] == 2
    assert gpu["recovery_action"] == 1 and gpu["recovery_action_name"] == "gpu_reset"  # Reset Required : Yes
    assert (gpu["temperature_c"], gpu["temperature_slowdown_c"]) == (35, 100)


def test_pre_ampere_counters_and_retired_pages():
    (gpu,) = nvidia_smi.parse_query((DATA / "smi-q-v100-retired.txt").read_text())["gpus"]
    assert gpu["ecc"]["volatile_corrected"] == 12 and gpu["ecc"]["aggregate_uncorrected"] == 1
    assert gpu["retired_pages"] == {"single_bit": 2, "double_bit": 1, "pending": True}
    assert gpu["remapped_rows"] is None


def test_the_tables_err_fields():
    assert [e.fields["gpu_index"] for e in nvidia_smi.table_events((DATA / "smi-table-err-power.txt").read_text())] == [
        1
    ]
    (power,) = nvidia_smi.table_events((DATA / "smi-table-err-power.txt").read_text())
    assert power.severity == "info" and power.fields["unreadable_fields"] == ["power"]  # transient alone
    (gpu,) = nvidia_smi.table_events((DATA / "smi-table-err-gpu.txt").read_text())
    assert (gpu.fields["gpu_index"], gpu.fields["pci_bus_id"], gpu.severity) == (1, "0000:13:00.0", "critical")
    assert {"fan", "temperature", "power", "uncorrectable ECC count"} <= set(gpu.fields["unreadable_fields"])


def test_read_report_leaves_other_files_alone(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("[ 1.0] NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.\n")
    assert nvidia_smi.read_report(str(log)) is None
    big = tmp_path / "big.txt"
    big.write_bytes((DATA / "smi-q-uncorrectable.txt").read_bytes() + b"x" * 64)
    assert nvidia_smi.read_report(str(big), max_bytes=100) is None  # a log, not a paste


COUNTER = st.one_of(st.integers(0, 10**6), st.just(None))


def _render(gpus: list[dict], attached: int) -> str:
    """An `nvidia-smi -q` report in the driver's own layout (4-space indents, padded keys)."""

    def kv(indent: int, key: str, value) -> str:
        text = "N/A" if value is None else ("Yes" if value is True else "No" if value is False else str(value))
        return f"{' ' * indent}{key:<{38 - indent}}: {text}"

    out = ["==============NVSMI LOG==============", "", kv(0, "Attached GPUs", attached)]
    for g in gpus:
        out += [f"GPU 00000000:{g['bus']:02X}:00.0", kv(4, "Product Name", "NVIDIA A100-SXM4-80GB"), "    ECC Errors"]
        for scope in ("Volatile", "Aggregate"):
            out.append(f"        {scope}")
            for key in ("SRAM Correctable", "SRAM Uncorrectable", "DRAM Correctable", "DRAM Uncorrectable"):
                out.append(kv(12, key, g[f"{scope}.{key}"]))
        out += ["    Remapped Rows"]
        out += [kv(8, "Correctable Error", g["rc"]), kv(8, "Uncorrectable Error", g["ru"])]
        out += [kv(8, "Pending", g["pending"]), kv(8, "Remapping Failure Occurred", g["failure"])]
    return "\n".join(out) + "\n"


GPU = st.fixed_dictionaries(
    {
        **{
            f"{scope}.{key}": COUNTER
            for scope in ("Volatile", "Aggregate")
            for key in ("SRAM Correctable", "SRAM Uncorrectable", "DRAM Correctable", "DRAM Uncorrectable")
        },
        "rc": st.integers(0, 10**4),
        "ru": st.integers(0, 10**4),
        "pending": st.booleans(),
        "failure": st.booleans(),
    }
)


@settings(max_examples=150, deadline=None)
@given(st.lists(GPU, min_size=1, max_size=8), st.integers(0, 2))
def test_generated_reports_round_trip(gpus, extra):
    for bus, g in enumerate(gpus):
        g["bus"] = 0x10 + bus
    snap = nvidia_smi.parse_query(_render(gpus, len(gpus) + extra))
    assert snap["complete"] is (extra == 0) and len(snap["gpus"]) == len(gpus)
    for g, got in zip(gpus, snap["gpus"]):
        assert got["index"] == (gpus.index(g) if extra == 0 else None)
        assert got["remapped_rows"] == {
            "correctable": g["rc"],
            "uncorrectable": g["ru"],
            "pending": g["pending"],
            "failure": g["failure"],
        }
        for scope, name in (("Volatile", "volatile"), ("Aggregate", "aggregate")):
            sram, dram = g[f"{scope}.SRAM Uncorrectable"], g[f"{scope}.DRAM Uncorrectable"]
            want = None if sram is None and dram is None else (sram or 0) + (dram or 0)
            if want is None and g[f"{scope}.SRAM Correctable"] is None and g[f"{scope}.DRAM Correctable"] is None:
                continue  # nothing printed: the older Single/Double Bit names are looked for instead
            assert got["ecc"][f"{name}_uncorrected"] == want
            assert got["ecc"][f"{name}_uncorrected_dram"] == dram
        nvml.validate_snapshot(snap)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=2000))
def test_any_text_parses_without_error(text):
    snap = nvidia_smi.parse_query(text)
    assert snap is None or isinstance(snap["gpus"], list)
    assert isinstance(nvidia_smi.table_events(text), list)
    nvidia_smi.looks_like_query(text)
