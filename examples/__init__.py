"""Example training jobs and the demos built on them: harnesses, not product code.

`gpu-recover demo`, the tests and the benchmarks launch these under real `torchrun`; the runtime
never imports them. They need `gpuguard[runtime]` (torch).
"""
