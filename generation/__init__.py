"""Generation certificates: incarnations, rules, ledger backends, state manifests, ownership."""
