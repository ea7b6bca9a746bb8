"""The training pipeline as a library: a toy drafter's recipe plugs into ``run_pipeline`` (no CLI
edited), every stage runs in order and resumes; the CLI's defaults are the library's; settings
out of range are refused by name."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from llm_worker.config import ModelConfig
from llm_worker.model.target import TargetInfo, TargetModel
from llm_worker.training.features import FeatureConfig, Sequence_
from llm_worker.training.pipeline import (
    PipelineConfig,
    PipelineError,
    Schedule,
    StageBar,
    TrainingRun,
    first_answer_tokens,
    run_pipeline,
)
from llm_worker.training.recipes import (
    EDD_RECIPE,
    EDD_SCHEDULE,
    GLIDE_RECIPE,
    GLIDE_SCHEDULE,
    EddRecipe,
    GlideRecipe,
)
from llm_worker.training.trainer import TrainReport


@dataclass
class ToyTrainer:
    """Trains nothing: counts steps, keeps the count as its state (a resume continues from it)."""

    run: TrainingRun
    train: list[Sequence_]
    log: list[str]
    step: int = 0

    def fit(self, state_path: Path, progress: Callable[[dict[str, Any]], None] | None = None) -> TrainReport:
        self.log.append("fit")
        if state_path.exists():
            self.step = int(state_path.read_text())
        while self.step < self.run.schedule.steps:
            self.step += 1
            if progress is not None:
                progress({"step": self.step, "loss": 1.0 / self.step, "accuracy": []})
        state_path.parent.mkdir(parents=True, exist_ok=True)
        state_path.write_text(str(self.step))
        return TrainReport(self.step, 0.0, 1.0 / self.step, [], 0)


@dataclass(frozen=True)
class ToyRecipe:
    """A new learned drafter as the pipeline sees it: the first layer's K/V, a toy trainer, a
    JSON checkpoint. Records which of its parts the pipeline called."""

    log: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return "toy"

    @property
    def defaults(self) -> Schedule:
        return Schedule(steps=3, tokens_per_batch=64, lr=0.1)

    def check(self, info: TargetInfo) -> None:
        self.log.append("check")

    def features(self, info: TargetInfo, max_bytes: int) -> FeatureConfig:
        self.log.append("features")
        return FeatureConfig(layer=0, max_bytes=max_bytes)

    def build_trainer(
        self,
        target: TargetModel,
        d2t: torch.Tensor,
        train: list[Sequence_],
        heldout: list[Sequence_],
        run: TrainingRun,
    ) -> ToyTrainer:
        self.log.append("build_trainer")
        keys = train[0].keys if train else None
        assert len(d2t) <= 64 and keys is not None and keys.shape[1] == len(train[0].tokens)
        return ToyTrainer(run, train, self.log)

    def save(
        self, trainer: ToyTrainer, stem: Path, target: dict[str, Any], command: str, meta: dict[str, Any]
    ) -> Path:
        self.log.append("save")
        path = stem.with_suffix(".json")
        path.write_text(json.dumps({"kind": "toy", "target": target, "command": command, "meta": meta}))
        return path


class Stages:
    """A ``Progress`` that records each stage and what its bar was told."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.updates: dict[str, list[int]] = {}

    @contextmanager
    def __call__(self, stage: str, total: int | None) -> Iterator[StageBar]:
        self.seen.append(stage)
        updates = self.updates.setdefault(stage, [])

        class Bar:
            def update(self, n: int) -> None:
                updates.append(n)

            def set_postfix_str(self, s: str) -> None:
                pass

        yield Bar()


REPORT_KEYS = [
    "data_dtype",
    "prompts",
    "answers",
    "data_seconds",
    "heldout_questions",
    "features",
    "vocabulary",
    "training",
    "checkpoint",
    "seconds",
]


def tiny_config(tiny_dir: Path, out: Path, work: Path, **overrides: Any) -> PipelineConfig:
    """A run small enough for a test: the tiny model, a few prompts, short answers."""
    fields: dict[str, Any] = dict(
        data_dtype="float32",
        instructions=1,
        local_tasks=4,
        heldout_fraction=0.3,
        max_answer_tokens=4,
        generate_batch=2,
        vocab=64,
    )
    fields.update(overrides)
    return PipelineConfig(model=ModelConfig(path=str(tiny_dir)), out=out, work=work, **fields)


