"""The rendezvous: torchrun's `gpuguard` backend on etcd, and a torch-free reader of any round.

Audience: torchrun agents (the backend and its store, loaded through the `torchrun.handlers`
entry point) and the tools that read or bind a job's rendezvous round without importing torch
(`state`, `tcpstore`, `etcd_keys`).
"""
