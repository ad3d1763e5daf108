"""`gpu-doctor logs --json` writes its events in groups (fewer writes on a 1 GiB log): what was found
before an error further on (a truncated rotated log) is still out, as when events were written one by one."""

from __future__ import annotations

import gzip
import json

from gpuguard.collectors.logscan import LogScan, open_log
from tests.support.cli import run_cli

XID = "[{t:12.6f}] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
NOISE = "[{t:12.6f}] usb 1-1: new high-speed USB device number 3 using xhci_hcd " + "x" * 60 + "\n"


def test_events_found_before_a_truncated_archive_are_written(tmp_path):
    lines = [(XID if i % 97 == 0 else NOISE).format(t=1.0 + i / 1000) for i in range(120_000)]
    whole = gzip.compress("".join(lines).encode(), compresslevel=1)
    log = tmp_path / "kern.log.2.gz"
    log.write_bytes(whole[: len(whole) * 3 // 4])  # cut: the end of the archive is missing
    found = []
    fh, _ = open_log(log)
    try:
        found.extend(e.line for e in LogScan(fh, source=str(log)))
    except (EOFError, OSError):
        pass
    finally:
        fh.close()
    assert len(found) > 256 and len(found) % 256  # more than one group, the last one partial
    r = run_cli("gpu-doctor", "logs", "--json", str(log))
    assert r.returncode == 65 and "truncated or corrupt" in r.stderr
    body = r.stdout[r.stdout.index("[") + 1 :]
    written = [json.loads(chunk.rstrip(",\n ")) for chunk in body.split("\n  ")[1:] if chunk.strip()]
    assert [e["line"] for e in written] == found
