"""The README's pictures of `gpu-doctor picture`, made from a real job, not drawn by hand.

    python bench/pictures.py [--job-dir DIR] [--out docs/pictures] [--width 100]

Runs `gpu-recover demo` (4 gloo workers under torchrun, rank 2 SIGKILLed mid optimizer step, a
certified restart; needs torch) into a temporary job directory (removed after) unless --job-dir names
one that already ran, then renders the heatmap and the restart timeline exactly as the terminal shows them
(`cli.doctor_picture.draw` on a recording rich console) into `picture.svg` and writes the job's Chrome
trace to `trace.json` (open it in ui.perfetto.dev). Nothing else is written.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from gpuguard.cli.doctor_picture import draw
from gpuguard.doctor.job_trace import chrome_trace, read_job_history

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--job-dir", type=Path, default=None, help="a job that already ran (default: run the demo)")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "pictures")
    p.add_argument("--width", type=int, default=100)
    args = p.parse_args(argv)
    if args.job_dir is not None:
        return render(args.job_dir, args.out, args.width)
    with tempfile.TemporaryDirectory(prefix="gpuguard-pictures-") as tmp:
        job = Path(tmp) / "job"
        demo = [sys.executable, "-m", "gpuguard.cli.recover", "demo", "--job-dir", str(job), "--steps", "40", "--json"]
        r = subprocess.run(demo, capture_output=True, text=True, timeout=600, check=False)
        if r.returncode != 0:
            print(f"pictures: the demo failed (exit {r.returncode}): {r.stderr.strip()[-500:]}", file=sys.stderr)
            return r.returncode
        return render(job, args.out, args.width)


def render(job: Path, out: Path, width: int) -> int:
    history = read_job_history(job)
    con = Console(record=True, width=width, force_terminal=True, color_system="truecolor", file=sys.stderr)
    draw(history, width, con)
    out.mkdir(parents=True, exist_ok=True)
    con.save_svg(str(out / "picture.svg"), title="gpu-doctor picture --job-dir JOB")
    trace = chrome_trace(history)
    trace["otherData"]["job_dir"] = "JOB"  # no machine path in a committed file
    (out / "trace.json").write_text(json.dumps(trace) + "\n")
    print(f"wrote {out / 'picture.svg'} and {out / 'trace.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
