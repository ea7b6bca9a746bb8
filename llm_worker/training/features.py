"""Target features cached on disk, and the reduced draft vocabulary.

One teacher-forced pass of the target over each conversation stores, per token, what a drafter's
recipe asks for (``FeatureConfig``): the K/V of one layer (as cached: keys after RoPE; GLIDE
reads them), the hidden states of some layers at every position (EDD's soft prompt), and always
the final hidden state (after the final norm; the target's logits are recomputed from it through
its head when training needs them — logits are never stored) at every position that has a next
token, or at answer positions only (``FeatureConfig.hidden_everywhere``). All fp16.

Chunks of ``sequences_per_chunk`` conversations, one safetensors file each, per split:
``features/train-00003.safetensors``. ``features/manifest.json`` lists the finished chunks with
their sha256 (written atomically after each chunk): a second run verifies them and continues with
the next; a chunk whose checksum fails is made again. ``max_bytes`` bounds the cache: no chunk
starts once the chunks on disk reach it.

A chunk holds: ``tokens`` [N] int32 (its conversations concatenated), ``offsets`` [S + 1] int64,
``loss_mask`` [N] uint8 (1 where the next token is part of an answer), ``hidden_mask`` [N] uint8
(1 where the hidden state is stored; absent in older chunks, where it is ``loss_mask``),
``keys``/``values`` [kv_heads, N, head_dim] fp16 (when ``FeatureConfig.layer`` is set),
``states-{L}`` [N, hidden] fp16 for each layer L of ``FeatureConfig.hidden_layers`` (0 = the
embeddings, l = after decoder layer l), ``hidden`` [M, hidden] fp16 at the M positions of
``hidden_mask``. The manifest records the layers: a directory made for other layers is refused.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from llm_worker.training.data import read_jsonl, template_ids
from specdraft.common import atomic_path, atomic_write_text, sha256_file
from specdraft.tokenizer import Tokenizer


@dataclass(frozen=True)
class FeatureConfig:
    layer: int | None
    """The target layer whose K/V are stored (0-based); None: no K/V."""
    hidden_layers: tuple[int, ...] = ()
    """Layers whose hidden states are stored at every position (0 = the embeddings, l = after
    decoder layer l)."""
    sequences_per_chunk: int = 32
    max_tokens: int = 1024
    """Conversations are cut to this many tokens."""
    max_bytes: int = 4 << 30
    hidden_everywhere: bool = False
    """Store the final hidden state at every position with a next token (prompts too: the
    target's predictions there are extra labels, for ``TrainConfig.context_weight`` > 0), not
    only at answer positions."""

    @property
    def dirname(self) -> str:
        """The features' directory in a work directory: ``features-l29`` (layer 29's K/V),
        ``features-h26`` (hidden states of layer 26), ``features-l29-h26``; ``-all`` added when
        prompt positions' final hidden states are kept too."""
        parts = [] if self.layer is None else [f"l{self.layer}"]
        parts += [f"h{layer}" for layer in self.hidden_layers]
        return "-".join(["features", *parts]) + ("-all" if self.hidden_everywhere else "")


@dataclass
class Forced:
    """One sequence's teacher-forced features, on the host (n: its length)."""

    keys: torch.Tensor | None  # [kv, n, d] as the target caches them (None: not asked for)
    values: torch.Tensor | None  # [kv, n, d]
    states: dict[int, torch.Tensor]  # layer → [n, hidden]
    final: torch.Tensor  # [n, hidden] after the final norm


def conversation_ids(
    tokenizer: Tokenizer, messages: list[dict[str, str]]
) -> tuple[list[int], list[int]] | None:
    """The conversation's token ids through the chat template and its loss mask (1 at each
    position whose next token belongs to an assistant turn, the template's turn end included).
    None if the template is not prefix-stable for it (the answer's ids could not be located)."""
    full = template_ids(tokenizer, messages, generation_prompt=False)
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = template_ids(tokenizer, messages[:i], generation_prompt=True)
        end = template_ids(tokenizer, messages[: i + 1], generation_prompt=False)
        if full[: len(start)] != start or full[: len(end)] != end or len(end) <= len(start):
            return None
        for p in range(len(start) - 1, len(end) - 1):
            mask[p] = 1
    return full, mask


FORWARD_TOKENS = 16384
"""Padded tokens per teacher-forced forward: a chunk's conversations go through the target
together, in as few forwards as fit (right-padded: a causal model's real positions never see the
padding after them)."""


