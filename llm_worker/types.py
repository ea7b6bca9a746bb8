"""The small data types that join drafting and verification.

Terms used throughout:

- *root*: the last committed token. Its KV entry is not in the cache yet; every forward starts
  with it, and its logits predict the first draft token.
- *draft tree*: draft tokens hanging off the root. A chain is a tree with one branch.
- *draft batch*: D drafts verified side by side as the D rows of one batched forward (each row
  the root followed by one draft); the verifier decides on their trie (``DraftBatch.trie``).
- *accepted*: a draft token the verifier kept. *Bonus* token: the one token the target itself
  supplies after the last accepted node (its argmax, or its sample at that position). Every
  verify step therefore yields accepted + 1 tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import torch

if TYPE_CHECKING:
    from llm_worker.model.target import KVBuffers

NO_SOURCE = -1


def causal_mask(rows: int, columns: int | None = None, diagonal: int = 0) -> torch.Tensor:
    """[rows, columns] bool, True where column j ≤ row i + ``diagonal``: ``torch.ones(...).tril()``
    without ``tril``, which opens an OpenMP parallel region even for a 2 × 2 mask. That wakes
    torch's worker threads, and their spinning takes a core from the fused kernels' own pool in
    the forward that follows (a 2-row forward cost 1.9 single-row ones on a 2-core EPYC, 1.2 with
    this mask). Example: ``causal_mask(2, 3, 1)`` → [[T, T, F], [T, T, T]]."""
    cols = rows if columns is None else columns
    return torch.arange(cols)[None, :] <= torch.arange(rows)[:, None] + diagonal


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens as a tree in topological order.

    ``tokens[i]`` is node i's token and ``parents[i]`` its parent node (-1: the root); every
    parent comes before its children, and siblings carry distinct tokens.

    Example: drafts [5, 6, 7] and [5, 8] merge into tokens (5, 6, 7, 8) with
    parents (-1, 0, 1, 0): node 0 (token 5) has children 1 (6) and 3 (8).
    """

    tokens: tuple[int, ...]  # [num_nodes]
    parents: tuple[int, ...]  # [num_nodes], -1 = the root
    sources: tuple[int, ...] = ()  # [num_nodes] context position the token was copied from, -1 = none
    features: tuple[str, ...] = ()  # [num_nodes] drafter's key for calibrated acceptance, "" = none

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.parents) != n:
            raise ValueError("tokens and parents differ in length")
        if self.sources and len(self.sources) != n:
            raise ValueError("sources must give one entry per node")
        if self.features and len(self.features) != n:
            raise ValueError("features must give one entry per node")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: nodes must follow their parents")

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def empty() -> DraftTree:
        return DraftTree((), ())

    @staticmethod
    def chain(
        tokens: Sequence[int],
        sources: Sequence[int] = (),
        features: Sequence[str] = (),
    ) -> DraftTree:
        """One branch: ``chain([4, 2])`` has parents (-1, 0)."""
        n = len(tokens)
        return DraftTree(
            tuple(int(t) for t in tokens),
            tuple(range(-1, n - 1)),
            tuple(int(s) for s in sources),
            tuple(features),
        )

    @staticmethod
    def from_sequences(
        sequences: Sequence[Sequence[int]],
        sources: Sequence[Sequence[int]] | None = None,
        features: Sequence[Sequence[str]] | None = None,
    ) -> DraftTree:
        """Merge drafts into a trie: shared prefixes become one node (first draft's source wins)."""
        tokens: list[int] = []
        parents: list[int] = []
        srcs: list[int] = []
        feats: list[str] = []
        child_of: dict[tuple[int, int], int] = {}
        for d, seq in enumerate(sequences):
            parent = -1
            for i, tok in enumerate(seq):
                key = (parent, int(tok))
                node = child_of.get(key)
                if node is None:
                    node = len(tokens)
                    child_of[key] = node
                    tokens.append(int(tok))
                    parents.append(parent)
                    srcs.append(sources[d][i] if sources else NO_SOURCE)
                    feats.append(features[d][i] if features else "")
                parent = node
        return DraftTree(tuple(tokens), tuple(parents), tuple(srcs), tuple(feats))

    def depths(self) -> list[int]:
        """Depth of each node: children of the root have depth 1."""
        depth: list[int] = []
        for p in self.parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        return depth

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def path(self, node: int) -> list[int]:
        """The tokens from the root's first child down to ``node``, inclusive (-1: none).
        Example: tokens (5, 6, 7, 8), parents (-1, 0, 1, 0): path(3) = [5, 8]."""
        tokens: list[int] = []
        while node >= 0:
            tokens.append(self.tokens[node])
            node = self.parents[node]
        return tokens[::-1]

    def source(self, node: int) -> int:
        return self.sources[node] if self.sources else NO_SOURCE

    def feature(self, node: int) -> str:
        return self.features[node] if self.features else ""

    def subtree(self, keep: Sequence[int]) -> DraftTree:
        """The nodes ``keep`` (closed under parents), renumbered in their original order."""
        kept = sorted(set(int(k) for k in keep))
        new_index = {old: new for new, old in enumerate(kept)}
        parents = []
        for old in kept:
            p = self.parents[old]
            if p >= 0 and p not in new_index:
                raise ValueError(f"node {old} kept without its parent {p}")
            parents.append(new_index[p] if p >= 0 else -1)
        return DraftTree(
            tuple(self.tokens[i] for i in kept),
            tuple(parents),
            tuple(self.sources[i] for i in kept) if self.sources else (),
            tuple(self.features[i] for i in kept) if self.features else (),
        )

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's child down to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