def test_a_new_drafter_plugs_in_as_a_recipe(tiny_dir: Path, tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out" / "toy"
    out.parent.mkdir()
    config = tiny_config(tiny_dir, out, work, max_answer_tokens=8, generate_batch=4, command="toy command")
    recipe, stages = ToyRecipe(), Stages()
    report = run_pipeline(config, recipe, stages)
    assert recipe.log == ["check", "features", "build_trainer", "fit", "save"]
    assert stages.seen == ["prompts", "answers", "features", "train"]
    assert list(report) == REPORT_KEYS
    assert report["training"]["steps"] == 3  # the recipe's default schedule
    assert stages.updates["train"] == [0, 1, 1, 1]
    for name in (
        "prompts.jsonl",
        "conversations.jsonl",
        "heldout-questions.jsonl",
        "features-l0/manifest.json",
    ):
        assert (work / name).is_file(), name
    saved = json.loads(Path(report["checkpoint"]).read_text())
    assert saved["command"] == "toy command" and saved["meta"]["training"] == report["training"]
    assert saved["meta"]["vocabulary"] == report["vocabulary"]

    # a second run with more steps: nothing generated twice, training continues from its state
    recipe, stages = ToyRecipe(), Stages()
    again = run_pipeline(dataclasses.replace(config, schedule=Schedule(steps=5)), recipe, stages)
    assert again["answers"]["skipped"] == report["answers"]["written"]
    assert again["training"]["steps"] == 5 and stages.updates["train"] == [0, 4, 1]


def test_a_layer_the_target_lacks_is_refused_before_any_data(tiny_dir: Path, tmp_path: Path) -> None:
    config = PipelineConfig(model=ModelConfig(path=str(tiny_dir)), out=tmp_path / "g", work=tmp_path / "w")
    with pytest.raises(PipelineError, match="--layer 99: the model has"):
        run_pipeline(config, dataclasses.replace(GLIDE_RECIPE, layer=99))
    assert not (tmp_path / "w").exists()


def test_settings_out_of_range_are_refused() -> None:
    with pytest.raises(PipelineError, match="--heldout-fraction"):
        PipelineConfig(model=ModelConfig(), out=Path("x"), heldout_fraction=1.0)
    with pytest.raises(PipelineError, match="--context-weight"):
        GlideRecipe(context_weight=-0.5)


def test_the_cli_defaults_are_the_librarys() -> None:
    """``specdraft train glide`` only parses: its defaults are the pipeline's and GLIDE's."""
    from client.cli import build_parser

    args = build_parser().parse_args(["train", "glide", "--out", "x"])
    config, recipe = PipelineConfig(model=ModelConfig(), out=Path("x")), GLIDE_RECIPE
    for name in (
        "data_dtype",
        "instructions",
        "local_tasks",
        "heldout_fraction",
        "max_answer_tokens",
        "generate_batch",
        "max_feature_gb",
        "train_answer_tokens",
        "vocab",
        "max_minutes",
        "seed",
    ):
        assert getattr(args, name) == getattr(config, name), name
    for name in ("layer", "init_layer", "block_size", "vanilla", "context_weight"):
        assert getattr(args, name) == getattr(recipe, name), name
    assert (args.steps, args.tokens_per_batch, args.lr) == dataclasses.astuple(GLIDE_SCHEDULE)
    assert recipe.defaults == GLIDE_SCHEDULE


def test_the_edd_cli_defaults_are_the_librarys() -> None:
    from client.cli import build_parser

    args = build_parser().parse_args(["train", "edd", "--out", "x"])
    for name in ("layer", "min_block", "max_block", "kl_weight", "hard_weight"):
        assert getattr(args, name) == getattr(EDD_RECIPE, name), name
    assert args.own_head is not EDD_RECIPE.shared_head
    assert (args.steps, args.tokens_per_batch, args.lr) == dataclasses.astuple(EDD_SCHEDULE)
    with pytest.raises(PipelineError, match="--min-block"):
        EddRecipe(min_block=4, max_block=2)
    with pytest.raises(PipelineError, match="--kl-weight"):
        EddRecipe(kl_weight=0, hard_weight=0)


def test_edd_trains_from_the_same_work_directory_as_glide(tiny_dir: Path, tmp_path: Path) -> None:
    """GLIDE's and EDD's recipes share every stage: EDD's run over GLIDE's work directory writes
    no answer again, makes its own features (one layer's hidden states, no K/V), trains, resumes,
    and exports a checkpoint without the target's head that ``edd`` loads."""
    from llm_worker.drafters import DRAFTERS, DraftResources
    from llm_worker.drafters.checkpoint import load_checkpoint
    from llm_worker.model import load_target

    work, out = tmp_path / "work", tmp_path / "drafters"
    out.mkdir()
    fast = dict(steps=2, tokens_per_batch=256, lr=1e-3)
    glide = tiny_config(tiny_dir, out / "glide", work, max_answer_tokens=8, schedule=Schedule(**fast))
    first = run_pipeline(glide, GLIDE_RECIPE)
    config = dataclasses.replace(glide, out=out / "edd")
    report = run_pipeline(config, dataclasses.replace(EDD_RECIPE, layer=1, max_block=3), Stages())
    assert report["answers"]["written"] == 0 and report["answers"]["skipped"] == first["answers"]["written"]
    assert (work / "features-h1" / "manifest.json").is_file() and report["training"]["steps"] == 2
    assert len(report["training"]["heldout_top1_by_depth"]) == 3
    again = run_pipeline(
        dataclasses.replace(config, schedule=Schedule(**{**fast, "steps": 3})),
        dataclasses.replace(EDD_RECIPE, layer=1, max_block=3),
    )
    assert again["training"]["steps"] == 3
    target, _ = load_target(ModelConfig(path=str(tiny_dir)))
    ckpt = load_checkpoint(out / "edd.json", target.info.weights_id or target.info.fingerprint, kind="edd")
    assert "head.weight" not in ckpt.weights and ckpt.config["shared_head"]
    DRAFTERS.create("edd+pct", target, DraftResources(drafters_dir=out))


def test_data_only_stops_after_the_answers_and_a_past_data_deadline_writes_none(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """``data_only`` grows the data and stops (no features, no training); a run whose data time
    is already up starts no batch of answers and says so, then a later run continues."""
    work, out = tmp_path / "work", tmp_path / "out" / "toy"
    config = tiny_config(tiny_dir, out, work, heldout_fraction=0.05, data_only=True, data_minutes=1e-9)
    recipe, stages = ToyRecipe(), Stages()
    report = run_pipeline(config, recipe, stages)
    assert stages.seen == ["prompts", "answers"] and recipe.log == ["check"]
    assert report["answers"]["written"] == 0 and report["answers"]["stopped_at_deadline"]
    assert not (work / "features-l0").exists()
    report = run_pipeline(dataclasses.replace(config, data_minutes=None), ToyRecipe(), Stages())
    assert report["answers"]["written"] == report["answers"]["prompts"] > 0
    assert not report["answers"]["stopped_at_deadline"]


def test_finish_minutes_leaves_time_for_the_export(tiny_dir: Path, tmp_path: Path) -> None:
    """``finish_minutes`` turns into the trainer's time limit: the run's deadline less the
    export's margin (at least a second), whatever ``max_minutes`` allowed."""
    from llm_worker.training import pipeline

    seen: list[float | None] = []

    @dataclass(frozen=True)
    class TimedRecipe(ToyRecipe):
        def build_trainer(self, target, d2t, train, heldout, run):  # type: ignore[no-untyped-def]
            seen.append(run.max_seconds)
            return super().build_trainer(target, d2t, train, heldout, run)

    config = tiny_config(tiny_dir, tmp_path / "toy", tmp_path / "work", max_minutes=60, finish_minutes=2)
    run_pipeline(config, TimedRecipe(), Stages())
    assert seen[0] is not None and 1.0 <= seen[0] <= 120 - pipeline.FINISH_MARGIN_SECONDS


def test_the_learning_rate_runs_out_with_the_time_limit() -> None:
    from llm_worker.training.trainer import GlideTrainer, TrainConfig

    trainer = GlideTrainer.__new__(GlideTrainer)
    trainer.cfg = TrainConfig(steps=1000, lr=1e-3)
    assert trainer.lr_at(500) == pytest.approx(trainer.lr_at(500, 0.0))
    assert trainer.lr_at(100, 1.0) == pytest.approx(0.0, abs=1e-12)  # the time is up: decayed
    assert trainer.lr_at(100, 0.5) < trainer.lr_at(100, 0.0)
    assert trainer.lr_at(999, 0.2) == pytest.approx(trainer.lr_at(999))  # the steps run out first


def _answers(n: int) -> Sequence_:
    mask = torch.zeros(n + 3, dtype=torch.bool)
    mask[2 : 2 + n] = True
    return Sequence_(torch.zeros(n + 3, dtype=torch.long), mask, None, None, torch.zeros(n, 4), mask)


def test_a_data_scaling_run_trains_on_a_prefix_of_the_cache(tiny_dir: Path, tmp_path: Path) -> None:
    """``train_answer_tokens`` keeps the first conversations until they hold that many answer
    tokens; the report says how many the trainer got."""
    seqs = [_answers(300), _answers(200), _answers(400)]
    assert first_answer_tokens(seqs, 450) == seqs[:2]
    assert first_answer_tokens(seqs, 300) == seqs[:1]
    assert first_answer_tokens(seqs, None) == seqs
    got: list[int] = []

    @dataclass(frozen=True)
    class CountingRecipe(ToyRecipe):
        def build_trainer(self, target, d2t, train, heldout, run):  # type: ignore[no-untyped-def]
            got.append(len(train))
            return super().build_trainer(target, d2t, train, heldout, run)

    config = tiny_config(tiny_dir, tmp_path / "toy", tmp_path / "work")
    whole = run_pipeline(config, CountingRecipe(), Stages())["training"]
    part = run_pipeline(
        dataclasses.replace(config, out=tmp_path / "part", train_answer_tokens=1), CountingRecipe(), Stages()
    )["training"]
    assert got[1] == 1 < got[0]
    assert 1 <= part["train_answer_tokens"] < whole["train_answer_tokens"]
