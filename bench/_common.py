"""What every benchmark shares: the `gpuguard.bench/1` JSON document and a plain table."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import Any

SCHEMA = "gpuguard.bench/1"


def wants_json(argv: list[str] | None = None) -> bool:
    return "--json" in (sys.argv[1:] if argv is None else argv)


def emit(name: str, results: list[dict[str, Any]], as_json: bool, notes: Iterable[str] = ()) -> None:
    """Print the results: `{"schema": "gpuguard.bench/1", ...}` with --json, else a table."""
    if as_json:
        doc = {"schema": SCHEMA, "bench": name, "results": results, "notes": list(notes)}
        print(json.dumps(doc, indent=2, default=str))
        return
    print(f"# {name}")
    if results:
        keys: list[str] = []
        for row in results:
            keys.extend(k for k in row if k not in keys)
        widths = {k: max(len(k), *(len(_fmt(r.get(k))) for r in results)) for k in keys}
        print("  ".join(k.ljust(widths[k]) for k in keys))
        for row in results:
            print("  ".join(_fmt(row.get(k)).ljust(widths[k]) for k in keys))
    for note in notes:
        print(f"note: {note}")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
