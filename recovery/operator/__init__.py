"""The operator: `gpu-recover`'s actions, runbooks, status page and audit log.

Audience: the engineer on call. Each action proves what it touches (process identity, the
ledger) before it changes anything, and records what it did in the job's audit log.
"""
