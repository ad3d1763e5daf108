"""The job signing key: 0600, exclusive, never overwritten; bad key files are one-line errors."""

from __future__ import annotations

import os
import stat

import pytest

from gpuguard.foundation.errors import DataError, GpuguardError, NoInputError
from gpuguard.generation.keys import create_key, key_path, load_key, sign, signature_ok


def test_key_is_0600_and_never_overwritten(tmp_path):
    old_umask = os.umask(0)
    try:
        key = create_key(tmp_path)
    finally:
        os.umask(old_umask)
    path = key_path(tmp_path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(key) == 32
    before = path.read_bytes()
    with pytest.raises(GpuguardError, match="refusing to overwrite"):
        create_key(tmp_path)
    assert path.read_bytes() == before and load_key(tmp_path) == key


def test_bad_key_files(tmp_path):
    with pytest.raises(NoInputError):
        load_key(tmp_path)
    key_path(tmp_path).write_text("zz\n")
    os.chmod(key_path(tmp_path), 0o600)
    with pytest.raises(DataError, match="not hex"):
        load_key(tmp_path)
    key_path(tmp_path).write_text("ab" * 16)
    with pytest.raises(DataError, match="16 bytes"):
        load_key(tmp_path)


def test_signature_is_hmac_and_checked_in_constant_time():
    k = bytes(32)
    sig = sign(k, b"msg")
    assert signature_ok(k, b"msg", sig)
    assert not signature_ok(k, b"msg!", sig) and not signature_ok(bytes(range(32)), b"msg", sig)


def test_a_key_others_can_read_or_a_linked_key_is_refused(tmp_path):
    import os

    from gpuguard.foundation.errors import DataError, PermissionDeniedError

    key = create_key(tmp_path)
    path = tmp_path / "generation.key"
    os.chmod(path, 0o640)
    with pytest.raises(PermissionDeniedError, match="chmod 600"):
        load_key(tmp_path)
    os.chmod(path, 0o600)
    assert load_key(tmp_path) == key
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation.key").symlink_to(path)
    with pytest.raises(DataError, match="symbolic link"):
        load_key(other)
