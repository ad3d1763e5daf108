"""Directory ledger backend: `<job-dir>/ledger/`, safe for many processes and hosts on a POSIX filesystem.

Activation of generation N: write the certificate to a unique temp file, fsync it, then
`os.link` it to `gen-N.json`. link(2) is atomic and fails with EEXIST when the name exists, so
exactly one racer creates generation N, and the final name only ever points at a complete,
fsynced file (a crash leaves at most a stray temp file, which readers ignore). The directory is
fsynced after the link so the new name survives a power loss before `activate` returns. The
chunks a `/2` certificate names (`chunks/<sha256>`) are stored the same way, before it.

Logs (`commits-<G>.log`, `fenced.log`, `refusals.log`) are append-only: one `O_APPEND` write per
record, one JSON line each; a torn last line is ignored by readers. They are *not* fsynced per
record by default: losing the newest commit records after a power loss can only move the
commit frontier back (the safe direction), never forward. Pass `fsync_logs=True` to fsync each.
On NFS, O_APPEND is not atomic across hosts: use the etcd backend for multi-host commit records.
Activating a certificate whose members span hosts warns once per process (`warn_many_hosts`).
"""

from __future__ import annotations

import fcntl
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from gpuguard.foundation.boundedread import CERTIFICATE_BYTES, LEDGER_LOG_BYTES, read_bytes, read_lines
from gpuguard.foundation.errors import NoInputError, from_os_error
from gpuguard.foundation.jobdir import atomic_write_bytes
from gpuguard.generation.chunks import CHUNK_READ_BYTES, Blob, is_sha256
from gpuguard.generation.ledger import Ledger, dumps_record, new_temp_name
from gpuguard.generation.records import Certificate

_GEN = re.compile(r"^gen-(\d+)\.json$")
_warned_many_hosts = False


def warn_many_hosts(hosts: Iterable[str], log: Callable[[str], None] | None = None) -> bool:
    """Once per process, when members sit on more than one host: a directory ledger (and the
    in-place switch's files next to it) only coordinates if the job dir is one filesystem all of
    them share, and nothing proves a member on another host quiet. True when it warned."""
    global _warned_many_hosts
    names = sorted(set(hosts))
    if len(names) <= 1 or _warned_many_hosts:
        return False
    _warned_many_hosts = True
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    msg = (
        f"gpuguard: warning: generation members on {len(names)} hosts ({shown}) share a directory ledger: "
        "that needs one shared filesystem, and a member on another host can only be waited for; "
        "use GPUGUARD_LEDGER=etcd://host:port/prefix for jobs that span hosts"
    )
    (log or (lambda m: print(m, file=sys.stderr, flush=True)))(msg)
    return True


