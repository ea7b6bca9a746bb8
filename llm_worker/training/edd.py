"""Training an EDD drafter (``llm_worker.drafters.edd``) on the target's own hidden states.

Features (``features.make_features`` with ``FeatureConfig(layer=None, hidden_layers=(L,))``, as
``recipes.EddRecipe`` asks): per position, layer L's hidden state (the soft prompt: 0 =
embeddings, l = after decoder layer l), and the final hidden state after the final norm at answer
positions (whence the target's logits, through its head).

Loss, at answer positions: KL(target ‖ draft) over the draft vocabulary — the target's
distribution from its final hidden state through the head rows of ``d2t`` — plus a hard
cross-entropy to the target's argmax over its whole vocabulary (computed once; where the draft
vocabulary holds it). The dual-block mask (``edd_net.dual_block_allowed``) with block lengths
drawn at random every step: a position sees the soft prompt before its block and its block's
tokens up to itself, as the k-th token of a chain sees a soft prompt k positions stale. The loop
(AdamW, warm-up and cosine decay, clipping, the state saved and resumed, the time limit) is
``trainer.StepTrainer``'s, as GLIDE's. With ``EddConfig.shared_head`` the head is the target's
own rows of the draft vocabulary, frozen, and left out of the checkpoint (the paper's setting).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from llm_worker.drafters.edd_net import (
    EddConfig,
    EddNet,
    dual_block_allowed,
    init_from_target,
    random_block_starts,
)
from llm_worker.drafters.glide_net import rope_tables
from llm_worker.training.features import Sequence_
from llm_worker.training.trainer import LoopConfig, StepTrainer, on_device, pinned, target_argmax


@dataclass(frozen=True)
class EddTrainConfig(LoopConfig):
    """EDD's trainer: the loop's settings and its loss's."""

    kl_weight: float = 1.0
    """Weight of KL(target ‖ draft) over the draft vocabulary."""
    hard_weight: float = 1.0
    """Weight of the cross-entropy to the target's argmax."""


@dataclass
class EddExample:
    """One conversation's features, as the trainer reads them."""

    tokens: torch.Tensor  # [n] long
    loss_mask: torch.Tensor  # [n] bool: positions whose next token is part of an answer
    prompt: torch.Tensor  # [n, hidden] fp16: the target's layer-L state (the soft prompt)
    final: torch.Tensor  # [m, hidden] fp16: the target's final hidden state at the m loss positions
    label: torch.Tensor  # [m] long: the target's argmax there (a target id)


def examples_of(seqs: list[Sequence_], layer: int, head: torch.Tensor) -> list[EddExample]:
    """The trainer's examples from cached features with layer ``layer``'s hidden states; labels
    through the target's ``head`` [vocab, hidden]."""
    out = []
    for s in seqs:
        if layer not in s.states:
            raise ValueError(f"features without layer {layer}'s hidden states; EDD reads them")
        final = s.hidden[s.loss_mask[s.hidden_mask]]  # the rows at answer positions
        out.append(EddExample(s.tokens, s.loss_mask, s.states[layer], final, target_argmax(final, head)))
    return out


