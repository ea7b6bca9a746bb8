"""Training a GLIDE drafter on cached target features.

Teacher-forced with GLIDE's block-wise cross mask (each sequence's block grid shifted at random
every epoch, so every position meets every staleness). Labels are the target's own: its argmax
over the full vocabulary at each labelled position (recomputed once from the cached final hidden
state through the target's head) for a hard cross-entropy, and its distribution over the draft
vocabulary for a soft one. Answer positions weigh 1, other labelled positions (the prompts'
text, where the target's predictions are labels too) ``context_weight``. AdamW, linear warm-up
then cosine decay, gradient clipping. Held-out accuracy counts answer positions only.

Progress shows the loss and the held-out top-1 accuracy per draft depth (position in its block:
depth k sees a cache k positions stale, as the k-th token of a chain does at inference). The
training state (network, optimiser, step) is saved atomically every ``save_every`` steps and at
the end; a second run with the same arguments continues from it. Deterministic for a seed on one
machine.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from llm_worker.drafters.checkpoint import DrafterCheckpoint, save_checkpoint
from llm_worker.drafters.glide_net import (
    GlideConfig,
    GlideNet,
    block_limit,
    cross_allowed,
    init_from_target,
    rope_tables,
)
from llm_worker.training.features import Sequence_
from specdraft.common import atomic_path


@dataclass(frozen=True)
class LoopConfig:
    """What ``StepTrainer``'s loop reads: every drafter's trainer config has these fields."""

    steps: int = 2000
    tokens_per_batch: int = 4096
    """Padded tokens per optimiser step (sequences are packed up to it)."""
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_fraction: float = 0.03
    clip: float = 1.0
    eval_every: int = 200
    save_every: int = 100
    max_seconds: float | None = None
    """Stop (state saved, checkpoint exported) after this long."""
    seed: int = 0
    device: str = "cpu"
    ahead: int = 2
    """Batches built on the host ahead of the step that uses them, in a background thread, while
    the device runs the steps before (0: each built when its step comes). The batches and the
    results are the same either way; on a GPU the host's share of a step stops adding to it."""


@dataclass(frozen=True)
class TrainConfig(LoopConfig):
    """GLIDE's trainer: the loop's settings and its loss's."""

    soft_weight: float = 1.0
    """Weight of the soft cross-entropy to the target's distribution over the draft vocabulary."""
    context_weight: float = 0.0
    """Loss weight of labelled positions outside the answers (0: answers only, and their rows
    are left out of the forward's head). Measured neutral so far (README)."""
    init_layer: int | None = None
    """The target decoder layer the draft layer's self-attention and MLP start from (None: the
    layer whose cache it reads); its cross-attention always starts from the layer it reads."""


@dataclass
class Example:
    tokens: torch.Tensor  # [n] long
    loss_mask: torch.Tensor  # [n] bool: answer positions
    keys: torch.Tensor  # [kv, n, d] fp16
    values: torch.Tensor  # [kv, n, d] fp16
    hidden: torch.Tensor  # [m, hidden] fp16 at labelled positions
    label: torch.Tensor  # [m] long: the target's argmax (a target id) at labelled positions
    labelled: torch.Tensor  # [n] bool: positions with a label (hidden state cached)


@dataclass
class TrainReport:
    steps: int
    seconds: float
    final_loss: float
    heldout_accuracy: list[float] = field(default_factory=list)  # [block_size] top-1 per depth
    heldout_positions: int = 0
    losses: list[float] = field(default_factory=list)
    curve: list[dict[str, Any]] = field(default_factory=list)
    """The held-out evaluations along the run (``StepTrainer.curve``)."""


