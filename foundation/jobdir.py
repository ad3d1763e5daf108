"""The job directory layout: one place that knows where every part of a job lives.

The runtime (inside training processes), `gpu-recover`, `gpu-doctor` and `gpu-generation` all
read and write the same `<job-dir>`; they import these helpers instead of hard-coding paths, so
the layout can change in one place. Small JSON records are written atomically (temp file +
fsync + rename) because a worker may be SIGKILLed mid-write and a reader must never see half a
record. Standard library only: `gpu-doctor` imports this and must stay torch-free.

Every file of the job dir and the snapshot root is named once below ("names"); its format, writer
and reader are listed in docs/formats/job-dir.md. Reads go through `foundation.boundedread`.
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

from gpuguard.foundation import boundedread
from gpuguard.foundation.env import SNAPSHOT_ROOT_ENV
from gpuguard.foundation.errors import DataError, GpuguardError, NoInputError, PermissionDeniedError, from_os_error

# ---------------------------------------------------------------- names
# Every file name of the job dir and of the snapshot root, once (docs/formats/job-dir.md lists each
# with its writer and reader). A module that writes or reads one of them asks for its path here.

JOB_JSON = "job.json"
LEDGER_DIR = "ledger"
LEDGER_URL_FILE = "ledger.url"  # the ledger URL `gpu-generation init --ledger` recorded
KEY_FILE = "generation.key"
RANKS_DIR = "ranks"
INCARNATIONS_DIR = "incarnations"
SNAPSHOTS_DIR = "snapshots"
CHECKPOINTS_DIR = "checkpoints"
COORD_DIR = "coord"
INPLACE_DIR = "inplace"  # under coord/
TRACES_DIR = "traces"
AUDIT_LOG = "audit.log"
RESTORE_PIN = "restore.json"  # the state `gpu-recover restore` pinned for the next activation
STATE_FILE = "state.json"  # in every snapshot / checkpoint step directory

JOB_SCHEMA = "gpuguard.job-dir/1"
INCARNATION_SCHEMA = "gpuguard.incarnation/1"
RESTORE_SCHEMA = "gpuguard.restore/1"
STATE_SCHEMA = "gpuguard.snapshot-state/1"
_STEP_DIR = re.compile(r"^step-(\d{1,15})$")


# ---------------------------------------------------------------- paths


def job_json_path(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / JOB_JSON


def ledger_dir(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / LEDGER_DIR


def ledger_url_path(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / LEDGER_URL_FILE


def key_path(job_dir: str | os.PathLike[str]) -> Path:
    """The 0600 signing key (generation/keys.py reads and writes it)."""
    return Path(job_dir) / KEY_FILE


def ranks_dir(job_dir: str | os.PathLike[str]) -> Path:
    """Where the per-rank step logs live (docs/formats/step-log.md)."""
    return Path(job_dir) / RANKS_DIR


def incarnations_dir(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / INCARNATIONS_DIR


def incarnation_path(job_dir: str | os.PathLike[str], incarnation_id: str) -> Path:
    _check_name(incarnation_id, "incarnation id")
    return incarnations_dir(job_dir) / f"{incarnation_id}.json"


def snapshot_root(job_dir: str | os.PathLike[str], override: str | os.PathLike[str] | None = None) -> Path:
    """Where `snapshots/` and `checkpoints/` live: `override`, else $GPUGUARD_SNAPSHOT_ROOT, else the
    job dir. The one rule: the runtime that writes them and every command that reads them agree.
    Not resolved (a caller that must follow a link once does so itself)."""
    chosen = override if override is not None and str(override) else os.environ.get(SNAPSHOT_ROOT_ENV) or job_dir
    return Path(chosen)


def snapshots_dir(root: str | os.PathLike[str]) -> Path:
    """`snapshots/` under the snapshot root (`snapshot_root`)."""
    return Path(root) / SNAPSHOTS_DIR


def snapshot_dir(root: str | os.PathLike[str], step: int) -> Path:
    return snapshots_dir(root) / step_dir_name(step)


def checkpoints_dir(root: str | os.PathLike[str]) -> Path:
    """`checkpoints/` under the snapshot root (`snapshot_root`)."""
    return Path(root) / CHECKPOINTS_DIR


def checkpoint_dir(root: str | os.PathLike[str], step: int) -> Path:
    return checkpoints_dir(root) / step_dir_name(step)


def state_record_path(step_dir: str | os.PathLike[str]) -> Path:
    """A snapshot's `state.json` (`write_snapshot_state` / `read_snapshot_state`)."""
    return Path(step_dir) / STATE_FILE


