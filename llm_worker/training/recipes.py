"""The learned drafters' training recipes (``pipeline.Recipe``): what each gives the pipeline.

``GLIDE_RECIPE``: GLIDE (``llm_worker.drafters.glide``), a one-layer draft network that reads
one target layer's K/V cache through cross-attention; trained on that layer's cached K/V and the
target's final hidden states (``features``) by ``trainer.GlideTrainer``. ``vanilla=True`` is the
ablation without cross-attention (the network reads no cache; its features are the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llm_worker.model.target import TargetInfo, TargetModel
from llm_worker.training.features import FeatureConfig, Sequence_
from llm_worker.training.pipeline import PipelineError, Schedule, TrainingRun
from llm_worker.training.trainer import GlideTrainer, TrainConfig

GLIDE_SCHEDULE = Schedule(steps=2000, tokens_per_batch=4096, lr=3e-3)


@dataclass(frozen=True)
class GlideRecipe:
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
            steps=run.schedule.steps,
            tokens_per_batch=run.schedule.tokens_per_batch,
            lr=run.schedule.lr,
            context_weight=self.context_weight,
            init_layer=self.init_layer,
            seed=run.seed,
            device=run.device,
            max_seconds=run.max_seconds,
        )
        return GlideTrainer(net_cfg, target.model, d2t, train, heldout, train_cfg)

    def save(
        self, trainer: GlideTrainer, stem: Path, target: dict[str, Any], command: str, meta: dict[str, Any]
    ) -> Path:
        return trainer.export(stem, target, command, meta)


GLIDE_RECIPE = GlideRecipe()
"""GLIDE with its defaults (``dataclasses.replace(GLIDE_RECIPE, vanilla=True)``: the ablation)."""
