"""The job directory layout: one place that knows where every part of a job lives.

The runtime (inside training processes), `gpu-recover`, `gpu-doctor` and `gpu-generation` all
read and write the same `<job-dir>`; they import these helpers instead of hard-coding paths, so
the layout can change in one place. Small JSON records are written atomically (temp file +
fsync + rename) because a worker may be SIGKILLed mid-write and a reader must never see half a
record. Standard library only: `gpu-doctor` imports this and must stay torch-free.

Layout (docs/formats/job-dir.md)::

    <job-dir>/job.json                        job id (written by the runtime's first start: `ensure_job`)
    <job-dir>/generation.key                  the 0600 signing key (generation/keys.py)
    <job-dir>/ledger/                         the directory ledger (generation/ledger_dir.py)
    <job-dir>/ranks/                          per-rank step records (foundation/steplog.py)
    <job-dir>/incarnations/<id>.json          one per worker process (this module)
    <job-dir>/snapshots/step-<S>/             DCP snapshot + state.json + gpuguard.manifest.json (recovery/snapshots/store.py)
    <job-dir>/checkpoints/step-<S>/           durable checkpoints, same shape
    <job-dir>/coord/                          activation and in-place files (recovery/, foundation/inplace_files.py)
    <job-dir>/traces/<rank>.<incarnation>.json collective traces
    <job-dir>/audit.log                       operator actions, JSON lines (recovery/operator/audit.py)
"""

from __future__ import annotations

import json
import os
import pwd
import re
import socket
import stat
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpuguard.foundation.errors import DataError, GpuguardError, NoInputError, PermissionDeniedError, from_os_error
from gpuguard.foundation.yamlfile import read_capped  # the one capped reader of regular files

JOB_JSON = "job.json"
JOB_SCHEMA = "gpuguard.job-dir/1"
INCARNATION_SCHEMA = "gpuguard.incarnation/1"
_STEP_DIR = re.compile(r"^step-(\d{1,15})$")


# ---------------------------------------------------------------- paths