def coord_dir(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / COORD_DIR


def activation_path(job_dir: str | os.PathLike[str], generation: int) -> Path:
    """The activation record of a generation (docs/formats/activation.md)."""
    return coord_dir(job_dir) / f"activation-g{int(generation)}.json"


def inplace_dir(job_dir: str | os.PathLike[str]) -> Path:
    """Where the in-place switch coordinates (docs/formats/inplace.md; foundation/inplace_files.py)."""
    return coord_dir(job_dir) / INPLACE_DIR


def switch_record_path(job_dir: str | os.PathLike[str], generation: int, rank: int) -> Path:
    """What a member of generation G records of the in-place switch that made it (`switch-g<G>-r<R>.json`)."""
    return inplace_dir(job_dir) / f"switch-g{int(generation)}-r{int(rank)}.json"


def switch_record_paths(job_dir: str | os.PathLike[str], generation: int | None = None) -> list[Path]:
    """Every member's switch record of generation G (None: of every generation), by name."""
    which = "*" if generation is None else str(int(generation))
    return sorted(inplace_dir(job_dir).glob(f"switch-g{which}-r*.json"))


def restore_pin_path(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / RESTORE_PIN


def restore_used_path(job_dir: str | os.PathLike[str], generation: int) -> Path:
    """Where the pin goes once generation G honoured it (`coord/restore-used-g<G>.json`)."""
    return coord_dir(job_dir) / f"restore-used-g{int(generation)}.json"


def unrestorable_path(root: str | os.PathLike[str], manifest_digest: str | None) -> Path:
    """The mark of a state some member failed to load, under the snapshot root's `coord/` (it
    describes a state, so every host that can see the state sees the mark)."""
    return coord_dir(root) / f"unrestorable-{str(manifest_digest)[:32]}.json"


def quiescence_path(job_dir: str | os.PathLike[str], time_ns: int) -> Path:
    """`gpu-recover abort`'s evidence of which incarnations this host saw gone (`coord/quiescence-abort-<ns>.json`)."""
    return coord_dir(job_dir) / f"quiescence-abort-{int(time_ns)}.json"


def traces_dir(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / TRACES_DIR


def audit_log_path(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / AUDIT_LOG


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


MAX_RECORD_BYTES = boundedread.RECORD_BYTES  # job-dir records are a few KiB; a larger file is not one of ours


def read_record(
    path: str | os.PathLike[str], max_bytes: int = MAX_RECORD_BYTES
) -> tuple[dict[str, Any], os.stat_result]:
    """A JSON object from `path` and the `fstat` of the file it was read from (its owner): every
    bound of `foundation.boundedread` (no link, no FIFO, at most `max_bytes`, 64 levels deep).
    NoInputError if missing, DataError if malformed or not a regular file."""
    raw, st = boundedread.read_regular(path, max_bytes=max_bytes, what="a record", follow_links=False)
    try:
        doc = boundedread.parse_json(raw)
    except ValueError as exc:
        raise DataError(f"{path}: malformed JSON ({str(exc)[:200]})") from None
    if not isinstance(doc, dict):
        raise DataError(f"{path}: expected a JSON object")
    return doc, st


def read_json(path: str | os.PathLike[str], max_bytes: int = MAX_RECORD_BYTES) -> dict[str, Any]:
    """A JSON object from `path` (`read_record` without the stat)."""
    return read_record(path, max_bytes)[0]


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


JOB_MARKERS = (JOB_JSON, LEDGER_DIR, LEDGER_URL_FILE, KEY_FILE)  # what makes a directory a job's


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
    """Every incarnation record, oldest file first; an unreadable one is yielded as its DataError
    (`iter_incarnation_files` adds who owns each file)."""
    for item in iter_incarnation_files(job_dir):
        yield item if isinstance(item, DataError) else item[0]


def iter_incarnation_files(job_dir: str | os.PathLike[str]) -> Iterator[tuple[IncarnationRecord, int] | DataError]:
    """Every incarnation record with the uid that owns its file (the kernel's fact, not the record's:
    the worker that wrote it ran as that user), oldest file first; an unreadable one as its DataError.

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
            doc, st = read_record(path)
            record = IncarnationRecord.from_dict(doc)
        except NoInputError:
            continue  # removed between listing and reading
        except GpuguardError as exc:
            yield DataError(f"{path}: {exc}")
            continue
        yield record, st.st_uid  # the owner of the very file that was read


def read_incarnations(job_dir: str | os.PathLike[str]) -> list[IncarnationRecord]:
    """The well-formed incarnation records (see `iter_incarnations` for the malformed ones)."""
    return [r for r in iter_incarnations(job_dir) if isinstance(r, IncarnationRecord)]


# ---------------------------------------------------------------- restore.json


@dataclass(frozen=True)
class RestorePin:
    """`restore.json` (`gpuguard.restore/1`): the state `gpu-recover restore` chose. The next
    activation starts from `step` at most (its only field the runtime acts on); the rest says which
    copy was verified, for the operator and the audit log."""

    step: int
    path: str = ""
    kind: str = ""
    generation: int | None = None
    manifest_digest: str | None = None
    state_digest: str | None = None
    pinned_at: float = 0.0

    def choice(self) -> dict[str, Any]:
        """What names the state (everything but `pinned_at`): two pins with equal choices are one pin."""
        doc = self.to_dict()
        doc.pop("pinned_at")
        return doc

    def to_dict(self) -> dict[str, Any]:
        return {"schema": RESTORE_SCHEMA, **asdict(self)}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> RestorePin:
        step = doc.get("step")
        if type(step) is not int or step < 0:
            raise DataError(f"{RESTORE_PIN}: step must be an integer >= 0, got {str(step)[:40]!r}")
        gen = doc.get("generation")
        try:
            return cls(
                step=step,
                path=str(doc.get("path", "")),
                kind=str(doc.get("kind", "")),
                generation=None if gen is None else int(gen),
                manifest_digest=_opt_str(doc.get("manifest_digest")),
                state_digest=_opt_str(doc.get("state_digest")),
                pinned_at=float(doc.get("pinned_at", 0.0)),
            )
        except (TypeError, ValueError) as exc:
            raise DataError(f"{RESTORE_PIN}: {exc}") from None


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def read_restore_pin(job_dir: str | os.PathLike[str]) -> RestorePin | None:
    """The pin, or None when there is none; DataError (65) when the file is not one."""
    try:
        return RestorePin.from_dict(read_json(restore_pin_path(job_dir)))
    except NoInputError:
        return None


def write_restore_pin(job_dir: str | os.PathLike[str], pin: RestorePin) -> Path:
    path = restore_pin_path(job_dir)
    atomic_write_json(path, pin.to_dict())
    return path


def consume_restore_pin(job_dir: str | os.PathLike[str], generation: int) -> Path:
    """The pin is used once: moved to `coord/restore-used-g<G>.json` when generation G honoured it,
    so later generations are bounded by their commits again."""
    used = restore_used_path(job_dir, generation)
    used.parent.mkdir(parents=True, exist_ok=True)
    refuse_linked_dir(used.parent)
    os.replace(restore_pin_path(job_dir), used)
    fsync_dir(used.parent)
    return used


# ---------------------------------------------------------------- state.json


@dataclass(frozen=True)
class SnapshotState:
    """`state.json` (`gpuguard.snapshot-state/1`) of a snapshot or checkpoint step directory: which
    step and generation, and the digest of the state as it was in memory. One record for both
    writers (replicated `recovery.snapshots.store.save_snapshot`, sharded `recovery.snapshots.sharded`):
    the sharded one adds `layout` and `world_size`."""

    step: int
    generation: int | None
    state_digest: str | None
    owner: str = ""
    time: float = 0.0
    keys: tuple[str, ...] = ()
    layout: str | None = None  # "gpuguard.sharded/1" for a sharded snapshot; absent for a replicated one
    world_size: int | None = None  # sharded only: the number of parts

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "schema": STATE_SCHEMA,
            "step": self.step,
            "generation": self.generation,
            "state_digest": self.state_digest,
            "owner": self.owner,
            "time": self.time,
            "keys": sorted(self.keys),
        }
        if self.layout is not None:
            doc["layout"] = self.layout
        if self.world_size is not None:
            doc["world_size"] = self.world_size
        return doc

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> SnapshotState:
        if doc.get("schema") != STATE_SCHEMA or type(doc.get("step")) is not int:
            raise DataError(f"not a {STATE_SCHEMA} record")
        gen, world, keys = doc.get("generation"), doc.get("world_size"), doc.get("keys", [])
        if (gen is not None and type(gen) is not int) or (world is not None and type(world) is not int):
            raise DataError(f"{STATE_FILE}: generation and world_size must be integers")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise DataError(f"{STATE_FILE}: keys must be a list of strings")
        try:
            return cls(
                step=doc["step"],
                generation=gen,
                state_digest=_opt_str(doc.get("state_digest")),
                owner=str(doc.get("owner", "")),
                time=float(doc.get("time", 0.0)),
                keys=tuple(keys),
                layout=_opt_str(doc.get("layout")),
                world_size=world,
            )
        except (TypeError, ValueError) as exc:
            raise DataError(f"{STATE_FILE}: {exc}") from None


def write_snapshot_state(step_dir: str | os.PathLike[str], state: SnapshotState) -> Path:
    """`state.json` into a (staging) step directory, atomically."""
    path = state_record_path(step_dir)
    atomic_write_json(path, state.to_dict())
    return path


def read_snapshot_state(step_dir: str | os.PathLike[str]) -> SnapshotState:
    """A step directory's `state.json`: NoInputError if missing, DataError if not a record."""
    path = state_record_path(step_dir)
    try:
        return SnapshotState.from_dict(read_json(path))
    except DataError as exc:
        if str(exc).startswith(str(path)):
            raise
        raise DataError(f"{path}: {exc}") from None


# ---------------------------------------------------------------- unrestorable marks


def mark_unrestorable(
    root: str | os.PathLike[str], *, step: int, path: str | os.PathLike[str], manifest_digest: str | None, reason: str
) -> bool:
    """Remember (under the snapshot root) that this exact state could not be loaded, so the next
    activation falls back to an older one instead of failing the same way forever. Best effort:
    False when the mark could not be written (the activation that failed says so itself)."""
    try:
        atomic_write_json(
            unrestorable_path(root, manifest_digest),
            {
                "step": step,
                "path": str(path),
                "manifest_digest": manifest_digest,
                "reason": reason[:500],
                "time": time.time(),
            },
        )
    except (OSError, GpuguardError):
        return False
    return True


def is_unrestorable(root: str | os.PathLike[str], manifest_digest: str | None) -> bool:
    return os.path.lexists(unrestorable_path(root, manifest_digest))
