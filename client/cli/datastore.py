"""``specdraft datastore``: build, generate, local-corpus, own-corpus, recycle-seed, bench, eval, info,
swap, rebuild."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from client.cli.common import (
    CliError,
    add_client_security_args,
    add_model_args,
    addresses,
    client_security,
    engine_from_args,
    model_config,
    model_from_args,
    non_negative_int,
    positive_int,
    print_json,
    tokenizer_from_args,
)

if TYPE_CHECKING:
    from datastore_svc.store import Extend
    from specdraft.tokenizer import Tokenizer


def add_datastore(sub: Any) -> None:
    dsc = sub.add_parser("datastore", help="build, inspect and swap datastore versions")
    dsc_sub = dsc.add_subparsers(dest="action", required=True)
    _add_build(dsc_sub)
    _add_generate(dsc_sub)
    _add_local_corpus(dsc_sub)
    _add_own_corpus(dsc_sub)
    _add_recycle_seed(dsc_sub)
    _add_bench(dsc_sub)
    _add_eval(dsc_sub)
    _add_info(dsc_sub)
    _add_swap(dsc_sub)
    _add_rebuild(dsc_sub)


def _add_build(dsc_sub: Any) -> None:
    """``datastore build``."""
    bd = dsc_sub.add_parser("build", help="build a new version from a JSONL corpus")
    bd.add_argument(
        "--corpus",
        help='JSONL of {"text"}, {"prompt","response"} or {"messages"}, or a committed corpus '
        "directory (corpus/<model>: its train split's conversations)",
    )
    bd.add_argument("--out", required=True, help="the new version directory (must not exist)")
    bd.add_argument("--shards", type=positive_int, default=1)
    _add_version_args(bd, derive=True)
    bd.set_defaults(func=cmd_build)


def _add_version_args(p: argparse.ArgumentParser, derive: bool) -> None:
    """How ``build`` and ``rebuild`` build a version: the model, progress, the dense index (and,
    with ``derive``, ``--from``: a dense rebuild over an existing version's tokens)."""
    add_model_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    dn = p.add_argument_group("dense index (DReSD): the model's hidden states, reduced, in FAISS")
    dn.add_argument("--dense", action="store_true", help="also build the dense index beside the sparse one")
    if derive:
        dn.add_argument(
            "--from",
            dest="source",
            help="a dense rebuild over this version's tokens (other dims or index type)",
        )
    else:
        p.set_defaults(source=None)
    dn.add_argument("--pca-dims", type=positive_int, default=64, help="query / key dimensions")
    dn.add_argument(
        "--index",
        default="auto",
        choices=["auto", "flat", "hnsw", "ivf", "ivfpq"],
        help="auto = exact search (flat) up to 50k keys per shard, inverted lists (ivf) above",
    )
    dn.add_argument("--hnsw-m", type=positive_int, default=32)
    dn.add_argument(
        "--ivf-lists",
        type=non_negative_int,
        default=0,
        help="inverted lists per shard, at most its keys (0 = about 4 sqrt(keys))",
    )
    dn.add_argument("--pq-bytes", type=non_negative_int, default=0, help="ivfpq bytes per key (0 = dims / 2)")
    dn.add_argument("--window", type=positive_int, default=512, help="tokens per forward window")
    dn.add_argument(
        "--overlap", type=int, default=None, help="context tokens before each window (default window/4, ≤ 64)"
    )
    dn.add_argument("--batch", type=positive_int, default=4, help="windows per forward")
    dn.add_argument("--stats-sample", type=positive_int, default=262_144, help="vectors PCA is fitted on")
    dn.add_argument(
        "--dense-tokens",
        type=int,
        default=0,
        help="keys for documents evenly spread up to about this many tokens (0 = all, or with --from: "
        "the source's); the sparse part keeps every token",
    )
    dn.add_argument("--hidden-cache", help="hidden-state cache (default: ~/.cache/specdraft/hidden)")
    dn.add_argument("--redis", help="publish the statistics to this Redis (redis://HOST:PORT)")


def _add_generate(dsc_sub: Any) -> None:
    """``datastore generate``."""
    dg = dsc_sub.add_parser("generate", help="the model's own answers to prompts, as a corpus (resumable)")
    add_model_args(dg)
    dg.add_argument(
        "--prompts", required=True, help='JSONL: Spec-Bench {"question_id","turns"} or {"prompt"}'
    )
    dg.add_argument("--out", required=True, help="corpus JSONL to append to (ids already there are skipped)")
    dg.add_argument(
        "--mode", default="pld+h", help="a lossless mode: the answers are the model's greedy ones"
    )
    dg.add_argument("--max-new-tokens", type=positive_int, default=512)
    dg.add_argument("--limit", type=int, default=0, help="only the first N prompts")
    dg.add_argument("--quiet", action="store_true", help="no progress bar")
    dg.set_defaults(func=cmd_generate)


def _add_local_corpus(dsc_sub: Any) -> None:
    """``datastore local-corpus``."""
    dl = dsc_sub.add_parser("local-corpus", help="a corpus of local text (Python sources, Debian docs)")
    dl.add_argument("--out", required=True)
    dl.add_argument("--max-chars", type=positive_int, default=4_000_000, help="about 4 chars per token")
    dl.add_argument("--questions-out", help="also write Spec-Bench code questions the corpus covers")
    dl.add_argument("--questions", type=positive_int, default=20)
    dl.set_defaults(func=cmd_local_corpus)


def _add_own_corpus(dsc_sub: Any) -> None:
    """``datastore own-corpus``."""
    do = dsc_sub.add_parser(
        "own-corpus", help="a committed training corpus's conversations as a datastore corpus"
    )
    do.add_argument("--corpus", required=True, help="a corpus directory, e.g. corpus/de7dc0073f16aefd")
    do.add_argument("--out", required=True, help="JSONL of chat records: the train split's conversations")
    do.add_argument(
        "--questions-out", help="also write the held-out split's first user turns as Spec-Bench questions"
    )
    do.set_defaults(func=cmd_own_corpus)


def _add_recycle_seed(dsc_sub: Any) -> None:
    """``datastore recycle-seed``."""
    rs = dsc_sub.add_parser(
        "recycle-seed",
        help="rows for recycle to start from: the target's top 8 over a corpus of its answers",
    )
    rs.add_argument(
        "--corpus",
        required=True,
        help='JSONL of chat records ({"messages"}), or a committed corpus directory (its train split)',
    )
    rs.add_argument("--out", required=True, help="the seed file to write (.npz; replaced whole)")
    rs.add_argument(
        "--conversations",
        type=positive_int,
        default=1000,
        help="conversations read, spread evenly over the corpus (a corpus lists its kinds in runs)",
    )
    add_model_args(rs)
    rs.set_defaults(func=cmd_recycle_seed)


def _add_bench(dsc_sub: Any) -> None:
    """``datastore bench``."""
    dbn = dsc_sub.add_parser("bench", help="load time and retrieval latency, in process and over gRPC")
    dbn.add_argument("--datastore", required=True)
    add_model_args(dbn)
    dbn.add_argument("--queries", type=positive_int, default=1000)
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
    dbn.add_argument("--max-new-tokens", type=positive_int, default=128, help="answer length for --tau")
    dbn.add_argument(
        "--dense",
        action="store_true",
        help="also dense retrieval latency (hidden states of the suite's prompts)",
    )
    dbn.add_argument("--json-out")
    dbn.set_defaults(func=cmd_bench)


def _add_eval(dsc_sub: Any) -> None:
    """``datastore eval``."""
    de = dsc_sub.add_parser("eval", help="dense index quality: MRR of the true continuation, recall vs exact")
    de.add_argument("--datastore", required=True, nargs="+", help="dense version(s), compared side by side")
    de.add_argument("--corpus", required=True, help="held-out JSONL (text the versions were not built from)")
    add_model_args(de)
    de.add_argument("--k", default="1,8,32,128", help="cut-offs for MRR, hit rate and recall")
    de.add_argument("--n", type=positive_int, default=4, help="continuation length of the second MRR")
    de.add_argument("--positions", type=positive_int, default=2000, help="held-out positions sampled")
    de.add_argument("--window", type=positive_int, default=512)
    de.add_argument("--hidden-cache", help="hidden-state cache (default: ~/.cache/specdraft/hidden)")
    de.add_argument("--seed", type=int, default=0)
    de.add_argument("--json-out")
    de.set_defaults(func=cmd_evaluate)


def _add_info(dsc_sub: Any) -> None:
    """``datastore info``."""
    di = dsc_sub.add_parser("info", help="check a version (checksums) and print its manifest summary")
    di.add_argument("path")
    di.add_argument("--no-verify", action="store_true", help="skip the checksums")
    di.set_defaults(func=cmd_info)


def _add_swap(dsc_sub: Any) -> None:
    """``datastore swap``."""
    dw = dsc_sub.add_parser(
        "swap",
        help="make every shard load a version and switch to it (two phases; all shards or none)",
    )
    dw.add_argument(
        "--version", required=True, help="version name: a directory under the shards' versions root"
    )
    dw.add_argument(
        "--admin-addr", required=True, help="HOST:PORT[,HOST:PORT...] of every shard's admin port"
    )
    dw.add_argument("--timeout", type=float, default=600.0, help="seconds each shard may take to load")
    add_client_security_args(dw, admin=True)
    dw.set_defaults(func=cmd_swap)


def _add_rebuild(dsc_sub: Any) -> None:
    """``datastore rebuild``."""
    rb = dsc_sub.add_parser(
        "rebuild",
        help="build a version and make it current on every shard and in DATA/current "
        "(resumable: a rerun finishes a killed one; a restarting shard never goes back)",
    )
    rb.add_argument(
        "--corpus", required=True, help="the JSONL corpus or a committed corpus directory (as for build)"
    )
    rb.add_argument(
        "--data", required=True, help="the datastore volume: DATA/versions/<V>, DATA/current -> versions/<V>"
    )
    rb.add_argument(
        "--admin-addr",
        required=True,
        help="HOST:PORT[,HOST:PORT...] of every shard's admin port; the version is built in as many shards",
    )
    rb.add_argument(
        "--version",
        default="",
        help="the new version's name (default: the UTC time, 20250101-030000); a pending one keeps its own",
    )
    rb.add_argument("--timeout", type=float, default=600.0, help="seconds each shard may take to load")
    _add_version_args(rb, derive=False)
    add_client_security_args(rb, admin=True)
    rb.set_defaults(func=cmd_rebuild)


def _dense_tokens(args: argparse.Namespace) -> int:
    """``--dense-tokens``, or for a dense rebuild (``--from``) without it the source's own subsample:
    a rebuild with other dimensions keys the same documents (and finds their hidden states cached)."""
    if args.dense_tokens or not getattr(args, "source", None):
        return int(args.dense_tokens)
    from datastore_svc.store import DatastoreError, read_manifest

    try:
        return int(read_manifest(Path(args.source)).get("dense", {}).get("max_tokens", 0))
    except DatastoreError as exc:
        raise CliError(str(exc)) from exc


def _dense_step(args: argparse.Namespace) -> tuple[Extend, Tokenizer, Path]:
    """(the build step adding the dense index, the model's tokenizer, the model directory)."""
    from datastore_svc.dense import IndexParams
    from datastore_svc.dense_build import DenseBuildConfig, default_overlap, dense_step
    from llm_worker.encoders import ModelEncoder
    from llm_worker.model.loading import resolve_model_dir

    target, tokenizer = model_from_args(args, "hf")
    model_dir = resolve_model_dir(args.model)
    try:
        cfg = DenseBuildConfig(
            dims=args.pca_dims,
            index=args.index,
            params=IndexParams(hnsw_m=args.hnsw_m, ivf_lists=args.ivf_lists, pq_bytes=args.pq_bytes),
            window=args.window,
            overlap=default_overlap(args.window) if args.overlap is None else args.overlap,
            batch=args.batch,
            sample=args.stats_sample,
            max_tokens=_dense_tokens(args),
            cache_dir=Path(args.hidden_cache) if args.hidden_cache else None,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    info = target.info
    encoder = ModelEncoder(target.model)
    return dense_step(encoder, info.name, info.weights_id, cfg, not args.quiet), tokenizer, model_dir


def cmd_build(args: argparse.Namespace) -> int:
    if args.source and not args.dense:
        raise CliError("--from adds a dense index to an existing version's tokens: add --dense")
    if bool(args.source) == bool(args.corpus):
        raise CliError("give --corpus FILE (a new version) or --from VERSION --dense (a dense rebuild)")
    if args.corpus:
        _check_corpus(args.corpus)
    print_json(_build_version(args, Path(args.out), args.shards))
    return 0


def _check_corpus(corpus: str) -> None:
    """A CliError unless ``corpus`` is a JSONL file or a committed corpus directory (with its
    ``manifest.json``; its files are checked when read)."""
    from llm_worker.training.corpus import MANIFEST

    path = Path(corpus)
    if path.is_dir() and not (path / MANIFEST).is_file():
        raise CliError(f"corpus {corpus} is a directory without a {MANIFEST}: not a committed corpus")
    if not path.exists():
        raise CliError(f"corpus {corpus} does not exist")


def _own_conversations(corpus: Path) -> Iterator[dict[str, Any]]:
    """The train split of a committed corpus directory as datastore records (chat ``messages``)."""
    from llm_worker.training.corpus import conversations

    return ({"id": c["id"], "messages": c["messages"]} for c in conversations(corpus, "train"))


@contextmanager
def _corpus_file(corpus: str) -> Iterator[str]:
    """The JSONL file a build reads: ``corpus`` itself, or for a committed corpus directory
    (``corpus/<model>``) its train split written to a temporary file, removed afterwards, as
    ``datastore own-corpus`` writes it. So ``datastore rebuild --corpus corpus/de7dc0073f16aefd``
    builds what ``make datastore-own`` builds, and held-out answers never enter the version."""
    from datastore_svc.corpus import write_jsonl
    from llm_worker.training.corpus import CorpusError

    if not Path(corpus).is_dir():
        yield corpus
        return
    with tempfile.TemporaryDirectory(prefix="specdraft-own-corpus-") as tmp:
        out = Path(tmp) / "corpus.jsonl"
        try:
            count = write_jsonl(out, _own_conversations(Path(corpus)))
        except (CorpusError, OSError) as exc:
            raise CliError(str(exc)) from exc
        sys.stderr.write(f"corpus {corpus}: {count} train conversations\n")
        yield str(out)


def _build_version(args: argparse.Namespace, out: Path, shards: int) -> dict[str, Any]:
    """Build the version ``out`` in ``shards`` shards as ``args`` say (``--corpus``, or ``--from``
    with ``--dense``; checked by the caller); its report (``build_report``)."""
    from datastore_svc.corpus import CorpusError
    from datastore_svc.dense import DenseError
    from datastore_svc.reports import build_report
    from datastore_svc.store import DatastoreError, DatastoreVersion, build, derive_version, read_manifest
    from datastore_svc.store import tokenizer_identity as identity

    extend = None
    if args.dense:
        extend, tokenizer, model_dir = _dense_step(args)
    else:
        tokenizer, model_dir = tokenizer_from_args(args)
    t0 = time.perf_counter()
    try:
        if args.source:
            assert extend is not None  # --from needs --dense (checked above)
            if (
                read_manifest(Path(args.source))["tokenizer"].get("fingerprint")
                != identity(tokenizer)["fingerprint"]
            ):
                raise CliError(f"{args.source} was built with another tokenizer than {model_dir}'s")
            derive_version(args.source, out, extend)
        else:
            with _corpus_file(args.corpus) as corpus:
                build(corpus, tokenizer, out, shards, str(model_dir), not args.quiet, extend)
        version = DatastoreVersion(out, verify=False)
    except (DatastoreError, CorpusError, DenseError) as exc:
        raise CliError(str(exc)) from exc
    report = build_report(version, time.perf_counter() - t0)
    if "dense" in report and args.redis and version.dense_stats is not None:
        from datastore_svc.cache import StatsCache, link_for

        try:
            published = StatsCache(link_for(args.redis)).publish(version.version, version.dense_stats)
        except ValueError as exc:
            raise CliError(str(exc)) from exc
        report["dense"]["published_to_redis"] = published
    return report


def cmd_generate(args: argparse.Namespace) -> int:
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
    engine, _target, tokenizer = engine_from_args(args)
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
    print_json({"out": args.out, **counts})
    return 0


def cmd_local_corpus(args: argparse.Namespace) -> int:
    from client.bench.datastore import code_questions, local_corpus

    counts = local_corpus(args.out, args.max_chars)
    if args.questions_out:
        counts["questions"] = code_questions(args.questions_out, args.questions)
    print_json({"out": args.out, **counts})
    return 0


def cmd_own_corpus(args: argparse.Namespace) -> int:
    from datastore_svc.corpus import own_questions, write_jsonl
    from llm_worker.training.corpus import CorpusError, conversations

    corpus = Path(args.corpus)
    try:
        counts = {"conversations": write_jsonl(args.out, _own_conversations(corpus))}
        if args.questions_out:
            held_out = own_questions(conversations(corpus, "heldout"))
            counts["questions"] = write_jsonl(args.questions_out, held_out)
    except (CorpusError, OSError) as exc:
        raise CliError(str(exc)) from exc
    print_json({"out": args.out, **counts})
    return 0


def cmd_recycle_seed(args: argparse.Namespace) -> int:
    import json

    from datastore_svc.store import tokenizer_identity
    from llm_worker.chat import chat_prompt_ids
    from llm_worker.drafters.recycle_seed import SeedInfo, save_seed, seed_rows
    from llm_worker.drafters.recycle_store import CONTEXT_SLOTS
    from llm_worker.training.corpus import CorpusError
    from specdraft.common import Progress

    _check_corpus(args.corpus)
    target, tokenizer = model_from_args(args)
    if not getattr(tokenizer, "chat_template", None):
        raise CliError(
            "a recycle seed reads answers through the model's chat template; this tokenizer has none"
        )

    def records() -> Iterator[dict[str, Any]]:
        if Path(args.corpus).is_dir():
            yield from _own_conversations(Path(args.corpus))
            return
        with open(args.corpus, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise CliError(f"{args.corpus}:{number}: not JSON ({exc.msg})") from None

    def examples() -> Iterator[tuple[list[int], list[int]]]:
        every = list(records())
        step = max(1.0, len(every) / args.conversations)
        for record in (every[int(i * step)] for i in range(min(args.conversations, len(every)))):
            messages = record.get("messages") if isinstance(record, dict) else None
            if not (isinstance(messages, list) and len(messages) >= 2):
                continue
            user, answer = messages[0], messages[1]
            if not (
                isinstance(user, dict) and isinstance(answer, dict) and answer.get("role") == "assistant"
            ):
                continue
            prompt = chat_prompt_ids(tokenizer, [user])
            text = tokenizer.apply_chat_template([user, answer], tokenize=False)
            whole = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if whole[: len(prompt)] == prompt:
                yield prompt, whole[len(prompt) :]

    progress = Progress(f"recycle seed: {args.conversations} conversations through the target", note="")
    try:
        matrix, read, written = seed_rows(
            target,
            examples(),
            progress=lambda n: progress.update(n / args.conversations),
        )
    except (CorpusError, OSError, UnicodeDecodeError) as exc:
        raise CliError(str(exc)) from exc
    progress.done()
    if not read:
        raise CliError(f"{args.corpus} has no conversation of a user turn and an assistant answer")
    info = SeedInfo(
        tokenizer_identity(tokenizer)["fingerprint"],
        target.info.vocab_size,
        matrix.next.shape[1],
        CONTEXT_SLOTS,
        read,
        written,
        f"specdraft datastore recycle-seed --corpus {args.corpus} --conversations {args.conversations}",
    )
    try:
        save_seed(args.out, matrix, info)
    except OSError as exc:
        raise CliError(f"cannot write {args.out}: {exc}") from exc
    print_json(
        {"out": args.out, "conversations": read, "positions": written, "bytes": Path(args.out).stat().st_size}
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from client.bench.datastore_run import DatastoreBenchConfig, DatastoreBenchError, run_datastore_bench

    tokenizer, _ = tokenizer_from_args(args)
    cfg = DatastoreBenchConfig(
        datastore=args.datastore,
        queries=args.queries,
        grpc=args.grpc,
        draftretriever=args.draftretriever,
        tau=args.tau,
        questions=args.questions,
        references=args.references,
        max_new_tokens=args.max_new_tokens,
        dense=args.dense,
    )
    try:
        report = run_datastore_bench(cfg, model_config(args), tokenizer)
    except DatastoreBenchError as exc:
        raise CliError(str(exc)) from exc
    print_json(report, args.json_out)
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from client.bench.dense_eval import evaluate_versions
    from datastore_svc.corpus import CorpusError
    from datastore_svc.store import DatastoreError

    ks = sorted({int(k) for k in args.k.split(",") if k.strip()})
    if not ks or ks[0] < 1:
        raise CliError("--k takes positive integers, e.g. 1,8,32")
    if not Path(args.corpus).is_file():
        raise CliError(f"corpus {args.corpus} does not exist")
    target, tokenizer = model_from_args(args, "hf")
    hidden_cache = Path(args.hidden_cache) if args.hidden_cache else None
    try:
        reports = evaluate_versions(
            target, tokenizer, args.datastore, args.corpus, ks, args.n, args.positions, args.seed,
            args.window, hidden_cache,
        )  # fmt: skip
    except (DatastoreError, CorpusError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    print_json({"corpus": args.corpus, "continuation": args.n, "versions": reports}, args.json_out, indent=1)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from datastore_svc.reports import info_report
    from datastore_svc.store import DatastoreError, DatastoreVersion

    try:
        version = DatastoreVersion(args.path, verify=not args.no_verify)
    except DatastoreError as exc:
        raise CliError(str(exc)) from exc
    print_json(info_report(version, verified=not args.no_verify))
    return 0


def cmd_swap(args: argparse.Namespace) -> int:
    from datastore_svc.fanout import SwapError, swap_all

    shards = addresses(args.admin_addr)
    security = client_security(args, admin=True)
    try:
        swapped = swap_all(list(shards), args.version, security, timeout=args.timeout)
    except SwapError as exc:
        raise CliError(str(exc)) from exc
    for address, (previous, current) in zip(shards, swapped, strict=True):
        sys.stderr.write(f"{address}: {previous} -> {current}\n")
    return 0


def cmd_rebuild(args: argparse.Namespace) -> int:
    from datastore_svc.fanout import SwapError
    from datastore_svc.rebuild import STEPS, RebuildConfig, RebuildError, rebuild

    _check_corpus(args.corpus)
    shards = addresses(args.admin_addr)
    cfg = RebuildConfig(
        Path(args.data), shards, args.version, client_security(args, admin=True), args.timeout
    )

    def build(out: Path) -> None:
        print_json(_build_version(args, out, len(shards)))

    def report(step: str, version: str) -> None:
        sys.stderr.write(f"rebuild of {version}: {STEPS.index(step) + 1}/{len(STEPS)} {step}\n")

    try:
        version = rebuild(cfg, build, report)
    except (RebuildError, SwapError) as exc:
        raise CliError(str(exc)) from exc
    sys.stderr.write(f"datastore version {version} is current on every shard and in {cfg.data / 'current'}\n")
    return 0
