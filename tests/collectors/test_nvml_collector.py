"""NVML collector: the real pynvml without a driver, the fake at the module boundary, hung probes."""

from __future__ import annotations

import ctypes
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.collectors import nvml
from gpuguard.foundation.errors import DataError
from tests.support.node import (
    healthy_gpu,
    load_fake_pynvml,
    sample_snapshot,
    snapshot,
    write_json,
)


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_real_pynvml_without_driver_is_unknown_with_the_reason():
    snap = nvml.collect(timeout=20)
    if _driver_present():  # a GPU machine: the real path must produce a valid snapshot
        assert snap["status"] in ("ok", "unknown", "failed")
        nvml.validate_snapshot(json.loads(json.dumps(snap)))
        return
    assert snap["status"] == "unknown"
    assert snap["nvml_error"] == "NVMLError_LibraryNotFound"
    assert "NVML Shared Library Not Found" in snap["reason"]
    assert snap["gpus"] == []


def _collect_fake(monkeypatch, tmp_path, doc, timeout=10.0):
    fake = load_fake_pynvml()
    monkeypatch.setenv("GPUGUARD_FAKE_NVML", str(write_json(tmp_path / "snap.json", doc)))
    return nvml.collect(timeout, loader=lambda: fake)


def _strip(doc):
    doc = json.loads(json.dumps(doc))
    doc.pop("collected_at", None)
    doc.pop("fake", None)
    return doc


def test_fake_round_trip_reproduces_the_recorded_snapshot(monkeypatch, tmp_path):
    recorded = sample_snapshot()
    got = _collect_fake(monkeypatch, tmp_path, recorded)
    assert _strip(got) == _strip(recorded)


def test_not_supported_fields_are_null_and_lost_gpu_is_recorded(monkeypatch, tmp_path):
    gpu = healthy_gpu(0)
    gpu["remapped_rows"] = None  # pre-Ampere: NotSupported
    gpu["pcie"]["replay_counter"] = None
    lost = healthy_gpu(1)
    lost["lost"] = True
    got = _collect_fake(monkeypatch, tmp_path, snapshot(gpu, lost))
    assert got["status"] == "ok"
    first, second = got["gpus"]
    assert first["remapped_rows"] is None and first["pcie"]["replay_counter"] is None
    assert first["pcie"]["width"] == 16 and first["errors"] == {}
    assert second["lost"] is True and second["error"] == "GPU is lost"
    assert second["pci_bus_id"] == lost["pci_bus_id"] and second["temperature_c"] is None


@pytest.mark.parametrize(
    "code,cls,status",
    [
        (12, "NVMLError_LibraryNotFound", "unknown"),
        (9, "NVMLError_DriverNotLoaded", "unknown"),
        (18, "NVMLError_LibRmVersionMismatch", "failed"),
    ],
)
def test_init_errors_become_a_status_with_the_reason(monkeypatch, tmp_path, code, cls, status):
    got = _collect_fake(monkeypatch, tmp_path, snapshot(fake={"init_error": code}))
    assert got["status"] == status and got["nvml_error"] == cls
    assert cls in got["reason"]


def test_hung_probe_gives_unknown_within_the_timeout(monkeypatch, tmp_path):
    start = time.monotonic()
    got = _collect_fake(monkeypatch, tmp_path, snapshot(healthy_gpu(0), fake={"hang_s": 5}), timeout=0.5)
    assert time.monotonic() - start < 3
    assert got["status"] == "unknown" and got["timed_out"] is True
    assert "did not answer within 0.5 s" in got["reason"]


def test_fake_error_classes_match_the_real_binding():
    import pynvml as real

    fake = load_fake_pynvml()
    for name in (
        "NVMLError_LibraryNotFound",
        "NVMLError_DriverNotLoaded",
        "NVMLError_NotSupported",
        "NVMLError_GpuIsLost",
        "NVMLError_LibRmVersionMismatch",
        "NVMLError_Unknown",
    ):
        assert getattr(fake, name)().value == getattr(real, name)().value, name
        assert str(getattr(fake, name)()) == str(getattr(real, name)()), name
    assert type(fake.NVMLError(15)).__name__ == "NVMLError_GpuIsLost"


def test_pci_bus_id_is_normalised():
    assert nvml.normalize_pci_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert nvml.normalize_pci_bus_id(b"00000009:01:00.0") == "0009:01:00.0"
    assert nvml.normalize_pci_bus_id("0000:cb:00") == "0000:cb:00.0"


def test_load_snapshot_rejects_bad_files_with_one_clear_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "gpuguard.nvml/1", "gpus": [')
    with pytest.raises(DataError, match="not valid JSON"):
        nvml.load_snapshot(str(bad))
    doc = snapshot(healthy_gpu(0))
    doc["gpus"][0]["temperature_c"] = "hot"
    with pytest.raises(DataError, match=r"gpus\[0\]\.temperature_c"):
        nvml.load_snapshot(str(write_json(bad, doc)))
    doc = snapshot(healthy_gpu(0))
    doc["gpus"][0]["remapped_rows"]["pending"] = "yes"
    with pytest.raises(DataError, match="remapped_rows.pending"):
        nvml.validate_snapshot(doc)
    with pytest.raises(DataError, match="schema"):
        nvml.validate_snapshot({"gpus": []})


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None)
@given(
    gpu=st.dictionaries(
        st.sampled_from(
            [
                "index",
                "name",
                "pci_bus_id",
                "lost",
                "ecc",
                "remapped_rows",
                "pcie",
                "nvlink",
                "temperature_c",
                "recovery_action",
                "retired_pages",
            ]
        ),
        _json,
        max_size=6,
    )
)
def test_snapshot_validation_accepts_or_raises_data_error_only(gpu):
    doc = {"schema": "gpuguard.nvml/1", "status": "ok", "gpus": [gpu]}
    try:
        nvml.validate_snapshot(doc)
    except DataError as exc:
        assert str(exc).startswith("NVML snapshot")


@settings(max_examples=60, deadline=None)
@given(raw=st.binary(max_size=300))
def test_snapshot_loader_on_random_bytes(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("s") / "snap.json"
    path.write_bytes(raw)
    try:
        nvml.load_snapshot(str(path))
    except DataError:
        pass
