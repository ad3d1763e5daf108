"""`gpu-recover demo`: kill a worker of a real torchrun job mid optimizer step; watch gpuguard bring it back.

`--scenario node-loss`: lose a whole node of a 3-agent torchrun job; the survivors switch in place.
`--scenario fsdp`: lose a node of a 4-agent FSDP2 job; certified restart at world 3, resharded.
`--scenario hsdp`: lose a node of a 4-agent HSDP job; the survivors go on in place, resharded from memory."""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Any

import typer

from gpuguard.cli._app import console, emit_json, stdout_is_terminal
from gpuguard.foundation.errors import EXIT_OK, EXIT_WARNING

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


class Scenario(str, Enum):
    restart = "restart"
    node_loss = "node-loss"
    fsdp = "fsdp"
    hsdp = "hsdp"


class Shrink(str, Enum):
    """The in-place runtime's shrink policy (`InPlaceRuntime(shrink=...)`), for the hsdp scenario."""

    repartition = "repartition"
    keep_layout = "keep-layout"


@contextmanager
def _spinner(out, as_json: bool) -> Iterator[None]:
    """A status spinner while the job runs, on a terminal only."""
    if not stdout_is_terminal() or as_json:
        yield
        return
    with out.status("running the job..."):
        yield


def _show_and_verify(out, job: Path, as_json: bool) -> int:
    """Print `gpu-generation show` + `verify` of the job (not with --json); verify's exit code."""
    from gpuguard.examples import demo as d

    show_rc, show_text = d.gpu_generation("show", "--job-dir", str(job))
    ver_rc, ver_text = d.gpu_generation("verify", "--job-dir", str(job))
    if "No such command" in show_text + ver_text:  # gpu-generation show/verify not installed yet
        ver_rc, ver_text = d.ledger_summary(job)
        show_text = ""
    if not as_json:
        if show_text:
            out.print("\n$ gpu-generation show --job-dir " + str(job), markup=False, soft_wrap=True)
            out.print(show_text.rstrip(), markup=False, highlight=False, soft_wrap=True)
        out.print("\n$ gpu-generation verify --job-dir " + str(job), markup=False, soft_wrap=True)
        out.print(ver_text.rstrip(), markup=False, highlight=False, soft_wrap=True)
    return ver_rc


def _node_loss(job: Path, steps: int, kill_step: int, timeout: float, as_json: bool) -> int:
    from gpuguard.examples import demo_node_loss as nl

    out = console(stderr=as_json)
    out.print(f"[bold]gpuguard demo[/] (node loss): {nl.LAUNCHER}; job dir {job}")
    out.print(f"  the node running rank 0 (agent + worker) will be SIGKILLed once step {kill_step} is committed")
    t0 = time.monotonic()

    def on_event(text: str) -> None:
        out.print(f"  {time.monotonic() - t0:6.1f}s  {text}", markup=False, highlight=False, soft_wrap=True)

    with _spinner(out, as_json):
        res = nl.run_node_loss(job, steps=steps, kill_step=kill_step, timeout_s=timeout, on_event=on_event)
    if res.resume_s is not None and not as_json:
        out.print(
            f"\nin place: the survivors committed their first step of generation 2 "
            f"{res.resume_s:.2f} s after the kill; no process restarted"
        )
    ver_rc = _show_and_verify(out, job, as_json)
    return _finish(
        out,
        as_json,
        t0,
        "node loss survived in place, certified",
        {
            "scenario": "node-loss",
            "launcher": res.launcher,
            "job_dir": str(job),
            "recovered": res.recovered,
            "kill": res.kill,
            "generations": res.generations,
            "switch": res.switch,
            "reason": res.reason,
            "frontier": res.frontier,
            "resume_s": res.resume_s,
            "survivors": res.survivors,
            "pids_unchanged": res.pids_unchanged,
            "matches_reference": res.matches_reference,
            "agents_restarted_nothing": res.agents_restarted_nothing,
            "verify_rc": ver_rc,
            "ok": res.recovered and ver_rc == EXIT_OK,
        },
    )


def _run_sharded(
    job: Path, as_json: bool, title: str, victim: int, kill_step: int, run: Callable[[Callable[[str], None]], Any]
) -> tuple[Any, float, Any]:
    """The sharded demos' frame: the header, one line per milestone, then `show` and `verify --deep`."""
    from gpuguard.examples import demo as d

    out = console(stderr=as_json)
    out.print(f"[bold]gpuguard demo[/] {title}; job dir {job}")
    out.print(f"  the node running rank {victim} (agent + worker) will be SIGKILLed once step {kill_step} is committed")
    t0 = time.monotonic()

    def on_event(text: str) -> None:
        out.print(f"  {time.monotonic() - t0:6.1f}s  {text}", markup=False, highlight=False, soft_wrap=True)

    with _spinner(out, as_json):
        res = run(on_event)
    if not as_json:
        _, show_text = d.gpu_generation("show", "--job-dir", str(job))
        out.print("\n$ gpu-generation show --job-dir " + str(job), markup=False, soft_wrap=True)
        out.print(show_text.rstrip(), markup=False, highlight=False, soft_wrap=True)
        out.print("\n$ gpu-generation verify --deep --job-dir " + str(job), markup=False, soft_wrap=True)
        out.print(res.verify_deep.rstrip(), markup=False, highlight=False, soft_wrap=True)
    return out, t0, res


