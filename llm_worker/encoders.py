"""The target model as an encoder of token windows, for the dense datastore build.

The datastore layer never runs the model: ``datastore build --dense`` and the dense benchmarks
give ``datastore_svc.dense_build`` a ``ModelEncoder`` of the loaded transformers model, which
returns its last hidden states (after the final norm) of a batch of windows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class ModelEncoder:
    """A transformers causal LM as a ``datastore_svc.dense_build.Encoder``: its base model's
    ``last_hidden_state`` (after the final norm) of a padded batch, on the model's device."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        weight = next(model.parameters())
        self.device = weight.device
        self.precision = str(weight.dtype)
        """The model's dtype, as torch writes it (``torch.bfloat16``): part of the cache key."""
        self.hidden_size = int(model.config.get_text_config().hidden_size)

    def __call__(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """``ids``, ``mask`` [batch, width] int64 → [batch, width, hidden_size] float32 states."""
        with torch.inference_mode():
            hidden = self.model.base_model(
                input_ids=torch.from_numpy(ids).to(self.device),
                attention_mask=torch.from_numpy(mask).to(self.device),
            ).last_hidden_state
        return hidden.float().cpu().numpy()
