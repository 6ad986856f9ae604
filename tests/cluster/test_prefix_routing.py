"""Prefix-aware routing on a real local cluster: 2 prefill replicas, 1 decode replica, the
prefix index in a real redis-server (password-protected, started here on a free port).

The tests run in file order and share the app: routing to the holder, Redis outage and
recovery, eviction, then a killed replica whose lease runs out."""

from __future__ import annotations

import re

import httpx
import pytest

from services.engine.block_hash import hash_blocks
from services.engine.sampling_params import SamplingParams
from services.prefix_index.redis_index import RedisIndex
from tests.cluster.conftest import BASE, complete, deploy, replica_stats, undeploy
from tests.fixtures import eventually, free_port, start_redis

pytestmark = [pytest.mark.slow, pytest.mark.integration]

APP, PREFIX, PASSWORD, TTL_S = "px", "/px", "px-s3cret", 2.0
SYSTEM = (
    "You are a careful assistant for a small hardware shop. Answer in one short sentence, "
    "name the aisle where the item is kept, never invent stock levels, and always suggest a "
    "cheaper alternative when one exists. Aisles: 1 paint and brushes, 2 screws, nails and "
    "anchors, 3 hand tools, 4 power tools, 5 garden, 6 plumbing, 7 electrical, 8 timber."
)


class _Redis:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None

    def start(self) -> None:
        self.proc = start_redis(self.port, PASSWORD)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def px(ray_serve):
    redis_ = _Redis()
    redis_.start()
    pools = {"num_kv_blocks": 256}
    deploy(
        {
            APP: (
                PREFIX,
                {
                    "prefill": {**pools, "replicas": 2},
                    "decode": pools,
                    "redis_url": redis_.url,  # the password comes separately, as from a secret
                    "redis_password": PASSWORD,
                    "index_lease_ttl_s": TTL_S,
                    "index_retry_s": 0.5,
                    "routing_stats_period_s": 0.5,
                },
            )
        }
    )
    yield redis_
    undeploy([APP])
    redis_.stop()


@pytest.fixture(scope="module")
def index(px):
    return RedisIndex(px.url, f"pdserve:{APP}", password=PASSWORD)


def _prompts(tok, n, start=0):
    sys_ids = tok.encode(SYSTEM)
    return sys_ids, [
        sys_ids + tok.encode(f" Customer {i}: where are {i} m of hose?")
        for i in range(start, start + n)
    ]


