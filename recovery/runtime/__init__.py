"""The in-job runtime: what runs inside every training process.

Audience: the training script (`Runtime`, `InPlaceRuntime`, `fault_tolerant`). It activates a
certified generation, commits steps, writes snapshots, holds the incarnation's lease and, in
place, switches to the next generation without a restart. Nothing here is imported by the
doctor or the operator's commands, which stay torch-free.
"""
