"""``specdraft``: the command line. A stable contract — tests and users script against it.

Commands that decode in process (``generate`` without a server, ``bench``,
``calibrate-heads``) load ``llm_worker`` lazily, so the client package itself depends on
nothing of ours.

Exit codes: 0 success, 2 bad input (unknown mode, bad option, prompt too long, ...), 1 other
failures. Errors go to stderr as one line ``specdraft: error: ...``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Literal

from specdraft.common import atomic_write_text

EXIT_BAD_INPUT = 2


class CliError(Exception):
    """A user error with a message worth printing as is."""


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors follow the contract: one line, exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"specdraft: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(EXIT_BAD_INPUT)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model", default=None, help="Hugging Face model directory (default: SmolLM2-135M-Instruct)"
    )
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1")
    g.add_argument(
        "--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    g.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "fast", "hf"],
        help="fast Llama-family forward or transformers'",
    )
    g.add_argument(
        "--kernel",
        default="auto",
        help="fast backend GEMM kernel, LIBRARY:MIN_ROWS (aten or onednn); auto: the fastest of those "
        "checked batch-invariant on this machine",
    )


def _load_model(args: argparse.Namespace, backend: Literal["hf"] | None = None) -> tuple[Any, Any]:
    """(target, tokenizer) from the model arguments; ``backend`` overrides --backend (the dense
    build reads hidden states through transformers' batched forward)."""
    _quiet_libraries()
    from llm_worker.config import ModelConfig
    from llm_worker.model import load_target
    from llm_worker.model.loading import ModelNotFoundError

    cfg = ModelConfig(
        path=args.model,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        backend=backend or args.backend,
        kernel=args.kernel,
    )
    try:
        return load_target(cfg)
    except (ModelNotFoundError, ValueError) as exc:
        raise CliError(str(exc)) from exc


def _load(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    from llm_worker.engine import Engine

    target, tokenizer = _load_model(args)
    return Engine(target, resources=_resources(args, tokenizer)), target, tokenizer


def _check_dense_model(version: Any, target: Any) -> None:
    """Refuse a dense version whose keys are another model's hidden states."""
    if version.dense_model and version.dense_model != target.info.weights_id:
        raise CliError(f"{version.path}: dense keys of another model than {target.info.name}")


def _add_datastore_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("datastore (for rest)")
    g.add_argument("--datastore", help="a datastore version directory, loaded in this process")
    g.add_argument("--datastore-addr", help="HOST:PORT[,HOST:PORT...] of datastore shards, one per shard")
    g.add_argument(
        "--datastore-deadline-ms", type=float, default=20.0, help="per-shard deadline of a remote retrieval"
    )
    g.add_argument(
        "--dense-cache",
        help="redis://HOST:PORT[/DB] caching dense statistics and query results (dresd), shared by workers",
    )
    g.add_argument("--dense-cache-ttl", type=int, default=600, help="seconds a cached dense query lives")
    g.add_argument(
        "--dense-cache-context",
        type=int,
        default=0,
        help="key cached dense queries by the last N context tokens (0 = the whole context)",
    )


def _resources(args: argparse.Namespace, tokenizer: Any) -> Any:
    from llm_worker.drafters import DraftResources

    path, addr = getattr(args, "datastore", None), getattr(args, "datastore_addr", None)
    if path and addr:
        raise CliError("give --datastore or --datastore-addr, not both")
    retriever: Any = None
    if path:
        from datastore_svc.store import DatastoreError, DatastoreVersion, LocalRetriever, tokenizer_identity

        try:
            from datastore_svc.dense import faiss_gpus

            device = getattr(args, "device", "cpu") or "cpu"
            gpu = None  # dense search on the model's GPU when faiss-gpu is installed, else on the CPU
            if device.startswith("cuda") and faiss_gpus() > 0:
                gpu = int(device.split(":")[1]) if ":" in device else 0
            version = DatastoreVersion(
                path, tokenizer_fingerprint=tokenizer_identity(tokenizer)["fingerprint"], faiss_gpu=gpu
            )
        except DatastoreError as exc:
            raise CliError(str(exc)) from exc
        retriever = LocalRetriever(version)
    elif addr:
        from datastore_svc.fanout import RemoteDatastore

        addresses = [a.strip() for a in addr.split(",") if a.strip()]
        retriever = RemoteDatastore(addresses, deadline=args.datastore_deadline_ms / 1000.0)
    if retriever is None:
        return DraftResources()
    from datastore_svc.cache import QueryCache, StatsCache, link_for

    try:
        link = link_for(getattr(args, "dense_cache", None))
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    queries = (
        QueryCache(link, ttl=args.dense_cache_ttl, context_window=args.dense_cache_context)
        if link is not None
        else None
    )
    return DraftResources(retriever, dense_stats=StatsCache(link), dense_queries=queries)


# -- generate ------------------------------------------------------------------------------


def _cmd_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        raise CliError("the prompt is empty")
    if args.registry and not args.server:
        args.server = _discover(args.registry, args.mode)
    if args.server:
        return _generate_remote(args, prompt)
    engine, _target, tokenizer = _load(args)
    from llm_worker.chat import chat_prompt_ids, prompt_ids
    from llm_worker.config import SamplingParams
    from llm_worker.drafters import ModeUnavailableError, UnknownModeError
    from llm_worker.engine import GenerationRequest, GenerationResult, InvalidRequestError, StepOutput

    try:
        ids = (
            chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
            if args.chat
            else prompt_ids(tokenizer, prompt)
        )
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
        req = GenerationRequest(tuple(ids), args.max_new_tokens, args.mode, sampling)
        stream_to = sys.stderr if args.json else sys.stdout
        result = None
        emitted: list[int] = []
        printed = ""
        for item in engine.stream(req):
            if isinstance(item, StepOutput) and args.stream:
                emitted.extend(item.token_ids)
                text = tokenizer.decode(emitted, skip_special_tokens=True)
                stream_to.write(text[len(printed) :])
                stream_to.flush()
                printed = text
            elif isinstance(item, GenerationResult):
                result = item
    except (UnknownModeError, ModeUnavailableError, InvalidRequestError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    assert result is not None
    text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    if args.json:
        if args.stream:
            sys.stderr.write("\n")
        payload = {
            "text": text,
            "token_ids": result.token_ids,
            "mode": result.mode,
            "finish_reason": result.finish_reason,
            "prompt_tokens": len(ids),
            "stats": result.stats.to_json(),
            "provenance": [span.to_json() for span in result.provenance],
        }
        if result.datastore_version:
            payload["datastore_version"] = result.datastore_version
        sys.stdout.write(json.dumps(payload) + "\n")
    elif args.stream:
        sys.stdout.write("\n")
    else:
        sys.stdout.write(text + "\n")
    return 0


def _discover(url: str, mode: str) -> str:
    from llm_worker.registry import discover, open_registry

    try:
        addresses = discover(open_registry(url), mode)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    except Exception as exc:  # the registry itself is unreachable
        sys.stderr.write(f"specdraft: error: registry {url} unreachable: {exc}\n")
        raise SystemExit(1) from exc
    if not addresses:
        raise CliError(f"no live worker in {url} serves mode {mode!r}")
    return ",".join(addresses)


def _generate_remote(args: argparse.Namespace, prompt: str) -> int:
    """``generate --server``: the same request and the same output, through a worker."""
    import grpc

    from client.grpc_client import GenerationClient, RequestOptions, build_request, response_to_json

    options = RequestOptions(
        mode=args.mode,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    request = (
        build_request(chat=[("user", prompt)], options=options)
        if args.chat
        else build_request(text=prompt, options=options)
    )
    addresses = [a.strip() for a in args.server.split(",") if a.strip()]
    stream_to = sys.stderr if args.json else sys.stdout
    with GenerationClient(addresses, timeout=args.timeout) as client:
        try:
            if args.stream:
                final = None
                for chunk in client.generate_stream(request):
                    if chunk.HasField("final"):
                        final = chunk.final
                    elif chunk.text:
                        stream_to.write(chunk.text)
                        stream_to.flush()
                stream_to.write("\n")
                assert final is not None, "the stream ended without a final message"
                response = final
            else:
                response = client.generate(request)
        except grpc.RpcError as exc:
            code = exc.code()
            message = f"{code.name}: {exc.details()}"
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise CliError(message) from None
            sys.stderr.write(f"specdraft: error: {message}\n")
            return 1
    if args.json:
        sys.stdout.write(json.dumps(response_to_json(response)) + "\n")
    elif not args.stream:
        sys.stdout.write(response.text + "\n")
    return 0


# -- serve ---------------------------------------------------------------------------------


def _cmd_serve_worker(args: argparse.Namespace) -> int:
    engine, _, tokenizer = _load(args)
    from llm_worker.server import ServerConfig, serve_forever
    from llm_worker.worker import Worker

    worker = Worker(
        engine, tokenizer, worker_id=args.worker_id, default_max_new_tokens=args.default_max_new_tokens
    )
    if args.warm:
        engine.cost_curve  # measure (or load) the verify cost curve before taking traffic  # noqa: B018
    from llm_worker.registry import open_registry

    cfg = ServerConfig(
        host=args.host,
        port=args.port,
        max_concurrent=args.max_concurrent,
        grace_seconds=args.grace_seconds,
        metrics_port=args.metrics_port,
        advertise=args.advertise,
    )
    try:
        registry = open_registry(args.registry, ttl=args.registry_ttl) if args.registry else None
    except ValueError as exc:
        raise CliError(str(exc)) from exc

    def ready(port: int) -> None:
        sys.stderr.write(f"specdraft worker {worker.worker_id} listening on {args.host}:{port}\n")
        sys.stderr.flush()

    serve_forever(worker, cfg, ready, registry)
    return 0


# -- datastore -------------------------------------------------------------------------------


def _load_tokenizer(args: argparse.Namespace) -> Any:
    _quiet_libraries()
    from transformers import AutoTokenizer

    from llm_worker.model.loading import ModelNotFoundError, resolve_model_dir

    try:
        path = resolve_model_dir(args.model)
    except ModelNotFoundError as exc:
        raise CliError(str(exc)) from exc
    return AutoTokenizer.from_pretrained(path), path


def _dense_step(args: argparse.Namespace) -> tuple[Any, Any, Path]:
    """(the build step adding the dense index, the model's tokenizer, the model directory)."""
    from datastore_svc.dense import IndexParams
    from datastore_svc.dense_build import DenseBuildConfig, dense_step
    from llm_worker.model.loading import resolve_model_dir

    target, tokenizer = _load_model(args, "hf")
    model_dir = resolve_model_dir(args.model)
    try:
        cfg = DenseBuildConfig(
            dims=args.pca_dims,
            index=args.index,
            params=IndexParams(hnsw_m=args.hnsw_m, ivf_lists=args.ivf_lists, pq_bytes=args.pq_bytes),
            window=args.window,
            overlap=min(64, args.window // 4) if args.overlap is None else args.overlap,
            batch=args.batch,
            sample=args.stats_sample,
            cache_dir=Path(args.hidden_cache) if args.hidden_cache else None,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    info = target.info
    return dense_step(target.model, info.name, info.weights_id, cfg, not args.quiet), tokenizer, model_dir


def _cmd_datastore_build(args: argparse.Namespace) -> int:
    from datastore_svc.corpus import CorpusError
    from datastore_svc.dense import DenseError
    from datastore_svc.store import (
        DatastoreError,
        DatastoreVersion,
        build,
        derive_version,
        read_manifest,
        tokenizer_identity,
    )

    if args.source and not args.dense:
        raise CliError("--from adds a dense index to an existing version's tokens: add --dense")
    if bool(args.source) == bool(args.corpus):
        raise CliError("give --corpus FILE (a new version) or --from VERSION --dense (a dense rebuild)")
    if args.corpus and not Path(args.corpus).is_file():
        raise CliError(f"corpus {args.corpus} does not exist")
    extend = None
    if args.dense:
        extend, tokenizer, model_dir = _dense_step(args)
    else:
        tokenizer, model_dir = _load_tokenizer(args)
    t0 = time.perf_counter()
    try:
        if args.source:
            assert extend is not None  # --from needs --dense (checked above)
            fingerprint = tokenizer_identity(tokenizer)["fingerprint"]
            if read_manifest(Path(args.source))["tokenizer"].get("fingerprint") != fingerprint:
                raise CliError(f"{args.source} was built with another tokenizer than {model_dir}'s")
            derive_version(args.source, args.out, extend)
        else:
            build(args.corpus, tokenizer, args.out, args.shards, str(model_dir), not args.quiet, extend)
        version = DatastoreVersion(args.out, verify=False)
    except (DatastoreError, CorpusError, DenseError) as exc:
        raise CliError(str(exc)) from exc
    m = version.manifest
    seconds = time.perf_counter() - t0
    files = [e["files"] for e in m["shards"]]
    sparse_bytes = sum(f[n]["bytes"] for f in files for n in f if n in ("tokens.npy", "sa.npy", "docs.npy"))
    payload: dict[str, Any] = {
        "path": str(version.path),
        "version": version.version,
        "documents": m.get("documents"),
        "tokens": m.get("tokens"),
        "shards": version.num_shards,
        "seconds": round(seconds, 3),
        "build_seconds": m["build"].get("seconds"),
        "tokens_per_second": round(int(m.get("tokens", 0)) / max(seconds, 1e-9), 1),
        "bytes": sparse_bytes,
        "bytes_per_token": round(sparse_bytes / max(int(m.get("tokens", 0)), 1), 2),
    }
    if "dense" in m:
        dense = m["dense"]
        dense_bytes = sum(f[n]["bytes"] for f in files for n in f if n in ("dense.faiss", "positions.npy"))
        payload["dense"] = {
            "keys": dense["keys"],
            "dims": dense["dims"],
            "index": dense["index"],
            "seconds": dense["seconds"],
            "chunks": dense["chunks"],
            "bytes": dense_bytes,
            "bytes_per_key": round(dense_bytes / max(dense["keys"], 1), 2),
        }
        if args.redis and version.dense_stats is not None:
            from datastore_svc.cache import StatsCache, link_for

            try:
                published = StatsCache(link_for(args.redis)).publish(version.version, version.dense_stats)
            except ValueError as exc:
                raise CliError(str(exc)) from exc
            payload["dense"]["published_to_redis"] = published
    sys.stdout.write(json.dumps(payload) + "\n")
    return 0


def _cmd_datastore_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from datastore_svc.selfgen import generate_corpus, read_prompts
    from llm_worker.chat import chat_prompt_ids, prompt_ids
    from llm_worker.engine import GenerationRequest

    try:
        prompts = list(read_prompts(args.prompts))
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    if args.limit:
        prompts = prompts[: args.limit]
    engine, _target, tokenizer = _load(args)
    engine.runtime(args.mode)  # unknown or unavailable mode: fail before any work

    def answer(messages: list[dict[str, str]]) -> str:
        if getattr(tokenizer, "chat_template", None):
            ids = chat_prompt_ids(tokenizer, messages)
        else:  # a base model: the conversation as plain text (as `datastore build` renders it)
            ids = prompt_ids(tokenizer, "\n\n".join(m["content"] for m in messages))
        result = engine.generate(GenerationRequest(tuple(ids), args.max_new_tokens, args.mode))
        return str(tokenizer.decode(result.token_ids, skip_special_tokens=True))

    with tqdm(total=len(prompts), desc="answers", unit="prompt", disable=args.quiet) as bar:
        counts = generate_corpus(prompts, answer, args.out, progress=bar.update)
    sys.stdout.write(json.dumps({"out": args.out, **counts}) + "\n")
    return 0


def _cmd_datastore_local_corpus(args: argparse.Namespace) -> int:
    from client.bench.datastore import code_questions, local_corpus

    counts = local_corpus(args.out, args.max_chars)
    if args.questions_out:
        counts["questions"] = code_questions(args.questions_out, args.questions)
    sys.stdout.write(json.dumps({"out": args.out, **counts}) + "\n")
    return 0


def _cmd_datastore_bench(args: argparse.Namespace) -> int:
    import time

    from client.bench.datastore import query_contexts, retrieval_latency
    from datastore_svc.store import DatastoreError, DatastoreVersion, LocalRetriever
    from llm_worker.drafters.rest import retrieval_config

    tokenizer, _ = _load_tokenizer(args)
    try:
        t0 = time.perf_counter()
        DatastoreVersion(args.datastore, verify=False)
        open_seconds = time.perf_counter() - t0
        version = DatastoreVersion(args.datastore)
    except DatastoreError as exc:
        raise CliError(str(exc)) from exc
    cfg = retrieval_config({})
    contexts = query_contexts(tokenizer, args.queries, cfg.c_max)
    m = version.manifest
    size = sum(f["bytes"] for s in m["shards"] for f in s["files"].values())
    report: dict[str, Any] = {
        "version": version.version,
        "tokens": m["tokens"],
        "shards": version.num_shards,
        "bytes_per_token": round(size / max(m["tokens"], 1), 2),
        "build_seconds": m["build"].get("seconds"),
        "load_seconds": {"mmap": round(open_seconds, 3), "mmap+checksums": round(version.load_seconds, 3)},
        "in_process": retrieval_latency(LocalRetriever(version), contexts[:50], cfg),  # warm-up
    }
    report["in_process"] = retrieval_latency(LocalRetriever(version), contexts, cfg)
    dense = _dense_bench_setup(args, version) if args.dense else None
    if dense is not None:
        from client.bench.dense import dense_latency

        stats, queries, dense_cfg = dense
        dense_latency(LocalRetriever(version), stats, queries[:50], dense_cfg)  # warm-up
        report["dense"] = {
            "keys": m["dense"]["keys"],
            "dims": stats.dims,
            "index": m["dense"]["index"],
            "bytes_per_key": round(_dense_bytes(m) / max(int(m["dense"]["keys"]), 1), 2),
            "build_seconds": m["dense"].get("seconds"),
            "in_process": dense_latency(LocalRetriever(version), stats, queries, dense_cfg),
        }
    if args.grpc:
        report["grpc"] = _grpc_latency(args.datastore, contexts, cfg, dense)
        if dense is not None:
            report["dense"]["grpc"] = report["grpc"].pop("dense")
    runs = _tau_references(args, tokenizer) if args.tau else []
    if args.tau:
        import dataclasses

        from client.bench.datastore import replay_tau, specdraft_proposer

        report["tau"] = {"references": {"runs": len(runs), "tokens": sum(len(r.reference) for r in runs)}}
        shapes = {"specdraft": cfg, "specdraft_l4": dataclasses.replace(cfg, max_length=4)}
        vocab = len(tokenizer)  # above every token id: the separator of the context's own index
        for name, shape in shapes.items():  # L = 4: draftretriever's depth
            for suffix, fuse in (("", vocab), ("_corpus_only", None)):  # rest (ctx=1) and rest:ctx=0
                stats = replay_tau(runs, specdraft_proposer(LocalRetriever(version), shape, fuse))
                report["tau"][name + suffix] = stats.to_json()
    if args.draftretriever:
        import tempfile

        from client.bench import datastore as bench

        tokens = [s.tokens for s in version.shards]
        with tempfile.TemporaryDirectory() as tmp:
            index = Path(tmp) / "draftretriever.idx"
            built = bench.build_draftretriever(tokens, version.shards[0].separator, index)
            searcher = bench.DraftRetrieverSearch(index)
            latency = bench.draftretriever_latency(searcher, contexts)
            report["draftretriever"] = {**built, "load_seconds": round(searcher.load_seconds, 3), **latency}
            for name, span in (("draftretriever", 16), ("draftretriever_last2", 2)) if args.tau else ():
                fresh = bench.DraftRetrieverSearch(index, span)  # its searches change its table
                stats = bench.replay_tau(runs, bench.draftretriever_proposer(fresh))
                report["tau"][name] = stats.to_json()
    sys.stdout.write(json.dumps(report) + "\n")
    if args.json_out:
        atomic_write_text(Path(args.json_out), json.dumps(report, indent=1) + "\n")
    return 0


def _dense_bytes(manifest: dict[str, Any]) -> int:
    names = ("dense.faiss", "positions.npy")
    return sum(f["bytes"] for s in manifest["shards"] for n, f in s["files"].items() if n in names)


def _dense_bench_setup(args: argparse.Namespace, version: Any) -> tuple[Any, Any, Any]:
    """(statistics, queries from the suite's prompts, the dresd draft shape) for --dense."""
    from client.bench.dense import dense_queries
    from llm_worker.drafters.dresd import dense_config

    if version.dense_stats is None:
        raise CliError(f"{version.path} has no dense index (build it with --dense)")
    target, tokenizer = _load_model(args, "hf")
    _check_dense_model(version, target)
    queries = dense_queries(target.model, tokenizer, args.queries)
    return version.dense_stats, queries, dense_config({}, 3, 10)


def _tau_references(args: argparse.Namespace, tokenizer: Any) -> list[Any]:
    """The target's greedy answers to --questions: from --references if it exists, else generated
    (mode ``ar``) and saved there."""
    from client.bench.datastore import greedy_references, load_references, save_references
    from client.bench.suite import load_questions
    from datastore_svc.store import tokenizer_identity

    fingerprint = tokenizer_identity(tokenizer)["fingerprint"]
    if args.references and Path(args.references).exists():
        try:
            meta, runs = load_references(args.references)
        except (OSError, ValueError) as exc:
            raise CliError(str(exc)) from exc
        if meta.get("tokenizer_fingerprint") != fingerprint:
            raise CliError(f"{args.references} was generated with another tokenizer")
        if meta.get("max_new_tokens") != args.max_new_tokens:
            raise CliError(f"{args.references} holds answers of {meta.get('max_new_tokens')} new tokens")
        return runs
    if not args.questions:
        raise CliError("--tau needs --questions (or an existing --references file)")
    try:
        questions = load_questions(args.questions)
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    engine, target, _ = _load(args)
    entries = greedy_references(engine, tokenizer, questions, args.max_new_tokens)
    if args.references:
        meta = {
            "model": target.info.name,
            "model_fingerprint": target.info.fingerprint,
            "tokenizer_fingerprint": fingerprint,
            "questions": args.questions,
            "max_new_tokens": args.max_new_tokens,
        }
        save_references(args.references, entries, meta)
    return [run for _, _, run in entries]


def _grpc_latency(path: str, contexts: list[Any], cfg: Any, dense: Any = None) -> dict[str, Any]:
    """Start the version's shard servers as the local stack does, time retrievals through them
    (sparse, and dense too when ``dense`` = (statistics, queries, shape))."""
    import tempfile

    from client.bench.datastore import retrieval_latency
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
            raise CliError(str(exc)) from exc
        shards = state.shards()
        try:
            remote = RemoteDatastore([p.address for p in shards], deadline=2.0)
            retrieval_latency(remote, contexts[:50], cfg)  # warm the channels
            result: dict[str, Any] = retrieval_latency(remote, contexts, cfg)
            result["failures"] = sum(remote.failures.values())
            if dense is not None:
                from client.bench.dense import dense_latency

                stats, queries, dense_cfg = dense
                dense_latency(remote, stats, queries[:50], dense_cfg)
                before = sum(remote.failures.values())
                result["dense"] = dense_latency(remote, stats, queries, dense_cfg)
                result["dense"]["failures"] = sum(remote.failures.values()) - before
            remote.close()
            return result
        finally:
            stop_processes(shards, grace_seconds=0.0)


def _cmd_datastore_eval(args: argparse.Namespace) -> int:
    from client.bench.dense_eval import evaluate
    from datastore_svc.corpus import CorpusError, read_documents
    from datastore_svc.dense_build import DenseBuildConfig, HiddenStates
    from datastore_svc.store import DatastoreError, DatastoreVersion, tokenize_documents, tokenizer_identity

    ks = sorted({int(k) for k in args.k.split(",") if k.strip()})
    if not ks or ks[0] < 1:
        raise CliError("--k takes positive integers, e.g. 1,8,32")
    if not Path(args.corpus).is_file():
        raise CliError(f"corpus {args.corpus} does not exist")
    target, tokenizer = _load_model(args, "hf")
    try:
        fingerprint = tokenizer_identity(tokenizer)["fingerprint"]
        reports = {}
        cfg = DenseBuildConfig(
            window=args.window,
            overlap=min(64, args.window // 4),
            cache_dir=Path(args.hidden_cache) if args.hidden_cache else None,
        )
        states = HiddenStates(target.model, target.info.weights_id, cfg)
        docs = tokenize_documents(read_documents(args.corpus, tokenizer), tokenizer)
        if not docs:
            raise CliError(f"{args.corpus}: no documents")
        hidden = [states.chunk([d])[0] for d in docs]
        for path in args.datastore:
            version = DatastoreVersion(path, tokenizer_fingerprint=fingerprint)
            _check_dense_model(version, target)
            report = evaluate(version, hidden, docs, ks, n=args.n, count=args.positions, seed=args.seed)
            reports[version.version] = {"dims": version.dense_stats.dims if version.dense_stats else 0}
            reports[version.version].update(report.as_dict())
    except (DatastoreError, CorpusError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    payload = {"corpus": args.corpus, "continuation": args.n, "versions": reports}
    text = json.dumps(payload, indent=1)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    sys.stdout.write(text + "\n")
    return 0


def _cmd_datastore_info(args: argparse.Namespace) -> int:
    from datastore_svc.store import DatastoreError, DatastoreVersion

    try:
        version = DatastoreVersion(args.path, verify=not args.no_verify)
    except DatastoreError as exc:
        raise CliError(str(exc)) from exc
    m = version.manifest
    payload = {
        "path": str(version.path),
        "version": version.version,
        "shards": version.num_shards,
        "documents": m.get("documents"),
        "tokens": m.get("tokens"),
        "tokenizer": m.get("tokenizer"),
        "model": m.get("model"),
        "verified": not args.no_verify,
        "load_seconds": round(version.load_seconds, 3),
        "build": m.get("build"),
    }
    if "dense" in m:
        payload["dense"] = {k: v for k, v in m["dense"].items() if k != "stats"}
    sys.stdout.write(json.dumps(payload) + "\n")
    return 0


def _cmd_datastore_swap(args: argparse.Namespace) -> int:
    from datastore_svc.fanout import swap_all

    addresses = [a.strip() for a in args.datastore_addr.split(",") if a.strip()]
    try:
        swapped = swap_all(addresses, args.version, timeout=args.timeout)
    except RuntimeError as exc:
        raise CliError(str(exc)) from exc
    for address, (previous, current) in zip(addresses, swapped, strict=True):
        sys.stderr.write(f"{address}: {previous} -> {current}\n")
    return 0


def _cmd_serve_datastore(args: argparse.Namespace) -> int:
    from datastore_svc.server import ShardServerConfig, serve_forever
    from datastore_svc.shard import ShardState
    from datastore_svc.store import DatastoreError

    try:
        state = ShardState.open(
            args.datastore, args.shard, drain_seconds=args.drain_seconds, faiss_gpu=args.faiss_gpu
        )
    except DatastoreError as exc:
        raise CliError(str(exc)) from exc
    cfg = ShardServerConfig(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        grace_seconds=args.grace_seconds,
        redis_url=args.redis,
    )

    def ready(port: int) -> None:
        name = state.current.version
        sys.stderr.write(f"specdraft datastore shard {args.shard} ({name}) listening on {args.host}:{port}\n")
        sys.stderr.flush()

    serve_forever(state, cfg, ready)
    return 0


# -- local stack ---------------------------------------------------------------------------


def _stack_dir(args: argparse.Namespace) -> Path:
    from client.stack import default_state_dir

    return Path(args.state_dir) if args.state_dir else default_state_dir()


def _worker_model_args(args: argparse.Namespace, threads: int | None) -> list[str]:
    """The model options of this command, as ``specdraft serve worker`` arguments."""
    out = ["--dtype", args.dtype, "--device", args.device, "--backend", args.backend, "--kernel", args.kernel]
    out += ["--model", args.model] if args.model else []
    return out + (["--threads", str(threads)] if threads else [])


def _cmd_up(args: argparse.Namespace) -> int:
    from client.stack import StackConfig, StackError, up

    threads = args.threads or (max(1, (os.cpu_count() or 1) // args.workers) if args.workers > 1 else None)
    worker_args = _worker_model_args(args, threads)
    worker_args += ["--max-concurrent", str(args.max_concurrent)]
    if not args.warm:
        worker_args.append("--no-warm")
    cfg = StackConfig(
        workers=args.workers,
        worker_port=args.port,
        metrics_port=None if args.no_metrics else args.metrics_port,
        redis=not args.no_redis,
        redis_port=args.redis_port,
        worker_args=tuple(worker_args),
        startup_timeout=args.timeout,
        grace_seconds=args.grace_seconds,
        datastore=args.datastore,
        datastore_port=args.datastore_port,
    )
    state_dir = _stack_dir(args)
    try:
        state = up(cfg, state_dir, log=lambda msg: sys.stderr.write(msg + "\n"))
    except StackError as exc:
        sys.stderr.write(f"specdraft: error: {exc}\n")
        return 1
    sys.stdout.write(json.dumps({"state_dir": str(state_dir), **state.to_json()}) + "\n")
    hint = f"--registry {state.registry} " if state.registry else f"--server {state.worker_addresses()[0]} "
    sys.stderr.write(f"ready. try: specdraft generate {hint}--mode pld 'Hello'; stop: specdraft down\n")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from client.stack import StackError, down

    try:
        state = down(_stack_dir(args), grace_seconds=args.grace_seconds)
    except StackError as exc:
        raise CliError(str(exc)) from exc
    if state is None:
        sys.stderr.write("no stack is running\n")
    else:
        sys.stderr.write(f"stopped {len(state.processes)} process(es)\n")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from client.stack import StackError, status

    try:
        rows = status(_stack_dir(args))
    except StackError as exc:
        raise CliError(str(exc)) from exc
    if args.json:
        sys.stdout.write(json.dumps(rows) + "\n")
    elif not rows:
        sys.stdout.write("no stack is running\n")
    for row in rows if not args.json else []:
        state = row["health"] or ("running" if row["alive"] else "DEAD")
        sys.stdout.write(f"{row['name']:10s} {row['address']:22s} pid {row['pid']:<8d} {state}\n")
    return 0 if all(r["alive"] for r in rows) else 1


def _cmd_bench_grpc(args: argparse.Namespace) -> int:
    import tempfile

    from client.bench.grpc_overhead import measure
    from client.stack import StackConfig, StackError, down, up

    prompt = "Write a numbered list of twenty fruits, one per line."
    if args.server:
        report = measure(args.server.split(","), args.calls, args.max_new_tokens, prompt, args.mode)
    else:
        worker_args = _worker_model_args(args, args.threads)
        cfg = StackConfig(
            worker_port=0, metrics_port=None, redis=False, worker_args=tuple(worker_args), grace_seconds=5
        )
        with tempfile.TemporaryDirectory(prefix="specdraft-bench-grpc-") as state:
            try:
                stack = up(cfg, Path(state))
            except StackError as exc:
                raise CliError(str(exc)) from exc
            try:
                report = measure(stack.worker_addresses(), args.calls, args.max_new_tokens, prompt, args.mode)
            finally:
                down(Path(state), grace_seconds=5)
    text = json.dumps(report.to_json(), indent=2)
    sys.stdout.write(text + "\n")
    if args.json_out:
        atomic_write_text(Path(args.json_out), text + "\n")
    return 0


# -- bench ---------------------------------------------------------------------------------


def _cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from client.bench.suite import builtin_suite, load_questions

    try:
        questions = load_questions(args.questions) if args.questions else builtin_suite(args.suite)
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    if args.limit:
        questions = questions[: args.limit]
    if not questions:
        raise CliError("no questions to run")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    engine, target, tokenizer = _load(args)
    from client.bench.report import plot, render_table
    from client.bench.runner import run_bench
    from llm_worker.drafters import DRAFTERS, ModeUnavailableError, UnknownModeError

    if not modes:
        modes = [*DRAFTERS.available(target, engine.resources), "hf-ar", "hf-pld"]
    others = []
    for dtype in [d.strip() for d in (args.also_dtype or "").split(",") if d.strip()]:
        if dtype not in ("float32", "bfloat16", "float16"):
            raise CliError(f"--also-dtype: unknown dtype {dtype!r}")
        if dtype != target.info.dtype:
            other_args = argparse.Namespace(**{**vars(args), "dtype": dtype})
            others.append(_load(other_args)[0])
    console = Console(stderr=True)
    try:
        result = run_bench(
            engine, tokenizer, questions, modes, args.max_new_tokens, progress=console.log, others=others
        )
    except (UnknownModeError, ModeUnavailableError) as exc:
        raise CliError(str(exc)) from exc
    report = result.to_json()
    render_table(report, Console())
    if args.json_out:
        atomic_write_text(Path(args.json_out), json.dumps(report, indent=1) + "\n")
        console.print(f"wrote {args.json_out}")
    if args.plot:
        console.print(f"wrote {plot(report, Path(args.plot))}")
    return 0


# -- calibrate-heads -----------------------------------------------------------------------


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from rich.console import Console

    _engine, target, tokenizer = _load(args)
    from client.bench.suite import calibration_prompts
    from llm_worker.calibrate import calibrate_heads
    from llm_worker.chat import chat_prompt_ids
    from llm_worker.drafters.heads import save_heads, shipped_heads_path, user_heads_dir

    console = Console(stderr=True)
    if args.prompts:
        lines = [ln for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
        texts = [json.loads(ln)["prompt"] if ln.lstrip().startswith("{") else ln for ln in lines]
    else:
        texts = calibration_prompts(args.count)
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    try:
        heads = calibrate_heads(
            target,
            prompts,
            args.max_new_tokens,
            progress=lambda i, n: console.log(f"calibration prompt {i}/{n}"),
        )
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    if args.out:
        path = Path(args.out)
    elif args.ship:
        path = shipped_heads_path(target.info.weights_id)  # shipped: one file for every dtype
    else:
        path = user_heads_dir() / f"{target.info.fingerprint}.json"
    save_heads(heads, path)
    top = ", ".join(f"L{h.layer}H{h.head}={h.score:.2f}" for h in heads.heads[:10])
    console.print(f"{heads.events} copy events over {heads.prompts} prompts; top heads: {top}")
    sys.stdout.write(str(path) + "\n")
    return 0


def _cmd_modes(args: argparse.Namespace) -> int:
    _engine, target, _tokenizer = _load(args)
    from llm_worker.drafters import DRAFTERS

    available = set(DRAFTERS.available(target, _engine.resources))
    for name in DRAFTERS.names():
        spec = DRAFTERS.spec(name)
        opts = f" (options: {', '.join(spec.options)})" if spec.options else ""
        state = "" if name in available else "  [unavailable here]"
        sys.stdout.write(f"{name:8s} {spec.summary}{opts}{state}\n")
    return 0


# -- parser --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdraft", description="Lossless speculative decoding.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    _add_model_args(g)
    _add_datastore_args(g)
    g.add_argument("prompt", help="the prompt text, or - to read it from stdin")
    g.add_argument("--mode", default="ar", help="drafting mode, e.g. ar, pld, pld+h, pld+a, pld+h:layer=12")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument(
        "--chat", action="store_true", help="apply the model's chat template (PROMPT is one user turn)"
    )
    g.add_argument(
        "--stream", action="store_true", help="print text as it is generated (to stderr with --json)"
    )
    g.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    g.add_argument("--server", help="HOST:PORT[,HOST:PORT...] of workers; default: decode in this process")
    g.add_argument("--registry", help="find workers serving --mode in this registry (redis://HOST:PORT)")
    g.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds with --server")
    g.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("serve", help="run a service")
    serve_sub = serve.add_subparsers(dest="service", required=True)
    w = serve_sub.add_parser("worker", help="an LLM worker (gRPC Generation service)")
    _add_model_args(w)
    _add_datastore_args(w)
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--port", type=int, default=50051, help="0 = any free port")
    w.add_argument(
        "--max-concurrent", type=int, default=4, help="generations at once; more get RESOURCE_EXHAUSTED"
    )
    w.add_argument("--grace-seconds", type=float, default=30.0, help="drain time on SIGTERM")
    w.add_argument("--default-max-new-tokens", type=int, default=256)
    w.add_argument("--worker-id", default=None)
    w.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    w.add_argument(
        "--registry", default=None, help="publish this worker in a registry: redis://HOST:PORT[/DB]"
    )
    w.add_argument(
        "--registry-ttl", type=float, default=10.0, help="seconds a record lives without a heartbeat"
    )
    w.add_argument(
        "--advertise", default=None, help="host:port to publish (default: --host and the bound port)"
    )
    w.add_argument(
        "--no-warm", dest="warm", action="store_false", help="skip measuring the cost curve at start"
    )
    w.set_defaults(func=_cmd_serve_worker)

    u = sub.add_parser("up", help="start the local stack: redis + workers on loopback")
    _add_model_args(u)
    u.add_argument("--workers", type=_positive_int, default=1, help="worker processes")
    u.add_argument("--port", type=int, default=50051, help="first worker's gRPC port (0 = free ports)")
    u.add_argument("--metrics-port", type=int, default=9100, help="first worker's metrics port")
    u.add_argument("--no-metrics", action="store_true", help="no Prometheus endpoints")
    u.add_argument("--redis-port", type=int, default=6380, help="0 = a free port")
    u.add_argument("--no-redis", action="store_true", help="workers run without a registry")
    u.add_argument("--datastore", help="a datastore version: one shard server per shard, used by the workers")
    u.add_argument("--datastore-port", type=int, default=50061, help="first shard's port (0 = free ports)")
    u.add_argument("--max-concurrent", type=_positive_int, default=4, help="per worker")
    u.add_argument("--grace-seconds", type=float, default=30.0, help="each worker's drain time on down")
    u.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for SERVING")
    u.add_argument("--no-warm", dest="warm", action="store_false", help="workers skip the cost curve")
    u.add_argument("--state-dir", help="where the state file and logs live (default: the user cache)")
    u.set_defaults(func=_cmd_up)

    d = sub.add_parser("down", help="stop the local stack")
    d.add_argument("--grace-seconds", type=float, default=30.0, help="drain time before SIGKILL")
    d.add_argument("--state-dir", help="as given to up")
    d.set_defaults(func=_cmd_down)

    st = sub.add_parser("status", help="what the local stack runs and whether it is healthy")
    st.add_argument("--state-dir", help="as given to up")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=_cmd_status)

    ds = serve_sub.add_parser("datastore", help="one datastore shard (gRPC Datastore service)")
    ds.add_argument("--datastore", required=True, help="the version directory to serve first")
    ds.add_argument("--shard", type=int, default=0, help="which shard of the version")
    ds.add_argument("--host", default="127.0.0.1")
    ds.add_argument("--port", type=int, default=50061, help="0 = any free port")
    ds.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    ds.add_argument("--grace-seconds", type=float, default=10.0, help="drain time on SIGTERM")
    ds.add_argument(
        "--drain-seconds",
        type=float,
        default=60.0,
        help="keep a swapped-out version this long for its requests",
    )
    ds.add_argument("--redis", help="publish each loaded version's dense statistics here (redis://HOST:PORT)")
    ds.add_argument(
        "--faiss-gpu", type=int, default=None, help="search dense indexes on this GPU (needs faiss-gpu)"
    )
    ds.set_defaults(func=_cmd_serve_datastore)

    dsc = sub.add_parser("datastore", help="build, inspect and swap datastore versions")
    dsc_sub = dsc.add_subparsers(dest="action", required=True)
    bd = dsc_sub.add_parser("build", help="build a new version from a JSONL corpus")
    bd.add_argument("--corpus", help='JSONL of {"text"}, {"prompt","response"} or {"messages"}')
    bd.add_argument("--out", required=True, help="the new version directory (must not exist)")
    bd.add_argument("--shards", type=_positive_int, default=1)
    _add_model_args(bd)
    bd.add_argument("--quiet", action="store_true", help="no progress bars")
    dn = bd.add_argument_group("dense index (DReSD): the model's hidden states, reduced, in FAISS")
    dn.add_argument("--dense", action="store_true", help="also build the dense index beside the sparse one")
    dn.add_argument(
        "--from", dest="source", help="a dense rebuild over this version's tokens (other dims or index type)"
    )
    dn.add_argument("--pca-dims", type=_positive_int, default=64, help="query / key dimensions")
    dn.add_argument("--index", default="auto", choices=["auto", "flat", "hnsw", "ivf", "ivfpq"])
    dn.add_argument("--hnsw-m", type=_positive_int, default=32)
    dn.add_argument("--ivf-lists", type=int, default=0, help="0 = about 4 sqrt(keys)")
    dn.add_argument("--pq-bytes", type=int, default=0, help="ivfpq bytes per key (0 = dims / 2)")
    dn.add_argument("--window", type=_positive_int, default=512, help="tokens per forward window")
    dn.add_argument(
        "--overlap", type=int, default=None, help="context tokens before each window (default window/4, ≤ 64)"
    )
    dn.add_argument("--batch", type=_positive_int, default=4, help="windows per forward")
    dn.add_argument("--stats-sample", type=_positive_int, default=262_144, help="vectors PCA is fitted on")
    dn.add_argument("--hidden-cache", help="hidden-state cache (default: ~/.cache/specdraft/hidden)")
    dn.add_argument("--redis", help="publish the statistics to this Redis (redis://HOST:PORT)")
    bd.set_defaults(func=_cmd_datastore_build)
    dg = dsc_sub.add_parser("generate", help="the model's own answers to prompts, as a corpus (resumable)")
    _add_model_args(dg)
    dg.add_argument(
        "--prompts", required=True, help='JSONL: Spec-Bench {"question_id","turns"} or {"prompt"}'
    )
    dg.add_argument("--out", required=True, help="corpus JSONL to append to (ids already there are skipped)")
    dg.add_argument(
        "--mode", default="pld+h", help="a lossless mode: the answers are the model's greedy ones"
    )
    dg.add_argument("--max-new-tokens", type=_positive_int, default=512)
    dg.add_argument("--limit", type=int, default=0, help="only the first N prompts")
    dg.add_argument("--quiet", action="store_true", help="no progress bar")
    dg.set_defaults(func=_cmd_datastore_generate)
    dl = dsc_sub.add_parser("local-corpus", help="a corpus of local text (Python sources, Debian docs)")
    dl.add_argument("--out", required=True)
    dl.add_argument("--max-chars", type=_positive_int, default=4_000_000, help="about 4 chars per token")
    dl.add_argument("--questions-out", help="also write Spec-Bench code questions the corpus covers")
    dl.add_argument("--questions", type=_positive_int, default=20)
    dl.set_defaults(func=_cmd_datastore_local_corpus)
    dbn = dsc_sub.add_parser("bench", help="load time and retrieval latency, in process and over gRPC")
    dbn.add_argument("--datastore", required=True)
    _add_model_args(dbn)
    dbn.add_argument("--queries", type=_positive_int, default=1000)
    dbn.add_argument("--grpc", action="store_true", help="also through shard server processes")
    dbn.add_argument(
        "--draftretriever",
        action="store_true",
        help="also the PyPI draftretriever on the same tokens (if installed)",
    )
    dbn.add_argument(
        "--tau", action="store_true", help="also τ by replaying the model's greedy answers to --questions"
    )
    dbn.add_argument("--questions", help="Spec-Bench JSONL whose greedy answers --tau replays")
    dbn.add_argument(
        "--references", help="JSON of those answers: read if it exists, else generated (ar) and written"
    )
    dbn.add_argument("--max-new-tokens", type=_positive_int, default=128, help="answer length for --tau")
    dbn.add_argument(
        "--dense",
        action="store_true",
        help="also dense retrieval latency (hidden states of the suite's prompts)",
    )
    dbn.add_argument("--json-out")
    dbn.set_defaults(func=_cmd_datastore_bench)
    de = dsc_sub.add_parser("eval", help="dense index quality: MRR of the true continuation, recall vs exact")
    de.add_argument("--datastore", required=True, nargs="+", help="dense version(s), compared side by side")
    de.add_argument("--corpus", required=True, help="held-out JSONL (text the versions were not built from)")
    _add_model_args(de)
    de.add_argument("--k", default="1,8,32,128", help="cut-offs for MRR, hit rate and recall")
    de.add_argument("--n", type=_positive_int, default=4, help="continuation length of the second MRR")
    de.add_argument("--positions", type=_positive_int, default=2000, help="held-out positions sampled")
    de.add_argument("--window", type=_positive_int, default=512)
    de.add_argument("--hidden-cache", help="hidden-state cache (default: ~/.cache/specdraft/hidden)")
    de.add_argument("--seed", type=int, default=0)
    de.add_argument("--json-out")
    de.set_defaults(func=_cmd_datastore_eval)
    di = dsc_sub.add_parser("info", help="check a version (checksums) and print its manifest summary")
    di.add_argument("path")
    di.add_argument("--no-verify", action="store_true", help="skip the checksums")
    di.set_defaults(func=_cmd_datastore_info)
    dw = dsc_sub.add_parser("swap", help="make every shard load a version and switch to it")
    dw.add_argument("--version", required=True, help="version name (beside the current one) or directory")
    dw.add_argument("--datastore-addr", required=True, help="HOST:PORT[,HOST:PORT...] of every shard")
    dw.add_argument("--timeout", type=float, default=600.0, help="seconds each shard may take to load")
    dw.set_defaults(func=_cmd_datastore_swap)

    b = sub.add_parser("bench", help="benchmark modes side by side")
    _add_model_args(b)
    _add_datastore_args(b)
    b.add_argument("--questions", help="JSONL in Spec-Bench's format (question_id, category, turns)")
    b.add_argument("--suite", default="input-guided", help="built-in suite when --questions is not given")
    b.add_argument(
        "--modes", default="", help="comma-separated modes (default: every available mode + hf-ar, hf-pld)"
    )
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--limit", type=int, default=0, help="run only the first N questions")
    b.add_argument("--json-out", help="write the report as JSON here")
    b.add_argument("--plot", help="write a PNG of speed-up and τ per mode and category")
    b.add_argument(
        "--also-dtype",
        help="also run every engine mode with the model in these dtypes (comma-separated), as MODE@DTYPE, "
        "interleaved in the same run",
    )
    b.set_defaults(func=_cmd_bench)

    bg = sub.add_parser("bench-grpc", help="gRPC overhead per unary call and per streamed token")
    _add_model_args(bg)
    bg.add_argument("--server", help="HOST:PORT of a running worker (default: start one)")
    bg.add_argument("--calls", type=_positive_int, default=50, help="unary + streaming pairs")
    bg.add_argument("--max-new-tokens", type=_positive_int, default=32)
    bg.add_argument("--mode", default="ar")
    bg.add_argument("--json-out", help="write the report as JSON here")
    bg.set_defaults(func=_cmd_bench_grpc)

    c = sub.add_parser("calibrate-heads", help="find the model's induction heads for pld+a")
    _add_model_args(c)
    c.add_argument("--prompts", help="calibration prompts: text lines or JSONL with a prompt field")
    c.add_argument("--count", type=int, default=24, help="built-in calibration prompts to use")
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--out", help="output file (default: the user cache, where pld+a looks first)")
    c.add_argument("--ship", action="store_true", help="write into the package data (maintainers)")
    c.set_defaults(func=_cmd_calibrate)

    m = sub.add_parser("modes", help="list drafting modes")
    _add_model_args(m)
    _add_datastore_args(m)
    m.set_defaults(func=_cmd_modes)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    try:
        return int(args.func(args))
    except CliError as exc:
        sys.stderr.write(f"specdraft: error: {exc}\n")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.verbose:
            raise
        sys.stderr.write(
            f"specdraft: error: internal error: {type(exc).__name__}: {exc} (run with -v for details)\n"
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
