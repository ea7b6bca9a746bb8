"""The drafter protocol and the registry of drafting modes.

A drafter sees the committed tokens (and, if it asks, model artifacts) and proposes a draft
tree or a batch of draft rows; it never builds attention masks and never sees logits. The
engine looks modes up by name here — adding a drafter never means editing the engine.

A mode string is a registered name with optional ``:key=value`` options, e.g. ``pld``,
``pld+h:layer=12:theta=0.4``, at most ``MAX_MODE_CHARS`` characters. A mode checks its options
(allowed, well formed, finite, in range) before it loads anything.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from datastore_svc.cache import QueryCache, StatsCache
from datastore_svc.protocols import Datastore
from llm_worker.config import SamplingParams
from llm_worker.drafters.checkpoint import SharedNetworks
from llm_worker.drafters.recycle_store import RecycleStore
from llm_worker.drafters.suffix_tree import SuffixStore
from llm_worker.model.artifacts import ARTIFACTS
from llm_worker.sampling import SamplingNoise
from llm_worker.types import (
    ATTENTION,
    ATTENTION_KEY,
    HIDDEN,
    KV,
    KV_BUFFERS,
    ArtifactKey,
    ArtifactNeeds,
    ArtifactUnavailableError,
    Draft,
    DraftTree,
    ForwardCandidates,
    UndeclaredArtifactError,
    VerifyResult,
    hidden_key,
    kv_buffers_key,
    kv_key,
)
from specdraft.common import shorten

if TYPE_CHECKING:
    from llm_worker.model.target import KVBuffers, TargetModel


T = TypeVar("T")
OptionT = TypeVar("OptionT", float, None)  # an option's default: a number, or None for "not set"

MAX_MODE_CHARS = 256
"""The longest mode string a worker takes (the longest sensible one, every option of
``glide+cape`` spelled out, has about 80 characters)."""


class UnknownModeError(ValueError):
    """A mode name that no drafter registered, or options it does not take."""


class ModeUnavailableError(ValueError):
    """A known mode that cannot run on this model (e.g. no induction-head file)."""


ArtifactReader = Callable[[ArtifactKey[Any]], Any]
"""Reads an artifact by key (the engine's: ``llm_worker.model.artifacts.ARTIFACTS.read``)."""


class DraftContext:
    """What a drafter may read when it proposes.

    ``tokens``: [T] the committed sequence (prompt + generated); its last token, the root, has
    no KV entry yet, so artifacts exist for positions 0 .. T-2 only.
    ``budget``: the most draft tokens worth proposing this step.
    ``artifacts``: reads the artifacts the drafter declared in its ``needs``, by key
    (``artifact``); ``hidden``, ``attention``, ``kv`` and ``kv_buffers`` answer their built-in
    kind's keys instead, for a context built by hand (tests, replays).
    ``request_state``: what lives as long as the request (``RequestState``).
    ``sampling`` / ``noise``: the request's sampling parameters and its position-coupled noise,
    for a drafter that samples its draft: the token at sequence position ``len(tokens) + d - 1``
    (depth d) is ``noise.choose(q, position)``, the race the target's own sample runs.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        budget: int,
        artifacts: ArtifactReader | None = None,
        *,
        request_state: RequestState | None = None,
        sampling: SamplingParams | None = None,
        noise: SamplingNoise | None = None,
        verify_seconds: Callable[[int], float] | None = None,
        hidden: Callable[[int], torch.Tensor] | None = None,
        attention: Callable[[], torch.Tensor] | None = None,
        kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
        kv_buffers: Callable[[int], KVBuffers | None] | None = None,
    ) -> None:
        self.tokens = tokens  # [T] int64
        self.budget = budget
        self.request_state = RequestState() if request_state is None else request_state
        self.sampling = sampling or SamplingParams()
        self.noise = noise
        self._artifacts = artifacts
        self._by_kind: dict[str, ArtifactReader] = {}  # the hand-built context's readers
        if hidden is not None:
            self._by_kind[HIDDEN] = lambda key: hidden(key.args[0])
        if attention is not None:
            self._by_kind[ATTENTION] = lambda key: attention()
        if kv is not None:
            self._by_kind[KV] = lambda key: kv(key.args[0])
        if kv_buffers is not None:
            self._by_kind[KV_BUFFERS] = lambda key: kv_buffers(key.args[0])
        self.verify_seconds = verify_seconds
        """The planner's price of this step's forward with n draft tokens (seconds; n = 0: the
        root alone), where a drafter weighs its own time against what a token saves."""

    def artifact(self, key: ArtifactKey[T]) -> T:
        """``key``'s value at this step, as its kind defines it (``llm_worker.model.artifacts``):
        ``UndeclaredArtifactError`` (a ``KeyError``) naming the key where the drafter's ``needs``
        did not declare it. Example: ``ctx.artifact(hidden_key(12))`` → [T-1, hidden_size]."""
        reader = self._by_kind.get(key.kind, self._artifacts)
        if reader is None:
            raise UndeclaredArtifactError(key)
        value: T = reader(key)
        return value

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's cached keys (after RoPE) and values of ``layer`` at positions 0 .. T-2,
        each [num_kv_heads, T-1, head_dim]: views of the live cache, read-only."""
        return self.artifact(kv_key(layer))

    def kv_buffers(self, layer: int) -> KVBuffers | None:
        """``layer``'s whole cache buffers and the request's slot (committed positions 0 .. T-2),
        for kernels that read the cache in place; None where the backend has none (or the
        drafter did not declare the KV cache)."""
        try:
            return self.artifact(kv_buffers_key(layer))
        except UndeclaredArtifactError:
            return None

    def hidden(self, layer: int) -> torch.Tensor:
        """[T-1, hidden_size]: layer ``layer``'s hidden state at positions 0 .. T-2."""
        return self.artifact(hidden_key(layer))

    def attention(self) -> torch.Tensor:
        """[num_query_heads, T-1]: attention of each requested head from position T-2 over 0 .. T-2."""
        return self.artifact(ATTENTION_KEY)


class Drafter(ABC):
    """One drafting mode. ``needs`` says which artifacts the engine must keep for it."""

    name: str = ""
    needs: ArtifactNeeds = ArtifactNeeds()
    proposes: bool = True  # False only for ``ar``: the engine then skips planning altogether
    gated: bool = False
    """Whether the draft gate (``llm_worker.planner.DraftGate``) may skip this drafter's steps:
    drafters that spend real work before the planner sees their draft (a learned network's
    forwards). Copy drafters are left to the acceptance model."""

    @abstractmethod
    def propose(self, ctx: DraftContext) -> Draft:
        """Draft up to ``ctx.budget`` tokens; an empty draft means "decode one token plainly".

        A ``DraftTree`` is verified in one forward with a tree mask, a ``DraftBatch`` as the
        rows of one batched forward (``llm_worker.verify.steps``).
        """

    def observe(self, tree: DraftTree, result: VerifyResult, state: RequestState) -> None:  # noqa: B027 - optional hook
        """Feedback after verification (default: none). ``tree`` is what the verdict is about:
        the part of the proposal the planner kept, or a batch's rows merged into their trie;
        ``state``: the request's, as ``propose`` saw it."""

    candidates: int = 0
    """How many of the target's likeliest next tokens this drafter wants to see at every row of
    every verify forward (``observe_candidates``; 0: none, the engine then computes nothing)."""

    def observe_candidates(self, state: RequestState, rows: ForwardCandidates) -> None:  # noqa: B027 - optional hook
        """After each verify forward of a tree draft (empty drafts too), for a drafter whose
        ``candidates`` is k > 0: the forward's rows (the root, then the draft's nodes), where
        each sits (its parent row, the committed tokens before the root) and the target's k
        likeliest next tokens after each, likeliest first, accepted or not (default: ignored).
        The ids alone: a drafter never sees logits."""

    def finish(self, state: RequestState, tokens: np.ndarray, prompt_length: int) -> None:  # noqa: B027
        """A request that ran to its end: ``tokens`` [T] its prompt and every generated token, the
        first ``prompt_length`` of them the prompt (default: nothing). Drafters that learn from
        what the service said keep them here, in ``state.tenant``'s namespace. A stream closed
        before its end is not reported."""

    def release(self, state: RequestState) -> None:  # noqa: B027 - optional hook
        """The request ended, however it ended (finished, cancelled, failed): drop what it still
        holds outside the worker's memory, e.g. a retrieval in flight (default: nothing). Called
        once, after ``finish`` where there is one."""

    def tensors(self) -> Iterable[torch.Tensor]:
        """The tensors this drafter holds beyond the target's own (a learned drafter's network
        and its fused copy; default: none), which the engine's mode runtimes count against their
        memory budget (``storage_bytes``: drafters that share a network list the same tensors,
        counted once)."""
        return ()


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``: a storage that several tensors view
    counts once (``storage_bytes([w, w[:2], w.T])`` is ``w``'s bytes)."""
    sizes: dict[int, int] = {}
    for t in tensors:
        if t.layout == torch.strided:
            storage = t.untyped_storage()
            sizes[storage.data_ptr()] = storage.nbytes()
        else:  # an opaque layout (a oneDNN-packed weight): its elements
            sizes[id(t)] = t.numel() * t.element_size()
    return sum(sizes.values())


@dataclass(frozen=True)
class DraftResources:
    """What a worker offers drafters beyond the model: a datastore (``datastore_svc.protocols``:
    in process or shards over gRPC), and the caches of dense retrieval (``datastore_svc.cache``:
    statistics, query results; shared through Redis)."""

    datastore: Datastore | None = None
    dense_stats: StatsCache = field(default_factory=lambda: StatsCache(None))
    dense_queries: QueryCache | None = None
    drafters_dir: Path | None = None
    """Where learned drafters' checkpoints are looked for before the shipped ones (worker
    configuration; ``llm_worker.drafters.checkpoint``)."""
    heads_file: Path | None = None
    """The induction-head calibration ``pld+a`` reads (worker configuration, never a request's:
    None = the one shipped or calibrated for the model)."""
    networks: SharedNetworks = field(default_factory=SharedNetworks)
    """Learned drafters' networks loaded from checkpoints, shared by every mode spelling that
    reads one (``glide:window=1000`` and ``glide:window=1001`` hold one network, not two)."""
    suffixes: SuffixStore = field(default_factory=SuffixStore)
    """What ``suffix`` mode learned from finished requests, per tenant, under a bound on stored
    tokens (``llm_worker.drafters.suffix_tree``): shared by every spelling of the mode, kept as
    long as the worker."""
    recycling: RecycleStore = field(default_factory=RecycleStore)
    """Token Recycling's matrices, one per tenant, shared by every spelling of ``recycle``
    (``llm_worker.drafters.recycle_store``; its bound, ``max_tenants``, is worker configuration)."""


class DrafterState:
    """What a drafter keeps for one request (``RequestState.drafter``): a drafter subclasses it
    with its own fields and finds its instance there again on the request's next step (e.g. a
    learned drafter's own KV cache, ``glide._State``)."""


@dataclass
class RequestState:
    """What lives as long as one request (drafters are shared by requests)."""

    datastore_version: str = ""
    """The datastore version the request is pinned to: the one that answered its first
    retrieval ("" until then). Later retrievals ask for it, so a swap never mixes versions."""
    drafter: DrafterState | None = None
    """What the mode's drafter keeps for this request (None until its first step)."""
    tenant: str = ""
    """The namespace of online drafting (``GenerationRequest.tenant``): a drafter that learns
    from requests keeps and drafts from this tenant's text only."""


DrafterFactory = Callable[["TargetModel", dict[str, str], DraftResources], Drafter]


@dataclass(frozen=True)
class DrafterSpec:
    name: str
    summary: str
    factory: DrafterFactory
    options: tuple[str, ...] = ()
    source_options: bool = False
    """The mode runs other modes (``fuse``) and passes them options named ``SOURCE.OPTION``:
    ``fuse:sources=pld.rest:rest.ctx=0`` runs ``rest:ctx=0``."""


def parse_mode(mode: str) -> tuple[str, dict[str, str]]:
    """``"pld+h:layer=12:theta=0.4"`` → ``("pld+h", {"layer": "12", "theta": "0.4"})``; a string
    over ``MAX_MODE_CHARS`` characters is refused before it is split."""
    if len(mode) > MAX_MODE_CHARS:
        raise UnknownModeError(
            f"a mode string has at most {MAX_MODE_CHARS} characters, not {shorten(mode)!r}"
        )
    name, *parts = mode.strip().split(":")
    options: dict[str, str] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise UnknownModeError(f"mode option {shorten(part)!r} in {shorten(mode)!r} is not key=value")
        options[key.strip()] = value.strip()
    return name.strip(), options


def _normal(value: str) -> str:
    """``"01"`` → ``"1"``, ``"0.50"`` → ``"0.5"``; anything else as it is."""
    for kind in (int, float):
        try:
            return str(kind(value))
        except ValueError:
            continue
    return value


def canonical_mode(mode: str) -> str:
    """One spelling per mode: options sorted, numbers normalised.
    ``"pld:max_n=03:min_n=1"`` → ``"pld:max_n=3:min_n=1"``."""
    name, options = parse_mode(mode)
    return ":".join([name, *(f"{k}={_normal(v)}" for k, v in sorted(options.items()))])


class DrafterRegistry:
    def __init__(self) -> None:
        self._specs: dict[str, DrafterSpec] = {}

    def register(
        self, name: str, summary: str, options: tuple[str, ...] = (), source_options: bool = False
    ) -> Callable[[DrafterFactory], DrafterFactory]:
        def add(factory: DrafterFactory) -> DrafterFactory:
            if name in self._specs:
                raise ValueError(f"drafting mode {name!r} registered twice")
            self._specs[name] = DrafterSpec(name, summary, factory, options, source_options)
            return factory

        return add

    @contextmanager
    def registered(
        self, name: str, summary: str, factory: DrafterFactory, options: tuple[str, ...] = ()
    ) -> Iterator[None]:
        """``name`` is a mode inside the ``with`` block only: registered as by ``register`` (a name
        already taken is refused), removed on leaving. For tests and short-lived plug-ins, which
        must not leave modes behind in the global registry."""
        self.register(name, summary, options)(factory)
        try:
            yield
        finally:
            del self._specs[name]

    def names(self) -> list[str]:
        return list(self._specs)

    def spec(self, name: str) -> DrafterSpec:
        try:
            return self._specs[name]
        except KeyError:
            known = ", ".join(self._specs)
            raise UnknownModeError(f"unknown mode {shorten(name)!r}; known modes: {known}") from None

    def check(self, mode: str) -> tuple[DrafterSpec, dict[str, str]]:
        """(spec, options) of ``mode`` if its name is registered and it names only options that
        mode takes, else ``UnknownModeError``; builds nothing and needs no model, so a command can
        refuse a mistyped mode before it loads one. Option values are checked by ``create``.
        Example: ``check("pld:max_n=4")`` → (pld's spec, ``{"max_n": "4"}``); ``check("pld:window=3")``
        → "mode 'pld' takes options [...], not ['window']". A mode with ``source_options`` also takes
        ``SOURCE.OPTION`` for an option of the mode SOURCE: ``check("fuse:rest.ctx=0")`` passes,
        ``check("fuse:rest.window=3")`` → "fuse option 'rest.window': mode 'rest' takes options
        [...], not ['window']"."""
        name, options = parse_mode(mode)
        spec = self.spec(name)
        unknown = set(options) - set(spec.options)
        if spec.source_options:
            for key in sorted(k for k in unknown if "." in k):
                source, _, option = key.partition(".")
                try:
                    self.check(f"{source}:{option}=")
                except UnknownModeError as exc:
                    raise UnknownModeError(f"{name} option {shorten(key)!r}: {exc}") from None
                unknown.discard(key)
        if unknown:
            given = shorten(str(sorted(unknown)))
            raise UnknownModeError(f"mode {name!r} takes options {list(spec.options) or 'none'}, not {given}")
        return spec, options

    def create(self, mode: str, target: TargetModel, resources: DraftResources | None = None) -> Drafter:
        spec, options = self.check(mode)
        name = spec.name
        drafter = spec.factory(target, options, resources or DraftResources())
        drafter.name = name
        try:
            ARTIFACTS.published(target, drafter.needs)
        except ArtifactUnavailableError as exc:
            raise ModeUnavailableError(f"mode {name!r} reads {exc}") from None
        return drafter

    def available(self, target: TargetModel, resources: DraftResources | None = None) -> list[str]:
        """Modes that can run on ``target`` with ``resources``."""
        names = []
        for name in self._specs:
            try:
                self.create(name, target, resources)
            except ModeUnavailableError:
                continue
            names.append(name)
        return names


DRAFTERS = DrafterRegistry()


class NoDrafter(Drafter):
    """``ar``: never drafts; every step decodes one token. The reference for every mode."""

    proposes = False

    def propose(self, ctx: DraftContext) -> DraftTree:
        return DraftTree.empty()


@DRAFTERS.register("ar", "plain autoregressive decoding, the reference")
def _make_ar(target: TargetModel, options: dict[str, str], resources: DraftResources) -> Drafter:
    return NoDrafter()


AFFORDABLE_PRICE = 2.0
"""A tree is kept to nodes whose verify forward costs at most this many plain steps."""


def affordable_nodes(verify_seconds: Callable[[int], float], most: int) -> int:
    """The most draft nodes worth retrieving: ``most``, halved while verifying that many costs
    more than ``AFFORDABLE_PRICE`` plain steps (``verify_seconds(n)``: a forward of the root and
    n draft tokens). The planner then keeps what pays of them; retrieving more costs merging,
    features and planning for nodes it never keeps, and on a CPU whose forward grows with its
    rows it keeps few (``rest``: about 3 a step of 47 proposed, 2026-11-28 log). On a 2-core
    Xeon t(8) = 1.8 plain steps, t(16) = 3.0 → 8 of 64; on a GPU, where 64 rows cost about one
    step, 64.

    Example: prices t(n) = 10 + n ms, most 64 → 64 (74 > 20), 32, 16, 8 (18 ≤ 20) → 8.
    """
    base = verify_seconds(0)
    nodes = most
    while nodes > 1 and verify_seconds(nodes) > AFFORDABLE_PRICE * base:
        nodes //= 2
    return nodes


def int_option(options: dict[str, str], key: str, default: int, lo: int, hi: int) -> int:
    """``options[key]`` as an integer in [lo, hi] (``UnknownModeError`` otherwise), or ``default``."""
    raw = options.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:  # also a number of more than 4 300 digits
        raise UnknownModeError(f"option {key}={shorten(raw)!r} is not an integer") from None
    if not lo <= value <= hi:
        raise UnknownModeError(f"option {key}={shorten(str(value))} is outside [{lo}, {hi}]")
    return value


def float_option(
    options: dict[str, str], key: str, default: OptionT, lo: float, hi: float
) -> float | OptionT:
    """``options[key]`` as a finite number in [lo, hi] (``UnknownModeError`` otherwise: ``nan``
    and ``inf`` parse as floats but are refused), or ``default``."""
    raw = options.get(key)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise UnknownModeError(f"option {key}={shorten(raw)!r} is not a number") from None
    if not math.isfinite(value) or not lo <= value <= hi:
        raise UnknownModeError(f"option {key}={shorten(raw)} is outside [{lo:g}, {hi:g}]")
    return value


def shared_prefix(kept: np.ndarray, tokens: np.ndarray) -> int:
    """How many leading ids ``kept`` and ``tokens`` share: where a drafter's per-request state
    still matches the committed tokens (one vectorised comparison, not a Python loop over a long
    prompt every step). Example: [5, 6, 7] and [5, 6, 9, 1] share 2."""
    n = min(len(kept), len(tokens))
    differ = np.flatnonzero(kept[:n] != tokens[:n])
    return int(differ[0]) if differ.size else n


def bucket(value: float, bounds: tuple[float, ...]) -> str:
    """The first bound ``value`` does not exceed, as a feature label (``"max"`` above them all):
    ``bucket(0.2, (0.1, 0.3))`` → ``"0.3"``."""
    for bound in bounds:
        if value <= bound:
            return f"{bound:g}"
    return "max"
