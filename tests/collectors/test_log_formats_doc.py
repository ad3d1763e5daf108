"""docs/log-formats.md names every rule the parser runs (by `Rule.id`), every marker, every event kind
and every catalog fault, and the kernel-log reader's keywords: a rule added without its documentation
fails here."""

from __future__ import annotations

import re

from gpuguard.collectors import kernel_log, logparse, logscan
from gpuguard.foundation import gpu_faults
from tests.support.cli import REPO

DOC = (REPO / "docs" / "log-formats.md").read_text()
CODE = set(re.findall(r"`([^`\n]+)`", DOC))  # every `code span` of the page


def _kinds() -> set[str]:
    """The event kinds of logparse's table (its docstring), the reference list of what rules emit."""
    rows = re.findall(r"^\| ([a-z_, ()]+?) \|", logparse.__doc__ or "", re.M)
    return {k.strip() for row in rows if row.strip() != "kind" for k in re.sub(r"\(.*?\)", "", row).split(",")}


def test_every_rule_id_is_documented():
    ids = [rule.id for rule in logparse.RULES]
    assert len(set(ids)) == len(ids), "rule ids must be unique"
    missing = [i for i in ids if i not in CODE]
    assert not missing, f"rules missing from docs/log-formats.md: {missing}"


def test_every_marker_is_documented():
    missing = [m for m in logparse.MARKERS if m not in CODE and m.strip() not in CODE]
    assert not missing, f"markers missing from docs/log-formats.md: {missing}"


def test_every_event_kind_and_fault_is_documented():
    kinds = _kinds()
    assert {"xid", "gpu_fault", "cuda_error", "rendezvous_error", "config_error"} <= kinds
    assert not [k for k in kinds if k not in CODE], [k for k in kinds if k not in CODE]
    assert not [f for f in gpu_faults.FAULTS if f not in CODE], [f for f in gpu_faults.FAULTS if f not in CODE]


def test_the_scanners_keywords_are_documented():
    assert not [k for k in kernel_log.KEYWORDS if k.decode() not in CODE and k.decode() not in DOC]
    assert "logscan.PREFILTER" in DOC and logscan.PREFILTER
