"""Artifacts by key: how each kind of model artifact a drafter reads is made.

A drafter declares the keys it reads (``ArtifactNeeds``) and reads each with
``DraftContext.artifact(key)``. A key's kind is registered here (``ARTIFACTS``) in one of two ways:

- *recorded*: taken from a point of the target's forward (a *tap*) for every row it computes;
  the engine keeps the committed rows' values, at every committed position (read as
  [T-1, ...]) or at the last one only (``keep_last``: read as [...]);
- *read*: computed when the drafter asks, from the target and the request's state and what was
  recorded (the KV cache read in place; attention scores from recorded queries).

Taps are what a backend's forward publishes (``TargetModel.taps``), each a tensor over the
forward's rows, by name and layer (L: the number of decoder layers):

- ``("hidden", l)``, 0 ≤ l ≤ L: [rows, hidden_size] the state entering decoder layer l
  (0: the embeddings); l = L: after the final norm — transformers' ``hidden_states[l]``;
- ``("residual", l)``, 0 ≤ l ≤ L: [rows, hidden_size] the residual stream after l decoder
  layers, before any norm (below L the same tensor as ``hidden``);
- ``("query", l)``, 0 ≤ l < L: [rows, num_heads, head_dim] layer l's post-RoPE queries.

A new artifact registers its kind (over a tap the backend publishes, or one added to that
backend's forward) and is declared by the drafter that reads it: forwards hand recorded values
on in ``ForwardOutput.artifacts`` by key, and the engine, the batching and the server never
look at a kind.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from llm_worker.types import (
    ATTENTION,
    HIDDEN,
    KV,
    KV_BUFFERS,
    QUERY,
    ArtifactKey,
    ArtifactNeeds,
    ArtifactUnavailableError,
    UndeclaredArtifactError,
)

if TYPE_CHECKING:
    from llm_worker.model.target import SequenceState, TargetModel

Tap = tuple[str, int]
"""A point of the forward, by name and layer: ``("hidden", 3)``."""

TapSink = Callable[[str, int, torch.Tensor], None]
"""What a forward hands each tap's value to, as it runs: (name, layer, value [rows, ...])."""

Select = Callable[[ArtifactKey[Any], torch.Tensor, slice], torch.Tensor]
"""A call's value from a tap: (key, the tap's tensor [forward rows, ...], the call's rows) →
[call rows, ...]."""


class ArtifactView(Protocol):
    """What a *read* kind reads from: the request's target and state, the declared needs, and
    the recorded artifacts (the engine's keeper of them)."""

    target: TargetModel
    state: SequenceState
    needs: ArtifactNeeds

    def recorded(self, key: ArtifactKey[Any]) -> torch.Tensor:
        """A recorded key's kept value: [T-1, ...] (every position) or [...] (the last)."""
        ...


def call_rows(key: ArtifactKey[Any], tapped: torch.Tensor, rows: slice) -> torch.Tensor:
    """The tap's value at the call's rows, as it is."""
    return tapped[rows]


@dataclass(frozen=True)
class ArtifactKind:
    """How artifacts of one kind are made: recorded from a ``tap``, or ``read`` when asked."""

    name: str
    tap: Callable[[ArtifactKey[Any]], Tap] | None = None
    """The point of the forward a key's value is taken from (recorded kinds)."""
    select: Select = call_rows
    """A key's value from the tap's tensor, for one call's rows."""
    keep_last: bool = False
    """Kept at the last committed position only (else at every committed position)."""
    read: Callable[[ArtifactView, ArtifactKey[Any]], Any] | None = None
    """Computes a key's value when a drafter asks (kinds no forward records)."""

    def __post_init__(self) -> None:
        if (self.tap is None) == (self.read is None):
            raise ValueError(f"artifact kind {self.name!r}: give a tap or a read, not both or neither")


@dataclass(frozen=True)
class Recording:
    """One recorded key of a drafter's needs: where its value comes from and how it is kept."""

    key: ArtifactKey[Any]
    tap: Tap
    select: Select
    keep_last: bool


