"""`python -m gpuguard.testhosts VERB ...`: the harness at a shell, one cluster per state file.

Each invocation loads the state file (JSON, 0600) that `up` wrote, acts, and writes it back under
a lock, so separate commands in separate shells address the same cluster. argparse, not the
gpuguard CLI layer: this package sits below it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpuguard.foundation.errors import EXIT_INTERRUPTED, EXIT_TEMPFAIL, GpuguardError, UnavailableError, UsageError
from gpuguard.testhosts.cleanup import cleanup_all, leftovers
from gpuguard.testhosts.cluster import DEFAULT_STATE, ROLES, SCHEMA, Cluster, up
from gpuguard.testhosts.layout import PREFIX

LOCK_TIMEOUT_S = 30.0
EXEC_TIMEOUT_S = 86_400.0


@contextlib.contextmanager
def _locked(state: Path) -> Iterator[None]:
    """One CLI invocation at a time per state file (bounded wait for the lock)."""
    state.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{state}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise UnavailableError(f"{state}: locked by another command for {LOCK_TIMEOUT_S:g} s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gpuguard.testhosts",
        description="Simulated hosts on one machine (Linux namespaces) for tests, benches and a shell.",
    )
    p.add_argument("--state", type=Path, default=DEFAULT_STATE, help=f"cluster state file (default {DEFAULT_STATE})")
    p.add_argument("--json", action="store_true", help=f"machine-readable output ({SCHEMA})")
    sub = p.add_subparsers(dest="verb", required=True)

    def verb(name: str, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help)
        # Accepted after the verb too: `status --json`, `up --hosts 3 --state F`.
        sp.add_argument("--state", type=Path, default=argparse.SUPPRESS)
        sp.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
        return sp

    sp = verb("up", "start N training hosts and a control host running etcd")
    sp.add_argument("--hosts", type=int, default=3)
    sp.add_argument("--shared", help="directory bound on every training host as shared checkpoint storage")
    sp.add_argument("--rendezvous-host", help="training host serving the rendezvous (default h1)")
    sp.add_argument("--subnet", help="a /24 (or larger) inside 198.18.0.0/15 (default: picked by the cluster id)")
    sp.add_argument("--no-etcd", action="store_true", help="no etcd on the control host")
    sp = verb("exec", "run a command on a host (argument list after --)")
    sp.add_argument("host")
    sp.add_argument("--timeout", type=float, default=EXEC_TIMEOUT_S, help="kill the command after this many seconds")
    sp.add_argument("command", nargs=argparse.REMAINDER)
    sp = verb("power-off", "kill every process on a host at once; its link goes dark")
    sp.add_argument("host", nargs="?")
    sp.add_argument("--role", choices=ROLES, help="the host with this role (rendezvous-host loss: --role rendezvous)")
    for name, text in (
        ("power-on", "boot a powered-off host again"),
        ("partition", "take a host's link down (its processes live on)"),
        ("heal", "bring a partitioned host's link back"),
        ("freeze", "SIGSTOP every process on a host"),
        ("thaw", "SIGCONT every process on a host"),
    ):
        verb(name, text).add_argument("host")
    sp = verb("slow", "delay (netem) and/or rate-limit (tbf) a host's link")
    sp.add_argument("host")
    sp.add_argument("--delay-ms", type=float, default=0.0)
    sp.add_argument("--rate-kbit", type=int)
    sp.add_argument("--clear", action="store_true", help="remove the delay and the limit")
    verb("down", "remove the cluster: processes, namespaces, links, work dir, state file")
    sp = verb("cleanup", f"remove every leftover of this harness (names starting {PREFIX})")
    sp.add_argument("--all", action="store_true", required=True)
    verb("status", "the hosts, their addresses and faults")
    return p


def _emit(args: argparse.Namespace, doc: dict[str, Any], human: str) -> None:
    if args.json:
        print(json.dumps({"schema": SCHEMA, **doc}, indent=2))
    else:
        print(human)


def _status_text(doc: dict[str, Any]) -> str:
    lines = [
        f"cluster {doc['prefix']}  subnet {doc['subnet']}  bridge {doc['bridge']}",
        f"  etcd: {doc['etcd_url'] or '(none)'}   rendezvous: {doc['rendezvous_endpoint']} ({doc['rendezvous_host']})",
        f"  shared storage (training hosts): {doc['shared_path']}",
        f"  job dir (private per host):     {doc['job_dir']}",
    ]
    for h in doc["hosts"]:
        faults = [
            f
            for f, on in (
                ("partitioned", h["partitioned"]),
                ("frozen", h["frozen"]),
                (f"delay {h['delay_ms']:g} ms", h["delay_ms"]),
                (f"rate {h['rate_kbit']} kbit", h["rate_kbit"]),
            )
            if on
        ]
        lines.append(
            f"  {h['name']:<4} {h['role']:<8} {h['address']:<15} {h['ifname']:<15} power {h['power']:<3} "
            f"procs {h['processes']:<3} {', '.join(faults)}"
        )
    caps = doc.get("capabilities") or {}
    if caps and not caps.get("netem", True):
        lines.append("  note: no netem in this kernel: `slow --delay-ms` is unavailable, `slow --rate-kbit` works")
    if doc.get("state_file"):
        lines.append(f"  state: {doc['state_file']}")
    return "\n".join(lines)


def _exec(cluster: Cluster, args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("exec HOST -- COMMAND...: no command")
    proc = cluster.exec(args.host, command, cwd=None)
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        print(f"exec: killed after {args.timeout:g} s", file=sys.stderr)
        return EXIT_TEMPFAIL
    except KeyboardInterrupt:
        # The terminal sent SIGINT to the command too (same process group): give it a moment.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        proc.kill()
        return EXIT_INTERRUPTED
    return rc if rc >= 0 else 128 - rc


def _act(cluster: Cluster, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    verb = args.verb
    if verb == "power-off":
        if bool(args.host) == bool(args.role):
            raise UsageError("power-off: give a HOST or --role ROLE (one of them)")
        host = cluster.host_for_role(args.role) if args.role else cluster.host(args.host)
        cluster.power_off(host)
        return {"verb": verb, "host": host.name}, f"{host.name}: powered off"
    host = cluster.host(args.host)
    if verb == "slow":
        if args.clear:
            cluster.unslow(host)
            return {"verb": verb, "host": host.name, "cleared": True}, f"{host.name}: link shaping removed"
        if not args.delay_ms and not args.rate_kbit:
            raise UsageError("slow: give --delay-ms N and/or --rate-kbit K (or --clear)")
        cluster.slow(host, delay_ms=args.delay_ms, rate_kbit=args.rate_kbit)
        parts = [f"delay {args.delay_ms:g} ms each way"] if args.delay_ms else []
        parts += [f"rate {args.rate_kbit} kbit/s"] if args.rate_kbit else []
        what = ", ".join(parts)
        return {
            "verb": verb,
            "host": host.name,
            "delay_ms": args.delay_ms,
            "rate_kbit": args.rate_kbit,
        }, f"{host.name}: {what}"
    action = {
        "power-on": (cluster.power_on, "powered on"),
        "partition": (cluster.partition, "partitioned (link down)"),
        "heal": (cluster.heal, "healed (link up)"),
        "freeze": (cluster.freeze, "frozen (SIGSTOP)"),
        "thaw": (cluster.thaw, "thawed (SIGCONT)"),
    }[verb]
    action[0](host)
    return {"verb": verb, "host": host.name}, f"{host.name}: {action[1]}"


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    state: Path = args.state
    if args.verb == "cleanup":
        report = cleanup_all()
        left = leftovers()
        doc = {"verb": "cleanup", "removed": report.__dict__, "left": left}
        human = (
            "nothing to clean up"
            if report.empty
            else "removed: " + "; ".join(f"{k} {', '.join(map(str, v))}" for k, v in report.__dict__.items() if v)
        )
        if any(left.values()):
            human += f"\nstill present: {left}"
        _emit(args, doc, human)
        return 0 if not any(left.values()) else 1
    with _locked(state):
        if args.verb == "up":
            if state.exists():
                raise UsageError(f"{state}: a cluster is already up; `down` it first or pass another --state")
            cluster = up(
                args.hosts,
                shared=args.shared,
                state_path=state,
                etcd=not args.no_etcd,
                rendezvous_host=args.rendezvous_host,
                subnet=args.subnet,
                detached=True,
            )
            doc = cluster.status()
            _emit(
                args,
                {"verb": "up", **doc},
                _status_text(doc) + "\n  next: python -m gpuguard.testhosts exec h1 -- hostname",
            )
            return 0
        cluster = Cluster.load(state)
        if args.verb == "status":
            doc = cluster.status()
            _emit(args, {**doc, "verb": "status"}, _status_text(doc))
            return 0
        if args.verb == "down":
            prefix = cluster.prefix
            cluster.down()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{state}.lock")  # held by us; nothing is left to serialize on
            _emit(args, {"verb": "down", "prefix": prefix}, f"cluster {prefix}: down")
            return 0
        if args.verb == "exec":
            return _exec(cluster, args)
        doc, human = _act(cluster, args)
        _emit(args, doc, human)
        return 0


def main(argv: list[str] | None = None) -> int:
    """Run one verb; an expected failure is one line on stderr and its documented exit code."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except GpuguardError as exc:
        print(f"testhosts: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
