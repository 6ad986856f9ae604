"""A replica's prefix cache reaches the index through the publisher, and survives an outage."""

from __future__ import annotations

import uuid

import pytest

from services.engine.block_hash import hash_blocks
from services.engine.sampling_params import SamplingParams
from services.prefix_index import get_index
from services.prefix_index.publisher import IndexPublisher, unique_replica_id
from tests.fixtures import eventually, free_port, start_redis

PROMPT = list(range(3, 3 + 40))  # 10 full blocks of 4


def _publish(eng, index, ttl_s=5.0):
    pub = IndexPublisher(index, unique_replica_id("prefill"), eng.blocks.cached_hashes, ttl_s=ttl_s)
    eng.blocks.set_listeners(pub.on_cached, pub.on_evicted)
    return pub


@pytest.fixture(params=["memory", "redis"])
def index(request):
    if request.param == "memory":
        return get_index("memory")
    return get_index(
        "redis", request.getfixturevalue("redis_url"), namespace=f"pub-{uuid.uuid4().hex[:6]}"
    )


def test_cached_blocks_are_published_and_evictions_removed(make_engine, index):
    eng = make_engine(num_kv_blocks=64)
    pub = _publish(eng, index)
    try:
        eng.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert pub.flush()
        hashes = hash_blocks(PROMPT, 4)
        # the prompt's 10 full blocks (43 tokens in all: the generated ones fill no new block)
        assert index.lookup(hashes) == {pub.replica_id: 10}
        eng.blocks.reset_prefix_cache()
        assert pub.flush()
        assert index.lookup(hashes) == {}
    finally:
        pub.stop()
    assert index.lookup(hash_blocks(PROMPT, 4)) == {}  # a stopped replica leaves nothing


def test_redis_outage_is_counted_and_resynced(make_engine):
    port = free_port()
    proc = start_redis(port)
    index = get_index("redis", f"redis://127.0.0.1:{port}/0")
    eng = make_engine(num_kv_blocks=64)
    pub = _publish(eng, index, ttl_s=0.6)
    try:
        assert pub.flush()
        proc.terminate()
        proc.wait(timeout=10)
        # the engine keeps serving while the index is down
        eng.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        eventually(lambda: pub.errors, 10, "the publisher noticing the outage")
        proc = start_redis(port)  # Redis is back, empty
        assert pub.flush(timeout_s=10)
        assert index.lookup(hash_blocks(PROMPT, 4)) == {pub.replica_id: 10}
    finally:
        pub.stop()
        proc.terminate()
        proc.wait(timeout=10)


def test_an_index_that_lost_its_data_is_repopulated(make_engine, redis_url):
    # a Redis restarted without persistence (or FLUSHALL) answers, but has forgotten everything
    import redis

    ns = f"lost-{uuid.uuid4().hex[:6]}"
    index = get_index("redis", redis_url, namespace=ns)
    eng = make_engine(num_kv_blocks=64)
    pub = _publish(eng, index, ttl_s=0.6)
    try:
        eng.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        assert pub.flush()
        r = redis.Redis.from_url(redis_url)
        r.delete(*r.keys(f"{ns}:*"))
        assert index.lookup(hash_blocks(PROMPT, 4)) == {}
        eventually(
            lambda: index.lookup(hash_blocks(PROMPT, 4)) == {pub.replica_id: 10},
            10,
            "the lost entries republished",
        )
        assert pub.errors == 0  # no error was seen: the lapsed lease alone triggered it
    finally:
        pub.stop()
