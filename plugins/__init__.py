"""Plugin registry (entry points) and the built-in outputs."""