def target_argmax(hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """The target's argmax [m] (on the host) from its final hidden states [m, hidden] through its
    ``head`` [vocab, hidden]: in blocks, float32, on ``head``'s device."""
    labels = [torch.zeros(0, dtype=torch.long)]
    for lo in range(0, hidden.shape[0], 512):
        block = hidden[lo : lo + 512].to(head.device).float()
        labels.append((block @ head.T).argmax(-1).cpu())
    return torch.cat(labels)


def with_labels(seqs: list[Sequence_], head: torch.Tensor) -> list[Example]:
    """The target's argmax at every labelled position, from its final hidden state and ``head``
    [vocab, hidden] (computed in blocks, float32, on ``head``'s device; the labels on the host)."""
    out = []
    for s in seqs:
        if s.keys is None or s.values is None:
            raise ValueError("GLIDE trains on a layer's K/V: features made without them")
        label = target_argmax(s.hidden, head)
        out.append(Example(s.tokens, s.loss_mask, s.keys, s.values, s.hidden, label, s.hidden_mask))
    return out


def warmup_cosine(
    lr: float, steps: int, warmup_fraction: float, step: int, time_fraction: float = 0.0
) -> float:
    """Linear warm-up, then cosine decay to 0 by the last step, or by the time limit
    (``time_fraction``: the share of the time limit spent) if that comes first."""
    warm = max(1, int(warmup_fraction * steps))
    if step < warm:
        return lr * (step + 1) / warm
    frac = max((step - warm) / max(1, steps - warm), time_fraction)
    return lr * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


class HasTokens(Protocol):
    """A training sequence as batching sees it: its tokens, and which of them are answers."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor


ExampleT = TypeVar("ExampleT", bound=HasTokens)


def pinned(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``tensors`` in page-locked memory when they go to a CUDA device (so the copy runs beside the
    device's work), else as they are."""
    if device.type != "cuda":
        return tensors
    return {name: tensor.pin_memory() for name, tensor in tensors.items()}


def on_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``tensors`` (a batch ``pinned`` on the host) copied to ``device``, without waiting for the copies."""
    return {name: tensor.to(device, non_blocking=True) for name, tensor in tensors.items()}


def batches(examples: Sequence[HasTokens], tokens_per_batch: int, rng: random.Random) -> list[list[int]]:
    """Indices of ``examples`` packed into batches (similar lengths together, order shuffled)."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].tokens), rng.random()))
    out: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        n = len(examples[i].tokens)
        if current and max(longest, n) * (len(current) + 1) > tokens_per_batch:
            out.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        out.append(current)
    rng.shuffle(out)
    return out


LOSSES_READ_EVERY = 16
"""Steps between reads of the training losses from the device (each read waits for the device)."""


class StepTrainer(Generic[ExampleT]):
    """The loop every learned drafter's trainer shares: batches packed by length and reshuffled
    each epoch, linear warm-up and cosine decay (with the time limit, if one comes first),
    gradient clipping, held-out accuracy every ``eval_every`` steps, the state saved atomically
    every ``save_every`` steps, at the end and at the time limit, a resumed run refused if it
    would continue another's, and the checkpoint's export. A drafter's trainer gives its network
    and data (``net``, ``net_cfg``, ``d2t``, ``opt``, ``train``, ``heldout``), its loss over a
    batch (``batch_loss``), its held-out accuracy (``evaluate``) and its checkpoint ``kind``;
    its ``cfg`` is a ``LoopConfig`` with its loss's settings added."""

    kind: str
    cfg: LoopConfig
    net_cfg: Any  # has ``to_json()``
    net: torch.nn.Module
    d2t: torch.Tensor
    opt: torch.optim.Optimizer
    train: list[ExampleT]
    heldout: list[ExampleT]
    step: int
    losses: list[float]
    seen: int = 0
    """Answer tokens trained on so far (an epoch's repeats counted again)."""
    curve: list[dict[str, Any]]
    """Every held-out evaluation of the run, in order: ``{"step", "answer_tokens_seen",
    "top1_by_depth", "positions"}`` (during the run on the first 20 000 held-out positions, at
    the end on all). Read against ``answer_tokens_seen``, the first epoch is acceptance against
    the amount of data: ``{"step": 200, "answer_tokens_seen": 409600, "top1_by_depth": [0.31,
    ...], "positions": 20000}``."""

    RUN_OWN = ("steps", "eval_every", "save_every", "max_seconds", "device", "ahead")
    """Settings a resumed run may change: they are the run's, not the network's."""

    def start_epoch(self, rng: random.Random) -> None:
        """Draw what an epoch fixes (after its batches, from the same ``rng``); nothing by default."""

    def host_batch(self, chosen: list[int], step: int) -> dict[str, torch.Tensor]:
        """Step ``step``'s batch (the training examples at ``chosen``) as host tensors: only what
        the epoch and the step fix may enter it, since it is built ahead, in another thread."""
        raise NotImplementedError

    def batch_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss of one batch that ``host_batch`` built (moved to the device here)."""
        raise NotImplementedError

    def evaluate(self, limit_tokens: int = 1 << 30) -> tuple[list[float], int]:
        """Held-out top-1 agreement with the target per draft depth, and the positions counted."""
        raise NotImplementedError

    def lr_at(self, step: int, time_fraction: float = 0.0) -> float:
        return warmup_cosine(self.cfg.lr, self.cfg.steps, self.cfg.warmup_fraction, step, time_fraction)

    def save_state(self, path: Path) -> None:
        with atomic_path(path) as tmp:
            torch.save(
                {
                    "net": self.net.state_dict(),
                    "opt": self.opt.state_dict(),
                    "step": self.step,
                    "losses": self.losses,
                    "seen": self.seen,
                    "curve": self.curve,
                    "net_cfg": self.net_cfg.to_json(),
                    "d2t": self.d2t.cpu(),
                    "recipe": self._recipe(),
                },
                tmp,
            )

    def _recipe(self) -> dict[str, Any]:
        """What a resumed run must share with the run that saved the state (``steps`` may grow;
        the time limit and the device are the run's own)."""
        fields = asdict(self.cfg)
        for own in self.RUN_OWN:
            fields.pop(own, None)
        return fields

    def load_state(self, path: Path) -> bool:
        """Resume from ``path`` if it exists; a state of another network, draft vocabulary or
        recipe is refused (the data it continues on would not be what it trained on)."""
        if not path.exists():
            return False
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            saved_cfg, saved_d2t = state["net_cfg"], state.get("d2t")
        except Exception as exc:  # a damaged or foreign file: say which, not a pickle traceback
            raise ValueError(
                f"{path} is not a readable training state ({exc}); delete it or use another --out"
            ) from None
        if saved_cfg != self.net_cfg.to_json():
            raise ValueError(f"{path} is the state of another network shape; use another --out")
        if saved_d2t is not None and not torch.equal(saved_d2t, self.d2t.cpu()):
            raise ValueError(
                f"{path} was trained on another draft vocabulary (the data changed); use another --out"
            )
        recipe, mine = state.get("recipe"), self._recipe()
        if recipe is not None and recipe != mine:
            changed = sorted(k for k in set(recipe) | set(mine) if recipe.get(k) != mine.get(k))
            raise ValueError(
                f"{path} was trained with other settings ({', '.join(changed)}); use another --out"
            )
        self.net.load_state_dict(state["net"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.losses = int(state["step"]), list(state["losses"])
        self.seen, self.curve = int(state.get("seen", 0)), list(state.get("curve", []))
        return True

    def _evaluated(self, limit_tokens: int = 1 << 30) -> list[float]:
        """``evaluate``, kept in ``curve`` with the data seen so far."""
        self.net.eval()
        accuracy, positions = self.evaluate(limit_tokens)
        self.curve.append(
            {
                "step": self.step,
                "answer_tokens_seen": self.seen,
                "top1_by_depth": [round(a, 4) for a in accuracy],
                "positions": positions,
            }
        )
        return accuracy

    def fit(self, state_path: Path, progress: Callable[[dict[str, Any]], None] | None = None) -> TrainReport:
        cfg = self.cfg
        began = time.perf_counter()
        self.load_state(state_path)
        accuracy: list[float] = []
        epoch_batches: list[list[int]] = []
        epoch = -1
        per_epoch = len(batches(self.train, cfg.tokens_per_batch, random.Random(0)))
        ahead: dict[int, Future[dict[str, torch.Tensor]]] = {}
        unread: list[torch.Tensor] = []  # losses still on the device: read back in one go, not per step
        with ThreadPoolExecutor(max_workers=1) as builder:
            while self.step < cfg.steps:
                if self.step // per_epoch != epoch:  # every batch built ahead was of the last epoch's
                    epoch = self.step // per_epoch
                    rng = random.Random(cfg.seed * 1000 + epoch)
                    epoch_batches = batches(self.train, cfg.tokens_per_batch, rng)
                    self.start_epoch(rng)
                last = min(cfg.steps, (epoch + 1) * per_epoch, self.step + 1 + cfg.ahead)
                for step in range(self.step + 1, last):
                    if step not in ahead:
                        ahead[step] = builder.submit(self.host_batch, epoch_batches[step % per_epoch], step)
                chosen = epoch_batches[self.step % per_epoch]
                built = ahead.pop(self.step, None)
                batch = built.result() if built is not None else self.host_batch(chosen, self.step)
                spent = 0.0 if cfg.max_seconds is None else (time.perf_counter() - began) / cfg.max_seconds
                for group in self.opt.param_groups:
                    group["lr"] = self.lr_at(self.step, spent)
                self.net.train()
                loss = self.batch_loss(batch)
                self.seen += sum(int(self.train[i].loss_mask.sum().item()) for i in chosen)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.net.parameters(), cfg.clip)
                self.opt.step()
                self.step += 1
                unread.append(loss.detach())
                stop = cfg.max_seconds is not None and time.perf_counter() - began > cfg.max_seconds
                evaluate = self.step % cfg.eval_every == 0 and bool(self.heldout)
                save = self.step % cfg.save_every == 0 or self.step == cfg.steps or stop
                if evaluate or save or stop or len(unread) >= LOSSES_READ_EVERY:
                    self.losses.extend(torch.stack(unread).float().tolist())
                    unread.clear()
                if evaluate:
                    accuracy = self._evaluated(limit_tokens=20000)
                if save:
                    self.save_state(state_path)
                if progress is not None:  # with the last loss read back
                    shown = self.losses[-1] if self.losses else float("nan")
                    progress({"step": self.step, "loss": shown, "accuracy": accuracy})
                if stop:
                    break
            for pending in ahead.values():
                pending.cancel()
        self.net.eval()
        accuracy = self._evaluated() if self.heldout else []
        return TrainReport(
            self.step,
            time.perf_counter() - began,
            self.losses[-1] if self.losses else float("nan"),
            accuracy,
            self.curve[-1]["positions"] if self.heldout else 0,
            self.losses,
            self.curve,
        )

    def export(self, stem: Path, target: dict[str, Any], command: str, meta: dict[str, Any]) -> Path:
        ckpt = DrafterCheckpoint(
            kind=self.kind,
            config=self.net_cfg.to_json(),
            d2t=self.d2t.cpu(),
            weights={k: v.cpu() for k, v in self.exported_weights().items()},
            target=target,
            command=command,
            meta={**meta, "train_config": asdict(self.cfg)},
        )
        return save_checkpoint(ckpt, stem)

    def exported_weights(self) -> dict[str, torch.Tensor]:
        """The network's weights the checkpoint keeps (all of its state by default)."""
        return dict(self.net.state_dict())


class GlideTrainer(StepTrainer[Example]):
    """Owns the network, the frozen target pieces (embeddings, head, RoPE) and the data."""

    kind = "glide"
    cfg: TrainConfig

    def __init__(
        self,
        net_cfg: GlideConfig,
        model: Any,
        d2t: torch.Tensor,
        train: list[Sequence_],
        heldout: list[Sequence_],
        cfg: TrainConfig,
    ) -> None:
        torch.manual_seed(cfg.seed)
        self.cfg, self.net_cfg = cfg, net_cfg
        self.device = torch.device(cfg.device)
        self.embed = model.get_input_embeddings().weight.detach().float().to(self.device)
        head = model.get_output_embeddings().weight.detach().float()
        self.d2t = d2t.to(self.device)
        self.t2d = torch.full((head.shape[0],), -1, dtype=torch.long, device=self.device)
        self.t2d[self.d2t] = torch.arange(len(d2t), device=self.device)
        self.draft_head = head[d2t.to(head.device)].to(
            self.device
        )  # [V, hidden]: the target's rows of the draft vocabulary
        longest = max([len(s.tokens) for s in train + heldout] + [1])
        cos, sin = rope_tables(model, longest)
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)
        self.train = with_labels(train, head)
        self.heldout = with_labels(heldout, head)
        self.net = GlideNet(net_cfg).to(self.device)
        init_from_target(
            self.net, model, d2t, net_cfg.target_layer if cfg.init_layer is None else cfg.init_layer
        )
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step = 0
        self.losses: list[float] = []
        self.curve: list[dict[str, Any]] = []
        self.shifts: dict[int, int] = {}

    # -- one batch ----------------------------------------------------------------------------

    def _inputs(self, items: list[Example], shifts: list[int]) -> dict[str, torch.Tensor]:
        return self._on_device(self._host_inputs(items, shifts))

    def _host_inputs(self, items: list[Example], shifts: list[int]) -> dict[str, torch.Tensor]:
        b, length = len(items), max(len(e.tokens) for e in items)
        kv, d = self.net_cfg.num_kv_heads, self.net_cfg.head_dim
        tokens = torch.zeros(b, length, dtype=torch.long)
        valid = torch.zeros(b, length, dtype=torch.bool)
        loss = torch.zeros(b, length, dtype=torch.bool)
        labelled = torch.zeros(b, length, dtype=torch.bool)
        keys = torch.zeros(b, kv, length, d)
        values = torch.zeros(b, kv, length, d)
        hidden, labels = [], []
        for i, e in enumerate(items):
            n = len(e.tokens)
            tokens[i, :n], valid[i, :n], loss[i, :n] = e.tokens, True, e.loss_mask
            use = e.labelled if self.cfg.context_weight > 0 else e.loss_mask & e.labelled  # [n]
            labelled[i, :n] = use
            keys[i, :, :n], values[i, :, :n] = e.keys.float(), e.values.float()
            chosen = use[e.labelled]  # [m]: which of e's labelled rows are used
            hidden.append(e.hidden[chosen].float())
            labels.append(e.label[chosen])
        positions = torch.arange(length)[None].expand(b, length)
        limit = (
            block_limit(positions, self.net_cfg.block_size, 0)
            if not shifts
            else torch.stack(
                [block_limit(positions[i], self.net_cfg.block_size, s) for i, s in enumerate(shifts)]
            )
        )
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        return pinned(
            {
                "tokens": tokens,
                "positions": positions,
                "self_allowed": (causal[None] & valid[:, None, :])[:, None],
                "cross": cross_allowed(positions, length, limit) & valid[:, None, None, :],
                "keys": keys,
                "values": values,
                "loss": loss,
                "labelled": labelled,
                "answer": loss[labelled],  # [m]: which labelled rows are answer positions
                "hidden": torch.cat(hidden),
                "labels": torch.cat(labels),
            },
            self.device,
        )

    def _on_device(self, host: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        t = on_device(host, self.device)
        t["x"] = self.embed[t.pop("tokens")]
        return t

    def _logits(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        pos = t["positions"]
        cross = self.net_cfg.cross_attention
        logits, _ = self.net(
            t["x"],
            self.cos[pos],
            self.sin[pos],
            t["self_allowed"],
            (t["keys"], t["values"]) if cross else None,
            t["cross"] if cross else None,
            rows=t["labelled"],
        )
        return logits  # [m, V] at labelled positions, in sequence order

    def loss(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss of a batch on the device (``_inputs``)."""
        logits = self._logits(t)
        logp = F.log_softmax(logits.float(), dim=-1)  # [m, V]
        weight = torch.where(t["answer"], 1.0, self.cfg.context_weight)  # [m]
        hard = self.t2d[t["labels"]]
        known = (hard >= 0) & (weight > 0)
        nll = -logp.gather(1, hard.clamp(min=0)[:, None])[:, 0]  # [m]
        loss = (nll * weight)[known].sum() / weight[known].sum().clamp(min=1e-9)
        if self.cfg.soft_weight:
            p = torch.softmax(t["hidden"] @ self.draft_head.T, dim=-1)  # the target over the draft vocabulary
            soft = -(p * logp).sum(-1)  # [m]
            loss = loss + self.cfg.soft_weight * (soft * weight).sum() / weight.sum().clamp(min=1e-9)
        return loss

    # -- evaluation ---------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, limit_tokens: int = 1 << 30) -> tuple[list[float], int]:
        """Held-out top-1 accuracy per depth (1 .. block size), block grid from position 0."""
        block = self.net_cfg.block_size
        hits, seen = np.zeros(block), np.zeros(block)
        done = 0
        for lo in range(0, len(self.heldout), 4):
            items = self.heldout[lo : lo + 4]
            t = self._inputs(items, [])
            answer = t["answer"]
            pred = self.d2t[self._logits(t).argmax(-1)][answer]
            depth = (t["positions"][t["loss"]] % block).cpu().numpy()
            right = (pred == t["labels"][answer]).cpu().numpy()
            np.add.at(hits, depth, right)
            np.add.at(seen, depth, 1)
            done += int(t["loss"].sum())
            if done >= limit_tokens:
                break
        return [float(h / s) if s else 0.0 for h, s in zip(hits, seen, strict=True)], int(seen.sum())

    # -- the loop's hooks ---------------------------------------------------------------------

    def start_epoch(self, rng: random.Random) -> None:
        """Each sequence's block grid is shifted at random for the epoch."""
        self.shifts = {i: rng.randrange(self.net_cfg.block_size) for i in range(len(self.train))}

    def host_batch(self, chosen: list[int], step: int) -> dict[str, torch.Tensor]:
        return self._host_inputs([self.train[i] for i in chosen], [self.shifts[i] for i in chosen])

    def batch_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.loss(self._on_device(batch))