def _fsdp(job: Path, steps: int, kill_step: int, timeout: float, as_json: bool) -> int:
    from gpuguard.examples import demo_fsdp as fd

    out, t0, res = _run_sharded(
        job,
        as_json,
        f"(FSDP2, sharded state): {fd.LAUNCHER}",
        fd.VICTIM_RANK,
        kill_step,
        lambda on_event: fd.run_fsdp(job, steps=steps, kill_step=kill_step, timeout_s=timeout, on_event=on_event),
    )
    return _finish(
        out,
        as_json,
        t0,
        "node loss survived: certified restart at world 3, resharded",
        _sharded_doc("fsdp", job, res, fd, "first_world steps_lost rng", certified_plan_held=res.plan_held),
    )


def _hsdp(job: Path, steps: int, kill_step: int, timeout: float, as_json: bool, shrink: Shrink) -> int:
    from gpuguard.examples import demo_hsdp as hd

    out, t0, res = _run_sharded(
        job,
        as_json,
        f"(HSDP, sharded state, in place, shrink policy {shrink.value}): {hd.LAUNCHER}",
        hd.VICTIM_RANK,
        kill_step,
        lambda on_event: hd.run_hsdp(
            job, steps=steps, kill_step=kill_step, timeout_s=timeout, on_event=on_event, shrink=shrink.value
        ),
    )
    success = (
        "node loss survived in place: the damaged replica dropped whole, the HSDP layout kept, nothing moved"
        if shrink is Shrink.keep_layout
        else "node loss survived in place: the lost rank's shards taken from its replica, resharded over 3"
    )
    return _finish(
        out,
        as_json,
        t0,
        success,
        _sharded_doc(
            "hsdp",
            job,
            res,
            hd,
            "switch steps_redone pids_unchanged compared_with_generation_1 elements_moved elements "
            "agents_restarted_nothing dropped rebuilt",
            shrink=shrink.value,
        ),
    )


# What every sharded demo reports (FSDP restart, HSDP in place), by its result's field names.
_SHARDED_FIELDS = (
    "launcher recovered kill generations reason world_after frontier resume_s restored_bitwise reshard_lines "
    "final_max_abs_diff matches_reference verify_deep_rc"
).split()


def _sharded_doc(scenario: str, job: Path, res: Any, demo: Any, own: str, **specific: Any) -> dict[str, Any]:
    """The gpuguard.demo/1 fields of a sharded demo: the common ones, then its `own` (field names)."""
    return {
        "scenario": scenario,
        "job_dir": str(job),
        **{name: getattr(res, name) for name in (*_SHARDED_FIELDS, *own.split())},
        "tolerance": {"atol": demo.ATOL, "rtol": demo.RTOL},
        **specific,
        "ok": res.recovered and res.verify_deep_rc == EXIT_OK,
    }


def _finish(out, as_json: bool, t0: float, success: str, doc: dict) -> int:
    """The last word: the gpuguard.demo/1 document, or one line; exit 0 when the demo's `ok`."""
    if as_json:
        emit_json({"schema": "gpuguard.demo/1", **doc})
    else:
        out.print(
            f"\n{f'[green]{success}[/]' if doc['ok'] else '[red]demo failed[/]'} "
            f"in {time.monotonic() - t0:.0f} s; job dir kept: {doc['job_dir']}"
        )
    return EXIT_OK if doc["ok"] else EXIT_WARNING


