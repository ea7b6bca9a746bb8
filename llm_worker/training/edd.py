"""Training an EDD drafter (``llm_worker.drafters.edd``) on the target's own hidden states.

Features (``edd_features``): one teacher-forced pass of the target per conversation gives, per
position, layer L's hidden state (the soft prompt: 0 = embeddings, l = after decoder layer l) and
the final hidden state after the final norm (whence the target's logits, through its head).

Loss, at answer positions: KL(target ‖ draft) over the draft vocabulary — the target's
distribution from its final hidden state through the head rows of ``d2t`` — plus a hard
cross-entropy to the target's argmax (where the draft vocabulary holds it). The dual-block mask
(``edd_net.dual_block_allowed``) with block lengths drawn at random every step: a position sees
the soft prompt before its block and its block's tokens up to itself, as the k-th token of a
chain sees a soft prompt k positions stale. AdamW, linear warm-up then cosine decay, gradient
clipping. The state (network, optimiser, step, losses) is saved atomically every ``save_every``
steps and at the end; a second run with the same settings continues from it.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from llm_worker.drafters.checkpoint import DrafterCheckpoint, save_checkpoint
from llm_worker.drafters.edd_net import (
    EddConfig,
    EddNet,
    dual_block_allowed,
    init_from_target,
    random_block_starts,
)
from llm_worker.drafters.glide_net import rope_tables
from llm_worker.training.trainer import batches, warmup_cosine
from specdraft.common import atomic_path, atomic_write_text, sha256_file


@dataclass(frozen=True)
class EddTrainConfig:
    steps: int = 2000
    tokens_per_batch: int = 4096
    """Padded tokens per optimiser step (sequences are packed up to it)."""
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_fraction: float = 0.03
    clip: float = 1.0
    kl_weight: float = 1.0
    """Weight of KL(target ‖ draft) over the draft vocabulary."""
    hard_weight: float = 1.0
    """Weight of the cross-entropy to the target's argmax."""
    save_every: int = 100
    seed: int = 0
    device: str = "cpu"


@dataclass
class EddExample:
    """One conversation's features."""

    tokens: torch.Tensor  # [n] long
    loss_mask: torch.Tensor  # [n] bool: positions whose next token is part of an answer
    hidden: torch.Tensor  # [n, hidden] fp16: the target's layer-L state (the soft prompt)
    final: torch.Tensor  # [n, hidden] fp16: the target's final hidden state, after the norm


def teacher_forced(model: Any, ids: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's layer-``layer`` hidden state and final (normed) hidden state at every
    position of ``ids``: [n, hidden] each, float32, on the host."""
    with torch.inference_mode():
        out = model.base_model(
            input_ids=torch.tensor([ids], device=model.device), output_hidden_states=True, use_cache=False
        )
    return out.hidden_states[layer][0].float().cpu(), out.last_hidden_state[0].float().cpu()


def make_example(model: Any, ids: list[int], loss_mask: list[int] | torch.Tensor, layer: int) -> EddExample:
    hidden, final = teacher_forced(model, ids, layer)
    mask = torch.as_tensor(loss_mask, dtype=torch.bool)
    return EddExample(torch.tensor(ids, dtype=torch.long), mask, hidden.half(), final.half())


# -- features on disk: the same chunk / manifest pattern as ``features``, one directory per layer --


def features_dirname(layer: int) -> str:
    """``features-h28``: the EDD features of soft-prompt layer 28."""
    return f"features-h{layer}"


def write_features(
    model: Any,
    conversations: list[tuple[list[int], list[int]]],
    layer: int,
    directory: Path,
    split: str = "train",
    sequences_per_chunk: int = 32,
) -> int:
    """Teacher-force ``conversations`` ((ids, loss mask) pairs) through the target and store
    their features in ``directory`` as chunks ``{split}-00003.safetensors``, listed with their
    sha256 in ``manifest.json`` after each chunk (atomically): a second run keeps the chunks whose
    checksum holds and makes the rest. Returns the chunks made now.

    A chunk holds ``tokens`` [N] int32 (its conversations concatenated), ``offsets`` [S + 1]
    int64, ``loss_mask`` [N] uint8 and ``hidden`` / ``final`` [N, hidden] fp16."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(directory)
    if manifest.setdefault("layer", layer) != layer:
        raise ValueError(f"{directory}: features of layer {manifest['layer']}, not {layer}")
    done = {c["file"]: c["sha256"] for c in manifest["chunks"]}
    made = 0
    for index, lo in enumerate(range(0, len(conversations), sequences_per_chunk)):
        name = f"{split}-{index:05d}.safetensors"
        path = directory / name
        if name in done and path.is_file() and sha256_file(path) == done[name]:
            continue
        group = conversations[lo : lo + sequences_per_chunk]
        examples = [make_example(model, ids, mask, layer) for ids, mask in group]
        lengths = torch.tensor([0] + [len(e.tokens) for e in examples], dtype=torch.int64)
        tensors = {
            "tokens": torch.cat([e.tokens for e in examples]).to(torch.int32),
            "offsets": lengths.cumsum(0),
            "loss_mask": torch.cat([e.loss_mask for e in examples]).to(torch.uint8),
            "hidden": torch.cat([e.hidden for e in examples]).contiguous(),
            "final": torch.cat([e.final for e in examples]).contiguous(),
        }
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp))
        manifest["chunks"] = [c for c in manifest["chunks"] if c["file"] != name]
        manifest["chunks"].append({"file": name, "split": split, "sha256": sha256_file(path)})
        atomic_write_text(directory / "manifest.json", json.dumps(manifest, indent=2) + "\n")
        made += 1
    return made


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / "manifest.json"
    if not path.exists():
        return {"chunks": []}
    return dict(json.loads(path.read_text()))


