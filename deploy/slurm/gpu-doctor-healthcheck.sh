#!/bin/bash
# Slurm HealthCheckProgram: one gpu-doctor sweep; a drain verdict drains this node in Slurm
# (scontrol update ... State=DRAIN Reason="gpu-doctor: ..."), never a node someone else drained.
#   slurm.conf:  HealthCheckProgram=/usr/local/sbin/gpu-doctor-healthcheck.sh
#                HealthCheckInterval=300
#                HealthCheckNodeState=ANY,CYCLE
# slurmd runs it as root; stdout/stderr go to slurmd's log. Exit: 0 healthy, 1 degraded, 2 reset or
# drain, 3 unknown (slurmd ignores the code: the drain is done by gpu-doctor itself).
set -u
GPU_DOCTOR=${GPU_DOCTOR:-gpu-doctor}
STATE_DIR=${GPUGUARD_STATE_DIR:-/var/lib/gpuguard}
NODE=${SLURMD_NODENAME:-$(hostname -s)}
exec "$GPU_DOCTOR" sweep --quiet --format nagios --run-drain --node "$NODE" --state-dir "$STATE_DIR" "$@"
