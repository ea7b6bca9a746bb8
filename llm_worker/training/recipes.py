"""The learned drafters' training recipes (``pipeline.Recipe``): what each gives the pipeline.

``GLIDE_RECIPE``: GLIDE (``llm_worker.drafters.glide``), a one-layer draft network that reads
one target layer's K/V cache through cross-attention; trained on that layer's cached K/V and the
target's final hidden states (``features``) by ``trainer.GlideTrainer``. ``vanilla=True`` is the
ablation without cross-attention (the network reads no cache; its features are the same).

``EDD_RECIPE``: EDD (``llm_worker.drafters.edd``), one decoder layer reading one target layer's
hidden states as a soft prompt; trained on that layer's hidden states at every position and the
target's final hidden states at answer positions by ``edd.EddTrainer`` (KL to the target, the
dual-block mask with random block lengths).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llm_worker.model.target import TargetInfo, TargetModel
from llm_worker.training.edd import EddTrainConfig, EddTrainer
from llm_worker.training.features import FeatureConfig, Sequence_
from llm_worker.training.pipeline import PipelineError, Schedule, TrainingRun
from llm_worker.training.trainer import GlideTrainer, StepTrainer, TrainConfig

GLIDE_SCHEDULE = Schedule(steps=2000, tokens_per_batch=4096, lr=3e-3)


class _StepRecipe:
    """What GLIDE's and EDD's recipes share: a ``trainer.StepTrainer`` of theirs, exported."""

    @staticmethod
    def run_fields(run: TrainingRun) -> dict[str, Any]:
        """The trainer config's fields a run sets: its schedule, seed, device and time limit."""
        schedule = run.schedule
        return dict(
            steps=schedule.steps,
            tokens_per_batch=schedule.tokens_per_batch,
            lr=schedule.lr,
            seed=run.seed,
            device=run.device,
            max_seconds=run.max_seconds,
        )

    def save(
        self,
        trainer: StepTrainer[Any],
        stem: Path,
        target: dict[str, Any],
        command: str,
        meta: dict[str, Any],
    ) -> Path:
        return trainer.export(stem, target, command, meta)


@dataclass(frozen=True)
class GlideRecipe(_StepRecipe):
    """GLIDE's hyper-parameters, and how the pipeline trains and saves it."""

    layer: int = -1
    """Target layer whose K/V the draft reads (negative: from the last, -1 = the last)."""
    init_layer: int | None = None
    """Target layer the draft layer's self-attention and MLP start from (None: ``layer``)."""
    block_size: int = 5
    """Positions per block of the training mask: depth k of a block sees a cache k positions
    stale, as the k-th token of a chain does at inference."""
    vanilla: bool = False
    """The ablation without cross-attention."""
    context_weight: float = 0.0
    """Loss weight of prompt positions (the target's predictions there; answers weigh 1). Above
    0 the features keep the hidden states of prompt positions too."""

    def __post_init__(self) -> None:
        if self.context_weight < 0:
            raise PipelineError("--context-weight must be >= 0")

    @property
    def name(self) -> str:
        return "glide"

    @property
    def defaults(self) -> Schedule:
        return GLIDE_SCHEDULE

    def target_layer(self, info: TargetInfo) -> int:
        """``layer`` as a 0-based index into the target's layers."""
        return self.layer if self.layer >= 0 else info.num_layers + self.layer

    def check(self, info: TargetInfo) -> None:
        if not 0 <= self.target_layer(info) < info.num_layers:
            raise PipelineError(f"--layer {self.layer}: the model has {info.num_layers} layers")
        if self.init_layer is not None and not 0 <= self.init_layer < info.num_layers:
            raise PipelineError(f"--init-layer {self.init_layer}: the model has {info.num_layers} layers")

    def features(self, info: TargetInfo, max_bytes: int) -> FeatureConfig:
        # Prompt positions' hidden states only when they are trained on: they would double the cache.
        return FeatureConfig(
            layer=self.target_layer(info), max_bytes=max_bytes, hidden_everywhere=self.context_weight > 0
        )

    def build_trainer(
        self,
        target: TargetModel,
        d2t: torch.Tensor,
        train: list[Sequence_],
        heldout: list[Sequence_],
        run: TrainingRun,
    ) -> GlideTrainer:
        from llm_worker.drafters.glide_net import glide_config_for

        net_cfg = glide_config_for(
            target.model,
            len(d2t),
            target_layer=self.target_layer(target.info),
            block_size=self.block_size,
            cross_attention=not self.vanilla,
        )
        train_cfg = TrainConfig(
            context_weight=self.context_weight, init_layer=self.init_layer, **self.run_fields(run)
        )
        return GlideTrainer(net_cfg, target.model, d2t, train, heldout, train_cfg)


