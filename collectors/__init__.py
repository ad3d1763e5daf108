"""Collectors read the world (kernel log, NVML, job processes, logs) and return records. Each has a timeout."""
