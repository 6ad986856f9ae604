"""Device-resident step state: persistent block tables synced incrementally, step inputs
derived on the device, decode-graph buckets with padding (the CPU twin of CUDA graphs), and
the KV pool sized from device memory."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine.attention import SeqSpan, build_metadata
from services.engine.cuda_graphs import DecodeGraphs, batch_buckets
from services.engine.memory import blocks_for_memory
from services.engine.sampling_params import SamplingParams
from services.engine.step_state import BlockTables


def test_block_tables_sync_only_new_entries_and_rewrite_readmissions():
    bt = BlockTables(max_seqs=2, max_blocks=8, scratch_block=99, device="cpu")
    # a device copy that only sees what flush() sends, as on CUDA
    bt.on_host = False
    bt.device_tables = bt.host.clone()
    a = [5, 6]
    ra = bt.row("a", a, {"a"})
    bt.flush()
    a.append(7)  # the request took one more block
    assert bt.row("a", a, {"a"}) == ra
    assert bt._pending == [(ra, 2, [7])]  # only the new entry travels
    bt.flush()
    assert bt.device_tables[ra, :3].tolist() == [5, 6, 7]
    assert bt.device_tables[ra, 3:].tolist() == [99] * 5
    a2 = [1]  # preempted and re-admitted: a new table, written from the start
    bt.row("a", a2, {"a"})
    bt.flush()
    assert bt.device_tables[ra, :1].tolist() == [1]
    assert bt.device_tables[bt.padding_row].tolist() == [99] * 8


def test_block_tables_reclaim_rows_of_requests_not_in_the_step():
    bt = BlockTables(max_seqs=2, max_blocks=4, scratch_block=0, device="cpu")
    r1 = bt.row("a", [1], {"a"})
    r2 = bt.row("b", [2], {"b"})
    r3 = bt.row("c", [3], {"b", "c"})  # "a" is not running any more: its row is reused
    assert r3 == r1 and r2 != r1
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        bt.row("d", [4], {"b", "c", "d"})


def test_step_inputs_equal_the_reference_metadata(make_engine):
    eng = make_engine(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    eng.add_request("p0", [rng.randrange(3, 256) for _ in range(9)], params)
    eng.step()  # p0 is decoding now
    eng.add_request("p1", [rng.randrange(3, 256) for _ in range(13)], params)
    eng.add_request("p2", [rng.randrange(3, 256) for _ in range(9)], params)
    sched = eng.scheduler.schedule()
    inp = eng.step_state.build(sched.spans)
    spans = [
        SeqSpan(s.start, s.num_new, eng.blocks.block_table(s.request.request_id))
        for s in sched.spans
    ]
    assert [s.num_new for s in spans] == [1, 13, 9]  # a decode and two prefills
    ref = build_metadata(spans, 4, "cpu")
    m = inp.meta
    assert m.slot_mapping.tolist() == ref.slot_mapping.tolist()
    assert m.seq_lens.tolist() == ref.seq_lens.tolist()
    assert m.query_start_loc.tolist() == ref.query_start_loc.tolist()
    for i, s in enumerate(spans):
        n = -(-(s.start + s.num_new) // 4)
        assert m.block_tables[i, :n].tolist() == list(s.block_table[:n])
    want_pos = [p for s in spans for p in range(s.start, s.start + s.num_new)]
    assert inp.positions.tolist() == want_pos
    assert inp.logits_idx.tolist() == [0, 13, 22]
    for s in sched.spans:
        eng.abort(s.request.request_id)
    eng.step()


def test_padded_decode_buckets_give_the_unpadded_tokens(make_engine):
    """The CUDA-graph path run eagerly (its CPU twin): batches padded to their bucket through
    the padding row and the scratch block give exactly the tokens of unpadded steps."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = make_engine(num_kv_blocks=128).generate(prompts, params)
    eng = make_engine(num_kv_blocks=128)
    graphs = DecodeGraphs(
        eng.model, eng.cache, eng.step_state, eng.backend, max_batch=8, capture=False
    )
    used: list[int] = []
    run = graphs.run
    graphs.run = lambda spans: used.append(graphs.bucket(len(spans))) or run(spans)  # type: ignore[method-assign]
    eng.runner.graphs = graphs
    assert eng.generate(prompts, params) == want
    assert 8 in used  # 5 sequences ran padded to the bucket of 8
    scratch = eng.cache.k[0][:, eng.cache.scratch_block]
    assert scratch.abs().sum() > 0  # the padding wrote there, and only there


def test_capture_needs_a_graph_safe_backend(make_engine):
    eng = make_engine()
    with pytest.raises(ValueError, match="graph-safe"):
        DecodeGraphs(eng.model, eng.cache, eng.step_state, eng.backend, 4, capture=True)


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64)[-3:] == [48, 56, 64]