GLIDE_RECIPE = GlideRecipe()
"""GLIDE with its defaults (``dataclasses.replace(GLIDE_RECIPE, vanilla=True)``: the ablation)."""


EDD_SCHEDULE = Schedule(steps=2000, tokens_per_batch=4096, lr=3e-3)


@dataclass(frozen=True)
class EddRecipe(_StepRecipe):
    """EDD's hyper-parameters, and how the pipeline trains and saves it."""

    layer: int | None = None
    """The target hidden state read as the soft prompt (0 = the embeddings, l = after decoder
    layer l, negative: from the last, -1 = the final one); None: the 4th from the last."""
    min_block: int = 1
    max_block: int = 8
    """Block lengths of the dual-block mask, drawn uniformly from [min_block, max_block] each
    step (``max_block`` is also the held-out evaluation's depth)."""
    shared_head: bool = True
    """The head is the target's rows of the draft vocabulary, frozen (the paper's; the checkpoint
    is a third of the size); False: a head of its own, trained."""
    kl_weight: float = 1.0
    hard_weight: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_block <= self.max_block:
            raise PipelineError("--min-block and --max-block: need 1 <= min <= max")
        if self.kl_weight < 0 or self.hard_weight < 0 or self.kl_weight + self.hard_weight == 0:
            raise PipelineError("--kl-weight and --hard-weight must be >= 0, not both 0")

    @property
    def name(self) -> str:
        return "edd"

    @property
    def defaults(self) -> Schedule:
        return EDD_SCHEDULE

    def prompt_layer(self, info: TargetInfo) -> int:
        """``layer`` as an index into the target's hidden states (0 .. num_layers)."""
        from llm_worker.drafters.edd_net import default_prompt_layer

        if self.layer is None:
            return default_prompt_layer(info.num_layers)
        return self.layer if self.layer >= 0 else info.num_layers + 1 + self.layer

    def check(self, info: TargetInfo) -> None:
        if not 0 <= self.prompt_layer(info) <= info.num_layers:
            raise PipelineError(f"--layer {self.layer}: the model has {info.num_layers} layers")

    def features(self, info: TargetInfo, max_bytes: int) -> FeatureConfig:
        return FeatureConfig(layer=None, hidden_layers=(self.prompt_layer(info),), max_bytes=max_bytes)

    def build_trainer(
        self,
        target: TargetModel,
        d2t: torch.Tensor,
        train: list[Sequence_],
        heldout: list[Sequence_],
        run: TrainingRun,
    ) -> EddTrainer:
        from llm_worker.drafters.edd_net import edd_config_for

        net_cfg = edd_config_for(
            target.model,
            len(d2t),
            prompt_layer=self.prompt_layer(target.info),
            min_block=self.min_block,
            max_block=self.max_block,
            shared_head=self.shared_head,
        )
        train_cfg = EddTrainConfig(
            kl_weight=self.kl_weight, hard_weight=self.hard_weight, **self.run_fields(run)
        )
        return EddTrainer(net_cfg, target.model, d2t, train, heldout, train_cfg)


EDD_RECIPE = EddRecipe()
"""EDD with its defaults: the 4th hidden state from the last, the target's head."""