class ArtifactRegistry:
    """Kinds of artifact by name."""

    def __init__(self) -> None:
        self._kinds: dict[str, ArtifactKind] = {}
        self._plans: dict[ArtifactNeeds, tuple[Recording, ...]] = {}  # needs -> its recordings

    def register(self, kind: ArtifactKind) -> ArtifactKind:
        if kind.name in self._kinds:
            raise ValueError(f"artifact kind {kind.name!r} registered twice")
        self._kinds[kind.name] = kind
        self._plans.clear()
        return kind

    @contextmanager
    def registered(self, kind: ArtifactKind) -> Iterator[ArtifactKind]:
        """``kind`` inside the ``with`` block only (tests and short-lived plug-ins)."""
        self.register(kind)
        try:
            yield kind
        finally:
            del self._kinds[kind.name]
            self._plans.clear()

    def kind(self, key: ArtifactKey[Any]) -> ArtifactKind:
        try:
            return self._kinds[key.kind]
        except KeyError:
            known = ", ".join(self._kinds)
            raise ArtifactUnavailableError(
                f"artifact {key}: no kind {key.kind!r} is registered (known: {known})"
            ) from None

    def recordings(self, needs: ArtifactNeeds) -> tuple[Recording, ...]:
        """The keys of ``needs`` a forward records, in ``needs.keys`` order (made once per needs)."""
        plan = self._plans.get(needs)
        if plan is None:
            kinds = [(key, self.kind(key)) for key in needs.keys]
            plan = self._plans[needs] = tuple(
                Recording(key, kind.tap(key), kind.select, kind.keep_last)
                for key, kind in kinds
                if kind.tap is not None
            )
        return plan

    def published(self, target: TargetModel, needs: ArtifactNeeds) -> tuple[Recording, ...]:
        """``recordings(needs)``, or ``ArtifactUnavailableError`` naming the first key whose tap
        ``target``'s forward does not publish (or whose kind is not registered)."""
        plan = self.recordings(needs)
        taps = target.taps
        for rec in plan:
            if rec.tap not in taps:
                raise ArtifactUnavailableError(
                    f"artifact {rec.key}: the {target.info.backend} backend's forward does not "
                    f"publish {rec.tap[0]!r} at layer {rec.tap[1]}"
                )
        return plan

    def read(self, view: ArtifactView, key: ArtifactKey[Any]) -> Any:
        """``key``'s value for a drafter: read by its kind, or as recorded."""
        if key not in view.needs.declared:
            raise UndeclaredArtifactError(key, view.needs.keys)
        kind = self.kind(key)
        if kind.read is not None:
            return kind.read(view, key)
        return view.recorded(key)


ARTIFACTS = ArtifactRegistry()


def select_head(key: ArtifactKey[Any], queries: torch.Tensor, rows: slice) -> torch.Tensor:
    """[rows, head_dim]: head ``key.args[1]`` of the queries [forward rows, heads, head_dim]."""
    return queries[rows, key.args[1]]


def attention(view: ArtifactView, key: ArtifactKey[Any]) -> torch.Tensor:
    """[heads, T-1]: softmax attention of each declared query head (``needs.query_heads``, in
    order) from the last cached position over every cached one."""
    target, needs = view.target, view.needs
    info = target.info
    group = info.num_heads // info.num_kv_heads
    scale = 1.0 / math.sqrt(info.head_dim)
    by_layer: dict[int, list[tuple[int, ArtifactKey[Any]]]] = {}
    for (layer, head), query in zip(needs.query_heads, needs.query_keys, strict=True):
        by_layer.setdefault(layer, []).append((head, query))
    scores: dict[ArtifactKey[Any], torch.Tensor] = {}
    for layer, heads in by_layer.items():
        keys = target.keys(view.state, layer)  # [kv_heads, T-1, head_dim]
        q = torch.stack([view.recorded(query) for _, query in heads])  # [m, head_dim]
        k = keys[torch.tensor([h // group for h, _ in heads], device=keys.device)]  # [m, T-1, head_dim]
        logits = torch.einsum("md,mld->ml", q.float(), k.float()) * scale
        for (_, query), row in zip(heads, torch.softmax(logits, dim=-1), strict=True):
            scores[query] = row
    return torch.stack([scores[query] for query in needs.query_keys])


ARTIFACTS.register(ArtifactKind(HIDDEN, tap=lambda key: ("hidden", key.args[0])))
ARTIFACTS.register(
    ArtifactKind(QUERY, tap=lambda key: ("query", key.args[0]), select=select_head, keep_last=True)
)
ARTIFACTS.register(ArtifactKind(ATTENTION, read=attention))
ARTIFACTS.register(ArtifactKind(KV, read=lambda view, key: view.target.kv(view.state, key.args[0])))
ARTIFACTS.register(
    ArtifactKind(KV_BUFFERS, read=lambda view, key: view.target.kv_buffers(view.state, key.args[0]))
)
