"""Command-line front ends: thin shells over collectors, diagnostics, generation and recovery."""