@dataclass(frozen=True)
class BatchTrie:
    """The rows of a ``DraftBatch`` merged into a tree, and where each node was computed.

    Node i sits at column ``depth(i)`` of row ``first_row[i]`` of the batched forward (column 0
    is the root), the first row whose path contains it.
    """

    tree: DraftTree  # shared prefixes once; the first row's source and feature win
    first_row: tuple[int, ...]  # [num_nodes] first batch row containing the node


@dataclass(frozen=True)
class DraftBatch:
    """Drafts verified as the D rows of one batched forward (batch verification, DReSD Fig. 3).

    Row r is a token path from the root. The target computes every row in full (input
    ``[D, 1 + L]``: the root, then row r padded to the longest row L), each row attending to the
    shared KV cache and causally to its own tokens; the verdict is taken on the rows' trie and
    the KV of one row holding the accepted path is committed (``llm_worker.verify.batch``).
    Drafters build rows only, never masks.

    Example: rows ((5, 6, 7), (5, 8)) → forward input [[root, 5, 6, 7], [root, 5, 8, pad]]; the
    trie has tokens (5, 6, 7, 8), parents (-1, 0, 1, 0) and first rows (0, 0, 0, 1).
    """

    rows: tuple[tuple[int, ...], ...]  # [D][len_r], every len_r >= 1
    sources: tuple[tuple[int, ...], ...] = ()  # [D][len_r] context position copied from, -1 = none
    features: tuple[tuple[str, ...], ...] = ()  # [D][len_r] drafter's key for calibrated acceptance

    def __post_init__(self) -> None:
        lengths = [len(row) for row in self.rows]
        if any(n == 0 for n in lengths):
            raise ValueError("a batch row must hold at least one draft token")
        for name in ("sources", "features"):
            per_row = getattr(self, name)
            if per_row and [len(r) for r in per_row] != lengths:
                raise ValueError(f"{name} must give one entry per token of every row")

    def __len__(self) -> int:
        """Draft tokens in all rows (a prefix two rows share counts twice: both rows compute it)."""
        return sum(len(row) for row in self.rows)

    @staticmethod
    def empty() -> DraftBatch:
        return DraftBatch(())

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def max_length(self) -> int:
        """L: the longest row."""
        return max((len(row) for row in self.rows), default=0)

    def padded(self, pad: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[D, L] long on ``device``: the rows, right-padded with ``pad``."""
        width = self.max_length
        rows = [[*row, *[int(pad)] * (width - len(row))] for row in self.rows]
        return torch.tensor(rows, dtype=torch.long, device=device).view(self.num_rows, width)

    def trie(self) -> BatchTrie:
        """The rows merged into a draft tree (shared prefixes once), with each node's first row."""
        tree = DraftTree.from_sequences(self.rows, self.sources, self.features)
        child = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens, strict=True))}
        first_row = [-1] * len(tree)
        for r, row in enumerate(self.rows):
            node = -1
            for token in row:
                node = child[(node, token)]
                if first_row[node] < 0:
                    first_row[node] = r
        return BatchTrie(tree, tuple(first_row))

    def truncated(self, keep: Sequence[tuple[int, int]]) -> DraftBatch:
        """Rows ``(row, length)``: row ``row`` cut to its first ``length`` tokens, in that order.

        A row cut to nothing is dropped.
        """
        keep = [(r, n) for r, n in keep if n > 0]
        return DraftBatch(
            tuple(self.rows[r][:n] for r, n in keep),
            tuple(self.sources[r][:n] for r, n in keep) if self.sources else (),
            tuple(self.features[r][:n] for r, n in keep) if self.features else (),
        )


