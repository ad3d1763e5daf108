"""The full `gpu-doctor` Typer app: every subcommand wired together.

Built only when a command needs it (`cli.doctor.main` runs `logs` and `diagnose node` through
`cli._fast` without typer when their arguments are plain). Each command module imports its heavy
dependencies inside the command function, so `gpu-doctor --help` and a cron sweep stay fast and never
import torch.
"""

from __future__ import annotations

import typer

from gpuguard.cli import (
    doctor_contract,
    doctor_job,
    doctor_logs,
    doctor_node,
    doctor_picture,
    doctor_torchrun,
    doctor_watch,
)
from gpuguard.cli._app import make_app

app = make_app(
    "gpu-doctor",
    "Diagnose GPU nodes and torchrun jobs: Xid/ECC/NVML health, logs, dead-vs-slow votes, "
    "collective contracts, cron sweeps and planners.",
)
diagnose_app = typer.Typer(help="Diagnose a node or a job.", no_args_is_help=True)
watch_app = typer.Typer(help="Live views.", no_args_is_help=True)
plan_app = typer.Typer(help="Planners: checkpoint interval, layout shrink, collective cost.", no_args_is_help=True)
app.add_typer(diagnose_app, name="diagnose")
app.add_typer(watch_app, name="watch")
app.add_typer(plan_app, name="plan")

for _module in (doctor_node, doctor_logs, doctor_job, doctor_contract, doctor_torchrun, doctor_watch, doctor_picture):
    _module.register(app=app, diagnose=diagnose_app, watch=watch_app, plan=plan_app)
