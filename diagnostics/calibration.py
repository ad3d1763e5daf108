"""Error rates of a verdict over a labelled set: per class precision, recall, false positives per 1,000
healthy files, and the confusion matrix.

Why: a node-health tool that publishes no error rate asks to be trusted; one public report gives a
node-verdict false-positive rate at all. `bench/heldout.py --calibrate` runs the verdict over the
labelled files (tests/data/calibration.yaml) and hands the (label, prediction) pairs here. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

CLASSES = ("healthy", "degraded", "reset", "drain", "unknown")


@dataclass(frozen=True)
class ClassScore:
    """One verdict class: how often it was predicted rightly, wrongly, and missed."""

    verdict: str
    support: int  # files labelled with this verdict
    predicted: int  # files the tool gave this verdict
    true_positives: int
    precision: float | None  # None: never predicted
    recall: float | None  # None: no file has this label
    fp_per_1000_healthy: float | None  # healthy files given this verdict, per 1,000 healthy files

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "support": self.support,
            "predicted": self.predicted,
            "true_positives": self.true_positives,
            "precision": _round(self.precision),
            "recall": _round(self.recall),
            "fp_per_1000_healthy": _round(self.fp_per_1000_healthy, 1),
        }


@dataclass(frozen=True)
class Calibration:
    """The scores of every class, the confusion matrix (label -> prediction -> count), and the totals."""

    classes: tuple[ClassScore, ...]
    confusion: dict[str, dict[str, int]]
    files: int
    correct: int
    healthy_files: int
    false_alarms: int  # healthy files given any other verdict

    @property
    def fp_per_1000_healthy(self) -> float | None:
        return 1000 * self.false_alarms / self.healthy_files if self.healthy_files else None


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def calibrate(pairs: Iterable[tuple[str, str]], classes: Sequence[str] = CLASSES) -> Calibration:
    """(label, prediction) pairs -> the error rates. A prediction outside `classes` (an exit code, a crash)
    is its own column of the confusion matrix: it is wrong for every label."""
    pairs = list(pairs)
    labels = list(dict.fromkeys([*classes, *(lab for lab, _ in pairs)]))
    columns = list(dict.fromkeys([*labels, *(p for _, p in pairs)]))
    confusion = {lab: dict.fromkeys(columns, 0) for lab in labels}
    for lab, pred in pairs:
        confusion[lab][pred] += 1
    healthy = sum(confusion.get("healthy", {}).values())
    scores = []
    for c in labels:
        support = sum(confusion[c].values())
        predicted = sum(row.get(c, 0) for row in confusion.values())
        tp = confusion[c].get(c, 0)
        fp_healthy = confusion.get("healthy", {}).get(c, 0) if c != "healthy" else 0
        scores.append(
            ClassScore(
                c,
                support,
                predicted,
                tp,
                tp / predicted if predicted else None,
                tp / support if support else None,
                1000 * fp_healthy / healthy if healthy and c != "healthy" else None,
            )
        )
    correct = sum(confusion[c].get(c, 0) for c in labels)
    alarms = healthy - confusion.get("healthy", {}).get("healthy", 0)
    return Calibration(tuple(scores), confusion, len(pairs), correct, healthy, alarms)
