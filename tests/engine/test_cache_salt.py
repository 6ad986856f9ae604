"""``cache_salt`` scopes prefix-cache reuse: requests with different salts never share cached
blocks (so ``cached_tokens`` says nothing across them), the same salt shares as before, and the
salt travels with the request into the KV handoff's hashes."""

from __future__ import annotations

import pytest

from services.engine.block_hash import ROOT_HASH, hash_blocks, salted_root
from services.engine.errors import InvalidRequestError
from services.engine.sampling_params import SamplingParams
from services.gateway.openai_models import CompletionRequest, parse
from tests.fixtures import prefill_for_handoff

PROMPT = list(range(3, 3 + 30))  # 7 full blocks of 4 reusable (the last token is computed)


def _cached(eng, rid: str, salt: str | None) -> int:
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, cache_salt=salt)
    eng.add_request(rid, PROMPT, params)
    outs = []
    while eng.has_unfinished:
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs[-1].num_cached_tokens


def test_salts_partition_the_prefix_cache(make_engine):
    eng = make_engine()
    assert _cached(eng, "a", "tenant-1") == 0
    assert _cached(eng, "b", "tenant-2") == 0  # another tenant: no hit, nothing learned
    assert _cached(eng, "c", None) == 0  # the shared cache is a scope of its own
    assert _cached(eng, "d", "tenant-1") == 28  # the same tenant reuses its blocks
    assert _cached(eng, "e", None) == 28


def test_the_salt_enters_the_root_of_the_hash_chain():
    assert salted_root(None) is None
    a, b = salted_root("t1"), salted_root("t2")
    assert a != b and a != ROOT_HASH and len(a) == 16
    plain = hash_blocks(PROMPT, 4)
    assert hash_blocks(PROMPT, 4, a) != plain
    assert all(x != y for x, y in zip(hash_blocks(PROMPT, 4, a), hash_blocks(PROMPT, 4, b)))


def test_a_salted_handoff_continues_on_a_decode_engine(make_engine):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, cache_salt="t1")
    (solo,) = make_engine().generate([PROMPT], params)
    pre, dec = make_engine(role="prefill"), make_engine(role="decode")
    _, handle = prefill_for_handoff(pre, "r", PROMPT, params)
    assert handle.block_hashes == tuple(hash_blocks(PROMPT, 4, salted_root("t1")))
    dec.add_request("r", PROMPT, params, kv_handle=handle)
    got = [handle.token_ids[-1]]
    while dec.has_unfinished:
        got += [t for o in dec.step() for t in o.new_token_ids]
    assert got == solo
    # a handle whose hashes were made under another salt is refused by its hashes
    with pytest.raises(InvalidRequestError, match="kv_handle"):
        other = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, cache_salt="t2")
        make_engine(role="decode").add_request("x", PROMPT, other, kv_handle=handle)


@pytest.mark.parametrize("salt", ["", "x" * 257])
def test_a_bad_salt_is_refused_by_name(salt):
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        SamplingParams(cache_salt=salt).validate()


def test_the_http_field_is_typed_and_reaches_the_engine_params():
    body = {"model": "m", "prompt": "hi", "cache_salt": "tenant-1"}
    req = parse(CompletionRequest, body)
    assert req.sampling_params(16, False).cache_salt == "tenant-1"
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        parse(CompletionRequest, {**body, "cache_salt": 7})


def test_the_grpc_field_reaches_the_engine_params():
    from pdserve.v1 import generate_pb2 as pb

    from services.gateway.grpc_api import sampling_params

    assert sampling_params(pb.SamplingParams(cache_salt="tenant-1")).cache_salt == "tenant-1"
    assert sampling_params(pb.SamplingParams()).cache_salt is None
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        sampling_params(pb.SamplingParams(cache_salt=""))
