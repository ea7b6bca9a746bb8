"""The adjacency matrices of Token Recycling (``recycle``), one per tenant, bounded in number.

A tenant's matrix ``next`` [vocab, k] holds, for every token t, the target's k likeliest next
tokens the last time t was an input row of a verify forward (likeliest first; -1 = never seen).
``written`` [vocab] says when that row was last written, on the store's clock (one tick per
observed forward), so a drafter can tell rows its own request wrote from older ones.

Beside it, a tenant keeps rows keyed by the last two and three tokens (``CONTEXT_ORDERS``): the
same candidates, written under the row's context along its path (the committed text before the
root, then the tree's branch). The paper keys rows by one token; a 135M target's top candidates
after one token, read in another context, seldom continue the text (the likeliest entry right
for 25 % of tokens on held-out open-ended prompts with a warm matrix), while those read after
the same three tokens are right for 35 %, and a chain grown from them reaches τ 1.78 against
1.40 (docs/measurements/2026-11-27-recycle-context.md). A lookup takes the longest context that
has a row, else the one-token row. The context rows live in a direct-mapped table of
``context_slots`` entries addressed by the context's tokens packed into one 64-bit key
(``packed_keys``): a newer context that lands on a taken slot replaces it (most recent wins, as
for the one-token rows), and a key that differs is a miss, never another context's row (but
while one request of a tenant rewrites a slot that another of its requests reads: drafts only,
verified, so at most a wasted node).

The store lives as long as the worker (``DraftResources.recycling``) and is shared by every
spelling of the mode. It keeps at most ``max_tenants`` matrices; a new tenant beyond that evicts
the least recently used one, which later starts again from empty rows (or the seed): memory is
bounded, and no request ever fails for it. One tenant never reads another's matrix.

Memory per tenant: vocab × (4k + 8) bytes, 1.97 MB at vocab 49 152 and k = 8, plus
``context_slots`` × (4k + 16) bytes, 3.1 MB at 65 536 slots.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

EMPTY = -1  # an entry of ``next`` never written
CONTEXT_ORDERS = (2, 3)
"""Context lengths (tokens, ending with the row's own) of the keyed rows; a lookup prefers the longest."""
CONTEXT_SLOTS = 1 << 16
"""``RecycleStore``'s default size of a tenant's table of context rows (a power of two)."""
RECYCLE_MAX_TENANTS = 16
"""``RecycleStore``'s default bound on matrices kept (``specdraft serve worker --recycle-max-tenants``)."""


@dataclass
class TenantMatrix:
    next: np.ndarray  # [vocab, k] int32: the target's k likeliest tokens after each token, or EMPTY
    written: np.ndarray  # [vocab] int64: the store's clock when the row was last written, -1 = never
    context_key: np.ndarray  # [slots] uint64: the context in each slot (``packed_keys``), 0 = empty
    context_next: np.ndarray  # [slots, k] int32: that context's candidates
    context_written: np.ndarray  # [slots] int64: when the slot was written

    @staticmethod
    def empty(vocab: int, k: int, slots: int = CONTEXT_SLOTS) -> TenantMatrix:
        return TenantMatrix(
            np.full((vocab, k), EMPTY, dtype=np.int32),
            np.full(vocab, -1, dtype=np.int64),
            np.zeros(slots, dtype=np.uint64),
            np.full((slots, k), EMPTY, dtype=np.int32),
            np.full(slots, -1, dtype=np.int64),
        )

    def copy(self) -> TenantMatrix:
        return TenantMatrix(*(a.copy() for a in self.arrays()))

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (self.next, self.written, self.context_key, self.context_next, self.context_written)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def row(self, context: Sequence[int]) -> tuple[np.ndarray, int, int]:
        """The candidates after ``context`` (token ids ending with one in the vocabulary, -1 before
        a known start): the row of its longest suffix of ``CONTEXT_ORDERS`` tokens that has one,
        else its last token's row. Returns (row [k], the context length that answered, when that
        row was written). Scalar code: a draft reads a few rows, where numpy's per-call overhead
        would dominate.

        Example: after writing [3, 4, 5] → [9, 8] as a context, [3, 4, 5] → ([9, 8], 3, clock);
        [0, 4, 5] → ([9, 8], 2, clock) (its 2-token suffix was written too); [0, 0, 5] → next[5].
        """
        slots = self.context_key.shape[0]
        for order, key in reversed(packed_keys(context)):
            slot = slot_of(key, slots)
            if int(self.context_key[slot]) == key:
                return self.context_next[slot], order, int(self.context_written[slot])
        last = context[-1]
        return self.next[last], 1, int(self.written[last])


TOKEN_BITS = 21
"""Bits per token of a context key: a context of up to three tokens is packed exactly into 63
bits (token + 1 each, 0 = no token); a context holding a token id of 2**21 - 1 or more has no
key (its one-token row answers)."""
_FIBONACCI = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads packed keys over slots
_MASK64 = (1 << 64) - 1
_PACKABLE = (1 << TOKEN_BITS) - 1


def packed_keys(context: Sequence[int]) -> list[tuple[int, int]]:
    """(order, key) for each of ``CONTEXT_ORDERS`` that ``context`` (token ids ending with the
    row's own; -1 before a known start) is long enough for, shortest first. A key holds the last
    ``order`` tokens packed exactly (token + 1 in ``TOKEN_BITS`` bits each), so two contexts share
    a key only if they are equal, and a shorter one never equals a longer one (its top field is
    0). Nothing for a token that is not known or too wide to pack.

    Example: [4, 5] → [(2, (5 << 21) | 6)]; [-1, 5] → [].
    """
    last = context[-1]
    if not 0 <= last < _PACKABLE:
        return []
    key = last + 1
    keys = []
    for j in range(2, min(max(CONTEXT_ORDERS), len(context)) + 1):
        token = context[-j]
        if not 0 <= token < _PACKABLE:
            break
        key |= (token + 1) << (TOKEN_BITS * (j - 1))
        if j in CONTEXT_ORDERS:
            keys.append((j, key))
    return keys


def slot_of(key: int, slots: int) -> int:
    """A key's slot in a table of ``slots`` (a power of two): the top bits of key × 2**64/φ."""
    bits = slots.bit_length() - 1
    return ((key * _FIBONACCI) & _MASK64) >> (64 - bits) if bits else 0


def update_matrix(
    matrix: TenantMatrix,
    inputs: np.ndarray,
    candidates: np.ndarray,
    clock: int,
    contexts: Sequence[Sequence[int]] | np.ndarray | None = None,
) -> None:
    """Write one verify forward into ``matrix``: row ``inputs[i]`` becomes ``candidates[i]``,
    and so does the row of each of its contexts (``contexts[i]``: the tokens ending with
    ``inputs[i]``, -1 before a known start; None: the one-token rows alone).

    ``inputs`` [rows] the forward's tokens (the root, then the draft's nodes); ``candidates``
    [rows, k'] the target's likeliest next tokens after each. A token (or context) that is an
    input more than once keeps its first row's candidates: the root comes first, then the nodes
    in topological order, so the row read in the context nearest the committed one wins (two
    contexts on one slot: the first row's). Candidates outside the vocabulary (a model whose
    logits are wider than its vocabulary) are stored as ``EMPTY``;
    columns beyond k' stay ``EMPTY`` (a vocabulary smaller than k).

    Example: inputs [5, 9, 5], candidates [[1, 2], [3, 4], [6, 7]] → next[5] = [1, 2],
    next[9] = [3, 4]; written[5] = written[9] = clock.
    """
    vocab, k = matrix.next.shape
    rows = candidates[:, :k].astype(np.int32)  # [inputs, min(k, k')]
    rows[(rows < 0) | (rows >= vocab)] = EMPTY
    width, slots = rows.shape[1], len(matrix.context_key)
    texts = contexts.tolist() if isinstance(contexts, np.ndarray) else contexts
    tokens = inputs.tolist()
    # one row at a time (a forward has a few: numpy's per-call cost would dominate), last first,
    # so that the first row of a token or context is written last and wins
    for i in range(len(tokens) - 1, -1, -1):
        token, row = tokens[i], rows[i]
        if 0 <= token < vocab:
            matrix.next[token, :width] = row
            matrix.written[token] = clock
        for _, key in packed_keys(texts[i]) if texts is not None else ():
            slot = slot_of(key, slots)
            if width < k:
                matrix.context_next[slot] = EMPTY
            matrix.context_next[slot, :width] = row
            matrix.context_written[slot] = clock
            matrix.context_key[slot] = key


class RecycleStore:
    """Every tenant's ``TenantMatrix``, the ``max_tenants`` most recently used (worker
    configuration, never a request's). ``k``: candidates kept per token; ``context_slots``:
    the size of each tenant's table of context rows (a power of two); ``seed``: rows every
    tenant starts from (``recycle_seed``: written from the operator's corpus, read by every
    tenant, never written to: a tenant's first write makes it a copy of its own; an evicted
    tenant starts from the seed again).

    Example: with ``max_tenants=2``, tenants a, b, then c: c's first write evicts a, whose
    next request drafts from an empty matrix.
    """

    def __init__(
        self,
        max_tenants: int = RECYCLE_MAX_TENANTS,
        k: int = 8,
        context_slots: int = CONTEXT_SLOTS,
        seed: TenantMatrix | None = None,
    ) -> None:
        if max_tenants < 1 or k < 1:
            raise ValueError(f"a recycling store needs max_tenants >= 1 and k >= 1, not {max_tenants}, {k}")
        if context_slots < 1 or context_slots & (context_slots - 1):
            raise ValueError(f"a recycling store's context_slots must be a power of two, not {context_slots}")
        if seed is not None and (seed.next.shape[1], len(seed.context_key)) != (k, context_slots):
            raise ValueError("a recycling store's seed must have its k and context_slots")
        self.max_tenants = max_tenants
        self.k = k
        self.context_slots = context_slots
        self.seed = seed
        self.clock = 0
        """Observed forwards so far, over every tenant (``TenantMatrix.written``'s time)."""
        self._matrices: OrderedDict[str, TenantMatrix] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # two spellings of the mode hold two different mode locks
        self.evictions = 0

    def get(self, tenant: str) -> TenantMatrix | None:
        """``tenant``'s matrix, else the seed (never written, or evicted), else None."""
        with self._lock:
            found = self._matrices.get(tenant)
            if found is not None:
                self._matrices.move_to_end(tenant)
                return found
            return self.seed

    def observe(
        self,
        tenant: str,
        vocab: int,
        inputs: np.ndarray,
        candidates: np.ndarray,
        contexts: Sequence[Sequence[int]] | np.ndarray | None = None,
    ) -> None:
        """Write one verify forward into ``tenant``'s matrix (``update_matrix``), made a copy of
        the seed (else empty) on first use (or when the vocabulary differs), evicting the least
        recently used beyond ``max_tenants``."""
        with self._lock:
            matrix = self._matrices.get(tenant)
            if matrix is None or matrix.next.shape[0] != vocab:
                if self.seed is not None and self.seed.next.shape[0] == vocab:
                    matrix = self.seed.copy()
                else:
                    matrix = TenantMatrix.empty(vocab, self.k, self.context_slots)
                self._matrices[tenant] = matrix
                while len(self._matrices) > self.max_tenants:
                    self._matrices.popitem(last=False)
                    self.evictions += 1
            self._matrices.move_to_end(tenant)
            self.clock += 1
            clock = self.clock
        update_matrix(matrix, inputs, candidates, clock, contexts)

    def tenants(self) -> list[str]:
        """The tenants with a matrix, least recently used first."""
        with self._lock:
            return list(self._matrices)

    @property
    def nbytes(self) -> int:
        """Bytes held by every matrix now (the seed's included)."""
        with self._lock:
            seed = self.seed.nbytes if self.seed is not None else 0
            return seed + sum(m.nbytes for m in self._matrices.values())
