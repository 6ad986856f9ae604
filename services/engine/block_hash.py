"""The one block-hash function of pdserve (engine, gateway and prefix index all import it).

Invariant: a block's hash covers its tokens and its parent block's hash, so two equal hashes
mean two equal prefixes (up to a 128-bit collision). The encoding is canonical and independent
of the process: a fixed root seed, the parent digest, then the token ids as little-endian
uint32. Never Python's per-process ``hash()``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # 16 bytes

HASH_BYTES = 16
# NOTE: bump the version string when the encoding changes; old index entries then never match.
ROOT_HASH: BlockHash = hashlib.sha256(b"pdserve/block-hash/v1").digest()[:HASH_BYTES]


def salted_root(salt: str | None) -> BlockHash | None:
    """The parent of a request's first block: None (``ROOT_HASH``) without a salt; with one, a
    root of its own, so requests with different salts never share a block hash (no prefix-cache
    reuse across them, and ``cached_tokens`` says nothing about the other salts' prompts)."""
    if salt is None:
        return None
    return hashlib.sha256(b"pdserve/block-hash/v1/salt\0" + salt.encode()).digest()[:HASH_BYTES]


def hash_block(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    """Hash one full block given its parent's hash (None for the first block)."""
    h = hashlib.sha256(parent if parent is not None else ROOT_HASH)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return h.digest()[:HASH_BYTES]


def hash_blocks(
    tokens: Sequence[int], block_size: int, parent: BlockHash | None = None
) -> list[BlockHash]:
    """Hash chain over the full blocks of ``tokens`` (a trailing partial block is ignored)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[BlockHash] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size])
        out.append(parent)
    return out
