"""The snapshot store: the directory format the runtime writes and the operator reads.

Audience: shared by the in-job runtime (writes, loads, prunes) and the operator (lists, pins,
verifies). Listing and selection are torch-free; writing and loading import torch lazily.
"""
