"""Prefill-only -> decode-only handoff gives exactly the solo tokens; layouts are checked."""

from __future__ import annotations

import dataclasses
import random

import pytest

from services.engine.errors import InvalidRequestError, LayoutMismatchError, UnknownRequestError
from services.engine.request import FinishReason
from services.engine.sampling_params import SamplingParams


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
    pre.add_request("r", prompt, params)
    (first,) = _run(pre)
    assert first.finish_reason is FinishReason.PREFILLED and first.new_token_ids == solo[:1]
    handle = pre.export_kv("r")
    assert handle.num_computed == prompt_len and handle.token_ids[-1] == solo[0]
    assert pre.stats().num_held == 1
    pre.release_kv("r")
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
        pre.add_request(rid, prompt, params)
        _run(pre)
        handle = pre.export_kv(rid)
        pre.release_kv(rid)
        dec.add_request(rid, prompt, params, kv_handle=handle)
        assert [t for o in _run(dec) for t in o.new_token_ids] == solo[1:]
    assert dec.stats().prefix_hit_tokens == 24  # second handle: all 6 full blocks already cached
    assert dec.stats().prompt_tokens_computed == 0


def test_mismatched_layout_is_refused(make_engine):
    pre, dec = make_engine(role="prefill"), make_engine(role="decode", block_size=8)
    pre.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    _run(pre)
    handle = pre.export_kv("r")
    pre.release_kv("r")
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


def test_unexported_hold_expires(make_engine):
    pre = make_engine(role="prefill", kv_hold_timeout_s=0.01)
    pre.add_request("r", list(range(3, 20)), SamplingParams(max_tokens=4, temperature=0))
    _run(pre)
    assert pre.blocks.num_used_blocks > 0
    import time

    assert pre.stats().num_hold_expiries == 0
    time.sleep(0.02)
    pre.step()
    assert pre.blocks.num_used_blocks == 0
    assert pre.stats().num_hold_expiries == 1  # counted apart from transport failures
    with pytest.raises(UnknownRequestError):
        pre.export_kv("r")


def test_prefill_request_that_stops_at_first_token_holds_nothing(make_engine):
    pre = make_engine(role="prefill")
    pre.add_request("r", [5, 6, 7], SamplingParams(max_tokens=1, temperature=0))
    (out,) = _run(pre)
    assert out.finish_reason is FinishReason.LENGTH and pre.blocks.num_used_blocks == 0
