"""``specdraft bench`` (modes side by side), ``bench-grpc`` (the service's overhead) and
``calibrate-heads`` (induction heads for ``pld+a``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from client.cli.common import (
    CliError,
    add_client_security_args,
    add_datastore_args,
    add_model_args,
    addresses,
    client_security,
    engine_from_args,
    positive_int,
    print_json,
    worker_model_args,
)
from llm_worker.config import DEFAULT_MODE
from specdraft.common import atomic_write_text

DTYPES = ("float32", "bfloat16", "float16")


def add_bench(sub: Any) -> None:
    b = sub.add_parser("bench", help="benchmark modes side by side")
    add_model_args(b)
    add_datastore_args(b)
    b.add_argument("--questions", help="JSONL in Spec-Bench's format (question_id, category, turns)")
    b.add_argument("--suite", default="input-guided", help="built-in suite when --questions is not given")
    b.add_argument(
        "--modes", default="", help="comma-separated modes (default: every available mode + hf-ar, hf-pld)"
    )
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--limit", type=int, default=0, help="run only the first N questions")
    b.add_argument(
        "--concurrency",
        default="",
        help="also run every engine mode with this many concurrent users through the worker's batch "
        "scheduler (comma-separated, e.g. 1,2,4,8), on the questions' first turns",
    )
    b.add_argument(
        "--without-prefix-cache",
        action="store_true",
        help="--concurrency: also run every mode without the prefix cache, as 'MODE (no prefix cache)'",
    )
    b.add_argument("--json-out", help="write the report as JSON here")
    b.add_argument(
        "--plot", help="write a PNG: tokens/s per mode, speed-up vs ar and τ per category (make demo does)"
    )
    b.add_argument(
        "--also-dtype",
        help="also run every engine mode with the model in these dtypes (comma-separated), as MODE@DTYPE, "
        "interleaved in the same run",
    )
    b.set_defaults(func=cmd_bench)

    bg = sub.add_parser("bench-grpc", help="gRPC overhead per unary call and per streamed token")
    add_model_args(bg)
    bg.add_argument("--server", help="HOST:PORT of a running worker (default: start one)")
    bg.add_argument("--calls", type=positive_int, default=50, help="unary + streaming pairs")
    bg.add_argument("--max-new-tokens", type=positive_int, default=32)
    bg.add_argument("--mode", default=DEFAULT_MODE)
    bg.add_argument(
        "--concurrency",
        default="",
        help="instead of the overhead: closed-loop users streaming the suite's first turns at each of "
        "these concurrencies (comma-separated, e.g. 1,2,4,8), every mode of --modes; the figures of "
        "bench --concurrency as a client sees them",
    )
    bg.add_argument("--modes", default="ar,pld+h", help="modes of --concurrency (comma-separated)")
    bg.add_argument("--questions", help="JSONL in Spec-Bench's format (question_id, category, turns)")
    bg.add_argument("--suite", default="input-guided", help="built-in suite when --questions is not given")
    bg.add_argument("--limit", type=int, default=0, help="run only the first N questions")
    bg.add_argument(
        "--metrics",
        help="with --server: the worker's /metrics URL, for requests per forward (default: not reported)",
    )
    bg.add_argument("--json-out", help="write the report as JSON here")
    add_client_security_args(bg)
    bg.set_defaults(func=cmd_bench_grpc)

    c = sub.add_parser("calibrate-heads", help="find the model's induction heads for pld+a")
    add_model_args(c)
    c.add_argument("--prompts", help="calibration prompts: text lines or JSONL with a prompt field")
    c.add_argument("--count", type=int, default=24, help="built-in calibration prompts to use")
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--out", help="output file (default: the user cache, where pld+a looks first)")
    c.add_argument("--ship", action="store_true", help="write into the package data (maintainers)")
    c.set_defaults(func=cmd_calibrate)


def concurrency_levels(text: str) -> list[int]:
    """``--concurrency 1,2,4,8`` → [1, 2, 4, 8]; a CLI error for anything else."""
    try:
        levels = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise CliError(f"--concurrency: expected comma-separated integers, got {text!r}") from None
    if any(c < 1 for c in levels):
        raise CliError(f"--concurrency: every level must be >= 1, got {text!r}")
    return levels


def suite_questions(args: argparse.Namespace) -> list[Any]:
    """The questions ``--questions`` / ``--suite`` and ``--limit`` name."""
    from client.bench.suite import builtin_suite, load_questions

    try:
        questions = load_questions(args.questions) if args.questions else builtin_suite(args.suite)
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    if args.limit:
        questions = questions[: args.limit]
    if not questions:
        raise CliError("no questions to run")
    return list(questions)


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    questions = suite_questions(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    levels = concurrency_levels(args.concurrency)
    also = [d.strip() for d in (args.also_dtype or "").split(",") if d.strip()]
    for dtype in also:
        if dtype not in DTYPES:
            raise CliError(f"--also-dtype: unknown dtype {dtype!r}")
    # Stages of a first run print their own lines with an estimate (conversion, native kernels,
    # kernel choice, cost curve); a later run loads in seconds.
    console.log(f"loading the model ({args.model or 'the default model'}, {args.dtype})")
    engine, target, tokenizer = engine_from_args(args)
    from client.bench.report import plot, render_table
    from client.bench.runner import run_bench
    from llm_worker.drafters import DRAFTERS, ModeUnavailableError, UnknownModeError

    if not modes:
        modes = [*DRAFTERS.available(target, engine.resources), "hf-ar", "hf-pld"]
    others = [
        engine_from_args(argparse.Namespace(**{**vars(args), "dtype": dtype}))[0]
        for dtype in also
        if dtype != target.info.dtype
    ]
    console.log(f"{len(questions)} prompts, at most {args.max_new_tokens} new tokens an answer")
    try:
        result = run_bench(
            engine,
            tokenizer,
            questions,
            modes,
            args.max_new_tokens,
            progress=console.log,
            others=others,
            concurrency=levels,
            without_prefix_cache=args.without_prefix_cache,
        )
    except (UnknownModeError, ModeUnavailableError) as exc:
        raise CliError(str(exc)) from exc
    report = result.to_json()
    times = getattr(engine.resources.datastore, "times", None)
    if times is not None:  # every retrieval of the run, whatever mode made it
        report["datastore_latency_ms"] = times.summary()
    render_table(report, Console())
    if args.json_out:
        atomic_write_text(Path(args.json_out), json.dumps(report, indent=1) + "\n")
        console.print(f"wrote {args.json_out}")
    if args.plot:
        console.print(f"wrote {plot(report, Path(args.plot))}")
    return 0


def cmd_bench_grpc(args: argparse.Namespace) -> int:
    from client.bench.grpc_overhead import PROMPT, measure_overhead, measure_overhead_new_worker
    from client.stack import StackError

    if args.concurrency:
        return bench_grpc_concurrency(args)
    if args.server:
        report = measure_overhead(
            list(addresses(args.server)),
            args.calls,
            args.max_new_tokens,
            PROMPT,
            args.mode,
            security=client_security(args),
        )
    else:
        try:
            worker = worker_model_args(args, args.threads)
            report = measure_overhead_new_worker(worker, args.calls, args.max_new_tokens, mode=args.mode)
        except StackError as exc:
            raise CliError(str(exc)) from exc
    print_json(report.to_json(), args.json_out, indent=2)
    return 0


def bench_grpc_concurrency(args: argparse.Namespace) -> int:
    from rich.console import Console

    from client.bench.grpc_concurrency import run_grpc_concurrency, run_grpc_concurrency_new_worker
    from client.stack import StackError

    levels = concurrency_levels(args.concurrency)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes:
        raise CliError("--modes: no mode given")
    prompts = [q.turns[0] for q in suite_questions(args)]
    console = Console(stderr=True)
    try:
        if args.server:
            report = run_grpc_concurrency(
                list(addresses(args.server)),
                prompts,
                modes,
                levels,
                args.max_new_tokens,
                args.metrics,
                security=client_security(args),
                progress=console.log,
            )
        else:
            worker = worker_model_args(args, args.threads)
            report = run_grpc_concurrency_new_worker(
                worker, prompts, modes, levels, args.max_new_tokens, progress=console.log
            )
    except StackError as exc:
        raise CliError(str(exc)) from exc
    print_json(report, args.json_out, indent=2)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from rich.console import Console

    _engine, target, tokenizer = engine_from_args(args)
    from client.bench.suite import calibration_prompts
    from llm_worker.calibrate import calibrate_to_file, read_prompt_texts

    console = Console(stderr=True)
    texts = read_prompt_texts(Path(args.prompts)) if args.prompts else calibration_prompts(args.count)
    try:
        heads, path = calibrate_to_file(
            target,
            tokenizer,
            texts,
            args.max_new_tokens,
            out=Path(args.out) if args.out else None,
            ship=args.ship,
            progress=lambda i, n: console.log(f"calibration prompt {i}/{n}"),
        )
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    top = ", ".join(f"L{h.layer}H{h.head}={h.score:.2f}" for h in heads.heads[:10])
    console.print(f"{heads.events} copy events over {heads.prompts} prompts; top heads: {top}")
    sys.stdout.write(str(path) + "\n")
    return 0
