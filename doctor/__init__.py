"""The doctor's services: the joins of readers and judges behind `gpu-doctor`, the sweep and its drain.

Audience: `gpu-doctor` (and `gpu-recover status`, which runs the same vote). Readers
(`collectors`) and judges (`diagnostics`) never import each other; this package is where they
meet: `node_diagnosis` (diagnose node), `job_observation` + `job_diagnosis` (diagnose / watch job),
`sweeper` (one sweep) over `sweep` (its state), `publish` (textfile, webhook, plugins) and `drain`
(the Slurm drain). It never imports torch, and never imports `recovery` (it sits below it).
"""
