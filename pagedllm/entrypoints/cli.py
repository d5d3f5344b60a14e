"""`pagedllm` command line: serve, generate, bench, run-batch.

Each subcommand lives in its own module exposing ``add_cli_args(parser)`` and ``run(args) -> int``;
they are imported lazily so ``pagedllm --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "serve": ("pagedllm.entrypoints.openai.launcher", "Start the OpenAI-compatible HTTP server."),
    "generate": ("pagedllm.entrypoints.generate_cli", "Generate a completion and stream it to stdout."),
    "bench": ("pagedllm_bench.cli", "Benchmarks: throughput, latency, perplexity, serve, step, roofline."),
    "run-batch": ("pagedllm.entrypoints.run_batch", "Answer a file of OpenAI Batch requests offline."),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    if argv and argv[0] in SUBCOMMANDS:
        # Import only the module of the chosen subcommand.
        names = [argv[0]]
    else:
        names = list(SUBCOMMANDS)
    modules = {}
    for name in names:
        module_name, help_text = SUBCOMMANDS[name]
        p = sub.add_parser(name, help=help_text, description=help_text)
        if len(names) == 1:
            try:
                modules[name] = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                if exc.name not in (module_name, module_name.split(".")[0]):
                    raise
                # The benchmarks are a package of their own (benchmarks/ in the repository).
                parser.exit(
                    2,
                    f"pagedllm {name}: {module_name.split('.')[0]} is not installed "
                    "(pip install -e ./benchmarks from the repository; make install does).\n",
                )
            modules[name].add_cli_args(p)
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
