"""The engine's KV handoff hooks: the pieces a prefill emits (``layer_computed``), applied in
order, equal the pinned KV it hands to ``prefilled``, bit for bit: cold, with prefix hits,
chunked, preempted; a request that ends without KV calls ``aborted``; a sink that does not keep
the KV has it freed at once."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine.errors import InvalidRequestError, UnknownRequestError
from services.engine.kv_handle import KVHandle
from services.engine.kv_stream import KVPiece, PinnedKV
from services.engine.request import FinishReason
from services.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


class Assembler:
    """A sink that rebuilds the block tensor the way a receiver does, and keeps the pinned KV
    (``keep``) to compare with."""

    wants_layers = True

    def __init__(self, keep: bool = True) -> None:
        self.pieces: list[KVPiece] = []
        self.final: KVHandle | None = None
        self.pinned: PinnedKV | None = None
        self.failed: str | None = None
        self.keep = keep

    def layer_computed(self, piece: KVPiece) -> None:
        assert self.final is None and self.failed is None, "a piece after the end"
        self.pieces.append(piece)

    def prefilled(self, handle: KVHandle, pinned: PinnedKV) -> bool:
        assert self.final is None and self.failed is None, "prefilled twice, or after a failure"
        self.final, self.pinned = handle, pinned
        return self.keep

    def aborted(self, reason: str) -> None:
        assert self.final is None, "aborted after prefilled"
        self.failed = self.failed or reason

    def blocks(self, like: torch.Tensor) -> torch.Tensor:
        layers, _, n_blocks, bs, heads, dim = like.shape
        out = torch.zeros((layers, 2, n_blocks * bs, heads, dim), dtype=like.dtype)
        seen = torch.zeros((layers, n_blocks * bs), dtype=torch.bool)
        for p in self.pieces:
            out[p.layer, :, p.token_start : p.token_end] = p.data
            seen[p.layer, p.token_start : p.token_end] = True
        assert self.final is not None
        n = self.final.num_computed
        assert seen[:, :n].all(), "positions never streamed"
        return out.view(layers, 2, n_blocks, bs, heads, dim)


def _prefill(eng, rid, prompt, sink, params=GREEDY):
    eng.add_request(rid, prompt, params, prefill_only=True, kv_sink=sink)
    outs = []
    while eng.has_unfinished:
        outs += eng.step()
    return [o for o in outs if o.request_id == rid][-1]


def _check(eng, rid, sink):
    want = sink.pinned.read()
    got = sink.blocks(want)
    n = sink.final.num_computed
    assert n == len(sink.final.token_ids) - 1 and sink.final.blocks.numel() == 0
    assert torch.equal(got.flatten(2, 3)[:, :, :n], want.flatten(2, 3)[:, :, :n])
    assert eng.stats().num_held >= 1
    sink.pinned.free()
    sink.pinned.free()  # idempotent
    with pytest.raises(UnknownRequestError):
        sink.pinned.read()  # never stale blocks


@pytest.mark.parametrize("prompt_len,chunk", [(1, 256), (13, 256), (40, 256), (40, 12)])
def test_pieces_rebuild_the_exported_kv(make_engine, prompt_len, chunk):
    eng = make_engine(role="prefill", max_num_batched_tokens=chunk)
    prompt = [random.Random(prompt_len).randrange(3, 256) for _ in range(prompt_len)]
    sink = Assembler()
    out = _prefill(eng, "r", prompt, sink)
    assert out.finish_reason is FinishReason.PREFILLED
    layers = eng.model_config.num_layers
    steps = -(-prompt_len // chunk)
    assert len(sink.pieces) == layers * steps  # one piece per layer per step, nothing else
    _check(eng, "r", sink)


def test_a_prefix_hit_is_sent_from_the_cache(make_engine):
    eng = make_engine(role="prefill")
    prompt = list(range(3, 3 + 30))
    first = Assembler()
    _prefill(eng, "a", prompt, first)
    _check(eng, "a", first)
    sink = Assembler()
    out = _prefill(eng, "b", prompt + [7, 8], sink)
    assert out.num_cached_tokens == 28  # 7 full blocks of 4 reused
    cached = [p for p in sink.pieces if p.token_start == 0]
    assert len(cached) == eng.model_config.num_layers and cached[0].token_end == 28
    _check(eng, "b", sink)


def test_a_preempted_prefill_still_streams_exact_kv(make_engine):
    # decoding requests grow into a small cache and push the streaming prefills out
    eng = make_engine(num_kv_blocks=24, max_num_batched_tokens=8)
    rng = random.Random(3)
    for i in range(3):
        prompt = [rng.randrange(3, 256) for _ in range(10)]
        eng.add_request(f"d{i}", prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    for _ in range(10):
        eng.step()
    prompts = [[rng.randrange(3, 256) for _ in range(30)] for _ in range(3)]
    sinks = [Assembler() for _ in prompts]
    for i, (p, s) in enumerate(zip(prompts, sinks)):
        eng.add_request(f"s{i}", p, GREEDY, prefill_only=True, kv_sink=s)
    preempted = set()
    while eng.has_unfinished:
        for r in eng.scheduler.running:
            if r.num_preemptions and r.kv_sink is not None:
                preempted.add(r.request_id)
        for o in eng.step():
            if o.finished and o.request_id.startswith("s"):
                _check(eng, o.request_id, sinks[int(o.request_id[1:])])
    assert preempted, "no streaming prefill was preempted; the test proves nothing"
    for s in sinks:
        assert s.final is not None


def test_a_request_that_ends_without_kv_fails_its_sink(make_engine):
    eng = make_engine(role="prefill")
    prompt = list(range(3, 20))
    (solo,) = make_engine().generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    stop = Assembler()  # its first token is a stop token: nothing to hand over
    params = SamplingParams(max_tokens=4, temperature=0, stop_token_ids=(solo[0],))
    out = _prefill(eng, "s", prompt, stop, params)
    assert out.finish_reason is FinishReason.STOP and stop.final is None
    assert "first token" in stop.failed
    aborted = Assembler()
    eng.add_request("x", prompt, GREEDY, prefill_only=True, kv_sink=aborted)
    eng.abort("x")
    eng.step()
    assert aborted.failed == "the request was aborted"
    assert eng.blocks.num_used_blocks == 0 and eng.stats().num_held == 0
    with pytest.raises(InvalidRequestError, match="kv_sink"):
        make_engine().add_request("y", prompt, GREEDY, kv_sink=Assembler())


def test_a_sink_that_does_not_keep_the_kv_has_it_freed(make_engine):
    eng = make_engine(role="prefill")
    sink = Assembler(keep=False)
    out = _prefill(eng, "r", list(range(3, 20)), sink)
    assert out.finish_reason is FinishReason.PREFILLED and sink.final is not None
    assert eng.blocks.num_used_blocks == 0 and eng.stats().num_held == 0
    with pytest.raises(UnknownRequestError):
        sink.pinned.read()
