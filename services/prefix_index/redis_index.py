"""Redis prefix index.

Key schema (``ns`` is the namespace, by default ``pdserve``; hashes are lowercase hex):
- ``{ns}:block:{hash}``   SET of replica ids holding that block
- ``{ns}:replica:{id}``   SET of the block hashes a replica holds (for ``drop_replica``);
  expires with the replica's lease (give or take its last publish after its last heartbeat)
- ``{ns}:lease:{id}``     STRING with a TTL, refreshed by ``heartbeat``; a replica without one
  is dead: ``lookup`` ignores it and removes it from the block sets it visits
Lookups run as one Lua script (one round trip) that walks the hashes in order and stops at the
first block no live replica holds. NOTE: the script builds key names itself, so it needs a
single Redis (or a cluster with all ``{ns}`` keys in one slot), not Redis Cluster sharding.
Every call has a socket timeout: an unreachable Redis raises ``redis.RedisError`` quickly, and
callers degrade to load-only routing.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from services.engine.block_hash import BlockHash

_LOOKUP = """
local ns = ARGV[1]
local alive = nil
local out = {}
for i = 2, #ARGV do
  local key = ns .. ':block:' .. ARGV[i]
  local nxt = {}
  local any = false
  for _, r in ipairs(redis.call('SMEMBERS', key)) do
    if alive == nil or alive[r] then
      if redis.call('EXISTS', ns .. ':lease:' .. r) == 1 then
        nxt[r] = true
        any = true
      else
        redis.call('SREM', key, r)
      end
    end
  end
  if not any then break end
  alive = nxt
  for r, _ in pairs(alive) do out[r] = i - 1 end
end
local flat = {}
for r, n in pairs(out) do
  table.insert(flat, r)
  table.insert(flat, n)
end
return flat
"""

_DROP = """
local ns = ARGV[1]
local r = ARGV[2]
for _, h in ipairs(redis.call('SMEMBERS', ns .. ':replica:' .. r)) do
  redis.call('SREM', ns .. ':block:' .. h, r)
end
redis.call('DEL', ns .. ':replica:' .. r, ns .. ':lease:' .. r)
return 0
"""


class RedisIndex:
    """Args:
    url: ``redis://[:password@]host:port/db`` or ``rediss://`` for TLS.
    password: overrides one in the URL (so it can come from a secret, not the URL).
    ca_cert: CA bundle that verifies a ``rediss://`` server.
    """

    def __init__(
        self,
        url: str,
        namespace: str = "pdserve",
        timeout_s: float = 0.5,
        password: str | None = None,
        ca_cert: str | None = None,
    ) -> None:
        self.ns = namespace
        extra: dict[str, str] = {}
        if password is not None:
            extra["password"] = password
        if ca_cert is not None:
            extra["ssl_ca_certs"] = ca_cert
        self._r = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            decode_responses=True,
            **extra,
        )
        self._lookup = self._r.register_script(_LOOKUP)
        self._drop = self._r.register_script(_DROP)
        self._ttl_ms: dict[str, int] = {}

    def add(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        self._update(replica, hashes, add=True)

    def evict(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        self._update(replica, hashes, add=False)

    def _update(self, replica: str, hashes: Sequence[BlockHash], add: bool) -> None:
        if not hashes:
            return
        hexes = [h.hex() for h in hashes]
        p = self._r.pipeline(transaction=False)
        op = p.sadd if add else p.srem
        for h in hexes:
            op(f"{self.ns}:block:{h}", replica)
        op(f"{self.ns}:replica:{replica}", *hexes)
        if add and replica in self._ttl_ms:
            p.pexpire(f"{self.ns}:replica:{replica}", self._ttl_ms[replica])
        p.execute()

    def drop_replica(self, replica: str) -> None:
        self._drop(args=[self.ns, replica])
        self._ttl_ms.pop(replica, None)

    def heartbeat(self, replica: str, ttl_s: float) -> bool:
        ms = max(1, int(ttl_s * 1000))
        self._ttl_ms[replica] = ms
        p = self._r.pipeline(transaction=False)
        p.set(f"{self.ns}:lease:{replica}", "1", px=ms, get=True)  # the old value: held?
        p.pexpire(f"{self.ns}:replica:{replica}", ms)
        return p.execute()[0] is not None

    def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        if not hashes:
            return {}
        flat = self._lookup(args=[self.ns, *(h.hex() for h in hashes)])
        return {flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def close(self) -> None:
        self._r.close()
