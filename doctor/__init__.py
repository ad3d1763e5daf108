"""The doctor's services: the joins of readers and judges behind `gpu-doctor`, and the sweep's state.

Audience: `gpu-doctor` (and `gpu-recover status`, which runs the same vote). Readers
(`collectors`) and judges (`diagnostics`) never import each other; this package is where they
meet. It never imports torch.
"""