def _write_new(path: Path, data: bytes) -> None:
    """A new file (never an existing one), fully written and fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


class DirectoryLedger(Ledger):
    def __init__(self, root: Path, *, key: bytes | None = None, fsync_logs: bool = False) -> None:
        super().__init__(key)
        self.root = Path(root)
        self.url = str(self.root)
        self.fsync_logs = fsync_logs

    def activate(self, cert: Certificate, *, manifest_ok: bool | None = None) -> None:
        warn_many_hosts(m.incarnation.host for m in cert.members)
        super().activate(cert, manifest_ok=manifest_ok)

    def gen_path(self, generation: int) -> Path:
        return self.root / f"gen-{generation}.json"

    def record_name(self, generation: int) -> str:
        return str(self.gen_path(generation))

    def create_root(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise from_os_error(exc, str(self.root)) from None

    def _read(self, generation: int) -> bytes | None:
        """The stored certificate (bounded: a FIFO, a link or an oversize file is one DataError)."""
        try:
            return read_bytes(
                self.gen_path(generation), max_bytes=CERTIFICATE_BYTES, what="a certificate", follow_links=False
            )
        except NoInputError:
            return None

    def _generations(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise from_os_error(exc, str(self.root)) from None
        return [int(m.group(1)) for n in names if (m := _GEN.match(n))]

    def _create(self, generation: int, data: bytes, refusal: dict[str, Any] | None = None) -> bool:
        tmp = self.root / new_temp_name()
        final = self.gen_path(generation)
        try:
            if generation == 0:
                self.root.mkdir(parents=True, exist_ok=True)
            _write_new(tmp, data)
            try:
                os.link(tmp, final)
            except FileExistsError:
                if refusal is not None:
                    self._append("refusals", refusal)
                return False
            finally:
                os.unlink(tmp)
            self._fsync_dir()
            return True
        except OSError as exc:
            raise from_os_error(exc, str(final)) from None

    def _fsync_dir(self, path: Path | None = None) -> None:
        fd = os.open(self.root if path is None else path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- chunks: <root>/chunks/<sha256>, created once each, like a certificate ---------------
    def chunk_path(self, sha256: str) -> Path:
        return self.root / "chunks" / sha256

    def _read_chunk(self, sha256: str) -> bytes | None:
        try:
            return read_bytes(
                self.chunk_path(sha256), max_bytes=CHUNK_READ_BYTES, what="a certificate chunk", follow_links=False
            )
        except NoInputError:
            return None

    def _write_chunks(self, chunks: Sequence[Blob]) -> None:
        """Each chunk through a temp file, fsync and link(2), as a certificate; one that exists is
        kept (same name, same bytes) and its mtime renewed, so pruning leaves it alone. The
        directory is fsynced before the certificate that names the chunks is created."""
        folder = self.root / "chunks"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for chunk in chunks:
                final = self.chunk_path(chunk.sha256)
                try:
                    os.utime(final, follow_symlinks=False)
                    continue
                except FileNotFoundError:
                    pass
                tmp = folder / new_temp_name()
                _write_new(tmp, chunk.data)
                try:
                    os.link(tmp, final)
                except FileExistsError:
                    pass  # a racer stored the same bytes under the same name
                finally:
                    os.unlink(tmp)
            self._fsync_dir(folder)
            self._fsync_dir()
        except OSError as exc:
            raise from_os_error(exc, str(folder)) from None

    def _chunk_stamps(self) -> dict[str, int]:
        try:
            entries = list(os.scandir(self.root / "chunks"))
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise from_os_error(exc, str(self.root / "chunks")) from None
        return {e.name: e.stat(follow_symlinks=False).st_mtime_ns for e in entries if is_sha256(e.name)}

    def _gen_stamp(self, generation: int) -> int | None:
        try:
            return self.gen_path(generation).stat(follow_symlinks=False).st_mtime_ns
        except FileNotFoundError:
            return None

    def _delete_chunk(self, sha256: str, stamp: int) -> bool:
        """Unlink unless re-written since it was listed (an activator renews a chunk it reuses; the
        window between this stat and the unlink is the directory backend's: prune while no
        activation that could reuse an orphan is under way, e.g. from the activator itself)."""
        path = self.chunk_path(sha256)
        try:
            if path.stat(follow_symlinks=False).st_mtime_ns != stamp:
                return False
            path.unlink()
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise from_os_error(exc, str(path)) from None

    def _log_path(self, log: str) -> Path:
        return self.root / f"{log}.log"

    def _append(self, log: str, record: dict[str, Any]) -> None:
        path = self._log_path(log)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, dumps_record(record))  # one write: appends do not interleave
                if self.fsync_logs:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise from_os_error(exc, str(path)) from None

    def frontier_path(self, generation: int) -> Path:
        return self.root / f"frontier-{int(generation)}.json"

    def _read_frontier(self, generation: int) -> tuple[bytes | None, Any]:
        try:
            raw = read_bytes(self.frontier_path(generation), max_bytes=CERTIFICATE_BYTES, what="a frontier record")
        except NoInputError:
            return None, None
        return raw, raw

    def _write_frontier(self, generation: int, data: bytes, token: Any) -> bool:
        """Under the ledger's frontier lock: still the record `token` read, still no generation
        `generation + 1`; then one atomic replace (temp, fsync, rename, directory fsync)."""
        try:
            fd = os.open(self.root / ".frontier.lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise from_os_error(exc, str(self.root / ".frontier.lock")) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if self._read_frontier(generation)[1] != token or self._read(generation + 1) is not None:
                return False
            atomic_write_bytes(self.frontier_path(generation), data)
            return True
        finally:
            os.close(fd)  # releases the lock

    def _read_log(self, log: str) -> bytes:
        """The log's complete lines, streamed and bounded (`boundedread.read_lines`: an overlong line
        is one garbled record, a FIFO or link one DataError); b"" when it does not exist."""
        try:
            return read_lines(self._log_path(log), max_bytes=LEDGER_LOG_BYTES, what="a ledger log")
        except NoInputError:
            return b""

    def stray_temp_files(self) -> list[str]:
        """Temp files left by a writer that crashed before linking (harmless; reported by verify)."""
        try:
            return sorted(n for n in os.listdir(self.root) if n.startswith(".tmp-"))
        except OSError:
            return []
