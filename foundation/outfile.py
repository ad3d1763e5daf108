"""Output files an operator names (`--dump-nvml`, `--textfile`): never clobbered, never through a link.

One writer for every output path, so each gets the same rules: the directory must exist (66; it is
never created for you) and not be a link (65); the file must not be a link (65) or a directory
(73); an existing file is replaced only when the caller says so (`force`; 73 otherwise), and then
only a regular file; run as root, the directory must be root's and not writable by group or others
(77, `jobdir.check_root_safe_dir`). The write is a temp file opened through a no-follow handle on
the directory, then hard-linked (new file) or renamed (replace) into place: atomic, and a link
planted at the name meanwhile is replaced, never written through.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from pathlib import Path
from typing import Any

from gpuguard.foundation.errors import EXIT_CANTCREAT, DataError, GpuguardError, NoInputError, from_os_error
from gpuguard.foundation.jobdir import check_root_safe_dir


def check_output_path(path: str, *, force: bool, what: str) -> None:
    """Refuse an output path at once: 66 its directory is missing (never created), 65 it or its
    directory is a symbolic link, 73 it exists (unless `force`, and then only a regular file)."""
    target = Path(path)
    parent = target.parent
    if os.path.islink(parent):
        raise DataError(f"{what} {path}: directory {parent} is a symbolic link: refusing to write through it")
    if not parent.is_dir():
        raise NoInputError(f"{what} {path}: no directory {parent} (it is not created for you)")
    check_root_safe_dir(parent, f"{what} {path}: directory")  # as root: 77 if another user controls it
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise from_os_error(exc, f"{what} {path}") from None
    if stat.S_ISLNK(st.st_mode):
        raise DataError(f"{what} {path}: is a symbolic link: refusing to write through it")
    if stat.S_ISDIR(st.st_mode):
        raise GpuguardError(f"{what} {path}: is a directory", exit_code=EXIT_CANTCREAT)
    if not force:
        raise GpuguardError(
            f"{what} {path}: exists: refusing to overwrite it (--force to replace it)", exit_code=EXIT_CANTCREAT
        )
    if not stat.S_ISREG(st.st_mode):
        raise GpuguardError(f"{what} {path}: not a regular file: refusing to replace it", exit_code=EXIT_CANTCREAT)


def write_output_file(path: str, data: bytes, *, force: bool, what: str, mode: int = 0o644) -> None:
    """Write `data` to a new file at `path` (see `check_output_path`): a temp file in the same
    directory, opened through a no-follow handle on that directory, then hard-linked into place
    (fails if the name appeared meanwhile) or, with `force`, renamed over the old regular file. A
    rename replaces a name, so no write ever goes through a link planted there."""
    check_output_path(path, force=force, what=what)
    target = Path(path)
    name = target.name
    try:
        dfd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(target.parent):
            raise DataError(f"{what} {path}: directory {target.parent} is a symbolic link") from None
        raise from_os_error(exc, f"{what} {path}") from None
    tmp = f".{name}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        try:
            fd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                mode,
                dir_fd=dfd,
            )
        except OSError as exc:
            raise from_os_error(exc, f"{what} {path}") from None
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            if force:
                st = _lstat_at(name, dfd)
                if st is not None and not _is_regular(st):
                    raise GpuguardError(
                        f"{what} {path}: is no longer a regular file: not replaced", exit_code=EXIT_CANTCREAT
                    )
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            else:
                try:
                    os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                except FileExistsError:
                    raise GpuguardError(
                        f"{what} {path}: exists: refusing to overwrite it (--force to replace it)",
                        exit_code=EXIT_CANTCREAT,
                    ) from None
                os.unlink(tmp, dir_fd=dfd)
            os.fsync(dfd)
        except OSError as exc:
            raise from_os_error(exc, f"{what} {path}") from None
        finally:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
    finally:
        os.close(dfd)


def _lstat_at(name: str, dfd: int) -> Any:

    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _is_regular(st: Any) -> bool:

    return stat.S_ISREG(st.st_mode)
