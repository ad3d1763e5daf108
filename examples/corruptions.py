"""Corruptions a training job can inject into its own state, once each (a marker file), for the
soundness tests and `bench/soundness.py`: what NVRx #349, Megatron-LM #5281 and torchft #309 saw.

- `nan R:S`: after the optimizer update of step S, before its commit, rank R writes NaN into the
  first element of its local shard of the first parameter (with HSDP: one replica's copy only);
- `diverge R:S`: the same, a finite change (the value + 1.0): the replicas silently disagree;
- `flip S`: at the start of step S, rank 0 waits for the snapshots in flight, flips one bit in the
  middle of `__1_0.distcp` of the newest published snapshot and says so (a marker); the other
  ranks wait for that marker (a planned `--kill` at step S then restarts the job onto it);
- `lose-data S`: the snapshot of step S gets an empty data position (a loader that lost it).

Each is written as `KIND:R:S` / `KIND:S` on the job's command line (`--corrupt`, repeatable).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gpuguard.generation.manifest import load_manifest

KINDS = ("nan", "diverge", "flip", "lose-data")
FLIP_WAIT_S = 30.0


def parse(text: str) -> tuple[str, int, int]:
    """`nan:1:5` -> ("nan", 1, 5); `flip:6` -> ("flip", 0, 6)."""
    kind, *nums = text.split(":")
    try:
        values = [int(x) for x in nums]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--corrupt {text!r}: numbers expected") from None
    if kind in ("nan", "diverge") and len(values) == 2:
        return kind, values[0], values[1]
    if kind in ("flip", "lose-data") and len(values) == 1:
        return kind, 0, values[0]
    raise argparse.ArgumentTypeError(f"--corrupt {text!r}: want nan:R:S, diverge:R:S, flip:S or lose-data:S")


class Corruptions:
    """The job's planned corruptions (module docstring); each fires once, marked under JOB/faults/."""

    def __init__(self, job_dir: Path, rank: int, planned: list[tuple[str, int, int]]) -> None:
        self.job_dir, self.rank, self.planned = job_dir, rank, planned

    def _marker(self, kind: str, step: int, rank: int | None = None) -> Path:
        who = "" if rank is None else f"-r{rank}"
        return self.job_dir / "faults" / f"corrupt-{kind}-s{step}{who}.json"

    def _once(self, kind: str, step: int, rank: int | None = None, detail: Mapping[str, Any] | None = None) -> bool:
        """Mark `kind` at `step` as done; False when it was done before (a replayed step)."""
        marker = self._marker(kind, step, rank)
        marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        rec = {"kind": kind, "rank": self.rank, "step": step, "time": time.time(), **(detail or {})}
        os.write(fd, json.dumps(rec).encode())
        os.close(fd)
        return True

    def after_update(self, step: int, model: Any) -> None:
        """`nan` / `diverge`: write into this rank's local copy of the first parameter."""
        for kind, rank, at in self.planned:
            if kind in ("nan", "diverge") and rank == self.rank and at == step and self._once(kind, step):
                p = next(model.parameters())
                local = p.to_local() if hasattr(p, "to_local") else p
                with torch.no_grad():
                    flat = local.view(-1)
                    flat[0] = float("nan") if kind == "nan" else flat[0] + 1.0

    def before_step(self, step: int, flush: Any) -> None:
        """`flip`: rank 0 flips a bit of the newest published snapshot; the others wait for it."""
        for kind, _rank, at in self.planned:
            if kind != "flip" or at != step:
                continue
            marker = self._marker(kind, step)
            if self.rank == 0:
                flush(FLIP_WAIT_S)
                if not marker.exists():
                    flipped, _path = flip_newest(self.job_dir / "snapshots")
                    self._once(kind, step, detail={"flipped_step": flipped})
            else:
                end = time.monotonic() + FLIP_WAIT_S
                while not marker.exists() and time.monotonic() < end:
                    time.sleep(0.05)

    def data_state(self, step: int, state: Mapping[str, Any]) -> Mapping[str, Any]:
        """`lose-data`: the position the snapshot of `step` gets (empty once, else `state`)."""
        for kind, _rank, at in self.planned:  # every rank loses it, each once (its own marker)
            if kind == "lose-data" and at == step and self._once(kind, step, self.rank):
                return {}
        return state


def flip_newest(snapshots: Path) -> tuple[int, Path]:
    """Flip one bit in the middle of the largest tensor chunk of the newest published snapshot
    (rank 1's file when it stores one): (its step, the file)."""
    steps = sorted((int(p.name.split("-")[1]), p) for p in snapshots.glob("step-*"))
    step, newest = steps[-1]
    entries = [e for e in load_manifest(newest).entries if e.spec.kind == "tensor" and e.spec.byte_length]
    ones = [e for e in entries if e.spec.file.startswith("__1_")]
    target = max(ones or entries, key=lambda e: e.spec.byte_length).spec
    path = newest / target.file
    data = bytearray(path.read_bytes())
    data[target.byte_offset + target.byte_length // 2] ^= 0x10
    path.write_bytes(bytes(data))
    return step, path


class Position:
    """A data position (`SampleStream`) as the job registers it, through `Corruptions.data_state`."""

    def __init__(self, stream: Any, corruptions: Corruptions) -> None:
        self.stream, self.corruptions, self.step = stream, corruptions, 0

    def state_dict(self) -> Mapping[str, Any]:
        return self.corruptions.data_state(self.step, self.stream.state_dict())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.stream.load_state_dict(state)
