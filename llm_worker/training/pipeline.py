"""The training pipeline of a learned drafter, driven by the drafter's recipe.

prompts → the target's answers → cached target features → a draft vocabulary → a trained
checkpoint. The stages are the same for every learned drafter; what differs is in its ``Recipe``:
which features it reads from the target (``Recipe.features``), how its trainer is built
(``Recipe.build_trainer``), how its checkpoint is saved (``Recipe.save``) and its default schedule
(``Recipe.defaults``). ``recipes.GLIDE_RECIPE`` is GLIDE's; a new drafter adds a recipe, not a
command: ``specdraft train glide`` only parses its arguments into a ``PipelineConfig`` and a
recipe and calls ``run_pipeline``.

Every stage resumes where an interrupted run stopped. The work directory (``PipelineConfig.work``)
keeps what the stages make: ``data-dtype`` (the dtype its data is written in, chosen once),
``prompts.jsonl`` and ``conversations.jsonl`` (``data``: JSON lines, ids already written are
skipped), ``heldout-questions.jsonl`` (the held-out prompts as benchmark questions, which
``specdraft train cape`` reads), ``features-…/`` (``features``: chunks and their manifest, one
directory per set of features a recipe asks for: ``FeatureConfig.dirname``). Next to the
checkpoint stem ``OUT`` the recipe's trainer keeps ``OUT.train-state.pt`` (a second run
continues from it) and the recipe writes ``OUT.safetensors`` and ``OUT.json``.

Errors a user can act on (a setting out of range, a tokenizer without a chat template, a work
directory or a training state of another run, no training data) are ``PipelineError``; their
messages name the settings as the command line spells them (``--layer``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, cast

import torch

from llm_worker.config import DType, ModelConfig
from llm_worker.model.target import TargetInfo, TargetModel
from llm_worker.training.data import DataConfig, read_jsonl
from llm_worker.training.features import FeatureConfig, Sequence_
from llm_worker.training.trainer import TrainReport
from specdraft.common import atomic_write_text
from specdraft.tokenizer import Tokenizer

PROMPTS = "prompts.jsonl"
CONVERSATIONS = "conversations.jsonl"
HELDOUT_QUESTIONS = "heldout-questions.jsonl"
DATA_DTYPE = "data-dtype"


class PipelineError(ValueError):
    """A run that cannot go on, with a message worth printing as is."""


# -- configuration --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    """How long and how fast a trainer learns: a recipe's defaults, which a run may override."""

    steps: int = 2000
    """Optimiser steps in all (a resumed run continues up to this many)."""
    tokens_per_batch: int = 4096
    """Padded tokens per optimiser step."""
    lr: float = 3e-3
    """Peak learning rate."""


@dataclass(frozen=True)
class TrainingRun:
    """What a recipe's trainer gets from the run besides the data."""

    schedule: Schedule
    """Steps, batch and learning rate."""
    seed: int = 0
    """Seed of the network's initialisation and of the batches' order."""
    device: str = "cpu"
    """Torch device the trainer computes on."""
    max_seconds: float | None = None
    """Stop (state saved, checkpoint exported) after this long; None: run every step."""


