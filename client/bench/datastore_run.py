"""``specdraft datastore bench``: a version's size and load time, retrieval latency in process,
through shard server processes and with PyPI's draftretriever on the same tokens, dense
retrieval latency, and τ by replaying the target's greedy answers."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from client.bench import datastore as bench
from client.bench.dense import dense_latency, dense_queries, other_model_reason
from datastore_svc.reports import DENSE_FILES, file_bytes
from datastore_svc.store import DatastoreError, DatastoreVersion, LocalRetriever, tokenizer_identity
from llm_worker.assembly import load_engine, load_model
from llm_worker.config import ModelConfig
from specdraft.tokenizer import Tokenizer


class DatastoreBenchError(ValueError):
    """The benchmark cannot run as asked (a missing dense index, references of another shape, ...)."""


@dataclass(frozen=True)
class DatastoreBenchConfig:
    datastore: str
    queries: int = 1000
    grpc: bool = False
    draftretriever: bool = False
    tau: bool = False
    questions: str | None = None
    """Spec-Bench JSONL whose greedy answers ``tau`` replays."""
    references: str | None = None
    """JSON of those answers: read if it exists, else generated (``ar``) and written."""
    max_new_tokens: int = 128
    dense: bool = False


def run_datastore_bench(
    cfg: DatastoreBenchConfig, model: ModelConfig, tokenizer: Tokenizer
) -> dict[str, Any]:
    from llm_worker.drafters.rest import retrieval_config

    try:
        t0 = time.perf_counter()
        DatastoreVersion(cfg.datastore, verify=False)
        open_seconds = time.perf_counter() - t0
        version = DatastoreVersion(cfg.datastore)
    except DatastoreError as exc:
        raise DatastoreBenchError(str(exc)) from exc
    shape = retrieval_config({})
    contexts = bench.query_contexts(tokenizer, cfg.queries, shape.c_max)
    m = version.manifest
    size = sum(f["bytes"] for s in m["shards"] for f in s["files"].values())
    bench.retrieval_latency(LocalRetriever(version), contexts[:50], shape)  # warm-up
    report: dict[str, Any] = {
        "version": version.version,
        "tokens": m["tokens"],
        "shards": version.num_shards,
        "bytes_per_token": round(size / max(m["tokens"], 1), 2),
        "build_seconds": m["build"].get("seconds"),
        "load_seconds": {"mmap": round(open_seconds, 3), "mmap+checksums": round(version.load_seconds, 3)},
        "in_process": bench.retrieval_latency(LocalRetriever(version), contexts, shape),
    }
    dense = _dense_setup(version, model, cfg.queries) if cfg.dense else None
    if dense is not None:
        stats, queries, dense_cfg = dense
        dense_latency(LocalRetriever(version), stats, queries[:50], dense_cfg)  # warm-up
        report["dense"] = {
            "keys": m["dense"]["keys"],
            "dims": stats.dims,
            "index": m["dense"]["index"],
            "bytes_per_key": round(file_bytes(m, DENSE_FILES) / max(int(m["dense"]["keys"]), 1), 2),
            "build_seconds": m["dense"].get("seconds"),
            "in_process": dense_latency(LocalRetriever(version), stats, queries, dense_cfg),
        }
    if cfg.grpc:
        report["grpc"] = grpc_latency(cfg.datastore, contexts, shape, dense)
        if dense is not None:
            report["dense"]["grpc"] = report["grpc"].pop("dense")
    runs = tau_references(cfg, model, tokenizer) if cfg.tau else []
    if cfg.tau:
        report["tau"] = {"references": {"runs": len(runs), "tokens": sum(len(r.reference) for r in runs)}}
        shapes = {"specdraft": shape, "specdraft_l4": dataclasses.replace(shape, max_length=4)}
        vocab = len(tokenizer)  # above every token id: the separator of the context's own index
        for name, each in shapes.items():  # L = 4: draftretriever's depth
            for suffix, fuse in (("", vocab), ("_corpus_only", None)):  # rest (ctx=1) and rest:ctx=0
                stats = bench.replay_tau(runs, bench.specdraft_proposer(LocalRetriever(version), each, fuse))
                report["tau"][name + suffix] = stats.to_json()
    if cfg.draftretriever:
        report.update(_draftretriever(version, contexts, runs if cfg.tau else None, report.get("tau")))
    return report


def _draftretriever(
    version: DatastoreVersion, contexts: list[Any], runs: list[Any] | None, tau: dict[str, Any] | None
) -> dict[str, Any]:
    tokens = [s.tokens for s in version.shards]
    with tempfile.TemporaryDirectory() as tmp:
        index = Path(tmp) / "draftretriever.idx"
        built = bench.build_draftretriever(tokens, version.shards[0].separator, index)
        searcher = bench.DraftRetrieverSearch(index)
        latency = bench.draftretriever_latency(searcher, contexts)
        out = {"draftretriever": {**built, "load_seconds": round(searcher.load_seconds, 3), **latency}}
        if runs is not None and tau is not None:
            for name, span in (("draftretriever", 16), ("draftretriever_last2", 2)):
                fresh = bench.DraftRetrieverSearch(index, span)  # its searches change its table
                tau[name] = bench.replay_tau(runs, bench.draftretriever_proposer(fresh)).to_json()
    return out


def _dense_setup(version: DatastoreVersion, model: ModelConfig, count: int) -> tuple[Any, Any, Any]:
    """(statistics, queries from the suite's prompts, the dresd draft shape)."""
    from llm_worker.drafters.dresd import dense_config

    if version.dense_stats is None:
        raise DatastoreBenchError(f"{version.path} has no dense index (build it with --dense)")
    target, tokenizer = load_model(dataclasses.replace(model, backend="hf"))
    reason = other_model_reason(version, target)
    if reason:
        raise DatastoreBenchError(reason)
    queries = dense_queries(target.model, tokenizer, count)
    return version.dense_stats, queries, dense_config({}, 3, 10)


def tau_references(cfg: DatastoreBenchConfig, model: ModelConfig, tokenizer: Tokenizer) -> list[Any]:
    """The target's greedy answers to ``cfg.questions``: from ``cfg.references`` if it exists,
    else generated (mode ``ar``) and saved there."""
    from client.bench.suite import load_questions

    fingerprint = tokenizer_identity(tokenizer)["fingerprint"]
    if cfg.references and Path(cfg.references).exists():
        try:
            meta, runs = bench.load_references(cfg.references)
        except (OSError, ValueError) as exc:
            raise DatastoreBenchError(str(exc)) from exc
        if meta.get("tokenizer_fingerprint") != fingerprint:
            raise DatastoreBenchError(f"{cfg.references} was generated with another tokenizer")
        if meta.get("max_new_tokens") != cfg.max_new_tokens:
            raise DatastoreBenchError(
                f"{cfg.references} holds answers of {meta.get('max_new_tokens')} new tokens"
            )
        return runs
    if not cfg.questions:
        raise DatastoreBenchError("--tau needs --questions (or an existing --references file)")
    try:
        questions = load_questions(cfg.questions)
    except (OSError, ValueError) as exc:
        raise DatastoreBenchError(str(exc)) from exc
    engine, target, _ = load_engine(model)
    entries = bench.greedy_references(engine, tokenizer, questions, cfg.max_new_tokens)
    if cfg.references:
        meta = {
            "model": target.info.name,
            "model_fingerprint": target.info.fingerprint,
            "tokenizer_fingerprint": fingerprint,
            "questions": cfg.questions,
            "max_new_tokens": cfg.max_new_tokens,
        }
        bench.save_references(cfg.references, entries, meta)
    return [run for _, _, run in entries]


def grpc_latency(path: str, contexts: list[Any], shape: Any, dense: Any = None) -> dict[str, Any]:
    """Start the version's shard servers as the local stack does, time retrievals through them
    (sparse, and dense too when ``dense`` = (statistics, queries, shape))."""
    from client.stack import StackConfig, StackError, StackState, start_shards, stop_processes, wait_serving
    from datastore_svc.fanout import RemoteDatastore

    stack = StackConfig(datastore=path, datastore_port=0)
    with tempfile.TemporaryDirectory(prefix="specdraft-bench-shards-") as tmp:
        state = StackState()
        try:
            start_shards(stack, state, Path(tmp), Path(tmp))
            wait_serving(state.shards(), 300.0)
        except StackError as exc:
            stop_processes(state.processes, grace_seconds=0.0)
            raise DatastoreBenchError(str(exc)) from exc
        shards = state.shards()
        try:
            remote = RemoteDatastore([p.address for p in shards], deadline_seconds=2.0)
            bench.retrieval_latency(remote, contexts[:50], shape)  # warm the channels
            result: dict[str, Any] = bench.retrieval_latency(remote, contexts, shape)
            result["failures"] = sum(remote.failures.values())
            if dense is not None:
                stats, queries, dense_cfg = dense
                dense_latency(remote, stats, queries[:50], dense_cfg)
                before = sum(remote.failures.values())
                result["dense"] = dense_latency(remote, stats, queries, dense_cfg)
                result["dense"]["failures"] = sum(remote.failures.values()) - before
            remote.close()
            return result
        finally:
            stop_processes(shards, grace_seconds=0.0)