Draft = DraftTree | DraftBatch
"""What a drafter proposes: a tree (chains included) or a batch of rows."""


class Outcome(IntEnum):
    """What verification said of one draft node."""

    UNREACHED = -1  # its parent was rejected (or a sibling was accepted first)
    REJECTED = 0
    ACCEPTED = 1


@dataclass(frozen=True)
class VerifyResult:
    """The verifier's verdict on one draft tree."""

    accepted: tuple[int, ...]  # node indices of the accepted path, root's child first
    bonus: int  # token the target supplies after the accepted path
    outcomes: tuple[Outcome, ...]  # [num_nodes]

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)


CANDIDATE_HISTORY = 4
"""How many committed tokens before the root ``ForwardCandidates.history`` carries."""


@dataclass(frozen=True)
class ForwardCandidates:
    """What one verify forward said at each of its rows (``Drafter.observe_candidates``).

    Row 0 is the root, row i > 0 the tree's node i - 1. ``parents[i]``: row i's parent row (-1:
    the root); ``history``: the last ``CANDIDATE_HISTORY`` (or fewer) committed tokens before the
    root, so that every row's preceding tokens are known; ``candidates[i]``: the target's k
    likeliest next tokens after row i, likeliest first, accepted or not.

    Example: context [.., 3, 4], root 4, tree tokens (5, 6) parents (-1, -1) → inputs [4, 5, 6],
    parents [-1, 0, 0], history [.., 3]; row 2 follows [.., 3, 4, 6].
    """

    inputs: np.ndarray  # [rows] int64
    parents: np.ndarray  # [rows] int64
    history: np.ndarray  # [<= CANDIDATE_HISTORY] int64
    candidates: np.ndarray  # [rows, k] int

    @staticmethod
    def of_tree(history: np.ndarray, root: int, tree: DraftTree, candidates: np.ndarray) -> ForwardCandidates:
        parents = np.array((-1, *(p + 1 for p in tree.parents)), dtype=np.int64)
        inputs = np.array((root, *tree.tokens), dtype=np.int64)
        return ForwardCandidates(inputs, parents, np.asarray(history, dtype=np.int64), candidates)

    def narrowed(self, k: int) -> ForwardCandidates:
        """The same rows with each row's first ``k`` candidates only."""
        return ForwardCandidates(self.inputs, self.parents, self.history, self.candidates[:, :k])

    def contexts(self, width: int) -> list[tuple[int, ...]]:
        """Each row's last ``width`` tokens along its path (history, root, ancestors), ending
        with its input; shorter where the known text is (a forward has a few rows: a walk in
        Python, where numpy's per-call cost would dominate).

        Example (the class's, history [2, 3]): width 3 → [(2, 3, 4), (3, 4, 5), (3, 4, 6)].
        """
        texts: list[tuple[int, ...]] = []
        history = tuple(self.history.tolist())
        for token, parent in zip(self.inputs.tolist(), self.parents.tolist(), strict=True):
            above = texts[parent] if parent >= 0 else history
            texts.append((*above[len(above) - min(len(above), width - 1) :], token))
        return texts


T = TypeVar("T")

HIDDEN = "hidden"
QUERY = "query"
ATTENTION = "attention"
KV = "kv"
KV_BUFFERS = "kv_buffers"
"""The built-in kinds of artifact (``llm_worker.model.artifacts`` says how each is made)."""


@dataclass(frozen=True)
class ArtifactKey(Generic[T]):
    """One model artifact a drafter reads, by kind and the integers that pick it; ``T`` is the
    type ``DraftContext.artifact`` returns for it.

    Example: ``ArtifactKey[torch.Tensor]("hidden", (12,))`` is layer 12's hidden state at every
    committed position, [T-1, hidden_size]; its kind (``"hidden"``) is registered in
    ``llm_worker.model.artifacts.ARTIFACTS``, which says how a backend makes it.
    """

    kind: str
    args: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"{self.kind}({', '.join(str(a) for a in self.args)})"


