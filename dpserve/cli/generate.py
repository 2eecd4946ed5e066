"""``dpserve generate``: send one prompt to a coordinator and print the completion."""

from __future__ import annotations

import argparse
import sys

from dpserve.cli.common import (
    DEFAULT_ZMQ_PORT,
    Subcommands,
    add_credentials,
    client_keys,
    zmq_address,
)
from dpserve.security import key_files


def add_parser(subparsers: Subcommands) -> None:
    generate = subparsers.add_parser("generate", help="send one prompt and print the completion")
    generate.add_argument("prompt")
    generate.add_argument(
        "--address", default=f"tcp://127.0.0.1:{DEFAULT_ZMQ_PORT}", help="coordinator address"
    )
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stream", action="store_true", help="print tokens as they come")
    generate.add_argument("--chat", action="store_true", help="apply the model's chat template")
    generate.add_argument("--timeout", type=float, default=120.0)
    add_credentials(generate, roles=True)
    generate.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from dpserve.client import ClientError, InferenceClient
    from dpserve.sampling import InvalidSamplingParams, SamplingParams

    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            num_tokens_to_generate=args.max_tokens,
            seed=args.seed,
        )
    except InvalidSamplingParams as exc:
        print(f"dpserve generate: {exc}", file=sys.stderr)
        return 2
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    try:
        keys = client_keys(args, zmq_address(args.address))
    except key_files.CredentialsError as exc:
        print(f"dpserve generate: {exc}", file=sys.stderr)
        return 2

    async def complete() -> None:
        async with InferenceClient(
            args.address,
            handshake_timeout=min(args.timeout, 10.0),
            startup_timeout=args.timeout,
            credentials=keys,
        ) as client:
            if args.stream:
                async for chunk in client.stream(prompt, params):
                    print(chunk.text, end="", flush=True)
                print()
            else:
                record = await asyncio.wait_for(client.add_request(prompt, params), args.timeout)
                print(record.generated_text)

    try:
        asyncio.run(complete())
    except (ClientError, TimeoutError) as exc:
        print(f"dpserve generate: {exc or 'timed out'}", file=sys.stderr)
        return 1
    return 0