def _teacher_forced(
    model: Any, sequences: list[list[int]], layer: int | None, hidden_layers: tuple[int, ...] = ()
) -> list[Forced]:
    """Per sequence: keys, values of ``layer`` as the target caches them, the hidden states of
    ``hidden_layers`` and the final hidden state (after the final norm), on the host. Batched on
    the model's device."""
    from transformers import DynamicCache

    base = model.base_model  # the decoder stack: its last hidden state is after the final norm
    device = model.device
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    placed: dict[int, Forced] = {}
    lo = 0
    while lo < len(order):
        width = len(sequences[order[lo]])
        rows = max(1, min(len(order) - lo, FORWARD_TOKENS // width))
        group = order[lo : lo + rows]
        ids = torch.zeros((len(group), width), dtype=torch.long)
        for row, i in enumerate(group):
            ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
        cache = DynamicCache() if layer is not None else None
        with torch.inference_mode():
            out = base(
                input_ids=ids.to(device),
                past_key_values=cache,
                use_cache=cache is not None,
                output_hidden_states=bool(hidden_layers),
            )
        keys = values = None
        if cache is not None and layer is not None:
            entry: Any = cache.layers[layer]
            keys, values = entry.keys.cpu(), entry.values.cpu()
        states = {h: out.hidden_states[h].cpu() for h in hidden_layers}
        final = out.last_hidden_state.cpu()
        for row, i in enumerate(group):
            n = len(sequences[i])
            placed[i] = Forced(
                None if keys is None else keys[row, :, :n],
                None if values is None else values[row, :, :n],
                {h: state[row, :n] for h, state in states.items()},
                final[row, :n],
            )
        lo += rows
    return [placed[i] for i in range(len(sequences))]


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / "manifest.json"
    if not path.exists():
        return {"chunks": []}
    return dict(json.loads(path.read_text()))


def make_features(
    model: Any,
    tokenizer: Tokenizer,
    conversations: Path,
    directory: Path,
    cfg: FeatureConfig,
    weights_id: str,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Cache features of every conversation (chunk by chunk, resumable); the manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(directory)
    layers = list(cfg.hidden_layers)
    if (
        manifest.get("weights_id", weights_id) != weights_id
        or manifest.get("layer", cfg.layer) != cfg.layer
        or manifest.get("hidden_layers", layers) != layers
    ):
        raise ValueError(f"{directory} holds features of another target or layer; use another directory")
    manifest.update(weights_id=weights_id, layer=cfg.layer, hidden_layers=layers)
    good = []
    for chunk in manifest["chunks"]:
        path = directory / chunk["file"]
        if path.is_file() and sha256_file(path) == chunk["sha256"]:
            good.append(chunk)
    manifest["chunks"] = good
    records = read_jsonl(conversations)
    skipped = 0
    for split in ("heldout", "train"):  # the held-out chunks first: the size bound never leaves none
        items = [r for r in records if r["split"] == split]
        per = cfg.sequences_per_chunk
        for number, lo in enumerate(range(0, len(items), per)):
            name = f"{split}-{number:05d}.safetensors"
            members = _members(items[lo : lo + per])
            done = [c for c in good if c["file"] == name]
            if done and done[0].get("members", members) == members:
                if progress is not None:
                    progress(len(items[lo : lo + per]))
                continue
            good = [c for c in good if c["file"] != name]  # made from other conversations: made again
            if sum((directory / c["file"]).stat().st_size for c in good) >= cfg.max_bytes:
                manifest["truncated"] = True
                break
            tensors, count, bad = _chunk(model, tokenizer, items[lo : lo + per], cfg)
            skipped += bad
            path = directory / name
            with atomic_path(path) as tmp:
                save_file(tensors, str(tmp))
            good.append(
                {
                    "file": name,
                    "split": split,
                    "members": members,
                    "sequences": count,
                    "tokens": int(tensors["tokens"].numel()),
                    "answer_tokens": int(tensors["loss_mask"].sum()),
                    "labelled_tokens": int(tensors["hidden"].shape[0]),
                    "sha256": sha256_file(path),
                }
            )
            manifest["chunks"] = good
            atomic_write_text(directory / "manifest.json", json.dumps(manifest, indent=1))
            if progress is not None:
                progress(len(items[lo : lo + per]))
    manifest["skipped_conversations"] = skipped
    atomic_write_text(directory / "manifest.json", json.dumps(manifest, indent=1))
    return manifest


def _members(items: list[dict[str, Any]]) -> str:
    """Which conversations a chunk holds (a digest of their ids): a chunk made from others, as
    when the conversations grew after it was made, is made again rather than trusted."""
    return hashlib.sha256("\n".join(str(r.get("id", "")) for r in items).encode()).hexdigest()


def _chunk(
    model: Any, tokenizer: Tokenizer, items: list[dict[str, Any]], cfg: FeatureConfig
) -> tuple[dict[str, torch.Tensor], int, int]:
    bad = 0
    usable: list[tuple[list[int], list[int]]] = []
    for record in items:
        made = conversation_ids(tokenizer, record["messages"])
        if made is None:
            bad += 1
            continue
        ids, mask = made[0][: cfg.max_tokens], made[1][: cfg.max_tokens]
        if len(ids) < 2:
            bad += 1
            continue
        mask[-1] = 0  # the last position's next token is not in the sequence
        usable.append((ids, mask))
    if not usable:
        raise ValueError("no usable conversation in a chunk")
    forced = _teacher_forced(model, [ids for ids, _ in usable], cfg.layer, cfg.hidden_layers)
    parts: dict[str, list[torch.Tensor]] = {}
    offsets = [0]
    for (ids, mask), f in zip(usable, forced, strict=True):
        answers = torch.tensor(mask, dtype=torch.bool)
        where = answers.clone()
        if cfg.hidden_everywhere:
            where[:-1] = True
        row = {
            "tokens": torch.tensor(ids, dtype=torch.int32),
            "loss_mask": answers.to(torch.uint8),
            "hidden_mask": where.to(torch.uint8),
            "hidden": f.final[where].to(torch.float16),
            **{f"states-{h}": state.to(torch.float16) for h, state in f.states.items()},
        }
        if f.keys is not None and f.values is not None:
            row["keys"], row["values"] = f.keys.to(torch.float16), f.values.to(torch.float16)
        for name, tensor in row.items():
            parts.setdefault(name, []).append(tensor)
        offsets.append(offsets[-1] + len(ids))
    tensors = {
        name: torch.cat(chunks, dim=1 if name in ("keys", "values") else 0).contiguous()
        for name, chunks in parts.items()
    }
    tensors["offsets"] = torch.tensor(offsets, dtype=torch.int64)
    return tensors, len(usable), bad


@dataclass
class Sequence_:
    tokens: torch.Tensor  # [n] long
    loss_mask: torch.Tensor  # [n] bool: the next token belongs to an answer
    keys: torch.Tensor | None  # [kv, n, d] fp16 (None: features without K/V)
    values: torch.Tensor | None  # [kv, n, d] fp16
    hidden: torch.Tensor  # [m, hidden] fp16 final hidden states at the positions of hidden_mask
    hidden_mask: torch.Tensor  # [n] bool: where ``hidden`` has a row (loss_mask ⊆ hidden_mask)
    states: dict[int, torch.Tensor] = field(default_factory=dict)  # layer → [n, hidden] fp16


def load_sequences(directory: Path, split: str) -> Iterator[Sequence_]:
    """Every cached conversation of ``split``, checksums verified."""
    manifest = read_manifest(directory)
    for chunk in manifest["chunks"]:
        if chunk["split"] != split:
            continue
        path = directory / chunk["file"]
        if sha256_file(path) != chunk["sha256"]:
            raise ValueError(f"{path}: checksum mismatch; run the feature stage again")
        t = load_file(str(path))
        offsets = t["offsets"].tolist()
        mask = t["loss_mask"].bool()
        hmask = t["hidden_mask"].bool() if "hidden_mask" in t else mask
        h_at = torch.cumsum(hmask.long(), 0)
        layers = [(int(name.removeprefix("states-")), name) for name in t if name.startswith("states-")]
        keys, values = t.get("keys"), t.get("values")
        for lo, hi in itertools.pairwise(offsets):
            h_lo = int(h_at[lo - 1]) if lo else 0
            h_hi = int(h_at[hi - 1])
            yield Sequence_(
                t["tokens"][lo:hi].long(),
                mask[lo:hi],
                None if keys is None else keys[:, lo:hi],
                None if values is None else values[:, lo:hi],
                t["hidden"][h_lo:h_hi],
                hmask[lo:hi],
                {layer: t[name][lo:hi] for layer, name in layers},
            )


def draft_vocabulary(
    directory: Path, size: int, always: tuple[int, ...] = ()
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The ``size`` most frequent answer tokens of the training split (plus ``always``, e.g. the
    end-of-sequence ids) as ``d2t`` [V] (ascending target ids), and its coverage of those tokens."""
    counts: Counter[int] = Counter()
    for seq in load_sequences(directory, "train"):
        nxt = seq.tokens[1:][seq.loss_mask[:-1]]
        counts.update(nxt.tolist())
    chosen = [t for t in always]
    for token, _n in counts.most_common():
        if len(chosen) >= size:
            break
        if token not in chosen:
            chosen.append(token)
    total = sum(counts.values())
    covered = sum(counts[t] for t in chosen)
    d2t = torch.tensor(sorted(chosen), dtype=torch.int64)
    return d2t, {
        "size": len(chosen),
        "distinct_answer_tokens": len(counts),
        "answer_tokens": total,
        "coverage": covered / total if total else 0.0,
    }
