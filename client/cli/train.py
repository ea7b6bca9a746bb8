"""``specdraft train glide`` / ``train edd``: prompts → the target's answers → cached features →
draft vocabulary → a trained GLIDE or EDD checkpoint; ``specdraft train cape``: CAPE's table for a
GLIDE checkpoint; ``specdraft train corpus``: the corpus kept compressed. Every stage resumes
where an interrupted run stopped (the work directory keeps its files). These commands only parse
their arguments: the pipeline is ``llm_worker.training.pipeline`` driven by the drafter's recipe
(``llm_worker.training.recipes``), the calibration ``llm_worker.training.calibrate``."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path
from typing import Any

from client.cli.common import CliError, add_model_args, model_config, positive_int, print_json


def _add_data_args(g: argparse.ArgumentParser) -> None:
    """The pipeline's data stages: what the target writes, and the features' bound."""
    g.add_argument(
        "--data-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="dtype the target writes prompts and answers in (features use --dtype); auto: the faster "
        "of float32 and bfloat16 on this machine, measured",
    )
    g.add_argument("--instructions", type=int, default=600, help="self-generated instructions")
    g.add_argument("--local-tasks", type=int, default=300, help="tasks over local text")
    g.add_argument("--heldout-fraction", type=float, default=0.05)
    g.add_argument("--max-answer-tokens", type=positive_int, default=192)
    g.add_argument("--generate-batch", type=positive_int, default=24, help="sequences per generate call")
    g.add_argument("--max-feature-gb", type=float, default=4.0, help="bound on the feature cache")
    g.add_argument(
        "--train-answer-tokens",
        type=positive_int,
        default=None,
        help="train on the first conversations holding this many answer tokens (data-scaling runs)",
    )
    g.add_argument("--vocab", type=positive_int, default=8192, help="draft vocabulary size")


def _add_schedule_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("--steps", type=positive_int, default=2000)
    g.add_argument("--tokens-per-batch", type=positive_int, default=4096)
    g.add_argument("--lr", type=float, default=3e-3)


def _add_run_args(g: argparse.ArgumentParser) -> None:
    """How long the run may take, and what it shows."""
    g.add_argument("--max-minutes", type=float, default=None, help="stop training after this long")
    g.add_argument(
        "--finish-minutes",
        type=float,
        default=None,
        help="end the whole run within this long: training stops in time for the export",
    )
    g.add_argument(
        "--data-only", action="store_true", help="stop after the prompts and answers (grow a corpus)"
    )
    g.add_argument(
        "--data-minutes",
        type=float,
        default=None,
        help="start no new batch of prompts or answers after this long; go on with what is written",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--quiet", action="store_true", help="no progress bars")


def add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a learned drafter for a model (resumable)")
    tsub = p.add_subparsers(dest="train_command", required=True)
    g = tsub.add_parser("glide", help="GLIDE: a draft network reading the target's KV cache")
    add_model_args(g)
    g.add_argument("--work", help="data and features (default: the cache, per model)")
    g.add_argument("--out", required=True, help="checkpoint stem: writes OUT.safetensors and OUT.json")
    g.add_argument("--vanilla", action="store_true", help="the ablation without cross-attention")
    _add_data_args(g)
    g.add_argument("--layer", type=int, default=-1, help="target layer whose KV the draft reads (-1 = last)")
    g.add_argument("--block-size", type=positive_int, default=5)
    _add_schedule_args(g)
    g.add_argument(
        "--context-weight",
        type=float,
        default=0.0,
        help="loss weight of prompt positions (the target's predictions there); answers weigh 1",
    )
    g.add_argument(
        "--init-layer",
        type=int,
        default=None,
        help="target layer the draft layer starts from (default: --layer)",
    )
    _add_run_args(g)
    g.set_defaults(func=cmd_train_glide)

    e = tsub.add_parser(
        "edd",
        help="EDD: a draft decoder reading the target's hidden states as a soft prompt",
        description="The same stages as `train glide` (and the same work directory: prompts and "
        "answers are shared; EDD's features are the hidden states of one layer).",
    )
    add_model_args(e)
    e.add_argument("--work", help="data and features (default: the cache, per model)")
    e.add_argument("--out", required=True, help="checkpoint stem: writes OUT.safetensors and OUT.json")
    _add_data_args(e)
    e.add_argument(
        "--layer",
        type=int,
        default=None,
        help="the hidden state read as the soft prompt (0 = embeddings, l = after layer l, -1 = the "
        "final one; default: the 4th from the last)",
    )
    e.add_argument("--min-block", type=positive_int, default=1, help="shortest block of the dual-block mask")
    e.add_argument("--max-block", type=positive_int, default=8, help="longest block of the dual-block mask")
    e.add_argument(
        "--own-head",
        action="store_true",
        help="train a head of its own (default: the target's head rows, frozen, not stored)",
    )
    e.add_argument("--kl-weight", type=float, default=1.0, help="weight of KL(target || draft)")
    e.add_argument("--hard-weight", type=float, default=1.0, help="weight of the target argmax's NLL")
    _add_schedule_args(e)
    _add_run_args(e)
    e.set_defaults(func=cmd_train_edd)

    k = tsub.add_parser(
        "corpus",
        help="keep the target's own corpus (prompts and answers) compressed, and continue from it",
        description="unpack: put a corpus directory's files into a work directory (checksums "
        "checked; a work directory that is ahead is kept), so `train glide --work WORK` continues "
        "it. pack: compress the work directory's prompts and answers back into the corpus "
        "directory and record the run in its manifest.",
    )
    k.add_argument("action", choices=["pack", "unpack"])
    k.add_argument("--corpus", required=True, help="the corpus directory (xz files and manifest.json)")
    k.add_argument("--work", required=True, help="the work directory of `train glide`")
    k.add_argument("--note", default="", help="pack: what grew it (the command), for the manifest's history")
    k.set_defaults(func=cmd_train_corpus)

    c = tsub.add_parser(
        "cape",
        help="CAPE's sibling table for a trained GLIDE checkpoint, from held-out acceptance",
        description="Answer held-out prompts with the target (greedy), replay the answers through "
        "the drafter and count how often the target's token was the draft's rank-r candidate, per "
        "band of the draft's top-1 probability; each band gets the ranks 2, 3, ... in a row right at "
        "least --min-hit of the time. Written into the checkpoint's JSON (meta.cape), which "
        "glide+cape then uses by default.",
    )
    add_model_args(c)
    c.add_argument("--checkpoint", required=True, help="the GLIDE checkpoint (stem or .json) to annotate")
    c.add_argument(
        "--questions",
        help="held-out questions, JSONL as `specdraft bench --questions` (default: the held-out split "
        "`specdraft train glide` wrote to WORK/heldout-questions.jsonl)",
    )
    c.add_argument("--work", help="train glide's work directory (default: the cache, per model)")
    c.add_argument("--limit", type=positive_int, default=None, help="use only the first N questions")
    c.add_argument("--max-new-tokens", type=positive_int, default=128, help="answer tokens per question")
    c.add_argument("--depth", type=positive_int, default=5, help="chain depth replayed from each position")
    c.add_argument("--min-hit", type=float, default=0.02, help="hit rate a sibling's rank must reach")
    c.add_argument("--dry-run", action="store_true", help="print the table; leave the checkpoint alone")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_train_cape)


def _bar(total: int | None, desc: str, quiet: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=quiet, file=sys.stderr, dynamic_ncols=True)


def _command(args: argparse.Namespace) -> str:
    return "specdraft " + shlex.join(getattr(args, "argv", None) or sys.argv[1:])


def _pipeline_config(args: argparse.Namespace) -> Any:
    """The run of ``train glide`` / ``train edd`` their shared options describe."""
    from client.bench.suite import SUITE_SOURCES
    from llm_worker.training.pipeline import PipelineConfig, Schedule

    return PipelineConfig(
        model=model_config(args),
        out=Path(args.out),
        work=Path(args.work) if args.work else None,
        data_dtype=args.data_dtype,
        instructions=args.instructions,
        local_tasks=args.local_tasks,
        heldout_fraction=args.heldout_fraction,
        max_answer_tokens=args.max_answer_tokens,
        generate_batch=args.generate_batch,
        max_feature_gb=args.max_feature_gb,
        train_answer_tokens=args.train_answer_tokens,
        vocab=args.vocab,
        schedule=Schedule(steps=args.steps, tokens_per_batch=args.tokens_per_batch, lr=args.lr),
        max_minutes=args.max_minutes,
        data_minutes=args.data_minutes,
        finish_minutes=args.finish_minutes,
        data_only=args.data_only,
        seed=args.seed,
        exclude_modules=frozenset(name.split(".")[0] for names in SUITE_SOURCES.values() for name in names),
        command=_command(args),
    )


def _run_pipeline(args: argparse.Namespace, recipe: Any, **settings: Any) -> int:
    """Run every stage for ``recipe`` with its ``settings`` replaced; print the report."""
    from llm_worker.training.pipeline import PipelineError, run_pipeline

    try:
        config, recipe = _pipeline_config(args), dataclasses.replace(recipe, **settings)
        report = run_pipeline(config, recipe, lambda stage, total: _bar(total, stage, args.quiet))
    except PipelineError as exc:
        raise CliError(str(exc)) from None
    print_json(report, indent=2)
    return 0


def cmd_train_glide(args: argparse.Namespace) -> int:
    from llm_worker.training.recipes import GLIDE_RECIPE

    names = ("layer", "init_layer", "block_size", "vanilla", "context_weight")
    return _run_pipeline(args, GLIDE_RECIPE, **{name: getattr(args, name) for name in names})


def cmd_train_edd(args: argparse.Namespace) -> int:
    from llm_worker.training.recipes import EDD_RECIPE

    names = ("layer", "min_block", "max_block", "kl_weight", "hard_weight")
    settings = {name: getattr(args, name) for name in names}
    return _run_pipeline(args, EDD_RECIPE, shared_head=not args.own_head, **settings)


def cmd_train_corpus(args: argparse.Namespace) -> int:
    from llm_worker.training.corpus import CorpusError, pack, unpack

    corpus, work = Path(args.corpus), Path(args.work)
    try:
        if args.action == "unpack":
            print_json(unpack(corpus, work), indent=1)
        else:
            manifest = pack(work, corpus, {"note": args.note} if args.note else None)
            print_json({"files": manifest["files"], "data_dtype": manifest.get("data_dtype")}, indent=1)
    except (CorpusError, OSError) as exc:
        raise CliError(str(exc)) from None
    return 0


def cmd_train_cape(args: argparse.Namespace) -> int:
    from client.bench.suite import load_questions
    from llm_worker.training.calibrate import CapeConfig, run_cape
    from llm_worker.training.pipeline import PipelineError

    def first_turns(path: Path) -> list[str]:
        return [q.turns[0] for q in load_questions(path)]

    try:
        config = CapeConfig(
            model=model_config(args),
            checkpoint=Path(args.checkpoint),
            questions=Path(args.questions) if args.questions else None,
            work=Path(args.work) if args.work else None,
            limit=args.limit,
            max_new_tokens=args.max_new_tokens,
            depth=args.depth,
            min_hit=args.min_hit,
            dry_run=args.dry_run,
            command=_command(args),
        )
        report = run_cape(config, first_turns, lambda stage, total: _bar(total, stage, args.quiet))
    except PipelineError as exc:
        raise CliError(str(exc)) from None
    print_json(report, indent=2)
    return 0
