"""Membership-transition counterexample benchmark: `python bench/transitions.py [--json] [--real]`.

The same runner as `gpu-generation bench transitions`: every fault schedule against restart-all,
communicator-only and gpuguard, judged by the exact oracle; semantic failures first, then recovery
latency, steps lost and extra synchronisation, with gpuguard's ratios against restart-all.
Exit 0 when gpuguard has no semantic failure, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    from gpuguard.cli.generation_bench import run_bench
    from gpuguard.transitions import report
    from gpuguard.transitions.model import LAYOUTS
    from gpuguard.transitions.strategies import STRATEGIES

    ap = argparse.ArgumentParser(prog="bench/transitions.py", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the gpuguard.bench/1 document")
    ap.add_argument("--real", action="store_true", help="real torchrun/gloo jobs (representative subset)")
    ap.add_argument("--strategy", action="append", choices=STRATEGIES)
    ap.add_argument("--layout", action="append", choices=LAYOUTS)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rows, notes = run_bench(
        real=args.real,
        strategies=args.strategy or list(STRATEGIES),
        layouts=args.layout or list(LAYOUTS),
        seed=args.seed,
    )
    if args.json:
        doc = report.document(rows, notes, {"mode": "real" if args.real else "sim", "seed": args.seed})
        print(json.dumps(doc, indent=2))
    else:
        report.render(rows, notes)
    return 1 if report.gpuguard_failures(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
