"""State manifests over real DCP checkpoints: build, verify, tamper, corrupt, restricted unpickling."""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path

import pytest

from gpuguard.foundation.errors import DataError, NoInputError
from gpuguard.generation.dcp_metadata import load_metadata
from gpuguard.generation.manifest import (
    MANIFEST_FILE,
    build_manifest,
    coverage,
    load_manifest,
    verify_manifest,
    write_manifest,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real DCP checkpoint: model, optimizer with state, LR scheduler, RNG, data-loader position."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    sched.step()
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "lr_scheduler": sched.state_dict(),
        "rng": torch.get_rng_state(),
        "loader": {"epoch": 2, "batch_index": 17},
    }
    path = tmp_path_factory.mktemp("ckpt")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=2))
    return path


def fresh_copy(checkpoint, tmp_path) -> Path:
    import shutil

    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint, dst)
    return dst


def test_manifest_lists_every_object_with_owner_generation_and_step(checkpoint, tmp_path):
    ck = fresh_copy(checkpoint, tmp_path)
    man = build_manifest(ck, step=120, generation=3, owners={0: "inc-0"})
    meta = load_metadata(ck)
    assert {e.spec.fqn for e in man.entries} == {i.fqn for i in meta.storage_data}
    w = next(e for e in man.entries if e.spec.fqn == "model.0.weight")
    assert w.spec.global_shape == (16, 8) and w.spec.dtype == "float32" and w.spec.chunk_sizes == (16, 8)
    assert (w.owner_rank, w.owner_incarnation, w.generation, w.step) == (0, "inc-0", 3, 120)
    state = man.non_tensor_state()
    assert state["optim.param_groups.0.lr"] == pytest.approx(0.01)
    assert state["loader.batch_index"] == 17 and state["lr_scheduler.last_epoch"] == 1
    cats = {e.to_dict()["category"] for e in man.entries}
    assert {"model", "optimizer", "optimizer-param-group", "lr-scheduler", "rng", "data-loader"} <= cats
    assert len({e.spec.file for e in man.entries}) == 2
    assert verify_manifest(man, ck) == [] and coverage(man, [e.key for e in man.entries]) == []


