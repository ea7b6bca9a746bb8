"""Datastore benchmarks: a corpus of real local text, and retrieval latency in process and over gRPC.

``local_corpus`` gathers text every Debian + Python machine has — the Python standard library's
sources, then the plain-text files under /usr/share/doc — in a fixed order, up to a size, as
``{"text"}`` JSONL. ``code_questions`` writes Spec-Bench questions asking for standard-library
functions from their signature and docstring (a task set a code corpus covers).

``retrieval_latency`` times ``retrieve`` calls for contexts cut from the built-in suite's prompts
(what a worker would send while answering them): p50 / p99 / mean in milliseconds, and how often
something matched.
"""

from __future__ import annotations

import gzip
import inspect
import json
import os
import statistics
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from client.bench_grpc import percentile
from datastore_svc.retrieval import RetrievalConfig

DOC_ROOT = Path("/usr/share/doc")
TEXT_SUFFIXES = ("", ".txt", ".md", ".rst", ".gz")


def _stdlib_sources() -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        try:
            yield path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue


def _doc_texts() -> Iterator[str]:
    if not DOC_ROOT.is_dir():
        return
    for path in sorted(DOC_ROOT.rglob("*")):
        if not path.is_file() or path.suffix not in TEXT_SUFFIXES or path.name == "copyright":
            continue
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        if text.strip():
            yield text


def local_corpus(out: str | Path, max_chars: int) -> dict[str, int]:
    """Write up to ``max_chars`` of local text as JSONL (atomically); documents and chars written."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    docs = chars = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for source in (_stdlib_sources(), _doc_texts()):
            for text in source:
                if chars >= max_chars:
                    break
                text = text[: max_chars - chars]
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                docs += 1
                chars += len(text)
    os.replace(tmp, out)
    return {"documents": docs, "chars": chars}


def code_questions(out: str | Path, count: int) -> int:
    """Spec-Bench questions: implement a standard-library function from its signature and docstring."""
    import importlib

    names = ["textwrap", "json", "shlex", "fnmatch", "posixpath", "string", "calendar", "base64", "heapq"]
    questions: list[dict[str, Any]] = []
    for module_name in names:
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != module_name:
                continue
            doc = inspect.getdoc(obj)
            try:
                signature = str(inspect.signature(obj))
                inspect.getsource(obj)
            except (TypeError, ValueError, OSError):
                continue
            if not doc or len(doc) < 40:
                continue
            turn = (
                f"Write the Python function `{name}{signature}` from the `{module_name}` module. "
                f"Its documentation says:\n\n{doc[:600]}\n\nGive the complete implementation."
            )
            questions.append({"question_id": len(questions), "category": "code", "turns": [turn]})
    step = max(1, len(questions) // count)
    chosen = questions[::step][:count]
    Path(out).write_text("\n".join(json.dumps(q) for q in chosen) + "\n")
    return len(chosen)


def query_contexts(tokenizer: Any, count: int, length: int, seed: int = 0) -> list[np.ndarray]:
    """``count`` contexts of ``length`` tokens at random places of the built-in suite's prompts."""
    from llm_worker.bench.suite import builtin_suite

    rng = np.random.default_rng(seed)
    texts = [t for q in builtin_suite() for t in q.turns]
    streams = [np.array(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    streams = [s for s in streams if len(s) > length]
    out = []
    for _ in range(count):
        s = streams[int(rng.integers(len(streams)))]
        end = int(rng.integers(length, len(s) + 1))
        out.append(s[end - length : end])
    return out


def retrieval_latency(retriever: Any, contexts: list[np.ndarray], cfg: RetrievalConfig) -> dict[str, float]:
    """Milliseconds per ``retrieve`` call (p50, p99, mean) and the share of calls with candidates."""
    times, matched = [], 0
    for ctx in contexts:
        t0 = time.perf_counter()
        result, _ = retriever.retrieve(ctx, cfg)
        times.append((time.perf_counter() - t0) * 1000.0)
        matched += bool(result.candidates)
    return {
        "calls": len(times),
        "p50_ms": round(statistics.median(times), 3),
        "p99_ms": round(percentile(times, 0.99), 3),
        "mean_ms": round(statistics.fmean(times), 3),
        "matched": round(matched / max(len(times), 1), 3),
    }


def draftretriever_latency(
    shard_tokens: list[np.ndarray], separator: int, contexts: list[np.ndarray], workdir: Path
) -> dict[str, Any]:
    """The PyPI ``draftretriever`` (if installed) on the same tokens and contexts, called the way
    REST's generation loop calls its retriever (suffix spans 16..2, first hit wins, choices=64).

    Caution: ``draftretriever`` 0.1.1 on PyPI is the ADED fork of REST's DraftRetriever — a
    tri-gram table searched from the last two tokens, not a suffix array — so this compares
    latency and build cost, not identical retrieval.
    """
    import draftretriever

    docs: list[list[int]] = []
    for tokens in shard_tokens:
        values = np.asarray(tokens, dtype=np.int64)
        for doc in np.split(values, np.flatnonzero(values == separator) + 1):
            doc = doc[doc != separator]
            if len(doc) >= 3:
                docs.append(doc.tolist())
    path = workdir / "draftretriever.idx"
    t0 = time.perf_counter()
    writer = draftretriever.Writer(file_path=str(path), vocab_size=separator + 1)
    for ids in docs:
        writer.add_entry(ids)
    writer.finalize()
    del writer
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    reader = draftretriever.Reader(index_file_path=str(path))
    load = time.perf_counter() - t0
    times, matched = [], 0
    for ctx in contexts:
        query = [int(t) for t in ctx]
        if len(query) < 2:  # the library aborts the process on shorter queries
            continue
        t0 = time.perf_counter()
        for span in range(min(16, len(query)), 1, -1):
            found = reader.search(query[-span:], choices=64)
            if len(found[0]):
                matched += 1
                break
        times.append((time.perf_counter() - t0) * 1000.0)
    return {
        "library": "draftretriever " + _version("draftretriever"),
        "build_seconds": round(build, 3),
        "bytes_per_token": round(path.stat().st_size / max(sum(len(d) for d in docs), 1), 2),
        "load_seconds": round(load, 3),
        "calls": len(times),
        "p50_ms": round(statistics.median(times), 3),
        "p99_ms": round(percentile(times, 0.99), 3),
        "mean_ms": round(statistics.fmean(times), 3),
        "matched": round(matched / max(len(times), 1), 3),
    }


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)
