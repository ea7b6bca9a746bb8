"""``specdraft train glide``: prompts → the target's answers → cached features → draft vocabulary →
a trained GLIDE checkpoint. Every stage resumes where an interrupted run stopped (the work
directory keeps its files); the library is ``llm_worker.training``."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from client.cli.common import CliError, add_model_args, model_config, positive_int, print_json


def add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a learned drafter for a model (resumable)")
    tsub = p.add_subparsers(dest="train_command", required=True)
    g = tsub.add_parser("glide", help="GLIDE: a draft network reading the target's KV cache")
    add_model_args(g)
    g.add_argument("--work", help="data and features (default: the cache, per model)")
    g.add_argument("--out", required=True, help="checkpoint stem: writes OUT.safetensors and OUT.json")
    g.add_argument("--vanilla", action="store_true", help="the ablation without cross-attention")
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
    g.add_argument("--vocab", type=positive_int, default=8192, help="draft vocabulary size")
    g.add_argument("--layer", type=int, default=-1, help="target layer whose KV the draft reads (-1 = last)")
    g.add_argument("--block-size", type=positive_int, default=5)
    g.add_argument("--steps", type=positive_int, default=2000)
    g.add_argument("--tokens-per-batch", type=positive_int, default=4096)
    g.add_argument("--lr", type=float, default=3e-3)
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
    g.add_argument("--max-minutes", type=float, default=None, help="stop training after this long")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    g.set_defaults(func=cmd_train_glide)

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


def write_heldout(prompts: Path, out: Path) -> Path:
    """The held-out prompts as benchmark questions (``specdraft bench --questions``): one turn
    each, category ``heldout-self`` (self-generated instructions) or ``heldout-local``."""
    import json

    from llm_worker.training.data import read_jsonl
    from specdraft.common import atomic_write_text

    lines = [
        json.dumps({"question_id": r["id"], "category": f"heldout-{r['kind']}", "turns": [r["text"]]})
        for r in read_jsonl(prompts)
        if r["split"] == "heldout"
    ]
    atomic_write_text(out, "".join(line + "\n" for line in lines))
    return out


def cmd_train_glide(args: argparse.Namespace) -> int:
    import torch

    from client.bench.suite import SUITE_SOURCES
    from llm_worker.assembly import AssemblyError, load_model
    from llm_worker.drafters.glide_net import glide_config_for
    from llm_worker.training.data import Completer, DataConfig, make_conversations, make_prompts
    from llm_worker.training.features import FeatureConfig, draft_vocabulary, load_sequences, make_features
    from llm_worker.training.generate import TargetCompleter
    from llm_worker.training.trainer import GlideTrainer, TrainConfig
    from specdraft.common import atomic_write_text, cache_root

    if not 0.0 <= args.heldout_fraction < 1.0:
        raise CliError("--heldout-fraction must be in [0, 1)")
    if args.context_weight < 0:
        raise CliError("--context-weight must be >= 0")
    began = time.perf_counter()
    report: dict[str, Any] = {}

    def config(dtype: str) -> Any:
        # The KV pool holds every sequence the data writer keeps in flight (grouped attention:
        # one kernel call per layer for all of them); it grows only as slots are taken.
        loaded = model_config(argparse.Namespace(**{**vars(args), "dtype": dtype}))
        return dataclasses.replace(loaded, kv_pool_slots=max(loaded.kv_pool_slots, args.generate_batch))

    try:
        target, tokenizer = load_model(config(args.dtype))
    except AssemblyError as exc:
        raise CliError(str(exc)) from exc
    if not getattr(tokenizer, "chat_template", None):
        raise CliError("training data is made through the model's chat template; this tokenizer has none")
    info = target.info
    weights_id = info.weights_id or info.fingerprint
    work = Path(args.work) if args.work else cache_root() / "train" / weights_id
    layer = args.layer if args.layer >= 0 else info.num_layers + args.layer
    if not 0 <= layer < info.num_layers:
        raise CliError(f"--layer {args.layer}: the model has {info.num_layers} layers")
    if args.init_layer is not None and not 0 <= args.init_layer < info.num_layers:
        raise CliError(f"--init-layer {args.init_layer}: the model has {info.num_layers} layers")
    torch.manual_seed(args.seed)

    # 1-2. prompts and answers, in --data-dtype
    data_cfg = DataConfig(
        instructions=args.instructions,
        local_tasks=args.local_tasks,
        heldout_fraction=args.heldout_fraction,
        max_answer_tokens=args.max_answer_tokens,
        batch_size=args.generate_batch,
        seed=args.seed,
    )
    chosen_file = work / "data-dtype"  # the data of one work directory is written in one dtype
    if args.data_dtype == "auto" and chosen_file.is_file():
        args.data_dtype = chosen_file.read_text().strip()
    if args.data_dtype == "auto":
        from llm_worker.model.kernels import fastest_dtype

        width = info.hidden_size
        chosen = fastest_dtype(
            [torch.float32, torch.bfloat16], args.generate_batch, width, 3 * width, args.device
        )
        args.data_dtype = str(chosen).removeprefix("torch.")
        work.mkdir(parents=True, exist_ok=True)
        atomic_write_text(chosen_file, args.data_dtype + "\n")
    report["data_dtype"] = args.data_dtype
    writer = target
    if args.data_dtype != args.dtype:
        writer, _ = load_model(config(args.data_dtype))
    completer: Completer | TargetCompleter
    if writer.info.backend == "fast":  # many sequences in flight through its batched forward
        completer = TargetCompleter(writer, info.eos_token_ids, data_cfg.batch_size)
    else:
        completer = Completer(writer.model, tokenizer, info.eos_token_ids, data_cfg.batch_size)
    exclude = {name.split(".")[0] for names in SUITE_SOURCES.values() for name in names}
    t0 = time.perf_counter()
    with _bar(args.instructions + args.local_tasks, "prompts", args.quiet) as bar:
        report["prompts"] = make_prompts(
            completer, tokenizer, data_cfg, work / "prompts.jsonl", exclude, bar.update
        )
    with _bar(None, "answers", args.quiet) as bar:
        report["answers"] = make_conversations(
            completer, tokenizer, data_cfg, work / "prompts.jsonl", work / "conversations.jsonl", bar.update
        )
    report["data_seconds"] = round(time.perf_counter() - t0, 1)
    report["heldout_questions"] = str(write_heldout(work / "prompts.jsonl", work / "heldout-questions.jsonl"))
    del writer, completer

    # 3. features, in --dtype
    t0 = time.perf_counter()
    # Prompt positions' hidden states only when they are trained on: they would double the cache.
    everywhere = args.context_weight > 0
    feature_cfg = FeatureConfig(
        layer=layer, max_bytes=int(args.max_feature_gb * (1 << 30)), hidden_everywhere=everywhere
    )
    directory = work / (f"features-l{layer}" + ("-all" if everywhere else ""))
    with _bar(None, "features", args.quiet) as bar:
        try:
            manifest = make_features(
                target.model,
                tokenizer,
                work / "conversations.jsonl",
                directory,
                feature_cfg,
                weights_id,
                bar.update,
            )
        except ValueError as exc:  # features of another target or layer, a damaged manifest
            raise CliError(f"{directory}: {exc}") from None
    report["features"] = {
        "chunks": len(manifest["chunks"]),
        "train_tokens": sum(c["answer_tokens"] for c in manifest["chunks"] if c["split"] == "train"),
        "heldout_tokens": sum(c["answer_tokens"] for c in manifest["chunks"] if c["split"] == "heldout"),
        "skipped_conversations": manifest.get("skipped_conversations", 0),
        "seconds": round(time.perf_counter() - t0, 1),
    }

    # 4. the draft vocabulary, 5. training
    d2t, vocab = draft_vocabulary(directory, min(args.vocab, info.vocab_size), info.eos_token_ids)
    report["vocabulary"] = vocab
    train = list(load_sequences(directory, "train"))
    heldout = list(load_sequences(directory, "heldout"))
    if not train:
        raise CliError("no training data was made (see the counts above)")
    net_cfg = glide_config_for(
        target.model,
        len(d2t),
        target_layer=layer,
        block_size=args.block_size,
        cross_attention=not args.vanilla,
    )
    train_cfg = TrainConfig(
        steps=args.steps,
        tokens_per_batch=args.tokens_per_batch,
        lr=args.lr,
        context_weight=args.context_weight,
        init_layer=args.init_layer,
        seed=args.seed,
        device=args.device,
        max_seconds=args.max_minutes * 60 if args.max_minutes else None,
    )
    trainer = GlideTrainer(net_cfg, target.model, d2t, train, heldout, train_cfg)
    out = Path(args.out)
    with _bar(args.steps, "train", args.quiet) as bar:
        bar.update(trainer.step)

        def progress(state: dict[str, Any]) -> None:
            acc = "/".join(f"{a:.2f}" for a in state["accuracy"]) or "-"
            bar.set_postfix_str(f"loss {state['loss']:.3f} acc@depth {acc}")
            bar.update(state["step"] - bar.n)

        try:
            result = trainer.fit(out.with_name(out.name + ".train-state.pt"), progress)
        except ValueError as exc:  # a state of another run, or a damaged one
            raise CliError(str(exc)) from None
    report["training"] = {
        "steps": result.steps,
        "seconds": round(result.seconds, 1),
        "final_loss": round(result.final_loss, 4),
        "heldout_top1_by_depth": [round(a, 4) for a in result.heldout_accuracy],
        "heldout_positions": result.heldout_positions,
    }
    command = "specdraft " + shlex.join(getattr(args, "argv", None) or sys.argv[1:])
    target_record = {"weights_id": weights_id, "name": info.name, "vocab_size": info.vocab_size}
    meta = {k: report[k] for k in ("vocabulary", "features", "training")}
    path = trainer.export(out, target_record, command, meta)
    report["checkpoint"] = str(path)
    report["seconds"] = round(time.perf_counter() - began, 1)
    print_json(report, indent=2)
    return 0


def cmd_train_cape(args: argparse.Namespace) -> int:
    from client.bench.suite import load_questions
    from llm_worker.assembly import AssemblyError, load_model
    from llm_worker.chat import chat_prompt_ids
    from llm_worker.drafters.base import ModeUnavailableError
    from llm_worker.drafters.checkpoint import CheckpointError, json_path_of, record_meta
    from llm_worker.drafters.glide import DEFAULT_WINDOW, GlideDrafter, load_glide
    from llm_worker.engine import Engine
    from llm_worker.training.cape import collect_stats, derive_table
    from specdraft.common import cache_root

    if not 0.0 < args.min_hit < 1.0:
        raise CliError("--min-hit must be in (0, 1)")
    checkpoint = json_path_of(args.checkpoint)
    if not checkpoint.is_file():
        raise CliError(f"no checkpoint at {checkpoint}")
    try:
        target, tokenizer = load_model(model_config(args))
    except AssemblyError as exc:
        raise CliError(str(exc)) from None
    weights_id = target.info.weights_id or target.info.fingerprint
    work = Path(args.work) if args.work else cache_root() / "train" / weights_id
    questions_path = Path(args.questions) if args.questions else work / "heldout-questions.jsonl"
    if not questions_path.is_file():
        raise CliError(f"no held-out questions at {questions_path}: pass --questions FILE")
    try:
        questions = load_questions(questions_path)[: args.limit]
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from None
    if not questions:
        raise CliError(f"{questions_path}: no questions")
    try:
        net, d2t, _ = load_glide(target, checkpoint.stem, checkpoint.parent)
    except (CheckpointError, ModeUnavailableError) as exc:
        raise CliError(str(exc)) from None
    # as ``glide`` drafts by default: its own attention from a window before a new request's root
    drafter = GlideDrafter(
        target, net, d2t, depth=args.depth, min_reach=0.0, cape=None, window=DEFAULT_WINDOW
    )
    engine = Engine(target)
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in questions]
    began = time.perf_counter()
    with _bar(len(prompts) * args.max_new_tokens, "replay", args.quiet) as bar:
        stats = collect_stats(engine, drafter, prompts, args.max_new_tokens, args.depth, bar.update)
    table = derive_table(stats, args.min_hit)
    command = "specdraft " + shlex.join(getattr(args, "argv", None) or sys.argv[1:])
    record = {
        "table": list(table),
        "min_hit": args.min_hit,
        "questions": str(questions_path),
        "command": command,
        **stats.to_json(),
    }
    if not args.dry_run:
        record_meta(checkpoint, "cape", record)
    print_json(
        {**record, "checkpoint": str(checkpoint), "seconds": round(time.perf_counter() - began, 1)}, indent=2
    )
    return 0