def test_manifest_file_roundtrips_and_any_flipped_byte_is_caught(checkpoint, tmp_path):
    ck = fresh_copy(checkpoint, tmp_path)
    man = build_manifest(ck, step=1, generation=1)
    path = write_manifest(man, ck)
    assert load_manifest(path).digest == man.digest
    orig = path.read_bytes()
    rng = random.Random(7)
    positions = sorted(rng.sample(range(len(orig) - 1), 150)) + list(range(len(orig) - 80, len(orig) - 1))
    for i in positions:
        data = bytearray(orig)
        data[i] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        with pytest.raises(DataError, match=MANIFEST_FILE):
            load_manifest(path)
    path.write_bytes(orig[: len(orig) // 2])
    with pytest.raises(DataError, match="unreadable manifest"):
        load_manifest(path)


def test_corrupted_shard_is_named(checkpoint, tmp_path):
    ck = fresh_copy(checkpoint, tmp_path)
    man = build_manifest(ck, step=1, generation=1)
    target = next(e for e in man.entries if e.spec.fqn == "model.1.weight")
    with open(ck / target.spec.file, "r+b") as f:
        f.seek(target.spec.byte_offset + target.spec.byte_length // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    problems = verify_manifest(man, ck)
    assert len(problems) == 1 and "model.1.weight" in problems[0] and "digest mismatch" in problems[0]


def test_missing_or_truncated_shard_is_named(checkpoint, tmp_path):
    ck = fresh_copy(checkpoint, tmp_path)
    man = build_manifest(ck, step=1, generation=1)
    files = sorted({e.spec.file for e in man.entries})
    (ck / files[0]).unlink()
    with open(ck / files[1], "r+b") as f:
        f.truncate(10)
    problems = verify_manifest(man, ck)
    assert any("storage file missing" in p and files[0] in p for p in problems)
    assert any("past the end" in p for p in problems)
    assert len(problems) == len(man.entries) - sum(
        1 for e in man.entries if e.spec.file == files[1] and e.spec.byte_offset + e.spec.byte_length <= 10
    )


def test_completeness_every_owned_object_exactly_once(checkpoint, tmp_path):
    ck = fresh_copy(checkpoint, tmp_path)
    man = build_manifest(ck, step=1, generation=1)
    keys = [e.key for e in man.entries]
    from dataclasses import replace

    dup = replace(man, entries=man.entries + (man.entries[0],))
    assert coverage(dup, keys) == [f"object {man.entries[0].key} is stored 2 times"]
    short = replace(man, entries=man.entries[1:])
    assert verify_manifest(short, ck, expected=keys) == [f"object {man.entries[0].key} is missing"]
    assert coverage(man, keys[1:]) == [f"object {keys[0]} is not in the ownership map"]


def test_malicious_metadata_pickle_is_refused(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(DataError, match="not allowed"):
        load_metadata(tmp_path)
    assert not marker.exists()
    with pytest.raises(NoInputError):
        load_metadata(tmp_path / "nowhere")


def test_storage_path_cannot_escape_the_checkpoint(checkpoint, tmp_path):
    from dataclasses import replace

    ck = fresh_copy(checkpoint, tmp_path)
    man = build_manifest(ck, step=1, generation=1)
    e = man.entries[0]
    evil = replace(man, entries=(replace(e, spec=replace(e.spec, file="../../etc/passwd")),))
    assert "escapes" in verify_manifest(evil, ck)[0]


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gpuguard.generation.canonical import canonical_bytes  # noqa: E402
from gpuguard.generation.manifest import Manifest, ManifestEntry, MetadataBinding, ObjectSpec  # noqa: E402

_dims = st.lists(st.integers(0, 2**31), min_size=1, max_size=3).map(tuple)
_spec = st.builds(
    ObjectSpec,
    fqn=st.text(min_size=1, max_size=12),
    kind=st.sampled_from(["tensor", "bytes"]),
    global_shape=st.none() | _dims,
    dtype=st.none() | st.sampled_from(["float32", "bfloat16"]),
    chunk_offsets=st.none() | _dims,
    chunk_sizes=st.none() | _dims,
    file=st.sampled_from(["__0_0.distcp", "__1_0.distcp"]),
    byte_offset=st.integers(0, 2**40),
    byte_length=st.integers(0, 2**30),
)
_entry = st.builds(
    ManifestEntry,
    spec=_spec,
    digest=st.text("0123456789abcdef", min_size=64, max_size=64),
    owner_rank=st.integers(-1, 1024),
    owner_incarnation=st.text(max_size=8),
    generation=st.integers(0, 10**6),
    step=st.integers(0, 10**9),
    value=st.none() | st.integers() | st.booleans() | st.floats(allow_nan=False, allow_infinity=False),
)


_binding = st.builds(
    MetadataBinding, digest=st.text("0123456789abcdef", min_size=64, max_size=64), size=st.integers(0, 2**40)
)


@settings(max_examples=80, deadline=None)
@given(entries=st.lists(_entry, max_size=6), step=st.integers(0, 10**9), metadata=st.none() | _binding)
def test_manifest_format_roundtrips_with_the_same_digest(tmp_path_factory, entries, step, metadata):
    """Both schemas: `/2` (`.metadata` bound, in the header leaf) and the legacy `/1` (none)."""
    man = Manifest(1, step, tuple(entries), 2, metadata=metadata)
    d = tmp_path_factory.mktemp("m")
    path = write_manifest(man, d)
    back = load_manifest(path)
    assert back.digest == man.digest and back.metadata == metadata
    assert back.header()["schema"] == ("gpuguard.manifest/1" if metadata is None else "gpuguard.manifest/2")
    if metadata is not None:  # the binding is under the digest: another one is another manifest
        other = MetadataBinding(metadata.digest[::-1], metadata.size)
        assert Manifest(1, step, tuple(entries), 2, metadata=other).digest != man.digest or other == metadata
    assert all(e.canonical() == canonical_bytes(e.to_dict()) for e in man.entries)
    assert canonical_bytes(back.to_dict()) == canonical_bytes(man.to_dict())
