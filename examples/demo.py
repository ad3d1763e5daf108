"""`gpu-recover demo`: a real torchrun job loses a worker mid optimizer step and comes back, certified.

It starts 4 gloo workers of `gpuguard.examples.demo_train` under plain `torchrun` (torch's
defaults: the shared store that makes unguarded restarts hang), SIGKILLs rank 2 in the middle of
its optimizer update, lets torchrun restart the group and the gpuguard runtime agree on the
frontier, verify the certificate and restore, then shows the certified generation with
`gpu-generation show` and `verify`. The job directory stays for inspection.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from gpuguard.foundation.errors import UnavailableError
from gpuguard.foundation.steplog import committed_steps
from gpuguard.generation.ledger_open import open_ledger
from gpuguard.generation.verify import verify_ledger
from gpuguard.recovery.rendezvous.signed_state import create_secret_file

RDZV_SECRET_FILE = "rendezvous.secret"  # the demo on etcd: the secret its agents sign the state with


@dataclass
class DemoResult:
    job_dir: Path
    returncode: int
    generations: list[int] = field(default_factory=list)
    kill: dict | None = None
    resumed_at: int | None = None
    frontier: int | None = None
    resume_s: float | None = None
    final_hashes_equal: bool = False
    verify_rc: int | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_argv(
    job_dir: Path,
    *,
    workers: int,
    steps: int,
    kills: list[str],
    max_restarts: int,
    port: int,
    run_id: str,
    extra: Sequence[str] = (),
    etcd_endpoint: str | None = None,
) -> list[str]:
    """The torchrun command line of the demo job (also used by the tests and the benchmark).

    `etcd_endpoint` (HOST:PORT[,...]): the rendezvous on gpuguard's etcd v3 backend instead of c10d
    on `port`, started through the `torchrun` console script (under `-m`, torch's dynamic
    rendezvous spends seconds in `inspect.stack()` on every state change: docs/rendezvous-etcd.md),
    with a rendezvous secret created in the job dir (`RDZV_SECRET_FILE`) that signs its state."""
    if etcd_endpoint:
        launcher = [str(Path(sys.executable).with_name("torchrun"))]
        rdzv = ["--rdzv-backend=gpuguard", f"--rdzv-endpoint={etcd_endpoint}", "--local-addr=127.0.0.1"]
        secret = job_dir / RDZV_SECRET_FILE  # the agents start before the runtime creates generation.key
        if not secret.exists():
            create_secret_file(secret)
        rdzv.append(f"--rdzv-conf=secret_file={secret}")
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run"]
        rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    argv = [
        *launcher,
        "--nnodes=1:1",
        f"--nproc-per-node={workers}",
        f"--max-restarts={max_restarts}",
        *rdzv,
        f"--rdzv-id={run_id}",
        "--monitor-interval=0.1",
        "-m",
        "gpuguard.examples.demo_train",
        "--job-dir",
        str(job_dir),
        "--steps",
        str(steps),
    ]
    for k in kills:
        argv += ["--kill", k]
    return argv + list(extra)


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # torch's defaults: the hard case
    return env


def run_job(
    argv: list[str], *, env: dict[str, str], timeout_s: float, on_line: Callable[[str], None], log_path: Path
) -> int:
    """Run torchrun in its own process group, stream its output, kill the whole group on timeout."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                on_line(line.rstrip("\n"))
                if time.monotonic() > deadline:
                    raise UnavailableError(f"the demo job did not finish within {timeout_s:.0f} s (log: {log_path})")
            return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise UnavailableError(f"the demo job did not finish within {timeout_s:.0f} s (log: {log_path})") from None
        finally:
            stop_job(proc, log_path.parent)


def stop_job(proc: subprocess.Popen, job_dir: Path) -> None:
    """Stop a torchrun job we started: SIGTERM its agent (which stops the workers), then SIGKILL,
    then any worker still alive (workers run in their own sessions, so they outlive a killed agent):
    found by their command line naming this job dir, killed by pid."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass

    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info.get("cmdline") or []
        if "gpuguard.examples.demo_train" in cmd and str(job_dir) in cmd:
            try:
                p.kill()
            except psutil.Error:
                pass


def summarize(job_dir: Path) -> DemoResult:
    """Read what the job left: kills, resumes, final per-rank state digests."""
    res = DemoResult(job_dir, 0)
    out = job_dir / "demo-out"
    kills = (
        sorted((json.loads(p.read_text()) for p in (job_dir / "faults").glob("kill-*.json")), key=lambda k: k["time"])
        if (job_dir / "faults").exists()
        else []
    )
    res.kill = kills[0] if kills else None
    resumes = (
        [json.loads(line) for line in (out / "resume-0.jsonl").read_text().splitlines()]
        if (out / "resume-0.jsonl").exists()
        else []
    )
    res.generations = [r["generation"] for r in resumes]
    if len(resumes) > 1:
        res.resumed_at, res.frontier = resumes[-1]["start_step"], resumes[-1]["frontier_step"]
    finals = [json.loads(p.read_text().splitlines()[-1]) for p in sorted(out.glob("final-*.jsonl"))]
    res.final_hashes_equal = len(finals) > 0 and len({f["hash"] for f in finals}) == 1
    if res.kill and len(resumes) > 1:
        first_commit = first_commit_time(job_dir, resumes[-1]["generation"])
        if first_commit is not None:
            res.resume_s = first_commit - res.kill["time"]
    return res


def first_commit_time(job_dir: Path, generation: int) -> float | None:
    """When the first step of `generation` was committed by every member (their step records)."""
    commits = committed_steps(job_dir, generation)
    if not commits:
        return None
    first = min(c.step for c in commits)
    times = [c.wall for c in commits if c.step == first]
    members = len(open_ledger(job_dir).get(generation).members)
    return max(times) if len(times) == members else None


def gpu_generation(*args: str) -> tuple[int, str]:
    """Run the `gpu-generation` console script (next to this interpreter, else on PATH)."""
    exe = Path(sys.executable).with_name("gpu-generation")
    cmd = [str(exe)] if exe.exists() else [shutil.which("gpu-generation") or "gpu-generation"]
    try:
        proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return proc.returncode, proc.stdout + proc.stderr


def ledger_summary(job_dir: Path) -> tuple[int, str]:
    """What `gpu-generation show` + `verify` say, from the library (used while those commands are
    not installed): the active certificate and the verification verdict."""

    ledger = open_ledger(job_dir)
    cert = ledger.require_active()
    lines = [
        f"generation {cert.generation} (parent {cert.parent_generation}), reason {cert.reason}, "
        f"quiescence {cert.quiescence}",
        f"frontier: step {cert.frontier.step}, state {cert.frontier.state_manifest_digest[:16] or '(initial)'}",
        f"certificate {cert.digest()[:16]}, issued by {cert.issued_by}",
    ]
    lines += [
        f"  rank {m.rank}: incarnation {m.incarnation.id[:12]} pid {m.incarnation.pid} on {m.incarnation.host}"
        + (" (admitted)" if m.rank in cert.admitted else "")
        for m in cert.members
    ]
    report = verify_ledger(ledger, ledger.key) if ledger.key else None
    if report is None:
        return 1, "\n".join(lines + ["verify: no signing key"])
    lines.append(f"verify: generations {report.checked}: " + ("OK" if report.ok else "FAILED"))
    lines += [f"  {f}" for f in report.findings]
    return (0 if report.ok else 1), "\n".join(lines)
