"""The sweep's action: drain this node in Slurm (`gpu-doctor sweep --drain / --run-drain`).

Why in the doctor and not with the operator's actions: the drain is what the sweep (and the watcher)
does with a `drain` verdict, and the doctor sits below `recovery/`, so it must not reach up into the
operator's room for it. `gpu-recover` (the operator) imports it from here.

The command is an argv, never a shell line; a node that carries a reason someone else set (an
admin's drain, a maintenance) is left alone; every outcome is one line (`drained`, `not run: ...`,
`failed: ...`), never an exception.
"""

from __future__ import annotations

import re
import shlex
import shutil
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuguard.foundation.errors import EXIT_CRITICAL, EXIT_OK, EXIT_REFUSED, EXIT_TEMPFAIL

DRAIN_PREFIX = "gpu-doctor:"  # every Reason= gpu-doctor sets starts with this: a drain it may own
REASON_MAX = 200  # what `drain_command` keeps of the reason
_REASON_RE = re.compile(r"\bReason=(.*?)(?: \w+=|$)")


@dataclass(frozen=True)
class DrainResult:
    """What one drain attempt did: outcome done | refused | failed | timeout, and the one-line summary."""

    outcome: str
    exit_code: int
    summary: str
    details: dict[str, Any] = field(default_factory=dict)  # the node and the command


def drain_command(node: str, summary: str) -> list[str]:
    """`scontrol update NodeName=<node> State=DRAIN Reason=gpu-doctor: <summary>` as an argv."""
    reason = f"{DRAIN_PREFIX} {summary}"[:REASON_MAX].replace("\n", " ")
    return ["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"]


def drain_command_line(node: str, summary: str) -> str:
    """`drain_command` as a line to print and paste: quoted with `shlex.join` (the reason has spaces,
    and a summary from a log may hold `;`, `$(...)` or quotes)."""
    return shlex.join(drain_command(node, summary))


def foreign_reason(show_output: str) -> str | None:
    """The Reason= in `scontrol show node <node> -o` output when someone other than gpu-doctor set it.

    None when there is no reason (`(null)` or empty) or it is gpu-doctor's own: then a drain may be set.
    """
    match = _REASON_RE.search(show_output or "")
    if match and match.group(1) not in ("(null)", "") and not match.group(1).startswith(DRAIN_PREFIX):
        return match.group(1)
    return None


def drain_node(node: str, summary: str, *, timeout_s: float = 10.0) -> DrainResult:
    """Drain `node` in Slurm with `drain_command`, never through a shell.

    A node that already carries a reason someone else set (an admin's drain, a maintenance) is left
    alone: outcome `refused`. The summary is the one line the sweep reports: `drained`, `not run: ...`
    or `failed: ...`.
    """
    command = drain_command(node, summary)
    details: dict[str, Any] = {"node": node, "command": command}

    def result(outcome: str, code: int, text: str) -> DrainResult:
        return DrainResult(outcome, code, text, details)

    exe = shutil.which(command[0])
    if exe is None:
        return result("failed", EXIT_CRITICAL, "not run: scontrol is not installed")
    try:
        show = subprocess.run(
            [exe, "show", "node", node, "-o"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        theirs = foreign_reason(show.stdout or "")
        if theirs is not None:
            return result(
                "refused", EXIT_REFUSED, f"not run: node already has a reason set by someone else ({theirs[:60]})"
            )
        proc = subprocess.run(
            [exe, *command[1:]],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return result("timeout", EXIT_TEMPFAIL, f"failed: scontrol timed out after {timeout_s:g} s")
    except OSError as exc:
        return result("failed", EXIT_CRITICAL, f"failed: {exc}")
    if proc.returncode == 0:
        return result("done", EXIT_OK, "drained")
    err = (proc.stderr or "").strip().splitlines()
    return result("failed", EXIT_CRITICAL, f"failed: exit {proc.returncode} {err[0] if err else ''}".strip())


def local_node_name() -> str:
    """This host's short name: the Slurm node name when `--node` is not given."""
    return socket.gethostname().split(".")[0]


def drain_record(node: str, summary: str, *, run: bool, timeout_s: float = 10.0) -> dict[str, Any]:
    """The document's `drain` section for a drain verdict: the command, and with `run` what running it did."""
    return {
        "command": drain_command(node, summary),
        "ran": run,
        "result": drain_node(node, summary, timeout_s=timeout_s).summary if run else None,
    }


def identity_note(identity: Mapping[str, Any], serials: Sequence[str] = ()) -> str:
    """` [boot 1a2b3c4d; serial 1324...; evidence 2024-08-30T11:40:01+00:00..11:45:09]`: whose verdict a drain
    mark is, so a replaced GPU or a rebooted node is not taken for the one that was drained."""
    parts = []
    if identity.get("boot_id"):
        parts.append(f"boot {str(identity['boot_id'])[:8]}")
    if serials:
        parts.append("serial " + ",".join(serials[:2]))
    first, last = identity.get("evidence_from"), identity.get("evidence_to")
    if first:
        parts.append(f"evidence {first}" + (f"..{str(last)[11:19]}" if last and last != first else ""))
    return f" [{'; '.join(parts)}]" if parts else ""


def drain_reason(verdict: Any) -> str:
    """The drain's reason: the verdict's summary, cut so that its identity note always fits."""
    serials = [g.serial for g in verdict.gpus if g.verdict == "drain" and getattr(g, "serial", None)]
    note = identity_note(verdict.identity, serials)
    room = REASON_MAX - len(DRAIN_PREFIX) - 1 - len(note)
    summary = verdict.summary if len(verdict.summary) <= room else verdict.summary[: max(0, room - 3)] + "..."
    return summary + note
