"""Calibrating a trained GLIDE checkpoint: CAPE's sibling table from held-out acceptance (``cape``),
written into the checkpoint's JSON (``meta.cape``), which ``glide+cape`` then uses by default.

``specdraft train cape`` parses its arguments into a ``CapeConfig`` and calls ``run_cape``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_worker.config import ModelConfig
from llm_worker.training.pipeline import HELDOUT_QUESTIONS, PipelineError, Progress, silent, weights_id_of


@dataclass(frozen=True)
class CapeConfig:
    """One calibration: the target, the checkpoint, the held-out questions, the replay."""

    model: ModelConfig
    """The target the checkpoint belongs to."""
    checkpoint: Path
    """The GLIDE checkpoint (stem or .json) to annotate."""
    questions: Path | None = None
    """Held-out questions, JSONL as ``specdraft bench --questions`` (None: the held-out split the
    training pipeline wrote to WORK/heldout-questions.jsonl)."""
    work: Path | None = None
    """The training pipeline's work directory (None: the cache, per target)."""
    limit: int | None = None
    """Use only the first N questions (None: all)."""
    max_new_tokens: int = 128
    """Answer tokens per question."""
    depth: int = 5
    """Chain depth replayed from each position."""
    min_hit: float = 0.02
    """Hit rate a sibling's rank must reach, in (0, 1)."""
    dry_run: bool = False
    """Report the table; leave the checkpoint alone."""
    command: str = ""
    """The command that measured the table, recorded with it."""

    def __post_init__(self) -> None:
        if not 0.0 < self.min_hit < 1.0:
            raise PipelineError("--min-hit must be in (0, 1)")


def run_cape(
    config: CapeConfig,
    read_questions: Callable[[Path], Sequence[str]],
    progress: Progress = silent,
) -> dict[str, Any]:
    """Answer the held-out questions with the target (greedy), replay the answers through the
    drafter, derive the table and (unless ``dry_run``) record it in the checkpoint. The record
    written, with ``checkpoint`` and ``seconds`` (of the replay) added. ``read_questions``: the
    first turn of each question of a file (OSError or ValueError for a bad one); ``progress``:
    the ``replay`` stage, counted in answer tokens."""
    from llm_worker.assembly import AssemblyError, load_model
    from llm_worker.chat import chat_prompt_ids
    from llm_worker.drafters.base import ModeUnavailableError
    from llm_worker.drafters.checkpoint import CheckpointError, json_path_of, record_meta
    from llm_worker.drafters.glide import DEFAULT_WINDOW, GlideDrafter, load_glide
    from llm_worker.engine import Engine
    from llm_worker.training.cape import collect_stats, derive_table
    from specdraft.common import cache_root

    checkpoint = json_path_of(config.checkpoint)
    if not checkpoint.is_file():
        raise PipelineError(f"no checkpoint at {checkpoint}")
    try:
        target, tokenizer = load_model(config.model)
    except AssemblyError as exc:
        raise PipelineError(str(exc)) from None
    work = config.work or cache_root() / "train" / weights_id_of(target.info)
    questions_path = config.questions or work / HELDOUT_QUESTIONS
    if not questions_path.is_file():
        raise PipelineError(f"no held-out questions at {questions_path}: pass --questions FILE")
    try:
        questions = list(read_questions(questions_path))[: config.limit]
    except (OSError, ValueError) as exc:
        raise PipelineError(str(exc)) from None
    if not questions:
        raise PipelineError(f"{questions_path}: no questions")
    try:
        network = load_glide(target, checkpoint.stem, checkpoint.parent)
    except (CheckpointError, ModeUnavailableError) as exc:
        raise PipelineError(str(exc)) from None
    # as ``glide`` drafts by default: its own attention from a window before a new request's root
    drafter = GlideDrafter(network, depth=config.depth, min_reach=0.0, cape=None, window=DEFAULT_WINDOW)
    engine = Engine(target)
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    began = time.perf_counter()
    with progress("replay", len(prompts) * config.max_new_tokens) as bar:
        stats = collect_stats(engine, drafter, prompts, config.max_new_tokens, config.depth, bar.update)
    table = derive_table(stats, config.min_hit)
    record = {
        "table": list(table),
        "min_hit": config.min_hit,
        "questions": str(questions_path),
        "command": config.command,
        **stats.to_json(),
    }
    if not config.dry_run:
        record_meta(checkpoint, "cape", record)
    return {**record, "checkpoint": str(checkpoint), "seconds": round(time.perf_counter() - began, 1)}
