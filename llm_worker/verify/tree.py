"""Attention mask and position offsets for verifying a draft tree in one forward.

Row 0 of the forward is the root (the last committed token), row i + 1 is draft node i. A row
attends to the whole KV cache plus its own ancestors and itself; its position is the cache
length plus its depth. Buffers depend only on the tree's shape, so they are built once per
shape and reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class TreeBuffers:
    mask: torch.Tensor  # [1 + num_nodes, 1 + num_nodes] bool, True = may attend
    position_offsets: torch.Tensor  # [1 + num_nodes] long: depth of each row, root = 0
    is_chain: bool

    @property
    def rows(self) -> int:
        return int(self.position_offsets.shape[0])


@lru_cache(maxsize=512)
def tree_buffers(parents: tuple[int, ...]) -> TreeBuffers:
    """Buffers for the tree whose node i has parent ``parents[i]`` (-1 = root).

    Example: parents (-1, 0, 0) → rows root, a, b with a and b both children of the root:
    mask = [[1,0,0],[1,1,0],[1,0,1]], offsets = [0, 1, 1].
    """
    n = len(parents) + 1
    mask = torch.zeros(n, n, dtype=torch.bool)
    offsets = torch.zeros(n, dtype=torch.long)
    mask[0, 0] = True
    for i, p in enumerate(parents):
        row, parent_row = i + 1, p + 1
        mask[row] = mask[parent_row]
        mask[row, row] = True
        offsets[row] = offsets[parent_row] + 1
    is_chain = all(p == i - 1 for i, p in enumerate(parents))
    return TreeBuffers(mask, offsets, is_chain)
