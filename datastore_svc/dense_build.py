"""Building a dense index beside a version's token arrays (``datastore build --dense``).

1. Hidden states: the target model reads every shard's documents in windows (``window`` tokens,
   each after ``overlap`` tokens of the document's preceding text as context), batched, and
   keeps the last hidden state (after the final norm) of every token. The model is an
   ``Encoder`` the caller gives (``llm_worker.encoders.ModelEncoder``): this layer cuts and
   batches the windows, never runs the model itself. The states are cached on disk per chunk of
   documents (``chunk_tokens`` tokens), named by a hash of the model, the window settings and
   the chunk's tokens — a rebuild with other PCA dimensions or another index type reads the
   cache instead of running the model, and an interrupted build resumes.
2. Statistics: z-score and PCA (``dense.fit_stats``) on an evenly spread sample of the states.
3. Keys: every state with a next token in its document, reduced; one FAISS index and the keys'
   token positions per shard (``dense.build_faiss_index``).

The files go into the version's temporary directory (``store.write_version`` / ``derive_version``),
which appears whole or not at all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from datastore_svc.dense import (
    DenseStats,
    IndexParams,
    build_faiss_index,
    check_index,
    choose_kind,
    fit_stats,
)
from datastore_svc.manifest import DenseEntry, Manifest
from datastore_svc.store import Extend, load_shard_arrays, shard_dir
from specdraft.common import atomic_path

INDEX_FILE = "dense.faiss"
POSITIONS_FILE = "positions.npy"


def default_overlap(window: int) -> int:
    """Context tokens before each window when none is asked for: a quarter window, at most 64."""
    return min(64, window // 4)


@dataclass(frozen=True)
class DenseBuildConfig:
    dims: int = 64
    index: str = "auto"
    params: IndexParams = field(default_factory=IndexParams)
    window: int = 512
    overlap: int = 64
    batch: int = 4
    chunk_tokens: int = 1 << 16
    sample: int = 262_144
    """Vectors the statistics are fitted on (at most; evenly spread over the corpus)."""
    cache_dir: Path | None = None
    """Hidden-state cache; None = ``~/.cache/specdraft/hidden``."""
    seed: int = 0
    max_tokens: int = 0
    """Keys for a subsample: documents evenly spread over each shard (every k-th), about this many
    tokens in all (``spread_documents``); 0 = every document. The sparse index keeps every token."""

    def __post_init__(self) -> None:
        if self.window < 2 or not 0 <= self.overlap < self.window:
            raise ValueError(
                f"need window >= 2 and 0 <= overlap < window (got {self.window}, {self.overlap})"
            )
        if self.batch < 1 or self.chunk_tokens < 1 or self.sample < 2 or self.max_tokens < 0:
            raise ValueError("batch and chunk_tokens must be positive, sample at least 2, max_tokens >= 0")


@dataclass
class DenseBuildReport:
    keys: int = 0
    kind: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    cached_chunks: int = 0
    computed_chunks: int = 0
    bytes: int = 0
    stats: DenseStats | None = None


def default_cache_dir() -> Path:
    from specdraft.common import cache_root

    return cache_root() / "hidden"


class Encoder(Protocol):
    """The target model as the dense build sees it: the last hidden states (after the final
    norm) of a batch of token windows. Built from the model by the layer that runs it
    (``llm_worker.encoders.ModelEncoder``)."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def precision(self) -> str:
        """The states' precision (the model's dtype, e.g. ``torch.bfloat16``): part of the
        hidden-state cache's key, as states of another precision are other states."""
        ...

    def __call__(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """``ids``, ``mask`` [batch, width] int64 (each row a window, left-aligned; mask 1 on its
        tokens, 0 on the padding after them) → [batch, width, hidden_size] float32 states."""
        ...


class HiddenStates:
    """The target's last hidden states of documents, computed in batched windows and cached per chunk."""

    def __init__(self, encoder: Encoder, fingerprint: str, cfg: DenseBuildConfig) -> None:
        self.encoder = encoder
        self.cfg = cfg
        self.cache = cfg.cache_dir or default_cache_dir()
        self.salt = f"{fingerprint}|w{cfg.window}|o{cfg.overlap}|{encoder.precision}"
        self.hidden_size = encoder.hidden_size

    def chunk_path(self, docs: list[np.ndarray]) -> Path:
        h = hashlib.sha256(self.salt.encode())
        for doc in docs:
            h.update(len(doc).to_bytes(8, "little"))
            h.update(np.ascontiguousarray(doc, dtype=np.int32).tobytes())
        return self.cache / f"{h.hexdigest()[:32]}.npy"

    def chunk(self, docs: list[np.ndarray]) -> tuple[np.ndarray, bool]:
        """([Σ len(doc), hidden] float16 states of the documents in order, whether from the cache)."""
        path = self.chunk_path(docs)
        if path.exists():
            try:
                states = np.load(path, mmap_mode="r")
                if states.shape == (sum(len(d) for d in docs), self.hidden_size):
                    return states, True
            except (OSError, ValueError):
                pass  # unreadable: computed again and replaced below
        states = self.compute(docs)
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.save(f, states)
        return states, False

    def compute(self, docs: list[np.ndarray]) -> np.ndarray:
        """Run the encoder: every document cut into windows, the windows batched by length."""
        cfg = self.cfg
        pieces = []  # (doc, first kept token, context start, end)
        step = cfg.window - cfg.overlap
        for d, doc in enumerate(docs):
            for begin in range(0, len(doc), step):
                ctx = max(0, begin - cfg.overlap)
                pieces.append((d, begin, ctx, min(len(doc), begin + step)))
        offsets = np.zeros(len(docs) + 1, dtype=np.int64)
        np.cumsum([len(d) for d in docs], out=offsets[1:])
        out = np.zeros((int(offsets[-1]), self.hidden_size), dtype=np.float16)
        pieces.sort(key=lambda p: p[3] - p[2])
        for i in range(0, len(pieces), cfg.batch):
            group = pieces[i : i + cfg.batch]
            width = max(end - ctx for _, _, ctx, end in group)
            ids = np.zeros((len(group), width), dtype=np.int64)  # [batch, width]
            mask = np.zeros((len(group), width), dtype=np.int64)  # [batch, width]
            for r, (d, _, ctx, end) in enumerate(group):
                ids[r, : end - ctx] = np.asarray(docs[d][ctx:end], dtype=np.int64)
                mask[r, : end - ctx] = 1
            hidden = self.encoder(ids, mask)  # [batch, width, hidden] float32
            for r, (d, begin, ctx, end) in enumerate(group):
                base = offsets[d]
                out[base + begin : base + end] = hidden[r, begin - ctx : end - ctx]
        return out


def shard_documents(
    tokens: np.ndarray, doc_starts: np.ndarray, separator: int
) -> list[tuple[int, np.ndarray]]:
    """(start, token ids) of every document of a shard (the separator after each one dropped)."""
    ends = np.append(doc_starts[1:] - 1, len(tokens) - 1)
    return [(int(s), np.asarray(tokens[s:e], dtype=np.int64)) for s, e in zip(doc_starts, ends, strict=True)]


def spread_documents(docs: list[tuple[int, np.ndarray]], max_tokens: int) -> list[tuple[int, np.ndarray]]:
    """Every k-th document, k the smallest stride that keeps about ``max_tokens`` tokens (0 or
    more than there are: all). Example: 10 documents of 100 tokens, ``max_tokens=300`` → documents
    0, 4 and 8 (k = 4: 300 tokens, where k = 3 would keep 400)."""
    total = sum(len(d) for _, d in docs)
    if max_tokens <= 0 or total <= max_tokens:
        return docs
    stride = -(-total // max_tokens)  # ceil
    return docs[::stride]


def chunks(docs: list[tuple[int, np.ndarray]], chunk_tokens: int) -> Iterator[list[tuple[int, np.ndarray]]]:
    group: list[tuple[int, np.ndarray]] = []
    size = 0
    for doc in docs:
        group.append(doc)
        size += len(doc[1])
        if size >= chunk_tokens:
            yield group
            group, size = [], 0
    if group:
        yield group


def build_dense(
    version_dir: Path,
    manifest: Manifest,
    encoder: Encoder,
    fingerprint: str,
    cfg: DenseBuildConfig,
    progress: bool = True,
) -> DenseBuildReport:
    """Add a dense index to every shard of the version being written at ``version_dir``.

    Writes ``dense.faiss`` and ``positions.npy`` into each shard directory and returns what the
    manifest records (``store.write_version`` adds the files' checksums and the statistics).
    """
    from tqdm import tqdm

    report = DenseBuildReport()
    separator = int(manifest["separator"])
    states = HiddenStates(encoder, fingerprint, cfg)
    shards = []  # per shard: list of (chunk docs)
    every = [
        shard_documents(arrays["tokens"], arrays["docs"], separator)
        for arrays in (load_shard_arrays(version_dir, int(e["index"])) for e in manifest["shards"])
    ]
    corpus_tokens = sum(len(d) for docs in every for _, d in docs)
    for docs in every:  # each shard keeps its share of the budget
        share = cfg.max_tokens * sum(len(d) for _, d in docs) // max(1, corpus_tokens)
        kept = spread_documents(docs, max(1, share)) if cfg.max_tokens else docs
        shards.append(list(chunks(kept, cfg.chunk_tokens)))
    total = sum(len(d) for shard in shards for group in shard for _, d in group)
    for shard in shards:  # an index that cannot be trained fails here, before the model runs
        num_keys = sum(max(0, len(d) - 1) for group in shard for _, d in group)
        check_index(num_keys, choose_kind(num_keys, cfg.index), cfg.params)

    # 1. hidden states (cached per chunk)
    t0 = time.perf_counter()
    with tqdm(total=total, desc="hidden states", unit="tok", disable=not progress) as bar:
        for shard in shards:
            for group in shard:
                _, cached = states.chunk([d for _, d in group])
                report.cached_chunks += int(cached)
                report.computed_chunks += int(not cached)
                bar.update(sum(len(d) for _, d in group))
    report.seconds["hidden"] = time.perf_counter() - t0

    # 2. statistics from an even sample of the keys' states
    t1 = time.perf_counter()
    stride = max(1, -(-total // cfg.sample))  # ceil: at most cfg.sample vectors
    sample = []
    seen = 0
    for shard in shards:
        for group in shard:
            chunk, _ = states.chunk([d for _, d in group])
            first = (-seen) % stride
            sample.append(np.asarray(chunk[first::stride], dtype=np.float32))
            seen += len(chunk)
    stats = fit_stats(np.concatenate(sample), cfg.dims)
    report.seconds["stats"] = time.perf_counter() - t1

    # 3. keys and indexes, per shard
    t2 = time.perf_counter()
    kinds = []
    for entry, shard in zip(manifest["shards"], shards, strict=True):
        keys, positions = [], []
        for group in shard:
            chunk, _ = states.chunk([d for _, d in group])
            row = 0
            for start, doc in group:
                n = len(doc)
                if n >= 2:  # the last token of a document predicts no token of it
                    keys.append(stats.project(np.asarray(chunk[row : row + n - 1], dtype=np.float32)))
                    positions.append(np.arange(start, start + n - 1, dtype=np.int64))
                row += n
        key_matrix = np.concatenate(keys) if keys else np.zeros((0, stats.dims), np.float32)
        pos = np.concatenate(positions) if positions else np.zeros(0, np.int64)
        kind = choose_kind(len(pos), cfg.index)
        index = build_faiss_index(key_matrix, kind, cfg.params)
        _write_index(version_dir / shard_dir(int(entry["index"])), index, pos)
        report.keys += len(pos)
        kinds.append(kind)
    report.seconds["index"] = time.perf_counter() - t2
    report.kind = ",".join(sorted(set(kinds)))
    report.stats = stats
    return report


def dense_step(
    encoder: Encoder, name: str, fingerprint: str, cfg: DenseBuildConfig, progress: bool = True
) -> Extend:
    """The ``store.Extend`` step that adds the dense index (``build_dense``) and returns its
    manifest entry; ``name`` and ``fingerprint`` are the model's the encoder runs."""

    def extend(version_dir: Path, manifest: Manifest) -> DenseEntry:
        report = build_dense(version_dir, manifest, encoder, fingerprint, cfg, progress)
        assert report.stats is not None
        return {
            "model": name,
            "model_fingerprint": fingerprint,
            "dims": report.stats.dims,
            "index": report.kind,
            "keys": report.keys,
            "params": dataclasses.asdict(cfg.params),
            "window": cfg.window,
            "overlap": cfg.overlap,
            "sample": cfg.sample,
            "max_tokens": cfg.max_tokens,
            "seconds": {k: round(v, 3) for k, v in report.seconds.items()},
            "chunks": {"cached": report.cached_chunks, "computed": report.computed_chunks},
            "stats": report.stats.to_manifest(),
        }

    return extend


def _write_index(sdir: Path, index: Any, positions: np.ndarray) -> None:
    import faiss

    dtype = np.int32 if len(positions) == 0 or positions.max() < 2**31 else np.int64
    np.save(sdir / POSITIONS_FILE, positions.astype(dtype))
    faiss.write_index(index, str(sdir / INDEX_FILE))