def register(*, app: typer.Typer) -> None:
    """Add the `demo` command to the gpu-recover app."""

    @app.command("demo")
    def demo(
        job_dir: Path | None = typer.Option(None, "--job-dir", help="Where the job lives (default: a new temp dir)."),
        workers: int = typer.Option(4, "--workers", min=2, max=8, help="gloo workers."),
        steps: int = typer.Option(14, "--steps", min=4, help="Training steps."),
        kill_step: int = typer.Option(
            6,
            "--kill-step",
            min=2,
            help="Step at which rank 2 is SIGKILLed (node-loss: the node goes once this step is committed).",
        ),
        timeout: float = typer.Option(180.0, "--timeout", help="Give up after this many seconds."),
        as_json: bool = typer.Option(False, "--json", help="One gpuguard.demo/1 document."),
        rdzv_endpoint: str | None = typer.Option(
            None,
            "--rdzv-endpoint",
            metavar="HOST:PORT",
            help="etcd v3 HOST:PORT[,...]: rendezvous on --rdzv-backend=gpuguard instead of c10d (restart scenario).",
        ),
        scenario: Scenario = typer.Option(
            Scenario.restart,
            "--scenario",
            help="restart: a worker SIGKILLed, certified restart. node-loss: 3 torchrun agents, one node (agent + "
            "worker) SIGKILLed, the survivors switch generation in place (--workers is ignored; --kill-step: "
            "kill once that step is committed). fsdp: 4 agents train an FSDP2 model with sharded snapshots, one "
            "node SIGKILLed once --kill-step is committed, certified restart at world 3 resharded, verify --deep. "
            "hsdp: 4 agents train an HSDP (2x2) model, one node SIGKILLed once --kill-step is committed, the "
            "survivors switch in place to FSDP2 over 3, the lost shards taken from their replica in memory.",
        ),
        shrink: Shrink = typer.Option(
            Shrink.repartition,
            "--shrink",
            help="hsdp only: repartition (reshard over the 3 survivors from memory) or keep-layout (drop the "
            "damaged replica whole, keep the HSDP layout: 0 elements move).",
        ),
    ) -> int:
        """Run a 4-worker torchrun job, SIGKILL one worker mid optimizer step, recover it, verify the certificate.

        With --scenario node-loss: lose a whole node; the survivors continue in place, no restart."""
        from gpuguard.foundation.optional import check_torch

        check_torch("gpu-recover demo")  # the demo's workers train with torch: one line, exit 69
        from gpuguard.examples import demo as d

        if kill_step >= steps:
            from gpuguard.foundation.errors import UsageError

            raise UsageError("--kill-step must be before the last step")
        if shrink is not Shrink.repartition and scenario is not Scenario.hsdp:
            from gpuguard.foundation.errors import UsageError

            raise UsageError("--shrink applies to --scenario hsdp only")
        job = (job_dir or Path(tempfile.mkdtemp(prefix="gpuguard-demo-"))).resolve()
        if job.exists() and any(job.iterdir()):
            from gpuguard.foundation.errors import UsageError

            raise UsageError(f"{job} is not empty: pick a new --job-dir")
        job.mkdir(parents=True, exist_ok=True)
        if scenario is Scenario.node_loss:
            return _node_loss(job, steps, kill_step, timeout, as_json)
        if scenario is Scenario.fsdp:
            return _fsdp(job, steps, kill_step, timeout, as_json)
        if scenario is Scenario.hsdp:
            return _hsdp(job, steps, kill_step, timeout, as_json, shrink)
        out = console(stderr=as_json)
        victim = min(2, workers - 1)
        argv = d.torchrun_argv(
            job,
            workers=workers,
            steps=steps,
            kills=[f"{victim}:{kill_step}:mid-update"],
            max_restarts=3,
            port=d.free_port(),
            run_id=f"demo-{job.name}",
            extra=["--progress", "--sleep", "0.05"],
            etcd_endpoint=rdzv_endpoint,
        )
        backend = f"rendezvous on etcd {rdzv_endpoint}" if rdzv_endpoint else "torch defaults"
        out.print(f"[bold]gpuguard demo[/]: {workers} gloo workers under torchrun ({backend}), job dir {job}")
        out.print(f"  rank {victim} will be SIGKILLed in the middle of its optimizer update at step {kill_step}")
        t0 = time.monotonic()

        def on_line(line: str) -> None:
            text = _progress(line)
            if text:
                out.print(f"  {time.monotonic() - t0:6.1f}s  {text}", markup=False, highlight=False, soft_wrap=True)

        with _spinner(out, as_json):
            rc = d.run_job(argv, env=d.worker_env(), timeout_s=timeout, on_line=on_line, log_path=job / "torchrun.log")
        res = d.summarize(job)
        res.returncode = rc
        recovered = rc == 0 and len(res.generations) >= 2 and res.final_hashes_equal
        out.print("")
        if res.kill:
            out.print(f"killed rank {res.kill['rank']} at step {res.kill['step']} ({res.kill['point']})")
        if res.resumed_at is not None:
            took = f" {res.resume_s:.1f} s after the kill" if res.resume_s is not None else ""
            out.print(
                f"resumed at step {res.resumed_at} from the certified frontier (step {res.frontier}){took}; "
                f"generations {res.generations}"
            )
        out.print(f"every rank ended with the same state digest: {'yes' if res.final_hashes_equal else 'NO'}")
        res.verify_rc = ver_rc = _show_and_verify(out, job, as_json)
        return _finish(
            out,
            as_json,
            t0,
            "recovered and certified",
            {
                "scenario": "restart",
                "job_dir": str(job),
                "returncode": rc,
                "recovered": recovered,
                "generations": res.generations,
                "kill": res.kill,
                "resumed_at": res.resumed_at,
                "frontier": res.frontier,
                "resume_s": res.resume_s,
                "final_hashes_equal": res.final_hashes_equal,
                "verify_rc": ver_rc,
                "ok": recovered and ver_rc == EXIT_OK,
            },
        )
