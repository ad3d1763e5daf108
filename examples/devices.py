"""Where a job's tensors live: the CPU, or this rank's GPU, several ranks sharing one if need be.

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected", ncclInvalidUsage,
NCCL >= 2.5): it keys a device by (host hash, PCI bus id). A machine with one GPU can still run a
2-rank NCCL job for the paths that matter here (communicator set-up, collectives, send/recv, the
Flight Recorder, a failing peer) when each rank claims a host of its own (`NCCL_HOSTID`, which
NCCL hashes instead of hostname + boot id): the ranks then talk through NCCL's socket transport on
loopback, as two hosts would. Slow, and no proof of NVLink or shared-memory transports; enough to
prove gpuguard's side of the NCCL paths (bench/gpu_check.py says so in its rows).
"""

from __future__ import annotations

import os
from typing import Any

import torch

DEVICES = ("cpu", "cuda")


def rank_device(kind: str, rank: int, ranks_here: int) -> Any:
    """`torch.device` for this rank: the CPU, or GPU `rank % count` (made current). When this host
    runs more ranks than it has GPUs, NCCL is told each rank is its own host (see the module
    docstring); call this before the first NCCL communicator of the process is made."""
    if kind not in DEVICES:
        raise ValueError(f"device {kind!r}: want one of {', '.join(DEVICES)}")
    if kind == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 0:
        raise RuntimeError("device cuda: this torch sees no CUDA device")
    if ranks_here > count:
        share_gpus(rank)
    index = rank % count
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def share_gpus(rank: int) -> None:
    """Let ranks of one host share a GPU under NCCL: a host id per rank, sockets on loopback."""
    os.environ["NCCL_HOSTID"] = f"{os.environ.get('NCCL_HOSTID', 'gpuguard-shared')}-rank{rank}"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_IB_DISABLE", "1")
    os.environ.setdefault("NCCL_MNNVL_ENABLE", "0")  # the "hosts" are one machine: no multi-node NVLink
