"""What every operator action returns: one `ActionResult`, printed as `gpuguard.action/1`.

Its own module so that each action (abort, restore, verify, drain, ...) and the shared driver
(`actions.run_action`) can import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SCHEMA = "gpuguard.action/1"


@dataclass
class ActionResult:
    action: str
    outcome: str  # done | noop | dry-run | refused | failed | coalesced | already-advanced | timeout
    exit_code: int
    summary: str
    details: dict[str, Any] = field(default_factory=dict)
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "action": self.action,
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "dry_run": self.dry_run,
            "summary": self.summary,
            "details": self.details,
        }
