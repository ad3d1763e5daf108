"""The part file (`gpuguard.sharded-part/1`) as a format: round trip, and any damage refused as bad data."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.foundation.errors import DataError, NoInputError
from gpuguard.generation.manifest import ManifestEntry, ObjectSpec
from gpuguard.recovery.snapshots.parts import Part, part_name, read_part, write_part


def part(rank: int = 1, n: int = 3) -> Part:
    entries = tuple(
        ManifestEntry(
            ObjectSpec(
                f"model.{i}.weight",
                "tensor",
                (8, 4),
                "float32",
                (4 * rank, 0),
                (4, 4),
                f"__{rank}_0.distcp",
                100 * i,
                90,
            ),
            f"{i:064x}",
            rank,
            "inc",
            2,
            7,
        )
        for i in range(n)
    )
    held = {e.key: (4, 4) for e in entries}
    return Part(7, 2, rank, 2, "inc", entries, held)


def test_a_part_round_trips_and_its_digest_binds_every_field(tmp_path):
    p = part()
    write_part(p, tmp_path)
    assert read_part(tmp_path, 1) == p
    other = Part(p.step, p.generation, p.rank, p.world_size, "another", p.entries, p.held)
    assert other.digest != p.digest  # the header is a leaf
    with pytest.raises(NoInputError):
        read_part(tmp_path, 0)
    with pytest.raises(DataError, match="says rank 1"):
        (tmp_path / part_name(0)).write_bytes((tmp_path / part_name(1)).read_bytes())
        read_part(tmp_path, 0)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_damaged_part_is_refused_as_bad_data_or_reads_back_unchanged(tmp_path, data):
    p = part()
    write_part(p, tmp_path)
    path: Path = tmp_path / part_name(1)
    raw = bytearray(path.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = data.draw(st.integers(0, len(raw) - 1))
        if kind == "flip":
            raw[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "cut":
            del raw[at:]
            if not raw:
                raw = bytearray(b"{")
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=4))
    path.write_bytes(bytes(raw))
    try:
        got = read_part(tmp_path, 1)
    except DataError as exc:
        assert "\n" not in str(exc) and str(path) in str(exc)
    else:
        assert got == p  # only a change the canonical reading cannot see (none expected) may pass
