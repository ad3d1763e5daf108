"""Score `gpu-doctor diagnose node` and `gpu-doctor logs` on the held-out real-log excerpts.

    python bench/heldout.py [--json] [--root DIR]

tests/data/heldout/expectations.yaml says, per excerpt, which node verdicts are acceptable, which
(PCI address, Xid) pairs and which watchdog timeouts (seq, op) must be found, and on which lines an
event may sit (an event elsewhere is invented). The expectations were written before the tool was run.

--root DIR: run the gpuguard package found in DIR/gpuguard instead of the installed one (to score an
older version: `git archive <rev> | tar -x -C /tmp/base/gpuguard`, then `--root /tmp/base`). An old
version without `diagnose node --log` gets training logs as `--kernel-log`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, wants_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HELDOUT = REPO / "tests" / "data" / "heldout"


def _root() -> str | None:
    argv = sys.argv[1:]
    return argv[argv.index("--root") + 1] if "--root" in argv else None


def doctor(args: list[str], root: str | None) -> tuple[int, str, str]:
    code = "import sys\n"
    if root:
        code += f"sys.path.insert(0, {root!r})\n"
    code += "from gpuguard.cli.doctor import main\nsys.argv = ['gpu-doctor', *sys.argv[1:]]\nsys.exit(main())\n"
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, cwd="/", check=False
    )
    return proc.returncode, proc.stdout, proc.stderr


def score(root: str | None = None) -> dict:
    spec = yaml.safe_load((HELDOUT / "expectations.yaml").read_text())
    _, help_text, _ = doctor(["diagnose", "node", "--help"], root)
    has_log = "--log " in help_text or "--log FILE" in help_text
    rows = []
    for case in spec["cases"]:
        path = str(HELDOUT / case["file"])
        flag = "--log" if case["input"] == "log" and has_log else "--kernel-log"
        rc, out, err = doctor(["diagnose", "node", "--json", flag, path], root)
        traceback = "Traceback (most recent call last)" in err
        try:
            node = json.loads(out)
        except ValueError:
            node = {}
        verdict = node.get("verdict", f"exit {rc}")
        xids = sorted(
            {(e.get("pci_bus_id"), e.get("xid")) for e in node.get("events", []) if e.get("kind") == "xid"},
            key=str,
        )
        lrc, lout, lerr = doctor(["logs", "--json", path], root)
        traceback = traceback or "Traceback (most recent call last)" in lerr
        try:
            events = json.loads(lout).get("events", [])
        except ValueError:
            events = []
        watchdog = sorted([e.get("seq"), e.get("op")] for e in events if e.get("kind") == "watchdog_timeout")
        allowed = set(case["event_lines"])
        invented = sorted({e["line"] for e in events if e.get("line") not in allowed})
        want_xids = {tuple(x) for x in case["xids"]}
        rows.append(
            {
                "file": case["file"],
                "verdict": verdict,
                "acceptable": verdict in case["acceptable"],
                "want": case["acceptable"],
                "xids_ok": want_xids <= set(xids),
                "xids_expected": len(want_xids),
                "watchdog_ok": sorted(map(list, case["watchdog"])) == watchdog,
                "watchdog_expected": len(case["watchdog"]),
                "invented_lines": invented,
                "traceback": traceback,
            }
        )
    n = len(rows)
    return {
        "excerpts": n,
        "acceptable": sum(r["acceptable"] for r in rows),
        "acceptable_pct": round(100 * sum(r["acceptable"] for r in rows) / n, 1),
        "xid_pairs_ok": f"{sum(r['xids_ok'] for r in rows if r['xids_expected'])}/"
        f"{sum(1 for r in rows if r['xids_expected'])}",
        "watchdog_ok": f"{sum(r['watchdog_ok'] for r in rows if r['watchdog_expected'])}/"
        f"{sum(1 for r in rows if r['watchdog_expected'])}",
        "invented_events": sum(len(r["invented_lines"]) for r in rows),
        "tracebacks": sum(r["traceback"] for r in rows),
        "rows": rows,
    }


def main() -> int:
    result = score(_root())
    if wants_json():
        summary = {k: v for k, v in result.items() if k != "rows"}
        emit("heldout", [summary], True, [f"{r['file']}: {'ok' if r['acceptable'] else 'BAD'}" for r in result["rows"]])
        return 0
    for r in result["rows"]:
        mark = "ok " if r["acceptable"] else "BAD"
        extra = []
        if not r["xids_ok"]:
            extra.append("xids missing")
        if not r["watchdog_ok"]:
            extra.append("watchdog mismatch")
        if r["invented_lines"]:
            extra.append(f"invented on lines {r['invented_lines']}")
        print(f"{mark} {r['file']:<36} {r['verdict']:<9} want {'/'.join(r['want'])} {'; '.join(extra)}")
    print(
        f"acceptable {result['acceptable']}/{result['excerpts']} ({result['acceptable_pct']} %), "
        f"Xid pairs {result['xid_pairs_ok']}, watchdog {result['watchdog_ok']}, "
        f"invented events {result['invented_events']}, tracebacks {result['tracebacks']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
