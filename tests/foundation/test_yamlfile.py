"""The one YAML reader: plain data round-trips; a repeated key, a non-finite number, an alias bomb,
an oversize file, a FIFO, a device or a directory is one error line (never a hang); and its three
callers (node thresholds, log-step specs, runbooks) go through it, end to end."""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.collectors.log_steps import LogStepSpec
from gpuguard.diagnostics import node_thresholds
from gpuguard.foundation.errors import DataError, GpuguardError, NoInputError, UsageError
from gpuguard.foundation.yamlfile import load_yaml, parse_yaml, read_capped
from gpuguard.recovery.operator import runbooks
from tests.support.cli import run_cli
from tests.support.node import SAMPLE_LOG, SAMPLE_NVML

OFFLINE = ("--kernel-log", str(SAMPLE_LOG), "--nvml-snapshot", str(SAMPLE_NVML))
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

keys = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=8)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False, width=64)
    | st.text(max_size=12)
)
plain = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4), max_leaves=30
)


def _write(tmp: Path, name: str, text: str | bytes) -> Path:
    p = tmp / name
    p.write_bytes(text.encode() if isinstance(text, str) else text)
    return p


@SETTINGS
@given(doc=st.dictionaries(keys, plain, max_size=6))
def test_plain_data_round_trips(tmp_path: Path, doc: dict[str, Any]) -> None:
    text = yaml.safe_dump(doc, allow_unicode=True)
    p = _write(tmp_path, "a.yaml", text)
    assert load_yaml(p) == yaml.safe_load(text)  # what safe_load reads (PyYAML folds a NEL to a space)


@SETTINGS
@given(
    doc=st.dictionaries(st.from_regex(r"k[a-z]{0,5}", fullmatch=True), st.integers(0, 9), min_size=1, max_size=6),
    data=st.data(),
)
def test_a_repeated_key_is_refused_naming_key_and_both_lines(tmp_path: Path, doc: dict[str, int], data: Any) -> None:
    lines = [f"{k}: {v}" for k, v in doc.items()]
    first = data.draw(st.integers(0, len(lines) - 1))
    key = list(doc)[first]
    at = data.draw(st.integers(first + 1, len(lines)))
    lines.insert(at, f"{key}: 7")
    p = _write(tmp_path, "d.yaml", "\n".join(lines) + "\n")
    with pytest.raises(DataError) as info:
        load_yaml(p)
    msg = str(info.value)
    assert f"duplicate key {key!r} (first at line {first + 1})" in msg and f"line {at + 1}" in msg
    assert "\n" not in msg


def test_a_repeated_key_in_a_nested_mapping_and_merge_keys() -> None:
    with pytest.raises(DataError, match=r"line 3: duplicate key 'drain' \(first at line 2\)"):
        parse_yaml("xid:\n  drain: [79]\n  drain: []\n", source="c.yaml")
    assert parse_yaml("a: &x {k: 1}\nb:\n  <<: *x\n  k: 2\n", source="m.yaml") == {"a": {"k": 1}, "b": {"k": 2}}


@pytest.mark.parametrize("number", [".nan", ".NaN", ".inf", "-.inf", "+.Inf", "1.0e+999"])
def test_non_finite_numbers_are_refused_unless_the_caller_checks_them(number: str) -> None:
    with pytest.raises(DataError, match="line 2: .* is not a finite number"):
        parse_yaml(f"a: 1\nb: [{number}]\n", source="n.yaml")
    got = parse_yaml(f"b: {number}\n", source="n.yaml", finite=False)["b"]
    assert not math.isfinite(got)
    assert parse_yaml("b: 'nan'\n", source="n.yaml") == {"b": "nan"}  # a string stays a string


