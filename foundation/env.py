"""The environment variables gpuguard reads, named once.

Training processes, the three commands and the tests all read these; a name written twice drifts.
README.md ("Runtime environment") documents what each one means and its default.
"""

from __future__ import annotations

JOB_DIR_ENV = "GPUGUARD_JOB_DIR"  # the job directory
JOB_ID_ENV = "GPUGUARD_JOB_ID"  # the job id a runtime records when it creates the job directory
INCARNATION_ID_ENV = "GPUGUARD_INCARNATION_ID"  # set by a launcher that names each worker's incarnation
LEDGER_ENV = "GPUGUARD_LEDGER"  # ledger URL; default <job-dir>/ledger
PG_TIMEOUT_ENV = "GPUGUARD_PG_TIMEOUT"  # collective timeout (s) of each generation's process group
SNAPSHOT_EVERY_ENV = "GPUGUARD_SNAPSHOT_EVERY"  # snapshot interval in steps
CHECKPOINT_EVERY_ENV = "GPUGUARD_CHECKPOINT_EVERY"  # durable checkpoint interval in steps
RDZV_ENDPOINT_ENV = "GPUGUARD_RDZV_ENDPOINT"  # where the rendezvous round is read (else the agent's argv)
STATE_DIR_ENV = "GPUGUARD_STATE_DIR"  # the sweep's state directory (cursor, recent events, lock)
PEER_HEARTBEAT_ENV = "GPUGUARD_PEER_HEARTBEAT"  # <s>[:<misses>]: in-place peer heartbeat (off by default)
WATCH_INTERVAL_ENV = "GPUGUARD_WATCH_INTERVAL"  # seconds between reads of the active generation (default 2)
FAST_EXIT_ENV = "GPUGUARD_FAST_EXIT"  # 0: a worker dying of an uncaught exception finalizes as Python does
LEASE_TTL_ENV = "GPUGUARD_LEASE_TTL"  # seconds: the etcd lease each host's ranks share (docs/formats/leases.md)
HOST_LEASE_DIR_ENV = "GPUGUARD_HOST_LEASE_DIR"  # host-local dir of the host lease's files (default /dev/shm)
SNAPSHOT_ROOT_ENV = (
    "GPUGUARD_SNAPSHOT_ROOT"  # snapshots/ and checkpoints/ (shared storage across hosts); default the job dir
)
BACKEND_ENV = "GPUGUARD_BACKEND"  # the world group's backend: gloo (default), nccl, or "cpu:gloo,cuda:nccl"
SHARDED_ENV = "GPUGUARD_SHARDED"  # 1: sharded (FSDP2/HSDP/DDP) state, collective snapshots on every rank
DEBUG_ENV = "GPUGUARD_DEBUG"  # 1: show the traceback of an internal error
RUNBOOK_DEPTH_ENV = "GPUGUARD_RUNBOOK_DEPTH"  # set to N+1 in a runbook step's environment: no recursion
ETCD_CACERT_ENV = "GPUGUARD_ETCD_CACERT"  # etcd TLS: the CA bundle that verifies the members (docs/formats/ledger.md)
ETCD_CERT_ENV = "GPUGUARD_ETCD_CERT"  # etcd TLS: our client certificate (etcd --client-cert-auth)
ETCD_KEY_ENV = "GPUGUARD_ETCD_KEY"  # etcd TLS: the client certificate's key