@dataclass(frozen=True)
class PipelineConfig:
    """One run of the pipeline: the target, where things go, how much data, the schedule."""

    model: ModelConfig
    """The target; its dtype is the one features are made and training runs in."""
    out: Path
    """Checkpoint stem: OUT.safetensors and OUT.json, the training state OUT.train-state.pt."""
    work: Path | None = None
    """Prompts, answers and features (None: the cache, per target: ``cache_root()/train/WEIGHTS``)."""
    data_dtype: Literal["auto"] | DType = "auto"
    """Dtype the target writes prompts and answers in; auto: the faster of float32 and bfloat16 on
    this machine, measured once per work directory (kept in WORK/data-dtype)."""
    instructions: int = 600
    """Self-generated instructions."""
    local_tasks: int = 300
    """Tasks over local text."""
    heldout_fraction: float = 0.05
    """Share of prompts held out of training (by a hash of their text), in [0, 1)."""
    max_answer_tokens: int = 192
    """Tokens per answer the target writes."""
    generate_batch: int = 24
    """Sequences per generate call (the target's KV pool gets at least this many slots)."""
    max_feature_gb: float = 4.0
    """Bound on the feature cache, GiB."""
    train_answer_tokens: int | None = None
    """Train on the first training conversations holding this many answer tokens (None: all
    cached). A data-scaling run trains the same recipe on growing prefixes of one cache."""
    vocab: int = 8192
    """Draft vocabulary size (at most the target's)."""
    schedule: Schedule | None = None
    """Steps, batch and learning rate; None: the recipe's defaults."""
    max_minutes: float | None = None
    """Stop training after this long (None or 0: no limit)."""
    finish_minutes: float | None = None
    """The whole run (data, features, training, export) ends within this many minutes of its
    start: training stops early enough for the held-out evaluation and the export (None or 0:
    no limit)."""
    data_minutes: float | None = None
    """Start no new batch of prompts or answers after this long (None or 0: no limit); the run
    goes on with the data written so far, and a rerun continues it."""
    seed: int = 0
    """Seed of the data (sampled answers, local tasks) and of training."""
    exclude_modules: frozenset[str] = frozenset()
    """Standard-library modules local tasks leave out (those a benchmark reads)."""
    command: str = ""
    """The command that made the checkpoint, recorded in it."""
    data_only: bool = False
    """Stop after the data stages (prompts and answers): to grow a corpus in pieces."""
    finish_by: float | None = None
    """Unix time ``finish_minutes`` sets at the run's start."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise PipelineError("--heldout-fraction must be in [0, 1)")

    def data_config(self, began: float | None = None) -> DataConfig:
        """The data stages' own config; ``began`` (``time.monotonic()``) starts ``data_minutes``."""
        deadline = None
        if self.data_minutes and began is not None:
            deadline = began + self.data_minutes * 60
        return DataConfig(
            deadline=deadline,
            instructions=self.instructions,
            local_tasks=self.local_tasks,
            heldout_fraction=self.heldout_fraction,
            max_answer_tokens=self.max_answer_tokens,
            batch_size=self.generate_batch,
            seed=self.seed,
        )

    def model_config(self, dtype: DType) -> ModelConfig:
        """The target in ``dtype``; its KV pool holds every sequence the data writer keeps in
        flight (grouped attention: one kernel call per layer for all of them), and grows only as
        slots are taken."""
        slots = max(self.model.kv_pool_slots, self.generate_batch)
        return dataclasses.replace(self.model, dtype=dtype, kv_pool_slots=slots)


# -- what a drafter provides ----------------------------------------------------------------------


class Trainer(Protocol):
    """A drafter's trainer, as the pipeline drives it."""

    @property
    def step(self) -> int:
        """Steps done (after a resume: those of the run it continues)."""
        ...

    def fit(self, state_path: Path, progress: Callable[[dict[str, Any]], None] | None = None) -> TrainReport:
        """Train up to the schedule's steps, resuming from ``state_path`` if it holds this run's
        state (ValueError if it holds another's) and saving it there; ``progress`` is called
        after each step with ``{"step", "loss", "accuracy"}`` (held-out top-1 per depth, or [])."""
        ...


TrainerT = TypeVar("TrainerT", bound=Trainer)


class Recipe(Protocol[TrainerT]):
    """What a learned drafter gives the pipeline: the target features it trains on, its trainer,
    its checkpoint, its default schedule. Its own hyper-parameters are its fields."""

    @property
    def name(self) -> str:
        """The drafter's name, as in ``specdraft train NAME``."""
        ...

    @property
    def defaults(self) -> Schedule:
        """The schedule a run gets when its config names none."""
        ...

    def check(self, info: TargetInfo) -> None:
        """Raise ``PipelineError`` if the recipe's settings do not fit the target (a layer it
        lacks); called once the target is loaded, before any data is made."""
        ...

    def features(self, info: TargetInfo, max_bytes: int) -> FeatureConfig:
        """Which features of the target the drafter trains on (cached at most ``max_bytes``)."""
        ...

    def build_trainer(
        self,
        target: TargetModel,
        d2t: torch.Tensor,
        train: list[Sequence_],
        heldout: list[Sequence_],
        run: TrainingRun,
    ) -> TrainerT:
        """The trainer over the cached sequences, with ``d2t`` [V] as the draft vocabulary."""
        ...

    def save(
        self, trainer: TrainerT, stem: Path, target: dict[str, Any], command: str, meta: dict[str, Any]
    ) -> Path:
        """Write the checkpoint at ``stem`` (``target``: the record a loader checks the target
        against; ``meta``: the run's report); its JSON's path."""
        ...


