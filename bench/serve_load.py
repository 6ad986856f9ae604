"""A standard serving load against the default ``pdserve serve``, as a new user runs it.

Starts ``pdserve serve`` (every default; only the ports moved) from each given source tree in
turn, waits for /health, sends ``--requests`` random prompts of ``--prompt-tokens`` tokens for
``--output-tokens`` tokens each (ignore_eos), ``--concurrency`` at a time (closed loop, streamed
over HTTP), and reports output tokens/s, TTFT p50/p99 and ITL p50/p99 at the client, and the
decode replicas' mean step and the share of it their engine thread ran (from the replicas'
step logs, ``GET /pdserve/doctor``: the rest it waited for a core); then stops
that server (SIGINT to the process it started) before the next tree. ``--cpu``: the CPU seconds
each of the server's processes (by title) spent during the measured load, from /proc. Comparing
trees in one run
(``--trees /path/to/old /path/to/new``: e.g. a ``git worktree`` of an earlier commit) puts a
change beside its baseline on the same machine state.

    OMP_NUM_THREADS=1 .venv/bin/python bench/serve_load.py [--trees . /tmp/old] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serving_bench import one, pct

from services.doctor.evidence import Evidence


async def load(
    url: str, prompts: list[list[int]], n_out: int, concurrency: int
) -> tuple[list, float]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient() as client:

        async def run(p: list[int]) -> dict[str, object]:
            async with sem:
                return await one(client, url, p, n_out)

        start = time.perf_counter()
        results = await asyncio.gather(*(run(p) for p in prompts))
        return list(results), time.perf_counter() - start


def wait_healthy(base: str, proc: subprocess.Popen, deadline_s: float = 300) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)  # polling a server we started; not test synchronization
    raise TimeoutError("pdserve serve did not become healthy")


Steps = tuple[int, float, float]


def decode_steps(base: str) -> Steps:
    """The decode pool's steps with decode rows so far: (count, wall seconds, the engine
    threads' CPU seconds), from the replicas' reports (``GET /pdserve/doctor``; NaN seconds
    from a tree that does not report them)."""
    r = httpx.get(f"{base}/pdserve/doctor", timeout=10)
    if r.status_code != 200:
        return (0, float("nan"), float("nan"))
    steps = [b for b in Evidence("serve_load", r.json()).steps("decode") if b["rows"]]
    return (
        sum(b["steps"] for b in steps),
        sum(b["seconds"] for b in steps),
        sum(b["cpu_seconds"] for b in steps),
    )


def settled_decode_steps(base: str, before: Steps) -> Steps:
    """``decode_steps`` once the replicas' reports (a routing-stats period old at most) show
    the load's steps: the count moved past ``before`` and held still for one read."""
    last, deadline = decode_steps(base), time.monotonic() + 15
    while last[0] and time.monotonic() < deadline:
        time.sleep(1.0)  # the reports' period; polling a server, not test synchronization
        now = decode_steps(base)
        if now[0] == last[0] and now[0] > before[0]:
            return now
        last = now
    return last


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (Ray's processes are the server's descendants)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def cpu_times(root: int) -> dict[int, tuple[str, float]]:
    """Title and CPU seconds so far (user + system, all threads) of each process under
    ``root``. A Ray worker's title names its actor (and, while it runs one, the method:
    dropped here, as it changes between samples)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for pid in descendants(root):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        title = title.split(" ")[0].rsplit("/", 1)[-1]
        if title.startswith("ray::"):
            title = title.split(".")[0]
        out[pid] = (title[:60] or "?", (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_spent(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]):  # type: ignore[no-untyped-def]
    """CPU seconds between two ``cpu_times`` samples, summed by title."""
    spent: dict[str, float] = {}
    for pid, (title, sec) in after.items():
        spent[title] = spent.get(title, 0.0) + sec - before.get(pid, (title, 0.0))[1]
    return spent


def measure(tree: Path, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "services.cli", "serve", "--http-port", str(args.port)]
    cmd += ["--grpc-port", "0"]
    # NOTE: the server's log goes to a file, never a pipe nobody reads: a full pipe (64 KiB,
    # reached by a longer load) blocked the server's logging, and so its shutdown
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=log)
        base = f"http://127.0.0.1:{args.port}"
        try:
            try:
                wait_healthy(base, proc)
            except (RuntimeError, TimeoutError) as e:
                log.seek(0)
                tail = log.read()[-4000:].decode(errors="replace")
                raise RuntimeError(f"{e}; its log ends:\n{tail}") from None
            url = f"{base}/v1/completions"
            asyncio.run(load(url, prompts[:2], 4, 2))  # warm-up
            before = cpu_times(proc.pid) if args.cpu else {}
            steps0 = decode_steps(base)
            results, wall = asyncio.run(load(url, prompts, args.output_tokens, args.concurrency))
            steps1 = settled_decode_steps(base, steps0)
            if args.cpu:
                spent = cpu_spent(before, cpu_times(proc.pid))
                print(f"CPU seconds over the {wall:.1f} s load (2 cores: {2 * wall:.1f}):")
                for t, c in sorted(spent.items(), key=lambda kv: -kv[1]):
                    if c >= 0.05:
                        print(f"  {c:6.2f}  {t}")
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    ttft = [float(r["ttft"]) for r in results]
    itl = [g for r in results for g in r["itls"]]  # type: ignore[attr-defined]
    # the first gap of a disaggregated stream spans the handoff (the decode replica takes
    # the KV, then waits for its step in flight); the others are decode steps
    first = [r["itls"][0] for r in results if r["itls"]]  # type: ignore[index]
    rest = [g for r in results for g in r["itls"][1:]]  # type: ignore[index]
    row = {
        "tok_per_s": sum(int(r["tokens"]) for r in results) / wall,
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "itl_p50": pct(itl, 50),
        "itl_p99": pct(itl, 99),
        "first_gap_p50": pct(first, 50),
        "first_gap_p99": pct(first, 99),
        "later_itl_p50": pct(rest, 50),
        "later_itl_p99": pct(rest, 99),
        # the share of its decode steps' wall time the decode engine's thread ran (the rest it
        # waited for a core): a step's CPU time barely moves with the load; its wait does
        "decode_engine_cpu_share": (steps1[2] - steps0[2]) / max(1e-9, steps1[1] - steps0[1]),
        "decode_step_ms": 1e3 * (steps1[1] - steps0[1]) / max(1, steps1[0] - steps0[0]),
    }
    print(
        f"{tree}: {row['tok_per_s']:.1f} output tok/s, TTFT p50 {row['ttft_p50']:.2f} s "
        f"p99 {row['ttft_p99']:.2f} s, ITL p50 {row['itl_p50'] * 1e3:.0f} ms "
        f"p99 {row['itl_p99'] * 1e3:.0f} ms (p99/p50 {row['itl_p99'] / row['itl_p50']:.1f}x); "
        f"first gap p50 {row['first_gap_p50'] * 1e3:.0f} ms p99 {row['first_gap_p99'] * 1e3:.0f} "
        f"ms, later gaps p50 {row['later_itl_p50'] * 1e3:.0f} ms p99 "
        f"{row['later_itl_p99'] * 1e3:.0f} ms; decode steps {row['decode_step_ms']:.1f} ms, "
        f"their thread ran {row['decode_engine_cpu_share']:.0%} of it",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", nargs="+", default=["."], help="source trees to serve, in order")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=18700)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu", action="store_true", help="CPU seconds per server process")
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)
    ]
    print(
        f"{args.requests} requests, {args.concurrency} concurrent, {args.prompt_tokens}-token "
        f"prompts, {args.output_tokens} output tokens, default pdserve serve",
        flush=True,
    )
    rows = {str(t): measure(Path(t).resolve(), args, prompts) for t in args.trees}
    base = next(iter(rows.values()))
    for name, r in list(rows.items())[1:]:
        print(f"{name} / {args.trees[0]}: output tok/s {r['tok_per_s'] / base['tok_per_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
