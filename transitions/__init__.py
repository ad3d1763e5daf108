"""The membership-transition counterexample benchmark.

A deterministic mini-training with an exact oracle, faults injected at the dangerous
boundaries of a step, and the same schedules run against several recovery strategies.
Semantic failures are reported before latency: a fast recovery that resumes one rank
from a different optimizer step is wrong, not noisy.
"""