# -- progress -------------------------------------------------------------------------------------


class StageBar(Protocol):
    """One stage's progress (the part of tqdm's interface the pipeline uses)."""

    def update(self, n: int) -> None: ...

    def set_postfix_str(self, s: str) -> None: ...


Progress = Callable[[str, int | None], AbstractContextManager[StageBar]]
"""``progress(stage, total)``: a bar for a stage (total None: unknown); stages are ``prompts``,
``answers``, ``features``, ``train``."""


class _Silent:
    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int) -> None:
        return None

    def set_postfix_str(self, s: str) -> None:
        return None


def silent(stage: str, total: int | None) -> AbstractContextManager[StageBar]:
    """No progress shown."""
    return _Silent()


# -- the stages -----------------------------------------------------------------------------------


def run_pipeline(
    config: PipelineConfig, recipe: Recipe[TrainerT], progress: Progress = silent
) -> dict[str, Any]:
    """Every stage for ``recipe`` (each resumes what an earlier run left); the run's report:
    ``data_dtype``, ``prompts``, ``answers``, ``data_seconds``, ``heldout_questions``,
    ``features``, ``vocabulary``, ``training``, ``checkpoint``, ``seconds``."""
    from specdraft.common import cache_root

    began = time.perf_counter()
    if config.finish_minutes:
        config = dataclasses.replace(config, finish_by=time.time() + config.finish_minutes * 60)
    target, tokenizer = load_target(config)
    info = target.info
    work = config.work or cache_root() / "train" / weights_id_of(info)
    recipe.check(info)
    torch.manual_seed(config.seed)
    if config.model.device.startswith("cuda"):
        # TF32 tensor cores for the float32 target's features and the drafter's training: a
        # drafter's inputs and gradients need no more than its 10-bit mantissa.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    report = make_data(config, target, tokenizer, work, progress)
    if config.data_only:
        report["seconds"] = round(time.perf_counter() - began, 1)
        return report
    directory, report["features"] = make_target_features(config, recipe, target, tokenizer, work, progress)
    d2t, report["vocabulary"] = draft_vocabulary_of(config, info, directory)
    trainer, report["training"] = train(config, recipe, target, directory, d2t, progress)
    target_record = {"weights_id": weights_id_of(info), "name": info.name, "vocab_size": info.vocab_size}
    meta = {k: report[k] for k in ("vocabulary", "features", "training")}
    report["checkpoint"] = str(recipe.save(trainer, config.out, target_record, config.command, meta))
    report["seconds"] = round(time.perf_counter() - began, 1)
    return report


def weights_id_of(info: TargetInfo) -> str:
    """The target's identity a checkpoint and a work directory are keyed by."""
    return info.weights_id or info.fingerprint


def load_model(cfg: ModelConfig) -> tuple[TargetModel, Any]:
    """The target of ``cfg`` and its tokenizer; PipelineError for a missing model or an impossible
    configuration. (Not through ``llm_worker.assembly``: training needs no engine, no gRPC stubs.)"""
    from llm_worker.model import load_target as load_model_target
    from llm_worker.model.loading import ModelNotFoundError, quiet_libraries

    quiet_libraries()
    try:
        return load_model_target(cfg)
    except (ModelNotFoundError, ValueError) as exc:
        raise PipelineError(str(exc)) from exc


def load_target(config: PipelineConfig) -> tuple[TargetModel, Any]:
    """The target in the run's dtype, and its tokenizer (which must have a chat template)."""
    target, tokenizer = load_model(config.model_config(config.model.dtype))
    if not getattr(tokenizer, "chat_template", None):
        raise PipelineError(
            "training data is made through the model's chat template; this tokenizer has none"
        )
    return target, tokenizer


