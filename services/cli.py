"""The ``pdserve`` command.

Sub-commands:
  serve      start (or join) a Ray cluster and deploy the disaggregated app (HTTP on :8000).
  generate   run one prompt (or chat message) on a single-process engine, no Ray; streams the
             text, then prints TTFT, mean ITL and tokens/s.
  client     call a running cluster's gRPC API: generate | chat | tokenize | models | health
             (``pdserve client --help``; the same as the SDK's ``pdserve-client``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import uuid

from services.engine.errors import EngineError, InvalidRequestError, ModelLoadError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="GGUF file or HF folder (default: embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on GPUs; on CPUs float32 activations and KV, with bf16 matrix "
        "products where the CPU has native bf16 (AMX / AVX512-BF16)",
    )
    g.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="weights: auto keeps a GGUF's quantized weights (CPU kernels)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "int8"],
        help="KV cache storage: auto = the matrix products' dtype (bf16 on a CPU with native "
        "bf16 under dtype auto); int8 = int8 with a scale per 32 values",
    )
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="kernels (auto: triton on CUDA, torch elsewhere)",
    )
    g.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        help="prompt-lookup draft tokens per step (lossless; copy-heavy prompts); 0 = off",
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=1024, help="KV blocks in the pool")
    g.add_argument("--max-num-batched-tokens", type=int, default=1024, help="per-step token budget")


def pdserve_version() -> str:
    """The installed distribution's version (pyproject.toml)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving"
    )
    parser.add_argument("--version", action="version", version=f"pdserve {pdserve_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from one prompt in this process (no Ray)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text to complete")
    src.add_argument("--chat", help="a user message, sent through the model's chat template")
    gen.add_argument("--system", default=None, help="system message for --chat")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    _add_engine_args(gen)

    # NOTE: parsed by pdserve.cli (the SDK's); listed here for --help only, see main()
    sub.add_parser("client", help="call a running cluster's gRPC API (see pdserve client -h)")

    srv = sub.add_parser(
        "serve",
        help="start or join a Ray cluster and deploy (Ctrl-C stops)",
        description="Every configuration field is a flag (generated from the config model: "
        "services/config.py); flags override PDSERVE_* variables, which override --config.",
    )
    srv.add_argument("--config", default=None, help="YAML config file (see deploy/pdserve.yaml)")
    from services.config_flags import add_flags

    add_flags(srv)

    from services.loadgen.bench import add_args as add_bench_args

    bench = sub.add_parser(
        "bench",
        help="load any OpenAI-compatible endpoint: TTFT, TPOT, ITL, E2E, goodput, plots",
        description="Open-loop Poisson (--rate) or closed-loop (--concurrency) runs of a "
        "locally generated workload; comma-separated values make a sweep.",
    )
    add_bench_args(bench)

    from services.doctor.doctor import add_args as add_doctor_args

    doctor = sub.add_parser(
        "doctor",
        help="answer the six latency questions for a live cluster or a bench report",
        description="Input lengths, TTFT split, ITL against batch size, KV pressure, "
        "quantization headroom, scheduling: numbers, a verdict, the likely cause, an action.",
    )
    add_doctor_args(doctor)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from services.config import load_config
    from services.config_flags import overrides
    from services.launcher import local_ray_auth, serve_forever

    try:
        cfg = load_config(args.config, overrides(args))
        check_model(cfg.model)
    except ValidationError as e:
        print(f"pdserve: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    except ModelLoadError as e:  # one line, before Ray starts (not a replica's traceback)
        print(f"pdserve: cannot load the model: {e}", file=sys.stderr)
        return 2
    if not cfg.ray_address:
        # NOTE: only before ray is imported (serve_forever imports it): Ray reads the mode
        # then, and a driver and GCS that disagree cannot talk (an embedding caller that
        # imported ray already keeps its own settings)
        if "ray" in sys.modules:
            print(
                "pdserve: ray is already imported; Ray token auth is left as it is", file=sys.stderr
            )
        else:
            local_ray_auth(os.environ)
    return serve_forever(cfg)


def check_model(model: str | None) -> None:
    """Raise ModelLoadError unless ``model`` resolves to a folder with a readable config of
    a supported architecture. Converts a GGUF here, once, with progress on stderr, so the
    replicas find it converted (on one host; other hosts convert their own copy)."""
    from services.engine.loader import read_model_config, resolve_model

    logging.basicConfig(level=logging.INFO, format="pdserve: %(message)s")
    folder, _ = resolve_model(model)
    read_model_config(folder)


def _generate(args: argparse.Namespace) -> int:
    from services.engine.config import EngineConfig
    from services.engine.engine import Engine
    from services.engine.sampling_params import SamplingParams

    params = SamplingParams.create(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    t0 = time.perf_counter()
    engine = Engine.from_path(
        args.model,
        EngineConfig(
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            max_num_batched_tokens=args.max_num_batched_tokens,
            threads=args.threads,
            dtype=args.dtype,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            speculative_tokens=args.speculative_tokens,
            device=args.device,
            attention_backend=args.attention_backend,
        ),
    )
    load_s = time.perf_counter() - t0
    tok = engine.tokenizer
    if tok is None:
        raise ModelLoadError("this model has no tokenizer; pdserve generate needs one")
    if args.chat is not None:
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.chat}
        ]
        prompt = tok.encode_chat(msgs)
    else:
        prompt = tok.encode(args.prompt)
    engine.add_request(uuid.uuid4().hex, prompt, params)
    final = None
    while engine.has_unfinished:
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            if out.finished:
                final = out
    sys.stdout.write("\n")
    assert final is not None
    itls = final.itls or []
    mean_itl = sum(itls) / len(itls) if itls else 0.0
    decode_s = sum(itls)
    tps = len(itls) / decode_s if decode_s > 0 else 0.0
    print(
        f"[{engine.model_id}] prompt {final.num_prompt_tokens} tokens, output {final.num_output_tokens} tokens "
        f"({final.finish_reason}); TTFT {1000 * (final.ttft_s or 0):.1f} ms, mean ITL {1000 * mean_itl:.1f} ms, "
        f"{tps:.1f} tokens/s; model load {load_s:.1f} s",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["client"]:
        from pdserve.cli import main as client_main

        return client_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "bench":
            from services.loadgen.bench import main as bench_main

            return bench_main(args)
        if args.command == "doctor":
            from services.doctor.doctor import main as doctor_main

            return doctor_main(args)
    except InvalidRequestError as e:
        print(f"pdserve: invalid request: {e}", file=sys.stderr)
        return 2
    except EngineError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
