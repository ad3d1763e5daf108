"""The sweep's action: drain this node in Slurm or Kubernetes (`gpu-doctor sweep --drain / --run-drain
[--drain-via slurm|kubernetes]`).

Why in the doctor and not with the operator's actions: the drain is what the sweep (and the watcher)
does with a `drain` verdict, and the doctor sits below `recovery/`, so it must not reach up into the
operator's room for it. `gpu-recover` (the operator) imports it from here.

The command is an argv, never a shell line; a node that carries a reason someone else set (an
admin's drain, a maintenance) is left alone; every outcome is one line (`drained`, `not run: ...`,
`failed: ...`), never an exception.

In Kubernetes (`kubectl`, never through a shell) the drain taints the node
`gpuguard.io/gpu-health=drain:NoSchedule` (no new pods; running ones finish, as a Slurm drain lets running
jobs finish; a pod that tolerates the taint, like the gpu-doctor DaemonSet itself, stays schedulable) and
annotates it with the reason (`gpuguard.io/drain-reason`, the text Slurm's Reason= gets). The same rules:
a node cordoned by someone else, or whose reason annotation is not gpu-doctor's, is left alone; without
`kubectl` on PATH it says so and runs nothing.
"""

from __future__ import annotations

import json
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


TAINT_KEY = "gpuguard.io/gpu-health"
TAINT = f"{TAINT_KEY}=drain:NoSchedule"
REASON_ANNOTATION = "gpuguard.io/drain-reason"
MAX_NODE_JSON = 4 << 20  # a Node object is a few KiB; more is not one


def _object(doc: dict[str, Any], key: str) -> dict[str, Any]:
    """`doc[key]` when it is a JSON object, else an empty one (a Node description may lack any part)."""
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def kubernetes_commands(node: str, summary: str) -> list[list[str]]:
    """The taint and the annotation as argvs (`kubectl taint ... --overwrite`, `kubectl annotate ... --overwrite`)."""
    reason = f"{DRAIN_PREFIX} {summary}"[:REASON_MAX].replace("\n", " ")
    return [
        ["kubectl", "taint", "nodes", node, TAINT, "--overwrite"],
        ["kubectl", "annotate", "nodes", node, f"{REASON_ANNOTATION}={reason}", "--overwrite"],
    ]


def foreign_hold(node_json: str) -> str | None:
    """Why the node is someone else's to keep out of service (`kubectl get node -o json`), or None.

    Cordoned (`spec.unschedulable`) without gpuguard's annotation: an admin's cordon, a `kubectl drain`
    for maintenance. gpuguard's own taint or annotation: ours, the drain may be set again."""
    try:
        doc = json.loads(node_json)
    except ValueError:
        return "its description is not JSON"
    if not isinstance(doc, dict):
        return "its description is not a Node object"
    spec = _object(doc, "spec")
    notes = _object(_object(doc, "metadata"), "annotations")
    ours = str(notes.get(REASON_ANNOTATION, "")).startswith(DRAIN_PREFIX)
    if spec.get("unschedulable") and not ours:
        return "cordoned by someone else"
    theirs = notes.get(REASON_ANNOTATION)
    if theirs and not ours:
        return f"{REASON_ANNOTATION} set by someone else ({str(theirs)[:60]})"
    return None


def drain_kubernetes_node(node: str, summary: str, *, timeout_s: float = 10.0) -> DrainResult:
    """Taint and annotate `node` with `kubernetes_commands`, after `foreign_hold` found nobody else's hold."""
    commands = kubernetes_commands(node, summary)
    details: dict[str, Any] = {"node": node, "command": commands[0], "commands": commands}

    def result(outcome: str, code: int, text: str) -> DrainResult:
        return DrainResult(outcome, code, text, details)

    exe = shutil.which("kubectl")
    if exe is None:
        return result("failed", EXIT_CRITICAL, "not run: kubectl is not installed")
    try:
        got = _kubectl(exe, ["get", "node", node, "-o", "json"], timeout_s)
        if got.returncode != 0:
            err = (got.stderr or "").strip().splitlines()
            return result("failed", EXIT_CRITICAL, f"failed: kubectl get node: {err[0] if err else got.returncode}")
        if len(got.stdout or "") > MAX_NODE_JSON:
            return result("failed", EXIT_CRITICAL, "failed: kubectl get node: the answer is too large for a Node")
        theirs = foreign_hold(got.stdout or "")
        if theirs is not None:
            return result("refused", EXIT_REFUSED, f"not run: node {theirs}")
        for argv in commands:
            proc = _kubectl(exe, argv[1:], timeout_s)
            if proc.returncode != 0:
                err = (proc.stderr or "").strip().splitlines()
                return result(
                    "failed",
                    EXIT_CRITICAL,
                    f"failed: kubectl {argv[1]}: exit {proc.returncode} {err[0] if err else ''}".strip(),
                )
    except subprocess.TimeoutExpired:
        return result("timeout", EXIT_TEMPFAIL, f"failed: kubectl timed out after {timeout_s:g} s")
    except OSError as exc:
        return result("failed", EXIT_CRITICAL, f"failed: {exc}")
    return result("done", EXIT_OK, "drained")


def _kubectl(exe: str, args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [exe, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def local_node_name() -> str:
    """This host's short name: the Slurm node name when `--node` is not given."""
    return socket.gethostname().split(".")[0]


DRAIN_VIA = ("slurm", "kubernetes")


def drain_record(node: str, summary: str, *, run: bool, via: str = "slurm", timeout_s: float = 10.0) -> dict[str, Any]:
    """The document's `drain` section for a drain verdict: the command(s), and with `run` what running them did."""
    if via == "kubernetes":
        commands = kubernetes_commands(node, summary)
        ran = drain_kubernetes_node(node, summary, timeout_s=timeout_s).summary if run else None
    else:
        commands = [drain_command(node, summary)]
        ran = drain_node(node, summary, timeout_s=timeout_s).summary if run else None
    return {"via": via, "command": commands[0], "commands": commands, "ran": run, "result": ran}


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
