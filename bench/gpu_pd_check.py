"""The KV handoff between two processes, on the device (issue 20): a prefill-role engine with
its ``Outbox`` and a real transport server in a child process, a decode-role engine with its
``Inbox`` and the transport's client in this one. No Ray (the device has none).

Per transport (grpc, shm, gloo; nccl only where two GPUs exist; cuda_ipc is reported as not
built yet) and per prompt length (2,048 and 8,192 tokens of the Llama-3-8B shape, random
weights, bf16, on the device; tiny shapes on CPU with ``--smoke``):
  - token equality: the handed-off request's greedy tokens against the same prompt prefilled
    on the decode engine itself (one engine, role-``both`` flow);
  - the handoff: a whole pull after the prefill, and a layer-wise stream attached before it
    starts; ``exposed_ms`` = when the decode side holds the verified KV minus when the prefill
    sampled its first token (one host, one clock), and its share of TTFT (prefill + exposed);
  - leaks: ``--churn`` handoffs with random cancels (released before, during or after the
    prefill, or never claimed and left to the lease), then the prefill side must hold no KV
    and no handoff, and the decode side no host buffer in use.
Writes $OUT/gpu_pd.json (rewritten after every measurement) and prints a table.

On the lent device, from the repo root:
    python3 bench/gpu_pd_check.py --budget-s 400
Test it on CPU first:
    OMP_NUM_THREADS=1 .venv/bin/python bench/gpu_pd_check.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.multiprocessing as mp
from gpu_engine_bench import GPU_PLAN, SMOKE_PLAN, Plan, make_model, prompts_of

from kvtransfer.base import KVRef
from kvtransfer.inbox import Inbox, InboxConfig
from kvtransfer.outbox import Outbox, OutboxConfig
from kvtransfer.transport import get_transport
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.host_buffers import HOST_BUFFERS
from services.engine.loader import LoadedModel
from services.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LEASE_S = 2.0


def engine_for(plan: Plan, role: str, max_len: int, smoke: bool) -> Engine:
    dtype = torch.float32 if smoke else torch.bfloat16
    model = make_model(plan, "8b", dtype)
    cfg = EngineConfig(
        role=role,  # type: ignore[arg-type]
        device=plan.device,
        dtype="float32" if smoke else "bfloat16",
        attention_backend="torch" if smoke else "auto",
        gpu_memory_utilization=None,
        num_kv_blocks=16 * (max_len // 16 + 2),
        max_num_seqs=8,
        max_num_batched_tokens=plan.chunk if smoke else 2048,
        block_size=16,
        prepack_weights=False,
    )
    loaded = LoadedModel(model.mcfg, model.sd, folder=Path("."), model_id="rand-8b")
    return Engine(loaded, None, cfg)


def prefill_side(conn: Any, transport: str, smoke: bool, max_len: int) -> None:
    """The prefill process: its engine stepped by one loop thread under the lock, as a replica."""
    plan = SMOKE_PLAN if smoke else GPU_PLAN
    if plan.device == "cuda":
        torch.cuda.set_device(0)
    torch.set_num_threads(1)
    engine = engine_for(plan, "prefill", max_len, smoke)
    lock = threading.Lock()
    outbox = Outbox(engine.fingerprint, lambda: lock, OutboxConfig(lease_s=LEASE_S))
    server = get_transport(transport).serve(outbox, "127.0.0.1", 0)
    conn.send(server.address)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg == "stats":
            outbox.expire()
            with lock:
                s = engine.stats()
            conn.send({**outbox.stats(), "num_held": s.num_held, "blocks_used": s.blocks_used})
            continue
        rid, ids, layerwise = msg
        entry = outbox.open(rid, len(ids), layerwise)
        with lock:
            engine.add_request(rid, ids, GREEDY, kv_sink=entry)
        conn.send(("open", entry.secret))  # NOTE: what the KVRef carries to the decode side
        start = time.time()
        first = None
        while first is None:
            outbox.expire()  # NOTE: the replica's lease thread; unclaimed KV must not fill the pool
            with lock:
                for o in engine.step():
                    if o.request_id == rid and o.finished:
                        first = o.new_token_ids[0]
        if plan.device == "cuda":
            torch.cuda.synchronize()
        conn.send((time.time(), start, first))
    server.stop(0)
    outbox.close()


class Check:
    def __init__(self, out: Path, budget_s: float) -> None:
        self.out = out
        self.end = time.monotonic() + budget_s
        self.res: dict[str, Any] = {"rows": [], "churn": [], "errors": []}

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_pd.json").write_text(json.dumps(self.res, indent=2))

    def left(self) -> float:
        return self.end - time.monotonic()


def run_transport(check: Check, transport: str, plan: Plan, smoke: bool, lens: list[int]) -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_side, args=(child, transport, smoke, max(lens) + 16))
    proc.start()
    try:
        address = parent.recv()
        engine = engine_for(plan, "decode", max(lens) + 16, smoke)
        inbox = Inbox(get_transport(transport).client(), engine.fingerprint, InboxConfig())
        vocab = engine.model_config.vocab_size
        for n in lens:
            (ids,) = prompts_of(1, n, vocab, n)
            (solo,) = engine.generate([ids], GREEDY)  # the single-engine reference
            for layerwise in (False, True):
                if check.left() < 30:
                    check.res["errors"].append(f"{transport} {n}: skipped (budget)")
                    return
                check.res["rows"].append(
                    handoff(parent, inbox, engine, address, transport, ids, solo, layerwise)
                )
                check.save()
                print(check.res["rows"][-1], flush=True)
        check.res["churn"].append(churn(parent, inbox, address, transport, vocab, check))
        check.save()
        print(check.res["churn"][-1], flush=True)
        inbox.client.close()
    finally:
        parent.send(None)
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def handoff(
    conn: Any,
    inbox: Inbox,
    engine: Engine,
    address: str,
    transport: str,
    ids: list[int],
    solo: list[int],
    layerwise: bool,
) -> dict[str, Any]:
    rid = f"h{len(ids)}-{layerwise}-{time.monotonic_ns()}"
    conn.send((rid, ids, layerwise))
    _, secret = conn.recv()
    ref = KVRef(rid, address, layerwise, secret)
    box: dict[str, Any] = {}

    def receive() -> None:
        try:
            box["got"] = inbox.receive(ref)
        except Exception as e:
            box["error"] = repr(e)
        box["at"] = time.time()

    th = threading.Thread(target=receive)
    if layerwise:
        th.start()  # attached before the prefill's first step
    done, start, first = conn.recv()
    if not layerwise:
        th.start()
    th.join()
    row: dict[str, Any] = {
        "transport": transport,
        "tokens": len(ids),
        "mode": "layerwise" if layerwise else "whole",
    }
    if "error" in box:
        return row | {"error": box["error"]}
    handle = box["got"].handle
    exposed = max(0.0, box["at"] - done)
    engine.add_request(rid, ids, GREEDY, kv_handle=handle)
    got = [first]
    while engine.has_unfinished:
        got += [t for o in engine.step() for t in o.new_token_ids]
    prefill_s = done - start
    return row | {
        "equal": got == solo,
        "prefill_ms": round(prefill_s * 1e3, 2),
        "exposed_ms": round(exposed * 1e3, 2),
        "exposed_share_of_ttft": round(exposed / (prefill_s + exposed), 4),
        "kv_MB": round(handle.nbytes / 1e6, 1),
    }


def churn(
    conn: Any, inbox: Inbox, address: str, transport: str, vocab: int, check: Check
) -> dict[str, Any]:
    """Handoffs with random fates; afterwards nothing may be left on either side."""
    rng = random.Random(5)
    fates = {"received": 0, "released_early": 0, "unclaimed": 0}
    n = 0
    deadline = time.monotonic() + min(120.0, max(10.0, check.left() / 3))
    while time.monotonic() < deadline and n < 1000:
        (ids,) = prompts_of(1, rng.randrange(8, 64), vocab, 10_000 + n)
        layerwise = rng.random() < 0.5
        rid = f"c{n}"
        conn.send((rid, ids, layerwise))
        _, secret = conn.recv()
        fate = rng.choice(list(fates))
        ref = KVRef(rid, address, layerwise, secret)
        if fate == "released_early":
            inbox.client.release(address, rid, 5.0, secret=secret)
        conn.recv()
        if fate == "received":
            inbox.receive(ref)
        fates[fate] += 1
        n += 1
    time.sleep(LEASE_S + 0.5)  # NOTE: a bench, not a test: let the unclaimed leases pass
    conn.send("stats")
    stats = conn.recv()
    pool = HOST_BUFFERS.stats()
    return {
        "transport": transport,
        "handoffs": n,
        **fates,
        "prefill_held": stats["num_held"],
        "prefill_blocks_used": stats["blocks_used"],
        "outbox_live": stats["open"] + stats["streaming"] + stats["held"],
        "decode_receives_in_flight": len(inbox.in_flight()),
        "decode_host_buffers_in_use": pool.in_use_bytes,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--transports", default="grpc,shm,gloo,nccl")
    args = ap.parse_args()
    plan = SMOKE_PLAN if args.smoke else GPU_PLAN
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("gpu_pd_check: no CUDA device; run with --smoke on CPU")
        return 2
    torch.set_num_threads(1)
    out = Path(os.environ.get("OUT", "gpu-pd-out"))
    check = Check(out, args.budget_s)
    check.res["device"] = torch.cuda.get_device_name(0) if plan.device == "cuda" else "cpu"
    check.res["cuda_ipc"] = "not built yet (needs a GPU session)"
    lens = [40, 100] if args.smoke else [2048, 8192]
    for t in args.transports.split(","):
        if t == "nccl" and torch.cuda.device_count() < 2:
            check.res["errors"].append("nccl: needs two GPUs; not run")
            continue
        try:
            run_transport(check, t, plan, args.smoke, lens)
        except Exception as e:
            check.res["errors"].append(f"{t}: {e!r}")
        check.save()
    print(json.dumps(check.res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