def job_json_path(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / JOB_JSON


def ledger_dir(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / "ledger"


def ranks_dir(job_dir: str | os.PathLike[str]) -> Path:
    """Where the per-rank step logs live (docs/formats/step-log.md)."""
    return Path(job_dir) / "ranks"


def incarnations_dir(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / "incarnations"


def incarnation_path(job_dir: str | os.PathLike[str], incarnation_id: str) -> Path:
    _check_name(incarnation_id, "incarnation id")
    return incarnations_dir(job_dir) / f"{incarnation_id}.json"


def snapshots_dir(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / "snapshots"


def snapshot_dir(job_dir: str | os.PathLike[str], step: int) -> Path:
    return snapshots_dir(job_dir) / step_dir_name(step)


def checkpoints_dir(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / "checkpoints"


def checkpoint_dir(job_dir: str | os.PathLike[str], step: int) -> Path:
    return checkpoints_dir(job_dir) / step_dir_name(step)


def coord_dir(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / "coord"


def activation_path(job_dir: str | os.PathLike[str], generation: int) -> Path:
    """The activation record of a generation (docs/formats/activation.md)."""
    return coord_dir(job_dir) / f"activation-g{int(generation)}.json"


def traces_dir(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / "traces"


def audit_log_path(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / "audit.log"


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{int(step)}"


def parse_step_dir(name: str) -> int | None:
    """`step-42` -> 42; anything else (temp dirs, stray files) -> None."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def step_dirs(parent: str | Path) -> list[tuple[int, Path]]:
    """The `step-<S>` folders under `parent`, oldest first (missing parent -> empty)."""
    parent = Path(parent)
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise from_os_error(exc, str(parent)) from exc
    found = []
    for entry in entries:
        step = parse_step_dir(entry.name)
        if step is not None and entry.is_dir(follow_symlinks=False):
            found.append((step, Path(entry.path)))
    return sorted(found)


def _check_name(name: str, what: str) -> None:
    if not name or "/" in name or name in (".", "..") or "\x00" in name:
        raise DataError(f"invalid {what}: {name!r}")


# ---------------------------------------------------------------- atomic JSON


def atomic_write_bytes(path: str | Path, data: bytes, mode: int = 0o644) -> None:
    """Write `data` to `path` so that readers see the old file or the new one, never a mix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    refuse_linked_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def refuse_linked_dir(path: str | os.PathLike[str]) -> None:
    """DataError if the folder a record is written into is a symbolic link: no write follows a link
    (a link planted in a job dir would redirect root's writes anywhere)."""
    if os.path.islink(path):
        raise DataError(f"{path}: is a symbolic link: refusing to write through it")


def fsync_dir(path: str | Path) -> None:
    """Make a rename durable (best effort: some filesystems refuse directory fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_json(path: str | Path, doc: Mapping[str, Any], mode: int = 0o644) -> None:
    atomic_write_bytes(path, (json.dumps(doc, sort_keys=True, indent=1) + "\n").encode(), mode)


MAX_RECORD_BYTES = 16 << 20  # job-dir records are a few KiB; a larger file is not one of ours


def read_json(path: str | os.PathLike[str], max_bytes: int = MAX_RECORD_BYTES) -> dict[str, Any]:
    """A JSON object from `path`: NoInputError if missing, DataError if malformed, a link, not a
    regular file (a FIFO would block) or larger than `max_bytes`."""
    path = Path(path)
    raw = read_capped(path, max_bytes=max_bytes, what="a record", follow_links=False)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: malformed JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise DataError(f"{path}: expected a JSON object")
    return doc


# ---------------------------------------------------------------- job.json


@dataclass(frozen=True)
class JobInfo:
    """`job.json`: the job's identity, fixed at its first start."""

    job_id: str
    created: float
    created_by: str

    def to_dict(self) -> dict[str, Any]:
        return {"schema": JOB_SCHEMA, **asdict(self)}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> JobInfo:
        try:
            job_id = doc["job_id"]
            if not isinstance(job_id, str) or not job_id:
                raise TypeError("job_id must be a non-empty string")
            return cls(job_id=job_id, created=float(doc.get("created", 0.0)), created_by=str(doc.get("created_by", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"job.json: {exc}") from exc


JOB_MARKERS = (JOB_JSON, "ledger", "ledger.url", "generation.key")  # what makes a directory a job's


def require_job_dir(job_dir: str | os.PathLike[str]) -> Path:
    """`job_dir` if it is a gpuguard job (a directory holding `job.json`, a ledger, a recorded ledger
    URL or the signing key), else one NoInputError (66) "no gpuguard job at …": a typo'd path is
    answered as a typo, never with a wait, an "init" hint or files written into it."""
    path = Path(job_dir)
    if not path.is_dir():
        raise NoInputError(f"no gpuguard job at {path} (no such directory)")
    if not any(os.path.lexists(path / marker) for marker in JOB_MARKERS):
        raise NoInputError(f"no gpuguard job at {path} (no {JOB_JSON}, ledger or key there)")
    check_root_safe_dir(path, "job dir")
    return path


def check_root_safe_dir(path: str | os.PathLike[str], what: str) -> None:
    """Run as root, refuse (77, with the fix) a directory another user owns or group/others may write.

    Why: root reads records from it, signals the processes they name and writes into it; whoever
    controls the directory could plant a link, a forged record or a FIFO there for root to act on.
    Not root: nothing to check (the kernel's permissions already bind the caller)."""
    if os.geteuid() != 0:
        return
    try:
        st = os.stat(path)
    except OSError as exc:
        raise from_os_error(exc, f"{what} {path}") from None
    if st.st_uid != 0:
        owner = _user_name(st.st_uid)
        raise PermissionDeniedError(
            f"{what} {path}: owned by {owner} (uid {st.st_uid}) while running as root: another user's "
            f"directory could redirect root's reads and writes; run as that user (`sudo -u {owner} ...`) "
            f"or, if it is root's, `chown root {path}`"
        )
    if st.st_mode & 0o022:
        raise PermissionDeniedError(
            f"{what} {path}: writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}) while running "
            f"as root: anyone who can write there could plant files for root; fix with `chmod go-w {path}`"
        )


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid-{uid}"


def read_job(job_dir: str | os.PathLike[str]) -> JobInfo | None:
    """The job's identity, or None if the job directory has not been initialised."""
    try:
        return JobInfo.from_dict(read_json(job_json_path(job_dir)))
    except NoInputError:
        return None


def ensure_job(job_dir: str | os.PathLike[str], job_id: str | None = None, created_by: str = "runtime") -> JobInfo:
    """Create `job.json` once (race-safe between ranks: the first writer wins); return it."""
    job_dir = Path(job_dir)
    existing = read_job(job_dir)
    if existing is not None:
        return existing
    job_dir.mkdir(parents=True, exist_ok=True)
    info = JobInfo(
        job_id=job_id or job_dir.resolve().name,
        created=time.time(),
        created_by=f"{created_by}@{socket.gethostname()}:{os.getpid()}",
    )
    data = (json.dumps(info.to_dict(), sort_keys=True, indent=1) + "\n").encode()
    fd, tmp = tempfile.mkstemp(prefix=".job.json.", suffix=".tmp", dir=job_dir)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, job_json_path(job_dir))  # atomic create-if-absent
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)
    fsync_dir(job_dir)
    found = read_job(job_dir)
    if found is None:  # pragma: no cover - deleted under our feet
        raise DataError(f"{job_json_path(job_dir)}: vanished while being created")
    return found


# ---------------------------------------------------------------- incarnations


@dataclass(frozen=True)
class IncarnationRecord:
    """What a worker process writes when it starts: enough for `gpu-recover abort` to find it by
    PID (checked against the process create time, so a reused PID is never signalled)."""

    incarnation: Mapping[str, Any]  # generation.records.Incarnation.to_dict()
    rank: int
    local_rank: int
    world_size: int
    generation: int | None  # None until activation certified one
    agent_pid: int
    run_id: str
    master_addr: str
    master_port: int
    restart_count: int
    attempt: str = ""  # the rendezvous attempt token this process joined under
    extra: Mapping[str, Any] = field(default_factory=dict)
    uid: int | None = None  # the real uid the worker ran as (identity.check_job_process); None: older record

    @property
    def incarnation_id(self) -> str:
        return str(self.incarnation["id"])

    @property
    def pid(self) -> int:
        return int(self.incarnation["pid"])

    @property
    def start_time(self) -> float:
        return float(self.incarnation["start_time"])

    @property
    def host(self) -> str:
        return str(self.incarnation.get("host", ""))

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["incarnation"] = dict(self.incarnation)
        doc["extra"] = dict(self.extra)
        return {"schema": INCARNATION_SCHEMA, **doc}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> IncarnationRecord:
        try:
            inc = doc["incarnation"]
            if not isinstance(inc, dict) or "id" not in inc or "pid" not in inc or "start_time" not in inc:
                raise TypeError("incarnation must carry id, pid and start_time")
            gen = doc.get("generation")
            return cls(
                incarnation=dict(inc),
                rank=int(doc["rank"]),
                local_rank=int(doc["local_rank"]),
                world_size=int(doc["world_size"]),
                generation=None if gen is None else int(gen),
                agent_pid=int(doc["agent_pid"]),
                run_id=str(doc["run_id"]),
                master_addr=str(doc["master_addr"]),
                master_port=int(doc["master_port"]),
                restart_count=int(doc["restart_count"]),
                attempt=str(doc.get("attempt", "")),
                extra=dict(doc.get("extra") or {}),
                uid=None if doc.get("uid") is None else int(doc["uid"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"incarnation record: {exc}") from exc


def write_incarnation(job_dir: str | os.PathLike[str], record: IncarnationRecord) -> Path:
    path = incarnation_path(job_dir, record.incarnation_id)
    atomic_write_json(path, record.to_dict())
    return path


def iter_incarnations(job_dir: str | os.PathLike[str]) -> Iterator[IncarnationRecord | DataError]:
    """Every incarnation record, oldest file first; an unreadable one is yielded as its DataError.

    Records come and go while we scan (workers start, temp files are renamed into place): an entry
    that vanishes between the listing and its read is skipped, one that cannot be read (a link, a
    FIFO, garbage, no permission) is reported, and neither ever hides the other records.
    """
    folder = incarnations_dir(job_dir)
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        yield DataError(f"{folder}: cannot list: {exc.strerror or exc}")
        return
    dated: list[tuple[float, str]] = []
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            dated.append((os.lstat(os.path.join(folder, name)).st_mtime, name))
        except FileNotFoundError:
            continue  # renamed or removed since the listing
        except OSError as exc:
            yield DataError(f"{folder / name}: cannot stat: {exc.strerror or exc}")
    for _, name in sorted(dated):
        path = folder / name
        try:
            yield IncarnationRecord.from_dict(read_json(path))
        except NoInputError:
            continue  # removed between listing and reading
        except GpuguardError as exc:
            yield DataError(f"{path}: {exc}")


def read_incarnations(job_dir: str | os.PathLike[str]) -> list[IncarnationRecord]:
    """The well-formed incarnation records (see `iter_incarnations` for the malformed ones)."""
    return [r for r in iter_incarnations(job_dir) if isinstance(r, IncarnationRecord)]