def read_features(directory: Path, split: str = "train") -> list[EddExample]:
    """Every conversation of ``split`` in ``directory``'s verified chunks."""
    out: list[EddExample] = []
    for chunk in read_manifest(directory)["chunks"]:
        if chunk["split"] != split:
            continue
        path = directory / chunk["file"]
        if sha256_file(path) != chunk["sha256"]:
            raise ValueError(f"{path}: does not match its checksum in the manifest; make the features again")
        t = load_file(str(path))
        offsets = t["offsets"].tolist()
        for lo, hi in itertools.pairwise(offsets):
            out.append(
                EddExample(
                    t["tokens"][lo:hi].long(),
                    t["loss_mask"][lo:hi].bool(),
                    t["hidden"][lo:hi],
                    t["final"][lo:hi],
                )
            )
    return out


# -- the trainer ----------------------------------------------------------------------------------


@dataclass
class EddReport:
    steps: int
    seconds: float
    final_loss: float
    heldout_accuracy: list[float] = field(default_factory=list)  # [max_block] top-1 per depth
    losses: list[float] = field(default_factory=list)


class EddTrainer:
    """Owns the network, the frozen target pieces (embeddings, head rows, RoPE) and the data."""

    def __init__(
        self,
        net_cfg: EddConfig,
        model: Any,
        d2t: torch.Tensor,
        train: list[EddExample],
        heldout: list[EddExample],
        cfg: EddTrainConfig,
    ) -> None:
        torch.manual_seed(cfg.seed)
        self.net_cfg, self.cfg = net_cfg, cfg
        self.device = torch.device(cfg.device)
        self.d2t = d2t  # [V] target id of each draft id
        self.net = EddNet(net_cfg)
        init_from_target(self.net, model, d2t)
        self.net.to(self.device)
        self.embed = model.get_input_embeddings().weight.detach().float().to(self.device)  # [vocab, h]
        head = model.lm_head.weight.detach().float().to(self.device)  # [vocab, hidden]
        self.head = head
        self.draft_head = head[d2t.to(self.device)]  # [V, hidden]
        to_draft = torch.full((head.shape[0],), -100, dtype=torch.long)
        to_draft[d2t] = torch.arange(len(d2t))
        self.to_draft = to_draft.to(self.device)  # [vocab] draft id of each target id, -100 = none
        longest = max([len(e.tokens) for e in train + heldout] + [1])
        cos, sin = rope_tables(model, longest)
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)
        self.train, self.heldout = train, heldout
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step = 0
        self.losses: list[float] = []

    def _batch(self, items: list[EddExample], generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Padded tensors of ``items`` and each position's block start (random block lengths)."""
        n = max(len(e.tokens) for e in items)
        b = len(items)
        tokens = torch.zeros(b, n, dtype=torch.long)
        mask = torch.zeros(b, n, dtype=torch.bool)
        hidden = torch.zeros(b, n, self.net_cfg.hidden_size)
        final = torch.zeros(b, n, self.net_cfg.hidden_size)
        starts = torch.zeros(b, n, dtype=torch.long)
        for row, e in enumerate(items):
            m = len(e.tokens)
            tokens[row, :m], mask[row, :m] = e.tokens, e.loss_mask[:m]
            hidden[row, :m], final[row, :m] = e.hidden.float(), e.final.float()
            starts[row] = random_block_starts(n, self.net_cfg.min_block, self.net_cfg.max_block, generator)
        dev = self.device
        return {
            "tokens": tokens.to(dev),
            "mask": mask.to(dev),
            "hidden": hidden.to(dev),
            "final": final.to(dev),
            "starts": starts.to(dev),
        }

    def _logits(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """[m, V] the draft's logits at the loss positions (in row order)."""
        b, n = t["tokens"].shape
        cos, sin = self.cos[:n].expand(b, -1, -1), self.sin[:n].expand(b, -1, -1)
        past = self.net.prompt_kv(t["hidden"], cos, sin)
        x = self.embed[t["tokens"]]  # [B, n, hidden]
        logits, _ = self.net(x, cos, sin, past, dual_block_allowed(t["starts"]), rows=t["mask"])
        return logits

    def loss(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        logp = F.log_softmax(self._logits(t).float(), dim=-1)  # [m, V]
        final = t["final"][t["mask"]]  # [m, hidden]
        target_logp = F.log_softmax(final @ self.draft_head.T, dim=-1)  # [m, V]
        kl = (target_logp.exp() * (target_logp - logp)).sum(-1).mean()
        label = self.to_draft[(final @ self.head.T).argmax(-1)]  # [m], -100 outside the draft vocabulary
        hard = F.nll_loss(logp, label, ignore_index=-100) if bool((label >= 0).any()) else logp.sum() * 0
        return self.cfg.kl_weight * kl + self.cfg.hard_weight * hard

    def evaluate(self) -> list[float]:
        """Held-out top-1 agreement with the target's argmax per depth (position in its block),
        blocks of ``max_block``: depth k sees a soft prompt k positions stale."""
        hits = torch.zeros(self.net_cfg.max_block)
        seen = torch.zeros(self.net_cfg.max_block)
        self.net.eval()
        with torch.inference_mode():
            for e in self.heldout:
                t = self._batch([e], torch.Generator().manual_seed(0))
                positions = torch.arange(len(e.tokens), device=self.device)
                t["starts"] = (positions - positions % self.net_cfg.max_block)[None]
                if not bool(t["mask"].any()):
                    continue
                guess = self.d2t.to(self.device)[self._logits(t).argmax(-1)]
                truth = (t["final"][t["mask"]] @ self.head.T).argmax(-1)
                depth = (positions - t["starts"][0])[t["mask"][0]].cpu()
                hits.index_add_(0, depth, (guess == truth).float().cpu())
                seen.index_add_(0, depth, torch.ones(len(depth)))
        return [round(float(h / s), 4) if s else 0.0 for h, s in zip(hits, seen, strict=True)]

    def lr_at(self, step: int) -> float:
        return warmup_cosine(self.cfg.lr, self.cfg.steps, self.cfg.warmup_fraction, step)

    def _settings(self) -> dict[str, Any]:
        """What a resumed run must share with the one that saved (steps may grow)."""
        return {**asdict(self.cfg), "steps": None, "net": self.net_cfg.to_json(), "d2t": self.d2t.tolist()}

    def save_state(self, path: Path) -> None:
        state = {
            "net": self.net.state_dict(),
            "opt": self.opt.state_dict(),
            "step": self.step,
            "losses": self.losses,
            "settings": self._settings(),
        }
        with atomic_path(path) as tmp:
            torch.save(state, tmp)

    def load_state(self, path: Path) -> bool:
        """Continue from ``path`` if it exists (False if not); another run's state is refused."""
        if not path.exists():
            return False
        try:
            state = torch.load(path, map_location=self.device, weights_only=False)
            settings = state["settings"]
        except Exception as exc:  # a damaged or foreign file: say which, not a pickle traceback
            raise ValueError(f"{path}: not a readable training state ({exc})") from None
        if settings != self._settings():
            raise ValueError(
                f"{path}: the state of a run with other settings or data; remove it to start over"
            )
        self.net.load_state_dict(state["net"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.losses = int(state["step"]), list(state["losses"])
        return True

    def fit(self, state_path: Path, progress: Callable[[dict[str, Any]], None] | None = None) -> EddReport:
        cfg = self.cfg
        began = time.perf_counter()
        self.load_state(state_path)
        per_epoch = len(batches(self.train, cfg.tokens_per_batch, random.Random(0)))
        while self.step < cfg.steps:
            epoch = self.step // per_epoch
            order = batches(self.train, cfg.tokens_per_batch, random.Random(cfg.seed * 1000 + epoch))
            generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.step)
            t = self._batch([self.train[i] for i in order[self.step % per_epoch]], generator)
            for group in self.opt.param_groups:
                group["lr"] = self.lr_at(self.step)
            self.net.train()
            loss = self.loss(t)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), cfg.clip)
            self.opt.step()
            self.step += 1
            self.losses.append(float(loss.detach()))
            if self.step % cfg.save_every == 0 or self.step == cfg.steps:
                self.save_state(state_path)
            if progress is not None:
                progress({"step": self.step, "loss": self.losses[-1]})
        accuracy = self.evaluate() if self.heldout else []
        final = self.losses[-1] if self.losses else float("nan")
        return EddReport(self.step, time.perf_counter() - began, final, accuracy, self.losses)

    def export(self, stem: Path, target: dict[str, Any], command: str, meta: dict[str, Any]) -> Path:
        ckpt = DrafterCheckpoint(
            kind="edd",
            config=self.net_cfg.to_json(),
            d2t=self.d2t.cpu(),
            weights={k: v.cpu() for k, v in self.net.state_dict().items()},
            target=target,
            command=command,
            meta={**meta, "train_config": asdict(self.cfg)},
        )
        return save_checkpoint(ckpt, stem)
