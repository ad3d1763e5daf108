"""Recovery: the in-job runtime, operator actions, runbooks."""