def choose_data_dtype(config: PipelineConfig, info: TargetInfo, work: Path) -> DType:
    """``config.data_dtype``, or for auto the one this work directory's data was written in, or
    the faster of float32 and bfloat16 here (measured, then kept in WORK/data-dtype)."""
    dtype: str = config.data_dtype
    chosen_file = work / DATA_DTYPE  # the data of one work directory is written in one dtype
    if dtype == "auto" and chosen_file.is_file():
        dtype = chosen_file.read_text().strip()
    if dtype == "auto" and config.model.device.startswith("cuda"):
        dtype = "bfloat16"  # tensor cores; no CPU kernel to measure
        work.mkdir(parents=True, exist_ok=True)
        atomic_write_text(chosen_file, dtype + "\n")
    if dtype == "auto":
        from llm_worker.model.kernels import fastest_dtype

        width = info.hidden_size
        candidates = [torch.float32, torch.bfloat16]
        chosen = fastest_dtype(candidates, config.generate_batch, width, 3 * width, config.model.device)
        dtype = str(chosen).removeprefix("torch.")
        work.mkdir(parents=True, exist_ok=True)
        atomic_write_text(chosen_file, dtype + "\n")
    return cast(DType, dtype)


def make_data(
    config: PipelineConfig, target: TargetModel, tokenizer: Tokenizer, work: Path, progress: Progress
) -> dict[str, Any]:
    """Stages 1-2: prompts and the target's answers, in the data dtype; the held-out prompts as
    benchmark questions. The report's data part."""
    from llm_worker.training.data import Completer, make_conversations, make_prompts
    from llm_worker.training.generate import TargetCompleter

    data_dtype = choose_data_dtype(config, target.info, work)
    report: dict[str, Any] = {"data_dtype": data_dtype}
    data_cfg = config.data_config(began=time.monotonic())
    writer = target
    if data_dtype != config.model.dtype:
        writer, _ = load_model(config.model_config(data_dtype))
    eos = target.info.eos_token_ids
    completer: Completer | TargetCompleter
    if writer.info.backend == "fast":  # many sequences in flight through its batched forward
        completer = TargetCompleter(writer, eos, data_cfg.batch_size)
    else:
        completer = Completer(writer.model, tokenizer, eos, data_cfg.batch_size)
    t0 = time.perf_counter()
    with progress("prompts", config.instructions + config.local_tasks) as bar:
        report["prompts"] = make_prompts(
            completer, tokenizer, data_cfg, work / PROMPTS, config.exclude_modules, bar.update
        )
    with progress("answers", None) as bar:
        report["answers"] = make_conversations(
            completer, tokenizer, data_cfg, work / PROMPTS, work / CONVERSATIONS, bar.update
        )
    report["data_seconds"] = round(time.perf_counter() - t0, 1)
    report["heldout_questions"] = str(write_heldout(work / PROMPTS, work / HELDOUT_QUESTIONS))
    return report


def write_heldout(prompts: Path, out: Path) -> Path:
    """The held-out prompts as benchmark questions (``specdraft bench --questions``): one turn
    each, category ``heldout-self`` (self-generated instructions) or ``heldout-local``."""
    lines = [
        json.dumps({"question_id": r["id"], "category": f"heldout-{r['kind']}", "turns": [r["text"]]})
        for r in read_jsonl(prompts)
        if r["split"] == "heldout"
    ]
    atomic_write_text(out, "".join(line + "\n" for line in lines))
    return out