def test_kv_pool_sized_from_device_memory():
    gib = 2**30
    # 80 GiB device, 20 GiB in use (weights, context), 0.9 of it ours, 2 GiB of activations
    n = blocks_for_memory(
        total=80 * gib,
        free=60 * gib,
        utilization=0.9,
        bytes_per_block=2**20,
        activation_bytes=2 * gib,
    )
    assert n == int((0.9 * 80 - 20 - 2) * 1024)
    with pytest.raises(ValueError, match="no room for the KV cache"):
        blocks_for_memory(
            total=80 * gib,
            free=10 * gib,
            utilization=0.9,
            bytes_per_block=2**20,
            activation_bytes=2 * gib,
        )


def _mixed_step(eng):
    """A decode row, a whole prompt scoring its tokens (prompt_logprobs), a whole plain
    prompt and the first chunk of a longer one (nothing sampled): 1 + 13 + 9 + 9 rows."""
    rng = random.Random(1)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    eng.add_request("d", [rng.randrange(3, 256) for _ in range(9)], params)
    eng.step()  # "d" is decoding now
    scoring = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0)
    eng.add_request("s", [rng.randrange(3, 256) for _ in range(13)], scoring)
    eng.add_request("p", [rng.randrange(3, 256) for _ in range(9)], params)
    eng.add_request("c", [rng.randrange(3, 256) for _ in range(20)], params)
    return eng.scheduler.schedule().spans


def test_tail_rows_run_each_span_from_its_first_row_with_logits(make_engine):
    eng = make_engine(block_size=4, num_kv_blocks=64, max_num_batched_tokens=32)
    spans = _mixed_step(eng)
    assert [(s.start, s.num_new) for s in spans] == [(9, 1), (0, 13), (0, 9), (0, 9)]
    inp = eng.step_state.build(spans)
    tail = inp.tail
    assert tail is not None
    # the decode row; all of "s" (it scores positions 0-11, samples 12); p's last row; none
    # of "c" (its chunk ends mid-prompt)
    assert tail.rows.tolist() == [0, *range(1, 14), 22]
    assert tail.rows[tail.logits_idx].tolist() == inp.logits_idx.tolist()
    m = tail.meta
    assert m.query_lens == [1, 13, 1] and m.context_lens == [10, 13, 9]
    assert m.query_start_loc.tolist() == [0, 1, 14, 15]
    assert m.prompt_spans == [False, True, True]
    assert m.block_tables.tolist() == inp.meta.block_tables[:3, : m.block_tables.shape[1]].tolist()
    for rid in "dspc":
        eng.abort(rid)
    eng.step()


def test_no_tail_when_every_row_has_logits_and_an_empty_one_when_none_has(make_engine):
    eng = make_engine(block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    eng.add_request("a", list(range(3, 23)), params)
    spans = eng.scheduler.schedule().spans  # 8 of 20 prompt tokens
    inp = eng.step_state.build(spans)
    assert inp.tail is not None and inp.tail.rows.numel() == 0 and inp.logits_idx.numel() == 0
    logits = eng.runner.run(spans)
    assert logits.shape == (0, eng.model_config.vocab_size)
    eng.abort("a")
    eng.step()
    eng.add_request("b", [5, 6, 7], params)
    eng.step()  # the prompt; then a step of one decode row
    assert eng.step_state.build(eng.scheduler.schedule().spans).tail is None
    eng.abort("b")
    eng.step()


@pytest.mark.parametrize(
    ("backend", "batch_invariant"),
    [("cpu", False), ("cpu", True), ("torch", False), ("triton", False)],
)
def test_the_last_layer_over_its_tail_gives_every_rows_logits(
    make_engine, backend, batch_invariant
):
    """Logits with the last layer computed over the tail rows alone equal those of the whole
    step's last layer: bit for bit with batch_invariant (every kernel computes each row on
    its own), to fp32 rounding otherwise (the tail's few rows may take other kernels)."""
    if backend == "triton":
        pytest.importorskip("triton")
    eng = make_engine(
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=32,
        batch_invariant=batch_invariant,
        attention_backend=backend,
        device="cuda" if backend == "triton" and torch.cuda.is_available() else "cpu",
    )
    assert eng.backend.name == backend
    inp = eng.step_state.build(_mixed_step(eng))
    assert inp.tail is not None

    def logits(tail):
        return eng.model.forward(
            inp.input_ids, inp.positions, eng.cache, inp.meta, eng.backend, inp.logits_idx,
            None, inp.roles, inp.sampled_roles, tail,
        ).cpu()  # fmt: skip

    seen: list[int] = []  # query rows of each layer's attention call
    forward = eng.backend.attention.forward

    def recording(q, *args):
        seen.append(q.shape[0])
        return forward(q, *args)

    eng.backend.attention.forward = recording
    whole, tail = logits(None), logits(inp.tail)
    layers = eng.model_config.num_layers
    assert seen == [32] * (2 * layers - 1) + [15]  # the tail's run: its last layer, 15 rows
    assert tail.shape == whole.shape == (1 + 13 + 1, eng.model_config.vocab_size)
    if batch_invariant:
        assert torch.equal(tail, whole)
    else:
        torch.testing.assert_close(tail, whole, rtol=1e-5, atol=1e-5)
    for rid in "dspc":
        eng.abort(rid)
    eng.step()