@pytest.mark.parametrize(
    "text",
    [
        # a billion laughs: 9 levels of 10 aliases, a few hundred bytes, 10**9 nodes unfolded
        "a: &a [x,x,x,x,x,x,x,x,x,x]\n"
        + "".join(f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)),
        "a: &a [*a]\n",  # a recursive alias: a cycle
    ],
)
def test_alias_bombs_and_cycles_are_refused_fast(text: str) -> None:
    assert len(text) < 1024
    t0 = time.perf_counter()
    with pytest.raises(DataError, match="refused: .*(shared references|reference cycle).*YAML aliases"):
        parse_yaml(text, source="bomb.yaml")
    assert time.perf_counter() - t0 < 10  # a deadline against a hang, not a speed assertion


def test_size_cap(tmp_path: Path) -> None:
    ok = _write(tmp_path, "ok.yaml", "a: " + "x" * 1000 + "\n")
    assert load_yaml(ok, max_bytes=1004) == {"a": "x" * 1000}
    with pytest.raises(DataError, match=r"1,005 bytes, more than the 1,004 bytes a config file may have"):
        load_yaml(_write(tmp_path, "big.yaml", "a: " + "x" * 1001 + "\n"), max_bytes=1004)
    with pytest.raises(DataError, match="more than the 1 MiB"):
        parse_yaml("a: 1\n" + "#" * (1 << 20), source="t")


@pytest.mark.timeout(20)
def test_fifo_device_directory_and_missing_file_never_block(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="not a regular file"):
        load_yaml(fifo)
    with pytest.raises(DataError, match="not a regular file"):
        load_yaml("/dev/zero")
    with pytest.raises(DataError, match="is a directory, not a config file"):
        load_yaml(tmp_path)
    with pytest.raises(NoInputError):
        load_yaml(tmp_path / "missing.yaml")
    with pytest.raises(UsageError, match="not a regular file"):
        read_capped(fifo, max_bytes=10, what="x", error=UsageError)


def test_a_fifo_with_a_writer_is_still_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    opened = threading.Event()

    def writer() -> None:
        fd = os.open(fifo, os.O_RDWR)  # holds the FIFO open, writes nothing
        opened.set()
        time.sleep(3)
        os.close(fd)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    assert opened.wait(5)
    t0 = time.monotonic()
    with pytest.raises(DataError, match="not a regular file"):
        load_yaml(fifo)
    assert time.monotonic() - t0 < 2
    t.join()


def test_not_utf8_and_not_yaml(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not UTF-8"):
        load_yaml(_write(tmp_path, "b.yaml", b"a: \xff\xfe\n"))
    with pytest.raises(DataError, match="not valid YAML at line 2"):
        load_yaml(_write(tmp_path, "c.yaml", "a: [1,\n"))
    with pytest.raises(DataError, match="not valid YAML"):
        load_yaml(_write(tmp_path, "e.yaml", "a: !!python/object:os.system x\n"))


@SETTINGS
@given(raw=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_any_bytes_give_data_or_one_line_error(tmp_path: Path, raw: bytes) -> None:
    p = _write(tmp_path, "f.yaml", raw)
    try:
        load_yaml(p)
    except GpuguardError as exc:
        assert "\n" not in str(exc) and exc.exit_code == 65


# -- the callers ------------------------------------------------------------------------------------

BOMB = "a: &a [1,1,1,1,1,1,1,1,1,1]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("xid:\n  drain: [79]\n  drain: []\n", "duplicate key 'drain'"),
        ("temperature:\n  slowdown_margin_c: .nan\n", "not a finite number"),
        (BOMB + "xid:\n  drain: *i\n", "YAML aliases"),
    ],
)
def test_gpu_doctor_config_rules_end_to_end(tmp_path: Path, text: str, needle: str) -> None:
    cfg = _write(tmp_path, "t.yaml", text)
    with pytest.raises(UsageError, match=needle):
        node_thresholds.load(cfg)
    r = run_cli("gpu-doctor", "diagnose", "node", *OFFLINE, "--config", str(cfg), timeout=60)
    assert r.returncode == 64 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.timeout(60)
