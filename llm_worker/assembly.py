"""Assembling a worker: the model, the datastore it drafts from, the dense caches, the engine.

One composition root for the CLI (``specdraft generate``, ``serve worker``, ``bench``, ...), the
server and the benchmarks: each builds a ``ModelConfig`` and a ``ResourceConfig`` and calls
``load_engine``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from datastore_svc.protocols import Datastore
from llm_worker.config import EngineConfig, ModelConfig
from llm_worker.drafters import DraftResources
from llm_worker.drafters.recycle_store import RECYCLE_MAX_TENANTS, RecycleStore
from llm_worker.drafters.suffix_tree import SUFFIX_MAX_TOKENS, SuffixStore
from llm_worker.engine import Engine
from llm_worker.model import load_target
from llm_worker.model.loading import ModelNotFoundError, quiet_libraries
from llm_worker.model.target import TargetModel
from specdraft.security import ClientSecurity
from specdraft.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class AssemblyError(ValueError):
    """The configuration cannot be assembled (a missing model, a bad datastore, both a local and
    a remote datastore, ...); the message says which and why."""


@dataclass(frozen=True)
class ResourceConfig:
    """What a worker drafts from beyond the model (``DraftResources``)."""

    datastore_path: str | None = None
    """A datastore version directory, opened in this process."""
    datastore_addresses: tuple[str, ...] = ()
    """HOST:PORT of each datastore shard server (a remote fan-out)."""
    datastore_deadline_seconds: float = 0.02
    """Per-shard deadline of one remote retrieval."""
    dense_cache_url: str | None = None
    """redis://HOST:PORT[/DB] caching dense statistics and query results, shared by workers."""
    dense_cache_ttl_seconds: int = 600
    dense_cache_context_tokens: int = 0
    """Key cached dense queries by the last N context tokens (0 = the whole context)."""
    device: str = "cpu"
    """The model's device: dense search runs on its GPU when faiss-gpu is installed."""
    datastore_security: ClientSecurity = field(default_factory=ClientSecurity)
    """TLS, client certificate and token for the shards (``specdraft.security``)."""
    heads_file: str | None = None
    """The induction-head calibration of ``pld+a`` (None = the one shipped for the model)."""
    drafters_dir: str | None = None
    """Learned drafters' checkpoints (``glide.json``, ...) looked for before the shipped ones."""
    suffix_max_tokens: int = SUFFIX_MAX_TOKENS
    """Tokens ``suffix`` mode keeps of finished requests, over all tenants (``SuffixStore``)."""
    recycle_max_tenants: int = RECYCLE_MAX_TENANTS
    """Token Recycling matrices kept, one per tenant (``RecycleStore``)."""
    recycle_seed: str | None = None
    """A file of rows every tenant's ``recycle`` starts from (``recycle_seed``); None: empty rows."""


def load_model(cfg: ModelConfig) -> tuple[TargetModel, Tokenizer]:
    """(target, tokenizer); AssemblyError for a missing model or an impossible configuration."""
    quiet_libraries()
    try:
        return load_target(cfg)
    except (ModelNotFoundError, ValueError) as exc:
        raise AssemblyError(str(exc)) from exc


def _recycle_store(cfg: ResourceConfig, tokenizer: Tokenizer | None, vocab: int | None) -> RecycleStore:
    """``recycle``'s rows under ``cfg``'s bound, seeded from ``cfg.recycle_seed`` when it names one
    (AssemblyError for a seed that cannot be used: unreadable, another tokenizer's, another shape)."""
    if cfg.recycle_seed is None:
        return RecycleStore(cfg.recycle_max_tenants)
    from datastore_svc.store import tokenizer_identity
    from llm_worker.drafters.recycle_seed import SeedError, load_seed

    fingerprint = None if tokenizer is None else tokenizer_identity(tokenizer)["fingerprint"]
    store = RecycleStore(cfg.recycle_max_tenants)
    try:
        seed, info = load_seed(cfg.recycle_seed, fingerprint, store.k, store.context_slots, vocab)
    except SeedError as exc:
        raise AssemblyError(str(exc)) from exc
    log.info(
        "recycle rows seeded from %s (%d conversations, %d positions)",
        cfg.recycle_seed,
        info.conversations,
        info.tokens,
    )
    return RecycleStore(cfg.recycle_max_tenants, store.k, store.context_slots, seed)


