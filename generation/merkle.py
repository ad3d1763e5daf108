"""BLAKE3 digests and the Merkle root a manifest is identified by (pure)."""

from __future__ import annotations

from collections.abc import Sequence

import blake3

LEAF, NODE = b"\x00", b"\x01"  # domain separation: a leaf can never pose as an inner node


def leaf(data: bytes) -> bytes:
    return blake3.blake3(LEAF + data).digest()


def merkle_root(leaves: Sequence[bytes]) -> str:
    """Root (hex) over leaf hashes, in order; an odd node is carried up unchanged."""
    if not leaves:
        return blake3.blake3(NODE).hexdigest()
    level = list(leaves)
    while len(level) > 1:
        nxt = [blake3.blake3(NODE + level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0].hex()
