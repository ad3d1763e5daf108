"""Command-line front ends: thin shells over collectors, diagnostics, generation and recovery.

Lazy imports (start-up time), in every command module: a command imports what it runs inside its
own function, so `gpu-doctor diagnose node` never pays for the ledger, the runtime or rich tables
it does not use (the sweep runs from cron on every node).
"""