def build_resources(
    cfg: ResourceConfig, tokenizer: Tokenizer | None, vocab: int | None = None
) -> DraftResources:
    """The datastore (local or remote) and the dense caches of ``cfg`` (none of them when
    ``cfg`` names no datastore), and the online stores of ``suffix`` and ``recycle`` under
    ``cfg``'s bounds (``vocab``: the model's, which a ``recycle`` seed must have)."""
    if cfg.datastore_path and cfg.datastore_addresses:
        raise AssemblyError("give --datastore or --datastore-addr, not both")
    suffixes, recycling = SuffixStore(cfg.suffix_max_tokens), _recycle_store(cfg, tokenizer, vocab)
    datastore: Datastore | None = None
    if cfg.datastore_path:
        from datastore_svc.dense import faiss_gpus
        from datastore_svc.store import DatastoreError, DatastoreVersion, LocalRetriever, tokenizer_identity

        gpu = None  # dense search on the model's GPU when faiss-gpu is installed, else on the CPU
        if cfg.device.startswith("cuda") and faiss_gpus() > 0:
            gpu = int(cfg.device.split(":")[1]) if ":" in cfg.device else 0
        fingerprint = None if tokenizer is None else tokenizer_identity(tokenizer)["fingerprint"]
        try:
            version = DatastoreVersion(cfg.datastore_path, tokenizer_fingerprint=fingerprint, faiss_gpu=gpu)
        except DatastoreError as exc:
            raise AssemblyError(str(exc)) from exc
        datastore = LocalRetriever(version)
    elif cfg.datastore_addresses:
        from datastore_svc.fanout import RemoteDatastore
        from datastore_svc.store import tokenizer_identity

        remote = RemoteDatastore(
            list(cfg.datastore_addresses),
            deadline_seconds=cfg.datastore_deadline_seconds,
            security=cfg.datastore_security,
            tokenizer_fingerprint=tokenizer_identity(tokenizer)["fingerprint"]
            if tokenizer is not None
            else "",
        )
        foreign, silent = remote.check_tokenizers()
        if foreign:
            remote.close()
            raise AssemblyError(
                f"the datastore shards at {', '.join(foreign)} serve a datastore built with another "
                "tokenizer than this model's: rebuild it with this model's tokenizer, or use other shards"
            )
        if silent:  # they may still be starting: checked again as they answer (``current_version``)
            log.warning("datastore shards not answering yet, tokenizer not checked: %s", ", ".join(silent))
        datastore = remote
    heads = Path(cfg.heads_file) if cfg.heads_file else None
    if heads is not None and not heads.is_file():
        raise AssemblyError(f"--heads-file {heads} is not a file")
    drafters = Path(cfg.drafters_dir) if cfg.drafters_dir else None
    if drafters is not None and not drafters.is_dir():
        raise AssemblyError(f"--drafters-dir {drafters} is not a directory")
    if datastore is None:
        return DraftResources(heads_file=heads, drafters_dir=drafters, suffixes=suffixes, recycling=recycling)
    from datastore_svc.cache import QueryCache, StatsCache, link_for

    try:
        link = link_for(cfg.dense_cache_url)
    except ValueError as exc:
        raise AssemblyError(str(exc)) from exc
    queries = (
        QueryCache(link, ttl=cfg.dense_cache_ttl_seconds, context_window=cfg.dense_cache_context_tokens)
        if link is not None
        else None
    )
    return DraftResources(
        datastore,
        dense_stats=StatsCache(link),
        dense_queries=queries,
        heads_file=heads,
        drafters_dir=drafters,
        suffixes=suffixes,
        recycling=recycling,
    )


def load_engine(
    model: ModelConfig, resources: ResourceConfig | None = None, config: EngineConfig | None = None
) -> tuple[Engine, TargetModel, Tokenizer]:
    """(engine, target, tokenizer): the model of ``model`` drafting from ``resources``, its decode
    loop configured by ``config`` (None: the defaults)."""
    target, tokenizer = load_model(model)
    return (
        Engine(
            target,
            config,
            resources=build_resources(resources or ResourceConfig(), tokenizer, target.info.vocab_size),
        ),
        target,
        tokenizer,
    )


def load_tokenizer(model_path: str | None) -> tuple[Tokenizer, Path]:
    """(tokenizer, model directory) of ``model_path`` (None: the default model), without the
    weights."""
    quiet_libraries()
    from transformers import AutoTokenizer

    from llm_worker.model.loading import resolve_model_dir

    try:
        path = resolve_model_dir(model_path)
    except ModelNotFoundError as exc:
        raise AssemblyError(str(exc)) from exc
    # a transformers tokenizer is a Tokenizer at run time; its methods are typed for more calls
    return cast(Tokenizer, AutoTokenizer.from_pretrained(path)), path
