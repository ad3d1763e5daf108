#!/bin/bash
# Slurm Prolog: before a job starts on this node, judge its GPUs on the last 10 minutes of evidence.
#   slurm.conf:  Prolog=/usr/local/sbin/gpu-doctor-prolog.sh
#                PrologFlags=Alloc      (run at allocation, before the job's first step)
# A reset or drain verdict fails the prolog (exit 1): slurmd drains the node ("Prolog error") and
# requeues the job instead of starting it on a bad GPU. Healthy, degraded and unknown pass; every
# verdict is logged on stderr (slurmd's log) with the job id. Bounded: 60 s (a hung NVML never holds
# the allocation). Extra arguments are passed to `gpu-doctor diagnose node` (a later --since wins).
set -u
GPU_DOCTOR=${GPU_DOCTOR:-gpu-doctor}
out=$(timeout 60 "$GPU_DOCTOR" diagnose node --since 10m --format nagios "$@" 2>&1)
rc=$?
printf 'gpu-doctor prolog, job %s: %s\n' "${SLURM_JOB_ID:-?}" "$(printf '%s' "$out" | head -n 1)" >&2
if [ "$rc" -eq 2 ]; then
    exit 1
fi
exit 0
