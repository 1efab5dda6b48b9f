"""A Merkle tree over a payload's chunks: its root names an int32 sum payload (wire/sums.py, sync/exact_sum.py),
and one chunk proves itself against the root with ceil(log2(chunks)) hashes, so an auditor checks a sum on the
few chunks it draws without fetching the rest (sync/sum_audit.py). Leaves and inner nodes are hashed under
different prefixes (a leaf can never pass for a node); an odd node is paired with itself."""

from __future__ import annotations

import hashlib
import math

CHUNK = 4096
"""int32 values per leaf (16 KB)."""


def chunk_count(numel: int) -> int:
    return max(1, math.ceil(numel / CHUNK))


def chunk_bytes(payload: bytes | memoryview, index: int) -> bytes:
    """The bytes of chunk `index` of an int32 payload."""
    return bytes(payload[index * CHUNK * 4:(index + 1) * CHUNK * 4])


def _leaf(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _levels(leaves: list[bytes]) -> list[list[bytes]]:
    levels = [leaves]
    while len(levels[-1]) > 1:
        level = levels[-1]
        levels.append([_node(level[i], level[i + 1] if i + 1 < len(level) else level[i])
                       for i in range(0, len(level), 2)])
    return levels


def merkle_root(payload: bytes | memoryview, numel: int) -> bytes:
    """The root of the payload's chunk hashes (domain-separated leaves and nodes)."""
    return _levels([_leaf(chunk_bytes(payload, i)) for i in range(chunk_count(numel))])[-1][0]


def merkle_proof(payload: bytes | memoryview, numel: int, index: int) -> list[bytes]:
    """The sibling hashes that prove chunk `index` against `merkle_root`."""
    levels = _levels([_leaf(chunk_bytes(payload, i)) for i in range(chunk_count(numel))])
    proof = []
    for level in levels[:-1]:
        sibling = index ^ 1
        proof.append(level[sibling] if sibling < len(level) else level[index])
        index //= 2
    return proof


def verify_chunk(root: bytes, numel: int, index: int, data: bytes, proof: list[bytes]) -> bool:
    """True if `data` is chunk `index` of the payload whose root is `root`."""
    n = chunk_count(numel)
    expected = min(CHUNK, numel - index * CHUNK) * 4 if 0 <= index < n else -1
    depth = math.ceil(math.log2(n)) if n > 1 else 0
    if len(data) != expected or len(proof) != depth:
        return False
    digest = _leaf(data)
    for sibling in proof:
        digest = _node(digest, sibling) if index % 2 == 0 else _node(sibling, digest)
        index //= 2
    return digest == root