class EddTrainer(StepTrainer[EddExample]):
    """Owns the network, the frozen target pieces (embeddings, head rows, RoPE) and the data."""

    kind = "edd"
    net: EddNet
    cfg: EddTrainConfig

    def __init__(
        self,
        net_cfg: EddConfig,
        model: Any,
        d2t: torch.Tensor,
        train: list[Sequence_],
        heldout: list[Sequence_],
        cfg: EddTrainConfig,
    ) -> None:
        torch.manual_seed(cfg.seed)
        self.net_cfg, self.cfg = net_cfg, cfg
        self.device = torch.device(cfg.device)
        self.d2t = d2t.to(self.device)  # [V] target id of each draft id
        self.net = EddNet(net_cfg)
        init_from_target(self.net, model, d2t)
        self.net.to(self.device)
        if net_cfg.shared_head:
            self.net.head.weight.requires_grad_(False)
        self.embed = model.get_input_embeddings().weight.detach().float().to(self.device)  # [vocab, h]
        head = model.get_output_embeddings().weight.detach().float()  # [vocab, hidden]
        self.draft_head = head[d2t.to(head.device)].to(self.device)  # [V, hidden]
        to_draft = torch.full((head.shape[0],), -100, dtype=torch.long)
        to_draft[d2t] = torch.arange(len(d2t))
        self.to_draft = to_draft.to(self.device)  # [vocab] draft id of each target id, -100 = none
        longest = max([len(s.tokens) for s in train + heldout] + [1])
        cos, sin = rope_tables(model, longest)
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)
        self.train = examples_of(train, net_cfg.prompt_layer, head)
        self.heldout = examples_of(heldout, net_cfg.prompt_layer, head)
        trainable = [p for p in self.net.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step = 0
        self.losses: list[float] = []
        self.curve: list[dict[str, Any]] = []

    def _batch(self, items: list[EddExample], generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        return self._on_device(self._host_batch(items, generator))

    def _on_device(self, host: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return on_device(host, self.device)

    def _host_batch(
        self, items: list[EddExample], generator: torch.Generator | None
    ) -> dict[str, torch.Tensor]:
        """Padded host tensors of ``items`` and each position's block start: random block lengths from
        ``generator``, or (None) blocks of ``max_block`` from position 0."""
        n = max(len(e.tokens) for e in items)
        b = len(items)
        tokens = torch.zeros(b, n, dtype=torch.long)
        mask = torch.zeros(b, n, dtype=torch.bool)
        prompt = torch.zeros(b, n, self.net_cfg.hidden_size)
        positions = torch.arange(n)
        grid = positions - positions % self.net_cfg.max_block
        starts = torch.zeros(b, n, dtype=torch.long)
        for row, e in enumerate(items):
            m = len(e.tokens)
            tokens[row, :m], mask[row, :m], prompt[row, :m] = e.tokens, e.loss_mask, e.prompt.float()
            if generator is None:
                starts[row] = grid
            else:
                lo, hi = self.net_cfg.min_block, self.net_cfg.max_block
                starts[row] = random_block_starts(n, lo, hi, generator)
        return pinned(
            {
                "tokens": tokens,
                "mask": mask,
                "prompt": prompt,
                "final": torch.cat([e.final for e in items]).float(),  # [m, hidden] in row order
                "label": torch.cat([e.label for e in items]),  # [m]
                "starts": starts,
            },
            self.device,
        )

    def _logits(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """[m, V] the draft's logits at the loss positions (in row order)."""
        b, n = t["tokens"].shape
        cos, sin = self.cos[:n].expand(b, -1, -1), self.sin[:n].expand(b, -1, -1)
        past = self.net.prompt_kv(t["prompt"], cos, sin)
        x = self.embed[t["tokens"]]  # [B, n, hidden]
        logits, _ = self.net(x, cos, sin, past, dual_block_allowed(t["starts"]), rows=t["mask"])
        return logits

    def loss(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        logp = F.log_softmax(self._logits(t).float(), dim=-1)  # [m, V]
        target_logp = F.log_softmax(t["final"] @ self.draft_head.T, dim=-1)  # [m, V]
        kl = (target_logp.exp() * (target_logp - logp)).sum(-1).mean()
        label = self.to_draft[t["label"]]  # [m], -100 outside the draft vocabulary
        known = label >= 0  # a mean over these (0 when none), without reading the device back
        nll = -logp.gather(1, label.clamp(min=0)[:, None])[:, 0]
        hard = (nll * known).sum() / known.sum().clamp(min=1)
        return self.cfg.kl_weight * kl + self.cfg.hard_weight * hard

    def host_batch(self, chosen: list[int], step: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        return self._host_batch([self.train[i] for i in chosen], generator)

    def batch_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.loss(self._on_device(batch))

    def evaluate(self, limit_tokens: int = 1 << 30) -> tuple[list[float], int]:
        """Held-out top-1 agreement with the target's argmax per depth (position in its block),
        blocks of ``max_block`` from position 0: depth k sees a soft prompt k positions stale."""
        hits = torch.zeros(self.net_cfg.max_block)
        seen = torch.zeros(self.net_cfg.max_block)
        with torch.inference_mode():
            for e in self.heldout:
                if not bool(e.loss_mask.any()):
                    continue
                t = self._batch([e], None)
                guess = self.d2t[self._logits(t).argmax(-1)]
                positions = torch.arange(len(e.tokens), device=self.device)
                depth = (positions - t["starts"][0])[t["mask"][0]].cpu()
                hits.index_add_(0, depth, (guess == t["label"]).float().cpu())
                seen.index_add_(0, depth, torch.ones(len(depth)))
                if int(seen.sum()) >= limit_tokens:
                    break
        accuracy = [round(float(h / s), 4) if s else 0.0 for h, s in zip(hits, seen, strict=True)]
        return accuracy, int(seen.sum())

    def exported_weights(self) -> dict[str, torch.Tensor]:
        """Without the head where it is the target's (the loader takes it from the target)."""
        weights = dict(self.net.state_dict())
        if self.net_cfg.shared_head:
            weights.pop("head.weight")
        return weights