def make_target_features(
    config: PipelineConfig,
    recipe: Recipe[TrainerT],
    target: TargetModel,
    tokenizer: Tokenizer,
    work: Path,
    progress: Progress,
) -> tuple[Path, dict[str, Any]]:
    """Stage 3: the features the recipe asks for, of every conversation, in the run's dtype; their
    directory and the report's features part."""
    from llm_worker.training.features import make_features

    t0 = time.perf_counter()
    feature_cfg = recipe.features(target.info, int(config.max_feature_gb * (1 << 30)))
    directory = work / feature_cfg.dirname
    with progress("features", None) as bar:
        try:
            manifest = make_features(
                target.model,
                tokenizer,
                work / CONVERSATIONS,
                directory,
                feature_cfg,
                weights_id_of(target.info),
                bar.update,
            )
        except ValueError as exc:  # features of another target or layer, a damaged manifest
            raise PipelineError(f"{directory}: {exc}") from None
    chunks = manifest["chunks"]
    return directory, {
        "chunks": len(chunks),
        "train_tokens": sum(c["answer_tokens"] for c in chunks if c["split"] == "train"),
        "heldout_tokens": sum(c["answer_tokens"] for c in chunks if c["split"] == "heldout"),
        "skipped_conversations": manifest.get("skipped_conversations", 0),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def draft_vocabulary_of(
    config: PipelineConfig, info: TargetInfo, directory: Path
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Stage 4: the draft vocabulary ``d2t`` [V] (the most frequent answer tokens, the end ids
    always) and the report's vocabulary part."""
    from llm_worker.training.features import draft_vocabulary

    return draft_vocabulary(directory, min(config.vocab, info.vocab_size), info.eos_token_ids)


def first_answer_tokens(sequences: Iterable[Sequence_], limit: int | None) -> list[Sequence_]:
    """The sequences in order until they hold ``limit`` answer tokens (the one that reaches it
    included); all of them for None. Example: sequences of 300, 200 and 400 answer tokens with
    limit 450 give the first two."""
    chosen: list[Sequence_] = []
    held = 0
    for seq in sequences:
        if limit is not None and held >= limit:
            break
        chosen.append(seq)
        held += int(seq.loss_mask.sum())
    return chosen


FINISH_MARGIN_SECONDS = 45.0
"""What ``finish_minutes`` keeps back from training for the final held-out evaluation and the
export (a few seconds on a GPU, under a minute on a CPU for a held-out split of 250 k tokens)."""


def train(
    config: PipelineConfig,
    recipe: Recipe[TrainerT],
    target: TargetModel,
    directory: Path,
    d2t: torch.Tensor,
    progress: Progress,
) -> tuple[TrainerT, dict[str, Any]]:
    """Stage 5: the recipe's trainer on the cached features, resumed from the state beside the
    checkpoint; the trainer and the report's training part."""
    from llm_worker.training.features import load_sequences

    train_seqs = first_answer_tokens(load_sequences(directory, "train"), config.train_answer_tokens)
    heldout = list(load_sequences(directory, "heldout"))
    if not train_seqs:
        raise PipelineError("no training data was made (see the counts above)")
    schedule = config.schedule or recipe.defaults
    max_seconds = config.max_minutes * 60 if config.max_minutes else None
    if config.finish_by is not None:  # leave time for the held-out evaluation and the export
        remaining = max(1.0, config.finish_by - time.time() - FINISH_MARGIN_SECONDS)
        max_seconds = remaining if max_seconds is None else min(max_seconds, remaining)
    run = TrainingRun(schedule, config.seed, config.model.device, max_seconds)
    trainer = recipe.build_trainer(target, d2t, train_seqs, heldout, run)
    with progress("train", schedule.steps) as bar:
        bar.update(trainer.step)
        shown = trainer.step

        def on_step(state: dict[str, Any]) -> None:
            nonlocal shown
            acc = "/".join(f"{a:.2f}" for a in state["accuracy"]) or "-"
            bar.set_postfix_str(f"loss {state['loss']:.3f} acc@depth {acc}")
            bar.update(state["step"] - shown)
            shown = state["step"]

        try:
            result = trainer.fit(train_state_path(config.out), on_step)
        except ValueError as exc:  # a state of another run, or a damaged one
            raise PipelineError(str(exc)) from None
    return trainer, {
        "train_answer_tokens": sum(int(seq.loss_mask.sum()) for seq in train_seqs),
        "steps": result.steps,
        "seconds": round(result.seconds, 1),
        "final_loss": round(result.final_loss, 4),
        "heldout_top1_by_depth": [round(a, 4) for a in result.heldout_accuracy],
        "heldout_positions": result.heldout_positions,
        "heldout_curve": result.curve,
    }


def train_state_path(out: Path) -> Path:
    """Where the trainer keeps its state for a checkpoint stem: ``OUT.train-state.pt``."""
    return out.with_name(out.name + ".train-state.pt")
