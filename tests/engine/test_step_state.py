"""Device-resident step state: persistent block tables synced incrementally, step inputs
derived on the device, decode-graph buckets with padding (the CPU twin of CUDA graphs), and
the KV pool sized from device memory."""

from __future__ import annotations

import random

import pytest

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
