"""The prefix cache: the KV of prompt prefixes computed once and reused by later requests.

Production traffic shares long system prompts and chat histories. A prompt is cut into blocks of
``block_tokens`` tokens; block i is named by a digest chained over the request's namespace (its
tenant) and every token up to the end of block i, so equal digests mean equal prefixes. A new
request copies the KV (and any artifacts its drafter records, such as hidden states) of its
longest run of cached blocks into its own cache and prefills only the rest.

Lossless by construction on a batch-invariant forward (``fast_llama``): a token's K/V are
bit-identical whether computed alone, in a prefill chunk of any size or at any row of a batch, so
the copied entries are exactly what a fresh prefill would write, and every later logit is
unchanged. A target that cannot promise this (``TargetModel.prefix_reuse`` False: the
transformers path) never uses the cache.

Example with ``block_tokens = 4``: a first request with prompt [s0..s9] (10 tokens) stores
blocks [s0..s3] and [s4..s7]; a second request with prompt [s0..s7, q0, q1, q2] reuses both (8
tokens) and prefills [q0, q1, q2]. At most ``len(prompt) - 1`` tokens are reused: the last
prompt token always runs, since its logits choose the first new token.

Bounded: blocks are evicted least recently used first once their bytes pass ``max_bytes``. A
block whose parent was evicted is unreachable (a lookup stops at the first missing block) and
ages out in turn. The namespace keeps tenants apart: one tenant's cached prompt never speeds up
(and so never reveals itself through the timing of) another's.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from llm_worker.types import ArtifactKey

Recorded = Mapping[ArtifactKey[Any], torch.Tensor]
"""Artifacts recorded per prompt position, key → [positions, ...]."""

BlockExport = Callable[[int, int], tuple[torch.Tensor, torch.Tensor, Recorded]]
"""(start, stop) → keys [layers, kv_heads, stop - start, d], values [..., d + 1] and the recorded
artifacts of those positions: copies, owned by the cache from then on."""


def block_names(namespace: str, tokens: Sequence[int], block_tokens: int, blocks: int) -> list[bytes]:
    """The names of the first ``blocks`` whole blocks of ``tokens``: name i is a digest chained
    over the namespace and tokens[: (i + 1) * block_tokens]."""
    ids = np.asarray(tokens[: blocks * block_tokens], dtype=np.int64)
    out: list[bytes] = []
    previous = hashlib.blake2b(namespace.encode(), digest_size=32).digest()
    for i in range(blocks):
        h = hashlib.blake2b(previous, digest_size=32)
        h.update(ids[i * block_tokens : (i + 1) * block_tokens].tobytes())
        previous = h.digest()
        out.append(previous)
    return out


@dataclass(frozen=True)
class PrefixHit:
    """The cached prefix of a prompt: ``tokens`` positions of KV and recorded artifacts."""

    tokens: int
    keys: torch.Tensor  # [layers, kv_heads, tokens, d]
    values: torch.Tensor  # [layers, kv_heads, tokens, d + 1]
    recorded: dict[ArtifactKey[Any], torch.Tensor]  # key -> [tokens, ...]


@dataclass
class _Block:
    keys: torch.Tensor  # [layers, kv_heads, block_tokens, d]
    values: torch.Tensor  # [layers, kv_heads, block_tokens, d + 1]
    recorded: dict[ArtifactKey[Any], torch.Tensor]  # key -> [block_tokens, ...]

    @property
    def nbytes(self) -> int:
        tensors = [self.keys, self.values, *self.recorded.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class PrefixCacheStats:
    """Counted in prompt tokens, as vLLM counts its prefix cache's queries and hits."""

    queried_tokens: int = 0  # prompt tokens looked up (each prompt's reusable part)
    hit_tokens: int = 0  # of those, found cached
    evicted_blocks: int = 0


