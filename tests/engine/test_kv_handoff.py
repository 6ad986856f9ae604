"""Prefill-only -> decode-only handoff gives exactly the solo tokens; layouts are checked."""

from __future__ import annotations

import contextlib
import dataclasses
import random

import pytest

from kvtransfer.outbox import Outbox, OutboxConfig
from services.engine.errors import InvalidRequestError, LayoutMismatchError
from services.engine.request import FinishReason
from services.engine.sampling_params import SamplingParams
from tests.fixtures import prefill_for_handoff


def _run(eng):
    outs = []
    while eng.has_unfinished:
        outs += eng.step()
    return outs


@pytest.mark.parametrize("prompt_len", [1, 4, 13, 40])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
        SamplingParams(
            max_tokens=16, temperature=0.8, top_k=20, seed=7, ignore_eos=True, logprobs=True
        ),
    ],
)
def test_handle_continued_on_decode_engine_gives_solo_tokens(make_engine, prompt_len, params):
    prompt = [random.Random(prompt_len).randrange(3, 256) for _ in range(prompt_len)]
    (solo,) = make_engine().generate([prompt], params)
    pre = make_engine(role="prefill")
    dec = make_engine(role="decode")
    (first,), handle = prefill_for_handoff(pre, "r", prompt, params)
    assert first.finish_reason is FinishReason.PREFILLED and first.new_token_ids == solo[:1]
    assert handle.num_computed == prompt_len and handle.token_ids[-1] == solo[0]
    assert pre.stats().num_held == 0 and pre.blocks.num_used_blocks == 0  # released
    dec.add_request("r", prompt, params, kv_handle=handle)
    outs = _run(dec)
    assert [t for o in outs for t in o.new_token_ids] == solo[1:]
    assert outs[-1].num_output_tokens == len(solo)
    if params.logprobs:
        assert len([lp for o in outs for lp in o.new_logprobs]) == len(solo) - 1


def test_decode_engine_reuses_its_prefix_cache_for_handles(make_engine):
    prompt = list(range(3, 3 + 24))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    (solo,) = make_engine().generate([prompt], params)
    pre, dec = make_engine(role="prefill"), make_engine(role="decode")
    for rid in ("a", "b"):
        _, handle = prefill_for_handoff(pre, rid, prompt, params)
        dec.add_request(rid, prompt, params, kv_handle=handle)
        assert [t for o in _run(dec) for t in o.new_token_ids] == solo[1:]
    assert dec.stats().prefix_hit_tokens == 24  # second handle: all 6 full blocks already cached
    assert dec.stats().prompt_tokens_computed == 0


def test_mismatched_layout_is_refused(make_engine):
    pre, dec = make_engine(role="prefill"), make_engine(role="decode", block_size=8)
    _, handle = prefill_for_handoff(
        pre, "r", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0)
    )
    with pytest.raises(LayoutMismatchError, match="block_size: 4 != 8"):
        dec.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4), kv_handle=handle)
    other = make_engine(role="decode", model="llama-mha-untied")
    with pytest.raises(LayoutMismatchError, match="num_kv_heads"):
        other.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4), kv_handle=handle)
    with pytest.raises(InvalidRequestError, match="kv_handle"):
        make_engine(role="decode").add_request(
            "r", [5, 6, 8], SamplingParams(max_tokens=4), kv_handle=handle
        )
    forged = dataclasses.replace(handle, block_hashes=(b"x" * 16,))
    with pytest.raises(InvalidRequestError, match="kv_handle"):
        make_engine(role="decode").add_request(
            "r", [5, 6, 7], SamplingParams(max_tokens=4), kv_handle=forged
        )
    assert dec.blocks.num_used_blocks == 0


def test_an_unclaimed_handoff_expires_by_its_lease(make_engine):
    """The engine keeps a prefilled request's blocks only while its sink (the Outbox) pins
    them: the lease's end frees them in the engine, and the KV is gone for a late receiver."""
    pre = make_engine(role="prefill")
    now = [0.0]
    box = Outbox(pre.fingerprint, contextlib.nullcontext, OutboxConfig(lease_s=5.0), lambda: now[0])
    prompt = list(range(3, 20))
    entry = box.open("r", len(prompt), False)
    pre.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0), kv_sink=entry)
    _run(pre)
    assert pre.blocks.num_used_blocks > 0 and pre.stats().num_held == 1
    with pytest.raises(InvalidRequestError, match="already in use"):
        pre.add_request("r", prompt, SamplingParams(max_tokens=4))  # pinned: still its id
    now[0] = 5.0
    assert box.expire() == 1
    assert pre.blocks.num_used_blocks == 0 and pre.stats().num_held == 0
    assert box.get("r", entry.secret) is None and box.stats()["ended_expired"] == 1


def test_a_prefill_only_request_without_a_sink_frees_its_kv(make_engine):
    pre = make_engine(role="prefill")
    pre.add_request("r", list(range(3, 20)), SamplingParams(max_tokens=4, temperature=0))
    (out,) = _run(pre)
    assert out.finish_reason is FinishReason.PREFILLED
    assert pre.blocks.num_used_blocks == 0 and pre.stats().num_held == 0


def test_prefill_request_that_stops_at_first_token_holds_nothing(make_engine):
    pre = make_engine(role="prefill")
    pre.add_request("r", [5, 6, 7], SamplingParams(max_tokens=1, temperature=0))
    (out,) = _run(pre)
    assert out.finish_reason is FinishReason.LENGTH and pre.blocks.num_used_blocks == 0
