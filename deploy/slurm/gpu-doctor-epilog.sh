#!/bin/bash
# Slurm Epilog: after a job ends on this node, one incremental gpu-doctor sweep over what the job left in
# the kernel log; a drain verdict drains the node with gpu-doctor's own reason (scontrol update ...
# State=DRAIN Reason="gpu-doctor: ..."; a node someone else drained is left alone), so the next job does
# not land on the GPU that just failed.
#   slurm.conf:  Epilog=/usr/local/sbin/gpu-doctor-epilog.sh
# Always exits 0: the drain, when due, is gpu-doctor's (an epilog failure would drain the node again with
# the reason "Epilog error" and hide why). The verdict goes to stderr (slurmd's log) with the job id.
# The sweep shares its state dir with gpu-doctor-sweep.timer or the watcher (it waits for their lock).
set -u
GPU_DOCTOR=${GPU_DOCTOR:-gpu-doctor}
STATE_DIR=${GPUGUARD_STATE_DIR:-/var/lib/gpuguard}
NODE=${SLURMD_NODENAME:-$(hostname -s)}
out=$(timeout 60 "$GPU_DOCTOR" sweep --format nagios --run-drain --node "$NODE" --state-dir "$STATE_DIR" "$@" 2>&1)
printf 'gpu-doctor epilog, job %s: %s\n' "${SLURM_JOB_ID:-?}" "$out" >&2
exit 0