def _body(prompt):
    return {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def _cold(engine, prompt):
    engine.blocks.reset_prefix_cache()
    return engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[
        0
    ]


def _prefill_by_index_id():
    return {i.index_id: i.stats for i in replica_stats(APP, "prefill", 2).values()}


def _metric(name):
    m = re.search(rf"^{name} (\S+)$", httpx.get(f"{BASE}{PREFIX}/metrics").text, re.M)
    return float(m.group(1)) if m else None


def _on_prefill(index, hashes):
    # the decode replica publishes too (its imported KV is cached there): keep prefill's
    return {k: v for k, v in index.lookup(hashes).items() if k.startswith("prefill-")}


def _holder(index, sys_ids):
    hashes = hash_blocks(sys_ids, 16)
    found = eventually(
        lambda: _on_prefill(index, hashes), 30, "the system prompt in the index", every_s=0.1
    )
    assert len(found) == 1 and list(found.values()) == [len(hashes)], found
    return next(iter(found))


def test_shared_system_prompt_routes_to_its_holder_and_prefills_only_the_suffix(
    px, index, smollm_engine
):
    sys_ids, prompts = _prompts(smollm_engine.tokenizer, 5)
    before = _prefill_by_index_id()
    got, resp = complete(_body(prompts[0]), prefix=PREFIX)
    assert got == _cold(smollm_engine, prompts[0])
    holder = _holder(index, sys_ids)
    (other,) = set(before) - {holder}
    mid = _prefill_by_index_id()
    assert mid[holder].prompt_tokens_computed - before[holder].prompt_tokens_computed == len(
        prompts[0]
    )
    for p in prompts[1:]:
        got, resp = complete(_body(p), prefix=PREFIX)
        assert got == _cold(smollm_engine, p)  # reused KV gives a cold run's tokens
        after = _prefill_by_index_id()
        cached = resp["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= len(sys_ids) // 16 * 16
        # only the suffix was computed, on the holder; the other replica did nothing
        computed = after[holder].prompt_tokens_computed - mid[holder].prompt_tokens_computed
        assert computed == len(p) - cached
        assert after[other].prompt_tokens_computed == before[other].prompt_tokens_computed
        mid = after
    text = httpx.get(f"{BASE}{PREFIX}/metrics").text
    assert 'pdserve_prefix_requests_total{hit="true"} 4.0' in text
    assert 'pdserve_prefix_requests_total{hit="false"} 1.0' in text
    rate = float(re.search(r'pdserve_prefix_hit_rate\{unit="requests"\} (\S+)', text).group(1))
    assert rate == 4 / 5
    assert "pdserve_prefix_lookup_seconds_count" in text


def test_redis_outage_keeps_serving_and_routing_recovers(px, index, smollm_engine):
    sys_ids, prompts = _prompts(smollm_engine.tokenizer, 3, start=10)
    holder = _holder(index, sys_ids)
    px.stop()
    for p in prompts:  # served by load only, same tokens
        got, _ = complete(_body(p), prefix=PREFIX)
        assert got == _cold(smollm_engine, p)
    assert _metric("pdserve_prefix_index_errors_total") >= 1
    assert _metric("pdserve_prefix_index_up") == 0.0
    px.start()  # back, and empty: the replicas' publishers republish their caches
    hashes = hash_blocks(sys_ids, 16)
    eventually(
        lambda: holder in index.lookup(hashes),
        30,
        "the holder's entries to be republished",
        every_s=0.1,
    )

    def routed_again() -> bool:
        complete(_body(prompts[0]), prefix=PREFIX)
        return _metric("pdserve_prefix_index_up") == 1.0

    eventually(routed_again, 30, "routing to use the index again", every_s=0.1)


def test_evicted_blocks_leave_the_index(px, index, smollm_engine):
    from ray import serve

    sys_ids, _ = _prompts(smollm_engine.tokenizer, 1)
    hashes = hash_blocks(sys_ids, 16)
    assert eventually(lambda: _on_prefill(index, hashes), 30, "entries to evict", every_s=0.1)
    prefill = serve.get_deployment_handle("prefill", app_name=APP)

    def evicted() -> bool:
        prefill.reset_prefix_cache.remote().result()  # lands on either replica
        flushed = all(prefill.flush_index.remote().result() for _ in range(4))
        return flushed and not _on_prefill(index, hashes)

    eventually(evicted, 30, "evicted blocks to leave the index", every_s=0.1)


def test_a_killed_replicas_entries_expire_with_its_lease(px, index, smollm_engine):
    import ray

    sys_ids, prompts = _prompts(smollm_engine.tokenizer, 1, start=20)
    complete(_body(prompts[0]), prefix=PREFIX)
    holder = _holder(index, sys_ids)
    uid = holder.split("-", 1)[1]
    (name,) = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].endswith(uid) and a["name"].startswith("SERVE_REPLICA")
    ]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    # no goodbye from a killed process: the entries go when the lease runs out
    hashes = hash_blocks(sys_ids, 16)
    eventually(
        lambda: holder not in index.lookup(hashes),
        TTL_S + 20,
        "the dead replica's entries to expire",
        every_s=0.1,
    )
    raw = index._r
    assert not raw.exists(f"pdserve:{APP}:lease:{holder}")
    # the hash set's expiry follows the lease's, give or take the replica's last publish
    # after its last heartbeat (at most one heartbeat period)
    eventually(
        lambda: not raw.exists(f"pdserve:{APP}:replica:{holder}"),
        TTL_S,
        "the hash set to expire",
        every_s=0.1,
    )
    got, _ = complete(_body(prompts[0]), prefix=PREFIX)  # the cluster keeps serving
    assert got == _cold(smollm_engine, prompts[0])