class PrefixCache:
    """Blocks of prompt KV by chained digest, least recently used first; thread-safe."""

    def __init__(self, max_bytes: int, block_tokens: int = 32) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.max_bytes = max_bytes
        self.block_tokens = block_tokens
        self.stats = PrefixCacheStats()
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    @property
    def blocks(self) -> int:
        return len(self._blocks)

    def digests(self, namespace: str, tokens: Sequence[int], blocks: int) -> list[bytes]:
        """The names of the first ``blocks`` whole blocks of ``tokens`` (``block_names``)."""
        return block_names(namespace, tokens, self.block_tokens, blocks)

    def reusable_blocks(self, prompt_tokens: int) -> int:
        """Whole blocks that may be reused from a prompt of ``prompt_tokens`` tokens: its last
        token always runs (its logits choose the first new token)."""
        return max(0, prompt_tokens - 1) // self.block_tokens

    def lookup(
        self, namespace: str, tokens: Sequence[int], recorded: Collection[ArtifactKey[Any]] = ()
    ) -> PrefixHit | None:
        """The longest cached run of ``tokens``' reusable blocks that carries every artifact key
        in ``recorded``; None if the first block is not cached."""
        blocks = self.reusable_blocks(len(tokens))
        if blocks == 0 or self.max_bytes <= 0:
            return None
        names = self.digests(namespace, tokens, blocks)
        found: list[_Block] = []
        with self._lock:
            self.stats.queried_tokens += blocks * self.block_tokens
            for name in names:
                block = self._blocks.get(name)
                if block is None or any(key not in block.recorded for key in recorded):
                    break
                found.append(block)
            self._touch(names[: len(found)])
            self.stats.hit_tokens += len(found) * self.block_tokens
        if not found:
            return None
        return PrefixHit(
            tokens=len(found) * self.block_tokens,
            keys=torch.cat([b.keys for b in found], dim=2),
            values=torch.cat([b.values for b in found], dim=2),
            recorded={key: torch.cat([b.recorded[key] for b in found]) for key in recorded},
        )

    def insert(
        self,
        namespace: str,
        tokens: Sequence[int],
        export: BlockExport,
        recorded: Collection[ArtifactKey[Any]] = (),
    ) -> int:
        """Store ``tokens``' reusable blocks that are not cached yet, or are cached without
        one of the ``recorded`` artifact keys the export carries (their KV is the same: the
        artifacts join it), reading them through ``export``; returns the blocks stored."""
        blocks = self.reusable_blocks(len(tokens))
        if blocks == 0 or self.max_bytes <= 0:
            return 0
        names = self.digests(namespace, tokens, blocks)
        with self._lock:
            missing = [i for i, name in enumerate(names) if self._lacks(name, recorded)]
        stored = 0
        for i in missing:
            lo, hi = i * self.block_tokens, (i + 1) * self.block_tokens
            keys, values, artifacts = export(lo, hi)
            block = _Block(keys, values, dict(artifacts))
            with self._lock:
                if not self._lacks(names[i], recorded):  # another request stored it meanwhile
                    continue
                old = self._blocks.pop(names[i], None)
                if old is not None:
                    self._bytes -= old.nbytes
                    block.recorded = {**old.recorded, **block.recorded}
                self._blocks[names[i]] = block
                self._bytes += block.nbytes
                stored += 1
                self._evict()
        with self._lock:
            self._touch([name for name in names if name in self._blocks])
        return stored

    def _lacks(self, name: bytes, recorded: Collection[ArtifactKey[Any]]) -> bool:
        block = self._blocks.get(name)
        return block is None or any(key not in block.recorded for key in recorded)

    def _touch(self, chain: Sequence[bytes]) -> None:
        """Mark a prompt's chain of blocks used, its first block last: eviction then takes a
        chain's deepest blocks first, and never leaves a deep block behind an evicted parent
        while the parent's prompt is in use."""
        for name in reversed(chain):
            self._blocks.move_to_end(name)

    def _evict(self) -> None:
        while self._bytes > self.max_bytes and self._blocks:
            _, block = self._blocks.popitem(last=False)
            self._bytes -= block.nbytes
            self.stats.evicted_blocks += 1
