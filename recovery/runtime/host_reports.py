"""The in-place reports of one host's survivors, gathered on the host before one of them publishes them.

At 100,000 ranks one etcd key per survivor's report makes the switch cost 100,000 writes, and the
coordinator's read 100,000 keys. Ranks of one host share a private host directory already (the host
lease's, `recovery.runtime.host_lease`: 0700, host-local, no link followed) and one process table.
So a survivor writes its report there, and the host's *aggregator* publishes the host's reports as
one `HostReport` per block of `HOST_BLOCK` ranks (`EtcdCoordination.aggregate`). The coordinator
then reads O(hosts) keys. The aggregator is the lowest rank that reported on this host and whose
process still runs (pid + start time, this host's process table). Every reporter computes the
same answer each pass of its switch loop, so when the aggregator dies or freezes, the next
reporter publishes instead. Nothing is trusted for that: what gets published is fenced by
`P/active` and the publisher's lease (docs/formats/inplace.md, "Aggregated reports").

Files (in the host directory, every one 0600, replaced atomically):
  reports/g<G>/<rank>-<incarnation>    {"report": Report, "pid", "start_time": the writer's process}
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpuguard.foundation.identity import own_start_time, process_status
from gpuguard.foundation.inplace_files import HOST_BLOCK, REPORT_INLINE_MAX, Report
from gpuguard.recovery.runtime.host_lease import HostDir, open_private_dir, read_at, replace_at
from gpuguard.recovery.runtime.switch import liveness

_NAME = re.compile(r"^(\d{1,9})-([A-Za-z0-9._-]{1,128})$")
_GEN = re.compile(r"^g(\d{1,12})$")
LOCAL_CAP = REPORT_INLINE_MAX + 1024  # the report and its wrapper


@dataclass(frozen=True)
class LocalReport:
    """A report as its writer left it on this host, and the process that wrote it."""

    report: Report
    pid: int
    start_time: float


class HostReports:
    """`reports/` of one host directory (see the module docstring)."""

    def __init__(self, hostdir: HostDir) -> None:
        self.fd = open_private_dir(hostdir.path / "reports")

    def close(self) -> None:
        os.close(self.fd)

    def _gen_fd(self, generation: int) -> int:
        return os.open(f"g{generation}", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=self.fd)

    def put(self, report: Report) -> bool:
        """Leave this process's report for the host's aggregator; False when it is too large to be
        aggregated (REPORT_INLINE_MAX, or an incarnation id no file may be named after) or the
        host directory cannot take it: the writer then publishes it on its own key."""
        data = json.dumps({"report": report.to_dict(), "pid": os.getpid(), "start_time": own_start_time()}).encode()
        name = f"{report.rank}-{report.incarnation_id}"
        if len(data) > LOCAL_CAP or not _NAME.match(name):
            return False
        try:
            try:
                os.mkdir(f"g{report.generation}", 0o700, dir_fd=self.fd)
            except FileExistsError:
                pass
            fd = self._gen_fd(report.generation)
            try:
                replace_at(fd, name, data)
            finally:
                os.close(fd)
            self._prune_below(report.generation)
        except OSError:  # a full or broken host directory: this report goes on its own key
            return False
        return True

    def read(self, generation: int) -> list[LocalReport]:
        """This host's reports of generation G, by rank (torn, foreign or malformed files are skipped)."""
        try:
            fd = self._gen_fd(generation)
        except OSError:
            return []
        out: list[LocalReport] = []
        try:
            for name in sorted(os.listdir(fd)):
                if not _NAME.match(name):
                    continue
                try:
                    doc = json.loads(read_at(fd, name, LOCAL_CAP) or b"")
                    rep = Report.from_dict(doc["report"])
                    pid, start = int(doc["pid"]), float(doc["start_time"])
                except (ValueError, KeyError, TypeError):
                    continue
                if rep.generation == generation and name == f"{rep.rank}-{rep.incarnation_id}":
                    out.append(LocalReport(rep, pid, start))
        finally:
            os.close(fd)
        return sorted(out, key=lambda lr: (lr.report.rank, lr.report.incarnation_id))

    def _prune_below(self, generation: int) -> None:
        """Forget the reports of generations before G (switched out of long ago: nobody reads them)."""
        for name in os.listdir(self.fd):
            m = _GEN.match(name)
            if m is None or int(m.group(1)) >= generation:
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=self.fd)
            except OSError:
                continue
            try:
                for f in os.listdir(fd):
                    os.unlink(f, dir_fd=fd)
            except OSError:
                pass  # another rank of the host prunes it at the same time
            finally:
                os.close(fd)
            try:
                os.rmdir(name, dir_fd=self.fd)
            except OSError:
                pass


def aggregator(local: Iterable[LocalReport], running: Callable[[int, float], bool] | None = None) -> int | None:
    """The rank that publishes this host's reports: the lowest reporter whose process runs (a
    stopped one is skipped: frozen, it must not hold its host's reports back)."""
    alive = running or (lambda pid, start: liveness(process_status(pid, start)) == "running")
    for lr in sorted(local, key=lambda lr: lr.report.rank):
        if alive(lr.pid, lr.start_time):
            return lr.report.rank
    return None


def blocks(reports: Iterable[Report]) -> dict[int, list[Report]]:
    """block -> its reports by rank: what one aggregated key holds (HOST_BLOCK ranks at most)."""
    out: dict[int, list[Report]] = {}
    for rep in sorted(reports, key=lambda r: (r.rank, r.incarnation_id)):
        out.setdefault(rep.rank // HOST_BLOCK, []).append(rep)
    return out
