"""The adjacency matrices of Token Recycling (``recycle``), one per tenant, bounded in number.

A tenant's matrix ``next`` [vocab, k] holds, for every token t, the target's k likeliest next
tokens the last time t was an input row of a verify forward (likeliest first; -1 = never seen).
``written`` [vocab] says when that row was last written, on the store's clock (one tick per
observed forward), so a drafter can tell rows its own request wrote from older ones.

The store lives as long as the worker (``DraftResources.recycling``) and is shared by every
spelling of the mode. It keeps at most ``max_tenants`` matrices; a new tenant beyond that evicts
the least recently used one, which later starts empty again: memory is bounded, and no request
ever fails for it. One tenant never reads another's matrix.

Memory per tenant: vocab × (4k + 8) bytes, 1.97 MB at vocab 49 152 and k = 8.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

EMPTY = -1  # an entry of ``next`` never written
RECYCLE_MAX_TENANTS = 16
"""``RecycleStore``'s default bound on matrices kept (``specdraft serve worker --recycle-max-tenants``)."""


@dataclass
class TenantMatrix:
    next: np.ndarray  # [vocab, k] int32: the target's k likeliest tokens after each token, or EMPTY
    written: np.ndarray  # [vocab] int64: the store's clock when the row was last written, -1 = never

    @staticmethod
    def empty(vocab: int, k: int) -> TenantMatrix:
        return TenantMatrix(np.full((vocab, k), EMPTY, dtype=np.int32), np.full(vocab, -1, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.next.nbytes + self.written.nbytes


def update_matrix(matrix: TenantMatrix, inputs: np.ndarray, candidates: np.ndarray, clock: int) -> None:
    """Write one verify forward into ``matrix``: row ``inputs[i]`` becomes ``candidates[i]``.

    ``inputs`` [rows] the forward's tokens (the root, then the draft's nodes); ``candidates``
    [rows, k'] the target's likeliest next tokens after each. A token that is an input more than
    once keeps its first row's candidates: the root comes first, then the nodes in topological
    order, so the row read in the context nearest the committed one wins. Candidates outside the
    vocabulary (a model whose logits are wider than its vocabulary) are stored as ``EMPTY``;
    columns beyond k' stay ``EMPTY`` (a vocabulary smaller than k).

    Example: inputs [5, 9, 5], candidates [[1, 2], [3, 4], [6, 7]] → next[5] = [1, 2],
    next[9] = [3, 4]; written[5] = written[9] = clock.
    """
    vocab, k = matrix.next.shape
    tokens, first = np.unique(inputs, return_index=True)  # each token's first row
    inside = (tokens >= 0) & (tokens < vocab)
    tokens, first = tokens[inside], first[inside]
    rows = candidates[first, :k].astype(np.int32)  # [tokens, min(k, k')]
    rows[(rows < 0) | (rows >= vocab)] = EMPTY
    matrix.next[tokens, : rows.shape[1]] = rows
    matrix.written[tokens] = clock


class RecycleStore:
    """Every tenant's ``TenantMatrix``, the ``max_tenants`` most recently used (worker
    configuration, never a request's). ``k``: candidates kept per token.

    Example: with ``max_tenants=2``, tenants a, b, then c: c's first write evicts a, whose
    next request drafts from an empty matrix.
    """

    def __init__(self, max_tenants: int = RECYCLE_MAX_TENANTS, k: int = 8) -> None:
        if max_tenants < 1 or k < 1:
            raise ValueError(f"a recycling store needs max_tenants >= 1 and k >= 1, not {max_tenants}, {k}")
        self.max_tenants = max_tenants
        self.k = k
        self.clock = 0
        """Observed forwards so far, over every tenant (``TenantMatrix.written``'s time)."""
        self._matrices: OrderedDict[str, TenantMatrix] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # two spellings of the mode hold two different mode locks
        self.evictions = 0

    def get(self, tenant: str) -> TenantMatrix | None:
        """``tenant``'s matrix, None if it has none (never written, or evicted)."""
        with self._lock:
            found = self._matrices.get(tenant)
            if found is not None:
                self._matrices.move_to_end(tenant)
            return found

    def observe(self, tenant: str, vocab: int, inputs: np.ndarray, candidates: np.ndarray) -> None:
        """Write one verify forward into ``tenant``'s matrix (``update_matrix``), made empty on
        first use (or when the vocabulary differs), evicting the least recently used beyond
        ``max_tenants``."""
        with self._lock:
            matrix = self._matrices.get(tenant)
            if matrix is None or matrix.next.shape[0] != vocab:
                matrix = TenantMatrix.empty(vocab, self.k)
                self._matrices[tenant] = matrix
                while len(self._matrices) > self.max_tenants:
                    self._matrices.popitem(last=False)
                    self.evictions += 1
            self._matrices.move_to_end(tenant)
            self.clock += 1
            clock = self.clock
        update_matrix(matrix, inputs, candidates, clock)

    def tenants(self) -> list[str]:
        """The tenants with a matrix, least recently used first."""
        with self._lock:
            return list(self._matrices)

    @property
    def nbytes(self) -> int:
        """Bytes held by every matrix now."""
        with self._lock:
            return sum(m.nbytes for m in self._matrices.values())
