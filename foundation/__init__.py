"""The foundation every other layer stands on, and that imports none of them.

The job directory (paths, atomic writes), the on-disk formats with their writer and reader side by
side (step log, collective trace ring), process identity, the one restricted unpickler, the
environment-variable names, the error taxonomy and exit codes, and the data types that readers
(`collectors`) produce and judges (`diagnostics`) consume (events, rank observations, collective
traces, torchrun facts, the Xid catalog). Standard library, psutil and pyyaml only; never torch.
"""
