"""`pagedllm generate`: stream one completion to stdout."""

from __future__ import annotations

import argparse
import logging
import sys

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    EngineConfig.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.sampling_seed,
            output_kind=RequestOutputKind.DELTA,  # each output holds the text to print next
        )
        engine = LLMEngine.from_config(EngineConfig.from_cli_args(args))
        prompt = args.prompt
        if args.chat:
            prompt = engine.apply_chat_template([{"role": "user", "content": prompt}])
        engine.add_request("cli", prompt, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    while engine.has_unfinished_requests():
        for out in engine.step():
            for completion in out.outputs:
                sys.stdout.write(completion.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
