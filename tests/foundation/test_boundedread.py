"""foundation.boundedread: regular files only, no-follow where asked, a cap per kind, lines streamed
with an overlong one counted as garbage, and JSON depth bounded without recursion (property-tested
against the real parser)."""

from __future__ import annotations

import json
import os
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.foundation import boundedread as br
from gpuguard.foundation.errors import DataError, NoInputError

json_leaves = st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab\n,:\u202e', max_size=8)
json_values = st.recursive(
    json_leaves,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='[]{}"\\k', max_size=4), inner, max_size=3)
    ),
    max_leaves=30,
)


def _depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@given(json_values)
@settings(max_examples=300, deadline=None)
def test_the_depth_scan_agrees_with_the_structure(value):
    text = json.dumps(value, ensure_ascii=False)
    for limit in (1, 2, 3, 64):
        problem = br.json_depth_problem(text, limit)
        assert (problem is None) == (_depth(value) <= limit), (text, limit, problem)
    assert br.parse_json(text.encode()) == value


@pytest.mark.parametrize("depth", [63, 64, 65, 10_000, 1_000_000])
def test_deep_nesting_is_refused_without_recursion(depth):
    for doc in ("[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth):
        if depth <= br.MAX_JSON_DEPTH:
            assert br.json_depth_problem(doc) is None and br.parse_json(doc) is not None
        else:
            with pytest.raises(ValueError, match="nested deeper than 64 levels"):
                br.parse_json(doc)


@given(st.text(max_size=200))
@settings(max_examples=300, deadline=None)
def test_any_text_parses_or_is_one_value_error(text):
    try:
        br.parse_json(text)
    except ValueError:
        pass


def test_unbalanced_brackets_are_named():
    assert br.json_depth_problem("[" * 70 + "}" * 70) == "its brackets do not balance"
    inside = "[" + '"[{\\"", ' * 100 + '"}"]'  # brackets (and escaped quotes) inside strings do not count
    assert br.json_depth_problem(inside) is None and len(br.parse_json(inside)) == 101


def test_a_fifo_a_link_a_directory_and_an_oversize_file_are_refused_before_any_read(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    link.symlink_to("/dev/zero")
    big = tmp_path / "big"
    with open(big, "wb") as fh:
        fh.truncate(1 << 30)
    done = threading.Event()

    def refuse_all() -> None:
        with pytest.raises(DataError, match="not a regular file"):
            br.read_bytes(fifo, max_bytes=10, what="a record")
        with pytest.raises(DataError, match="not a regular file"):
            br.read_bytes(link, max_bytes=10, what="a record")  # followed: /dev/zero is a device
        with pytest.raises(DataError, match="symbolic link"):
            br.read_bytes(link, max_bytes=10, what="a record", follow_links=False)
        with pytest.raises(DataError, match="is a directory"):
            br.read_bytes(tmp_path, max_bytes=10, what="a record")
        with pytest.raises(DataError, match="more than the 16 MiB"):
            br.read_bytes(big, max_bytes=br.RECORD_BYTES, what="a record")
        with pytest.raises(DataError, match="not a regular file"):
            br.read_lines(fifo, max_bytes=10, what="a log")
        with pytest.raises(NoInputError):
            br.read_bytes(tmp_path / "missing", max_bytes=10, what="a record")
        done.set()

    worker = threading.Thread(target=refuse_all, daemon=True)
    worker.start()
    worker.join(10)
    assert done.is_set(), "a read blocked or failed"


@given(st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=30), st.binary(max_size=20))
@settings(max_examples=200, deadline=None)
def test_lines_stream_back_unchanged_and_an_overlong_one_is_one_garbage_line(tmp_path_factory, lines, tail):
    d = tmp_path_factory.mktemp("l")
    data = b"".join(line + b"\n" for line in lines) + tail.replace(b"\n", b"")
    (d / "log").write_bytes(data)
    got = br.read_lines(d / "log", max_bytes=1 << 20, what="a log", max_line=20)
    want = [line if len(line) <= 20 else b"\x00" for line in lines]
    rest = tail.replace(b"\n", b"")
    assert got.split(b"\n")[: len(lines)] == want
    assert got.split(b"\n")[-1] == (rest if len(rest) <= 20 else b"\x00")


def test_an_endless_line_costs_one_garbage_line_not_its_size(tmp_path):
    (tmp_path / "log").write_bytes(b'{"ok":1}\n' + b"x" * (5 << 20) + b"\n" + b'{"ok":2}\n')
    got = br.read_lines(tmp_path / "log", max_bytes=64 << 20, what="a log")
    assert got == b'{"ok":1}\n\x00\n{"ok":2}\n'