def test_gpu_doctor_config_fifo_and_oversize_end_to_end(tmp_path: Path) -> None:
    fifo = tmp_path / "cfg.yaml"
    os.mkfifo(fifo)
    r = run_cli("gpu-doctor", "diagnose", "node", *OFFLINE, "--config", str(fifo), timeout=30)
    assert r.returncode == 64 and "not a regular file" in r.stderr
    big = _write(tmp_path, "big.yaml", "#" * ((1 << 20) + 1))
    r = run_cli("gpu-doctor", "diagnose", "node", *OFFLINE, "--config", str(big), timeout=30)
    assert r.returncode == 64 and "more than the 1 MiB" in r.stderr


def test_log_step_spec_through_the_reader(tmp_path: Path) -> None:
    good = _write(tmp_path, "s.yaml", "step_log:\n  pattern: 'step (?P<step>\\d+) (?P<step_s>[0-9.]+)s'\n")
    assert LogStepSpec.from_yaml(good).pattern.groupindex.keys() >= {"step", "step_s"}
    dup = _write(tmp_path, "d.yaml", "step_log:\n  pattern: 'a'\n  pattern: '(?P<step>1)(?P<ts>2)'\n")
    with pytest.raises(DataError, match="duplicate key 'pattern'"):
        LogStepSpec.from_yaml(dup)
    with pytest.raises(DataError, match="default_rank must be a whole number"):
        LogStepSpec.from_yaml(_write(tmp_path, "r.yaml", "pattern: '(?P<step>1)(?P<ts>2)'\ndefault_rank: 1.5\n"))
    with pytest.raises(DataError, match="not a finite number"):
        LogStepSpec.from_yaml(_write(tmp_path, "i.yaml", "pattern: '(?P<step>1)(?P<ts>2)'\ndefault_rank: .inf\n"))
    with pytest.raises(DataError, match="64 KiB"):
        LogStepSpec.from_yaml(_write(tmp_path, "b.yaml", "#" * (65 << 10)))
    with pytest.raises(NoInputError, match="no such log spec"):
        LogStepSpec.from_yaml(tmp_path / "missing.yaml")
    fifo = tmp_path / "f.yaml"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="not a regular file"):
        LogStepSpec.from_yaml(fifo)


def test_runbooks_through_the_reader(tmp_path: Path) -> None:
    with pytest.raises(runbooks.RunbookError, match="YAML aliases"):
        runbooks.parse(BOMB, "bomb.yaml")
    book = _write(tmp_path, "b.yaml", "name: a\nname: b\nsteps: [{name: s, action: diagnose}]\n")
    with pytest.raises(runbooks.RunbookError, match=r"line 2: duplicate key 'name' \(first at line 1\)"):
        runbooks.load(str(book))


def test_a_large_aliased_value_in_a_thresholds_error_is_shown_bounded(tmp_path: Path) -> None:
    """Under the node budget (aliases of aliases: 111,110 items), but the message shows a bounded
    repr of the value, built without walking all of it."""
    levels = ["&a [" + ", ".join(["1"] * 10) + "]"]
    levels += [f"&{c} [" + ", ".join(["*" + p] * 10) + "]" for p, c in zip("abcd", "bcde", strict=True)]
    cfg = _write(tmp_path, "t.yaml", "xid:\n  drain: [" + ", ".join(levels) + "]\n")
    t0 = time.perf_counter()
    with pytest.raises(UsageError) as info:
        node_thresholds.load(cfg)
    assert time.perf_counter() - t0 < 10  # a deadline against a hang, not a speed assertion
    assert "expected a list of Xid codes" in str(info.value) and len(str(info.value)) < 250
    huge = [[[[1] * 1000] * 1000] * 1000]  # 10**9 items shared by reference
    assert len(node_thresholds._shown(huge)) <= 60
