"""Block manager: reference-counted KV blocks with a prefix cache and LRU eviction.

Invariants:
- every block is in exactly one state: free (ref 0, no hash), cached (ref 0, hash, evictable),
  or used (ref > 0, maybe hashed); ``check_integrity`` verifies free + cached + used == total.
- the free queue holds every ref-0 block in eviction order: blocks without a hash first
  (they carry nothing), then cached blocks least recently used first.
- a hash maps to at most one block; a block that computed a prefix already cached elsewhere
  stays unhashed and is freed first.
Allocation is check-then-commit: ``allocate`` returns None when there is no room and leaves
nothing changed; it raises only for bad arguments.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.engine.block_hash import BlockHash


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockManager:
    """Owns the block ids of one KV pool and the per-request block tables.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: keep hashed blocks after free for reuse.
        on_cached / on_evicted: called with a block hash when it enters / leaves the prefix
            cache (the prefix index publisher hooks in here).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        on_cached: Callable[[BlockHash], None] | None = None,
        on_evicted: Callable[[BlockHash], None] | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._on_cached = on_cached
        self._on_evicted = on_evicted
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}

    def set_listeners(
        self,
        on_cached: Callable[[BlockHash], None] | None,
        on_evicted: Callable[[BlockHash], None] | None,
    ) -> None:
        """Hooks called with a hash when it enters / leaves the prefix cache."""
        self._on_cached = on_cached
        self._on_evicted = on_evicted

    # ---- queries -------------------------------------------------------------------------
    def cached_hashes(self) -> list[BlockHash]:
        """Every hash now in the prefix cache (a snapshot, for resynchronizing an index)."""
        return list(self._cached)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation may take (free plus evictable cached)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Hashed blocks, whether in use or evictable."""
        return len(self._cached)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes``; stops at the first miss."""
        if not self.enable_prefix_caching:
            return []
        out: list[int] = []
        for h in hashes:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            out.append(block_id)
        return out

    # ---- mutations -----------------------------------------------------------------------
    def allocate(
        self, request_id: str, num_tokens: int, prefix_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Grow ``request_id``'s table to hold ``num_tokens`` tokens.

        Args:
            prefix_blocks: cached blocks (from ``lookup_prefix``) to share as the start of a
                new table; only valid on a request's first allocation.
        Returns:
            the ids of the newly taken (not shared) blocks, or None if there is no room.
        """
        table = self._tables.get(request_id)
        if table is not None and prefix_blocks:
            raise ValueError(
                f"request {request_id!r} already has blocks; prefix sharing is only at start"
            )
        have = len(table) if table is not None else len(prefix_blocks)
        need = self.blocks_needed(num_tokens) - have
        # Shared blocks with ref 0 sit in the free queue; touching them takes them out of it.
        revived = sum(1 for b in prefix_blocks if self._blocks[b].ref_count == 0)
        if need > len(self._free) - revived:
            return None
        if table is None:
            table = []
            self._tables[request_id] = table
            self._num_hashed[request_id] = len(prefix_blocks)
            for b in prefix_blocks:
                self._ref(b)
                table.append(b)
        new: list[int] = []
        for _ in range(max(need, 0)):
            block_id, _ = self._free.popitem(last=False)
            self._evict_hash(self._blocks[block_id])
            self._blocks[block_id].ref_count = 1
            new.append(block_id)
        table.extend(new)
        return new

    def cache_blocks(self, request_id: str, hashes: Sequence[BlockHash]) -> None:
        """Register the hashes of ``request_id``'s full, computed blocks (``hashes[i]`` is block i)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[request_id]
        start = self._num_hashed[request_id]
        upto = min(len(hashes), len(table))
        for i in range(start, upto):
            block = self._blocks[table[i]]
            h = hashes[i]
            if block.block_hash is None and h not in self._cached:
                block.block_hash = h
                self._cached[h] = block.block_id
                if self._on_cached is not None:
                    self._on_cached(h)
        self._num_hashed[request_id] = max(start, upto)

    def free(self, request_id: str) -> None:
        """Drop ``request_id``'s references; hashed blocks stay cached until evicted."""
        table = self._tables.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        if table is None:
            return
        # NOTE: reversed, so that a request's tail blocks are evicted before its head: the head
        # is the prefix other requests are most likely to share.
        for block_id in reversed(table):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> int:
        """Evict every unreferenced cached block; returns how many were evicted."""
        evicted = 0
        for block_id in list(self._free):
            block = self._blocks[block_id]
            if block.block_hash is not None:
                self._evict_hash(block)
                self._free.move_to_end(block_id, last=False)
                evicted += 1
        return evicted

    def check_integrity(self) -> None:
        """Assert free + cached + used == total and that the structures agree."""
        free = sum(1 for b in self._blocks if b.ref_count == 0 and b.block_hash is None)
        cached = sum(1 for b in self._blocks if b.ref_count == 0 and b.block_hash is not None)
        used = sum(1 for b in self._blocks if b.ref_count > 0)
        assert free + cached + used == self.num_blocks, (free, cached, used)
        assert len(self._free) == free + cached, (len(self._free), free, cached)
        assert all(self._blocks[b].ref_count == 0 for b in self._free)
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            for b in table:
                refs[b] += 1
        assert refs == [b.ref_count for b in self._blocks], "ref counts disagree with tables"
        for h, b in self._cached.items():
            assert self._blocks[b].block_hash == h

    # ---- internals -----------------------------------------------------------------------
    def _ref(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _evict_hash(self, block: Block) -> None:
        h = block.block_hash
        if h is None:
            return
        block.block_hash = None
        if self._cached.get(h) == block.block_id:
            del self._cached[h]
            if self._on_evicted is not None:
                self._on_evicted(h)
