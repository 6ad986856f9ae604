"""``pdserve client`` (also installed as ``pdserve-client``): the gRPC API from a shell.

    pdserve client generate --prompt "The capital of France is" --max-tokens 8
    pdserve client chat "Name three planets" --system "Be brief"
    pdserve client tokenize "Hello world"
    pdserve client models
    pdserve client health

The target, token and TLS options come from flags or the environment (``PDSERVE_TARGET``,
``PDSERVE_AUTH_TOKEN``). A failed call prints its gRPC status and exits 1; ``health`` exits 1
unless the server is SERVING.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

import grpc

from pdserve.client import Client, Result


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    p = common
    p.add_argument(
        "--target",
        default=os.environ.get("PDSERVE_TARGET", "127.0.0.1:50051"),
        help="host:port of the gRPC API (PDSERVE_TARGET; default 127.0.0.1:50051)",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("PDSERVE_AUTH_TOKEN"),
        help="bearer token (PDSERVE_AUTH_TOKEN)",
    )
    p.add_argument("--tls", action="store_true", help="TLS with the system's root certificates")
    p.add_argument("--root-certs", default=None, help="PEM file of the CA to trust (implies TLS)")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    p = argparse.ArgumentParser(prog="pdserve client", description="call a pdserve gRPC API")
    sub = p.add_subparsers(dest="command", required=True)

    def sampling(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--max-tokens", type=int, default=128)
        sp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
        sp.add_argument("--top-p", type=float, default=None)
        sp.add_argument("--top-k", type=int, default=0)
        sp.add_argument("--seed", type=int, default=None)
        sp.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
        sp.add_argument("--ignore-eos", action="store_true")
        sp.add_argument("--logprobs", action="store_true")
        sp.add_argument("--request-id", default="")
        sp.add_argument("--model", default="")
        sp.add_argument(
            "--json", action="store_true", help="print the whole result as JSON, not the text"
        )

    gen = sub.add_parser("generate", help="complete a prompt, streaming the text", parents=[common])
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text")
    src.add_argument("--token-ids", help="comma-separated token ids")
    sampling(gen)
    chat = sub.add_parser(
        "chat", help="answer a user message through the chat template", parents=[common]
    )
    chat.add_argument("message")
    chat.add_argument("--system", default=None, help="system message")
    sampling(chat)
    tok = sub.add_parser("tokenize", help="print the token ids of a text", parents=[common])
    tok.add_argument("text")
    tok.add_argument("--model", default="")
    sub.add_parser("models", help="list the served models", parents=[common])
    sub.add_parser(
        "health", help="print the health status (exit 1 unless SERVING)", parents=[common]
    )
    return p


def _generate(c: Client, args: argparse.Namespace, prompt: Any) -> int:
    kw: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos,
        "logprobs": args.logprobs,
    }
    if args.top_p is not None:
        kw["top_p"] = args.top_p
    if args.seed is not None:
        kw["seed"] = args.seed
    common = {"model": args.model, "request_id": args.request_id, "timeout": args.timeout}
    if args.json:
        result = c.complete(prompt, **common, **kw)
        print(json.dumps(dataclasses.asdict(result)))
        return 0
    stream = c.generate(prompt, **common, **kw)
    for chunk in stream:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(_summary(stream.result), file=sys.stderr)
    return 0


def _summary(r: Result) -> str:
    itl = sum(r.itl_s) / len(r.itl_s) if r.itl_s else 0.0
    return (
        f"[{r.request_id}] {len(r.token_ids)} tokens ({r.finish_reason}); "
        f"TTFT {1000 * (r.ttft_s or 0):.1f} ms, mean ITL {1000 * itl:.1f} ms"
        + (f", resumed {r.resumes}x" if r.resumes else "")
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    opts: dict[str, Any] = {"token": args.token, "tls": args.tls}
    if args.root_certs:
        opts["root_certificates"] = args.root_certs
    try:
        with Client(args.target, **opts) as c:
            if args.command == "generate":
                if args.prompt is not None:
                    return _generate(c, args, args.prompt)
                return _generate(c, args, [int(t) for t in args.token_ids.split(",") if t])
            if args.command == "chat":
                msgs = [{"role": "system", "content": args.system}] if args.system else []
                return _generate(c, args, [*msgs, {"role": "user", "content": args.message}])
            if args.command == "tokenize":
                print(json.dumps(c.tokenize(args.text, model=args.model)))
                return 0
            if args.command == "models":
                print("\n".join(c.models()))
                return 0
            status = c.health(timeout=args.timeout)
            print(status)
            return 0 if status == "SERVING" else 1
    except grpc.RpcError as e:
        print(f"pdserve client: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except ValueError as e:  # a malformed --token-ids
        print(f"pdserve client: {e}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
