"""`gpu-recover demo`: kill a worker of a real torchrun job mid optimizer step; watch gpuguard bring it back."""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer

from gpuguard.cli._app import console, emit_json, stdout_is_terminal

_STEP = re.compile(r"\[demo\] (generation \d+ step \d+ loss \S+)")
_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def _progress(line: str) -> str | None:
    """The lines of the job's output worth showing, shortened."""
    if m := _STEP.search(line):
        return m.group(1)
    if m := _FAILED.search(line):
        return f"torchrun: local rank {m.group(2)} exited with {m.group(1)}; restarting the worker group"
    if line.startswith("[gpuguard rank 0]") or "SIGKILL at step" in line or "refuses to start" in line:
        return line.split("] ", 1)[-1] if line.startswith("[") else line
    return None


def register(*, app: typer.Typer) -> None:
    """Add the `demo` command to the gpu-recover app."""

    @app.command("demo")
    def demo(
        job_dir: Optional[Path] = typer.Option(None, "--job-dir", help="Where the job lives (default: a new temp dir)."),
        workers: int = typer.Option(4, "--workers", min=2, max=8, help="gloo workers."),
        steps: int = typer.Option(14, "--steps", min=4, help="Training steps."),
        kill_step: int = typer.Option(6, "--kill-step", min=2, help="Step at which rank 2 is SIGKILLed."),
        timeout: float = typer.Option(180.0, "--timeout", help="Give up after this many seconds."),
        as_json: bool = typer.Option(False, "--json", help="One gpuguard.demo/1 document."),
    ) -> int:
        """Run a 4-worker torchrun job, SIGKILL one worker mid optimizer step, recover it, verify the certificate."""
        from gpuguard.recovery import demo as d  # noqa: PLC0415

        if kill_step >= steps:
            from gpuguard.errors import UsageError  # noqa: PLC0415

            raise UsageError("--kill-step must be before the last step")
        job = (job_dir or Path(tempfile.mkdtemp(prefix="gpuguard-demo-"))).resolve()
        if job.exists() and any(job.iterdir()):
            from gpuguard.errors import UsageError  # noqa: PLC0415

            raise UsageError(f"{job} is not empty: pick a new --job-dir")
        job.mkdir(parents=True, exist_ok=True)
        out = console(stderr=as_json)
        victim = min(2, workers - 1)
        argv = d.torchrun_argv(job, workers=workers, steps=steps, kills=[f"{victim}:{kill_step}:mid-update"],
                               max_restarts=3, port=d.free_port(), run_id=f"demo-{job.name}",
                               extra=["--progress", "--sleep", "0.05"])
        out.print(f"[bold]gpuguard demo[/]: {workers} gloo workers under torchrun (torch defaults), job dir {job}")
        out.print(f"  rank {victim} will be SIGKILLed in the middle of its optimizer update at step {kill_step}")
        t0 = time.monotonic()

        def on_line(line: str) -> None:
            text = _progress(line)
            if text:
                out.print(f"  {time.monotonic() - t0:6.1f}s  {text}", markup=False, highlight=False, soft_wrap=True)

        status = out.status("running the job...") if stdout_is_terminal() and not as_json else None
        if status is not None:
            status.start()
        try:
            rc = d.run_job(argv, env=d.worker_env(), timeout_s=timeout, on_line=on_line,
                           log_path=job / "torchrun.log")
        finally:
            if status is not None:
                status.stop()
        res = d.summarize(job)
        res.returncode = rc
        recovered = rc == 0 and len(res.generations) >= 2 and res.final_hashes_equal
        out.print("")
        if res.kill:
            out.print(f"killed rank {res.kill['rank']} at step {res.kill['step']} ({res.kill['point']})")
        if res.resumed_at is not None:
            took = f" {res.resume_s:.1f} s after the kill" if res.resume_s is not None else ""
            out.print(f"resumed at step {res.resumed_at} from the certified frontier (step {res.frontier}){took}; "
                      f"generations {res.generations}")
        out.print(f"every rank ended with the same state digest: {'yes' if res.final_hashes_equal else 'NO'}")
        show_rc, show_text = d.gpu_generation("show", "--job-dir", str(job))
        ver_rc, ver_text = d.gpu_generation("verify", "--job-dir", str(job))
        if "No such command" in show_text + ver_text:  # gpu-generation show/verify not installed yet
            ver_rc, ver_text = d.ledger_summary(job)
            show_text = ""
        res.verify_rc = ver_rc
        if not as_json:
            if show_text:
                out.print("\n$ gpu-generation show --job-dir " + str(job), markup=False, soft_wrap=True)
                out.print(show_text.rstrip(), markup=False, highlight=False, soft_wrap=True)
            out.print("\n$ gpu-generation verify --job-dir " + str(job), markup=False, soft_wrap=True)
            out.print(ver_text.rstrip(), markup=False, highlight=False, soft_wrap=True)
        ok = recovered and ver_rc == 0
        if as_json:
            emit_json({"schema": "gpuguard.demo/1", "job_dir": str(job), "returncode": rc, "recovered": recovered,
                       "generations": res.generations, "kill": res.kill, "resumed_at": res.resumed_at,
                       "frontier": res.frontier, "resume_s": res.resume_s,
                       "final_hashes_equal": res.final_hashes_equal, "verify_rc": ver_rc, "ok": ok})
        else:
            out.print(f"\n{'[green]recovered and certified[/]' if ok else '[red]demo failed[/]'} "
                      f"in {time.monotonic() - t0:.0f} s; job dir kept: {job}")
        return 0 if ok else 1
