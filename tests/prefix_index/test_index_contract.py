"""One contract suite for every prefix index backend (in-process and a real redis-server)."""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from services.engine.block_hash import hash_blocks
from services.prefix_index import get_index

H = hash_blocks(list(range(64)), 8)  # 8 chained block hashes
OTHER = hash_blocks(list(range(100, 164)), 8)


@pytest.fixture(params=["memory", "redis"])
def index(request):
    if request.param == "memory":
        return get_index("memory")
    url = request.getfixturevalue("redis_url")
    return get_index("redis", url, namespace=f"test-{uuid.uuid4().hex[:8]}")


def test_longest_prefix_per_live_replica_stops_at_first_miss(index):
    for r in ("a", "b", "c"):
        index.heartbeat(r, 30)
    index.add("a", H[:3])
    index.add("b", H[:6])
    index.add("c", [H[0], H[2], H[3]])  # a hole at block 1: only its first block counts
    assert index.lookup(H) == {"a": 3, "b": 6, "c": 1}
    assert index.lookup(OTHER) == {}
    assert index.lookup([]) == {}
    assert index.lookup(H[1:]) == {"a": 2, "b": 5}  # not a prefix of anything: no hit for c


def test_evict_and_drop(index):
    index.heartbeat("a", 30)
    index.heartbeat("b", 30)
    index.add("a", H[:4])
    index.add("b", H[:4])
    index.evict("a", [H[2]])
    assert index.lookup(H) == {"a": 2, "b": 4}
    index.drop_replica("b")
    assert index.lookup(H) == {"a": 2}
    index.evict("a", H[:2])
    assert index.lookup(H) == {}


def test_expired_lease_hides_and_cleans_a_dead_replica(index):
    index.heartbeat("alive", 30)
    index.heartbeat("dead", 0.2)
    index.add("alive", H[:2])
    index.add("dead", H[:5])
    assert index.lookup(H) == {"alive": 2, "dead": 5}
    time.sleep(0.35)
    assert index.lookup(H) == {"alive": 2}
    # a restarted replica comes back under a new id (ids carry a per-start nonce) and sees none
    # of its predecessor's entries
    index.heartbeat("dead-2", 30)
    index.add("dead-2", H[:1])
    assert index.lookup(H) == {"alive": 2, "dead-2": 1}


def test_heartbeat_says_whether_the_lease_was_held(index):
    assert index.heartbeat("r", 0.2) is False  # new: the caller must publish everything
    assert index.heartbeat("r", 0.2) is True
    time.sleep(0.35)
    assert index.heartbeat("r", 30) is False  # lapsed: entries may be gone


def test_replica_without_a_lease_is_invisible(index):
    index.add("nolease", H[:3])
    assert index.lookup(H) == {}


def test_registry_names_valid_choices():
    with pytest.raises(ValueError, match="memory, redis"):
        get_index("etcd")
    with pytest.raises(ValueError, match="needs a URL"):
        get_index("redis")


def test_wrong_password_and_unreachable_redis_fail_fast(redis_url):
    bad = redis_url.replace("s3cret", "nope")
    with pytest.raises(redis.AuthenticationError):
        get_index("redis", bad).lookup(H)
    t = time.perf_counter()
    with pytest.raises(redis.ConnectionError):
        get_index("redis", "redis://127.0.0.1:1/0").lookup(H)
    assert time.perf_counter() - t < 5  # bounded by the socket timeout, never hangs
