"""What a StepLog call costs inside a training step, against the `logging` line a user would write instead.

    python bench/steplog_cost.py [--json] [--steps N]

Per step the training loop makes 4 calls (begin_step, enter_collective, exit_collective, end_step);
the baseline is one `logging.info` line per event to a file handler (what scripts do today for step
times), which is buffered by the handler but formats a LogRecord each time. Target: < 20 µs per call.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

from gpuguard.collectors.step_records import read_job  # noqa: E402
from gpuguard.foundation.steplog import StepLog  # noqa: E402


def run_steplog(d: str, steps: int) -> tuple[float, float]:
    log = StepLog(d, 0, "bench")
    t0, c0 = time.perf_counter(), time.process_time()
    for s in range(steps):
        log.begin_step(s)
        log.enter_collective(s, "all_reduce", 1 << 20)
        log.exit_collective(s)
        log.end_step(s)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    log.close()
    return dt / (4 * steps), dc / (4 * steps)


def run_logging(d: str, steps: int) -> tuple[float, float]:
    logger = logging.getLogger(f"bench{time.monotonic_ns()}")
    logger.propagate = False
    handler = logging.FileHandler(os.path.join(d, "train.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    t0, c0 = time.perf_counter(), time.process_time()
    for s in range(steps):
        logger.info("step %d begin", s)
        logger.info("step %d all_reduce begin bytes=%d", s, 1 << 20)
        logger.info("step %d all_reduce end", s)
        logger.info("step %d end", s)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    handler.close()
    return dt / (4 * steps), dc / (4 * steps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    sl, lg = [], []
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.repeats):
            sl.append(run_steplog(os.path.join(d, f"s{i}"), args.steps))
            lg.append(run_logging(d, args.steps))
        t0 = time.perf_counter()
        job = read_job(os.path.join(d, "s0"))
        read_s = time.perf_counter() - t0
        kept = len(job.ranks[0].steps)
    s_us, l_us = statistics.median(x for x, _ in sl) * 1e6, statistics.median(x for x, _ in lg) * 1e6
    s_cpu, l_cpu = statistics.median(c for _, c in sl) * 1e6, statistics.median(c for _, c in lg) * 1e6
    rows = [
        {
            "method": "steplog",
            "us_per_call_median": round(s_us, 2),
            "us_per_call_min": round(min(sl)[0] * 1e6, 2),
            "cpu_us_per_call": round(s_cpu, 2),
            "visible_to_readers": "at once (one write per call)",
            "ratio_vs_logging": round(s_us / l_us, 3),
        },
        {
            "method": "logging.FileHandler",
            "us_per_call_median": round(l_us, 2),
            "us_per_call_min": round(min(lg)[0] * 1e6, 2),
            "cpu_us_per_call": round(l_cpu, 2),
            "visible_to_readers": "at once (flush per record)",
            "ratio_vs_logging": 1.0,
        },
    ]
    notes = [
        f"{args.steps} steps × 4 calls, {args.repeats} repeats (median shown); target < 20 µs per call",
        f"reading back one rank's rotated stream ({kept} steps kept): {read_s * 1e3:.1f} ms",
    ]
    emit("steplog_cost", rows, args.json, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