def hidden_key(layer: int) -> ArtifactKey[torch.Tensor]:
    """Layer ``layer``'s output hidden state: [T-1, hidden_size]."""
    return ArtifactKey(HIDDEN, (layer,))


def query_key(layer: int, head: int) -> ArtifactKey[torch.Tensor]:
    """The post-RoPE query of (``layer``, ``head``) at the last position with a KV entry: [head_dim]."""
    return ArtifactKey(QUERY, (layer, head))


ATTENTION_KEY: ArtifactKey[torch.Tensor] = ArtifactKey(ATTENTION)
"""[num_query_heads, T-1]: attention of each ``query_heads`` head from position T-2 over 0 .. T-2."""


def kv_key(layer: int) -> ArtifactKey[tuple[torch.Tensor, torch.Tensor]]:
    """``layer``'s cached keys (after RoPE) and values, each [num_kv_heads, T-1, head_dim]."""
    return ArtifactKey(KV, (layer,))


def kv_buffers_key(layer: int) -> ArtifactKey[KVBuffers | None]:
    """``layer``'s whole cache buffers and the request's slot (None where the backend has none)."""
    return ArtifactKey(KV_BUFFERS, (layer,))


class UndeclaredArtifactError(KeyError):
    """A drafter read an artifact its ``needs`` did not declare."""

    def __init__(self, key: ArtifactKey[Any], declared: Iterable[ArtifactKey[Any]] = ()) -> None:
        names = ", ".join(sorted(str(k) for k in declared)) or "none"
        super().__init__(f"artifact {key} is not among the drafter's needs (declared: {names})")
        self.key = key

    def __str__(self) -> str:
        return str(self.args[0])


class ArtifactUnavailableError(ValueError):
    """An artifact of a kind nobody registered, or one the backend's forward cannot produce."""


@dataclass(frozen=True)
class ArtifactNeeds:
    """Model artifacts a drafter reads, beyond the committed tokens (``DraftContext.artifact``).

    ``hidden_layers``: layer l's output hidden state (0 = embeddings, l = after decoder layer l)
    at every committed position. ``query_heads``: the post-RoPE query of (layer, head) at the
    last position that has a KV entry, to score attention over the context. ``kv_layers``: the
    target's live KV cache of these layers (read in place, never copied or recorded).
    ``extra``: artifacts of any other registered kind (``llm_worker.model.artifacts``), so that a
    new one needs no field here.
    """

    hidden_layers: frozenset[int] = frozenset()
    query_heads: tuple[tuple[int, int], ...] = ()
    kv_layers: frozenset[int] = frozenset()
    extra: frozenset[ArtifactKey[Any]] = frozenset()

    @cached_property
    def query_keys(self) -> tuple[ArtifactKey[torch.Tensor], ...]:
        """``query_heads`` as keys, in their order."""
        return tuple(query_key(layer, head) for layer, head in self.query_heads)

    @cached_property
    def keys(self) -> tuple[ArtifactKey[Any], ...]:
        """Every artifact declared, by key: the fields' (hidden layers ascending, query heads and
        attention, the KV cache and its buffers), then ``extra`` sorted by name."""
        keys: list[ArtifactKey[Any]] = [hidden_key(layer) for layer in sorted(self.hidden_layers)]
        if self.query_heads:
            keys += [*self.query_keys, ATTENTION_KEY]
        for layer in sorted(self.kv_layers):
            keys += [kv_key(layer), kv_buffers_key(layer)]
        return (*keys, *sorted(self.extra, key=str))

    @cached_property
    def declared(self) -> frozenset[ArtifactKey[Any]]:
        return frozenset(self.keys)

    @staticmethod
    def union(needs: Iterable[ArtifactNeeds]) -> ArtifactNeeds:
        """Everything any of ``needs`` declares (query heads in first-seen order, each once): what
        a drafter that runs several others reads. Example: hidden layers {1} and {1, 3} → {1, 3}."""
        every = list(needs)
        return ArtifactNeeds(
            hidden_layers=frozenset().union(*(n.hidden_layers for n in every)),
            query_heads=tuple(dict.fromkeys(h for n in every for h in n.query_heads)),
            kv_layers=frozenset().union(*(n.kv_layers for n in every)),
            extra=frozenset().union(*(n.extra for n in every)),
        )
