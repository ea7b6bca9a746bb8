"""``specdraft``: the command line. A stable contract — tests and users script against it.

One module per command group (``generate``, ``serve``, ``stack``, ``datastore``, ``bench``), each
only parsing arguments, building typed configuration, calling a library function and printing.
Commands that decode in process load ``llm_worker`` lazily, so ``specdraft --help`` and the
gRPC-only commands start fast.

Exit codes: 0 success, 2 bad input (unknown mode, bad option, prompt too long, ...), 1 other
failures. Errors go to stderr as one line ``specdraft: error: ...``.
"""

from __future__ import annotations

import argparse
import logging
import sys

from client.cli import bench, datastore, generate, secrets, serve, stack, train
from client.cli.common import EXIT_BAD_INPUT, CliError, Parser, VersionAction

__all__ = ["EXIT_BAD_INPUT", "CliError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="specdraft", description="Lossless speculative decoding.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    parser.add_argument(
        "--version", action=VersionAction, help="print the versions of specdraft, torch and transformers"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_generate(sub)
    serve.add_serve(sub)
    stack.add_stack(sub)
    datastore.add_datastore(sub)
    bench.add_bench(sub)
    generate.add_modes(sub)
    secrets.add_secrets(sub)
    train.add_train(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    try:
        return int(args.func(args))
    except CliError as exc:
        sys.stderr.write(f"specdraft: error: {exc}\n")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.verbose:
            raise
        sys.stderr.write(
            f"specdraft: error: internal error: {type(exc).__name__}: {exc} (run with -v for details)\n"
        )
        return 1
