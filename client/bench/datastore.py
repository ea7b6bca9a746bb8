"""Datastore benchmarks: a corpus of real local text, and retrieval latency in process and over gRPC.

``local_corpus`` gathers text every Debian + Python machine has — the Python standard library's
sources, then the plain-text files under /usr/share/doc — in a fixed order, up to a size, as
``{"text"}`` JSONL. ``code_questions`` writes Spec-Bench questions asking for standard-library
functions from their signature and docstring (a task set a code corpus covers).

``retrieval_latency`` times ``retrieve`` calls for contexts cut from the built-in suite's prompts
(what a worker would send while answering them): p50 / p99 / mean in milliseconds, and how often
something matched. ``draftretriever_latency`` does the same for the PyPI ``draftretriever``
indexed over the same tokens.

``replay_tau`` measures τ without the model and without timing: the target's greedy answers
(``greedy_references``, saved with ``save_references``) are replayed step by step against a
drafter's candidates, exactly as greedy speculative decoding would accept them — so τ of our
retriever and of ``draftretriever`` compare on the same tokens, independent of the hardware.
"""

from __future__ import annotations

import gzip
import inspect
import json
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from client.bench.timing import latency_ms
from datastore_svc.protocols import SparseRetriever
from datastore_svc.retrieval import RetrievalConfig
from specdraft.common import atomic_path, atomic_write_text
from specdraft.tokenizer import Tokenizer

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
    docs = chars = 0
    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for source in (_stdlib_sources(), _doc_texts()):
            for text in source:
                if chars >= max_chars:
                    break
                text = text[: max_chars - chars]
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                docs += 1
                chars += len(text)
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


def query_contexts(tokenizer: Tokenizer, count: int, length: int, seed: int = 0) -> list[np.ndarray]:
    """``count`` contexts of ``length`` tokens at random places of the built-in suite's prompts."""
    from client.bench.suite import builtin_suite

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


def retrieval_latency(
    retriever: SparseRetriever, contexts: list[np.ndarray], cfg: RetrievalConfig
) -> dict[str, float]:
    """Milliseconds per ``retrieve`` call (p50, p99, mean) and the share of calls with candidates."""
    times, matched = [], 0
    for ctx in contexts:
        t0 = time.perf_counter()
        result, _ = retriever.retrieve(ctx, cfg)
        times.append((time.perf_counter() - t0) * 1000.0)
        matched += bool(result.candidates)
    return {**latency_ms(times), "matched": round(matched / max(len(times), 1), 3)}


DRAFTRETRIEVER_MAX_NODES = 64  # draftretriever's draft buffers keep at most 64 nodes
DRAFTRETRIEVER_PAD = -2  # pads its paths to one length


def _draftretriever_docs(shard_tokens: list[np.ndarray], separator: int) -> list[list[int]]:
    docs: list[list[int]] = []
    for tokens in shard_tokens:
        values = np.asarray(tokens, dtype=np.int64)
        for doc in np.split(values, np.flatnonzero(values == separator) + 1):
            doc = doc[doc != separator]
            if len(doc) >= 3:
                docs.append(doc.tolist())
    return docs


def build_draftretriever(shard_tokens: list[np.ndarray], separator: int, path: Path) -> dict[str, Any]:
    """Index the datastore's documents with the PyPI ``draftretriever``: build time and size.

    Caution: ``draftretriever`` 0.1.1 on PyPI is the ADED fork of REST's DraftRetriever — a
    tri-gram table searched from the last two tokens (drafts up to 4 tokens deep, by a tree search
    over the table, which every search also adapts to its query), not a suffix array — so this
    compares cost and τ with that library, not identical retrieval.
    """
    import draftretriever

    docs = _draftretriever_docs(shard_tokens, separator)
    t0 = time.perf_counter()
    writer = draftretriever.Writer(file_path=str(path), vocab_size=separator + 1)
    for ids in docs:
        writer.add_entry(ids)
    writer.finalize()
    del writer
    return {
        "library": "draftretriever " + _version("draftretriever"),
        "build_seconds": round(time.perf_counter() - t0, 3),
        "bytes_per_token": round(path.stat().st_size / max(sum(len(d) for d in docs), 1), 2),
    }


class DraftRetrieverSearch:
    """A fresh ``draftretriever.Reader``, searched as REST's loop does.

    Each search also raises, in the reader's table, the tri-grams of the query's last 16 tokens
    (the library adapts to the context: a prompt lookup of sorts). ``longest_span=2`` sends only
    the last two tokens — the corpus table alone, unchanged by searches.
    """

    def __init__(self, path: Path, longest_span: int = 16) -> None:
        import draftretriever

        t0 = time.perf_counter()
        self.reader = draftretriever.Reader(index_file_path=str(path))
        self.load_seconds = time.perf_counter() - t0
        self.longest_span = longest_span

    def search(self, query: list[int]) -> list[list[int]]:
        """Suffix spans 16..2 of ``query``, first hit wins, choices=64: the hit's padded paths."""
        if len(query) < 2:  # the library aborts the process on shorter queries
            return []
        for span in range(min(self.longest_span, len(query)), 1, -1):
            found = self.reader.search(query[-span:], choices=64)
            if len(found[0]):
                return list(found[0])
        return []


def draftretriever_tree(
    paths: Sequence[Sequence[int]], max_nodes: int = DRAFTRETRIEVER_MAX_NODES
) -> list[tuple[int, ...]]:
    """The tree nodes (token paths) that draftretriever's draft buffers keep from its ``paths``.

    The library numbers each depth's distinct tokens in order of first appearance over the paths,
    names a node by the numbers along its path, sorts the names (shorter first, then
    lexicographically) and keeps the first 64: its mask and tree / retrieve indices cover only
    those. Example: paths [[9, 9, -2], [4, 5, 6]], max_nodes 3 → depth 0 numbers 9:0, 4:1, depth 1
    9:0, 5:1 → names (0,) (1,) (0, 0) (1, 1) (1, 1, 0) → kept (9,), (4,), (9, 9).
    """
    numbers: list[dict[int, int]] = []
    names: dict[tuple[int, ...], tuple[int, ...]] = {}
    for path in paths:
        tokens = [int(t) for t in path if t != DRAFTRETRIEVER_PAD]
        for depth, token in enumerate(tokens):
            if depth == len(numbers):
                numbers.append({})
            numbers[depth].setdefault(token, len(numbers[depth]))
        for depth in range(len(tokens)):
            node = tuple(tokens[: depth + 1])
            names[node] = tuple(numbers[d][t] for d, t in enumerate(node))
    return sorted(names, key=lambda node: (len(node), names[node]))[:max_nodes]


def draftretriever_proposer(searcher: DraftRetrieverSearch) -> Propose:
    def propose(context: np.ndarray) -> list[tuple[int, ...]]:
        return draftretriever_tree(searcher.search([int(t) for t in context[-16:]]))

    return propose


def draftretriever_latency(searcher: DraftRetrieverSearch, contexts: list[np.ndarray]) -> dict[str, Any]:
    """Milliseconds per search (p50, p99, mean) on the contexts ``retrieval_latency`` times."""
    times, matched = [], 0
    for ctx in contexts:
        query = [int(t) for t in ctx]
        if len(query) < 2:
            continue
        t0 = time.perf_counter()
        found = searcher.search(query)
        times.append((time.perf_counter() - t0) * 1000.0)
        matched += bool(found)
    return {**latency_ms(times), "matched": round(matched / max(len(times), 1), 3)}


# -- τ by replay --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReferenceRun:
    """A prompt and the target model's greedy continuation of it (what mode ``ar`` generates)."""

    prompt: tuple[int, ...]
    reference: tuple[int, ...]


Propose = Callable[[np.ndarray], Sequence[Sequence[int]]]
"""context ([T] ints, its last token the root) → candidate token sequences continuing the root."""


def draft_nodes(candidates: Sequence[Sequence[int]]) -> int:
    """Nodes of the candidates' trie (distinct non-empty prefixes): [[4, 2], [4, 9], [7]] → 4."""
    return len({tuple(c[: i + 1]) for c in candidates for i in range(len(c))})


def accepted_length(candidates: Sequence[Sequence[int]], target: Sequence[int]) -> int:
    """The longest path of the candidates' trie equal to a prefix of ``target``.

    Every trie path is a prefix of some candidate, so this is the longest common prefix of
    ``target`` with any candidate: [[4, 2], [4, 9, 1], [7]] and target [4, 9, 5] → 2.
    """
    best = 0
    for cand in candidates:
        n = 0
        for a, b in zip(cand, target, strict=False):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best


@dataclass
class ReplayStats:
    """Verification steps of a greedy generation replayed against its reference tokens.

    A step verifies one draft tree: its ``accepted`` tokens (the longest tree path the target
    agrees with) plus one bonus token (the target's own next token) are emitted, so
    τ = emitted / steps = 1 + accepted / steps.
    """

    steps: int = 0
    emitted: int = 0
    accepted: int = 0
    drafted_steps: int = 0  # steps with a non-empty draft
    nodes: int = 0  # draft tree nodes over all steps

    def observe_step(self, accepted: int, nodes: int) -> None:
        self.steps += 1
        self.emitted += accepted + 1
        self.accepted += accepted
        self.drafted_steps += nodes > 0
        self.nodes += nodes

    @property
    def tau(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    def to_json(self) -> dict[str, float]:
        steps = max(self.steps, 1)
        return {
            "tau": round(self.tau, 3),
            "mean_accepted": round(self.accepted / steps, 3),
            "drafted_share": round(self.drafted_steps / steps, 3),
            "mean_nodes": round(self.nodes / steps, 2),
            "steps": self.steps,
            "tokens": self.emitted,
        }


def replay_tau(runs: Sequence[ReferenceRun], propose: Propose) -> ReplayStats:
    """τ of a drafter under greedy decoding, without the model: replay the reference tokens.

    Under greedy decoding a draft token is accepted exactly when it equals the reference token at
    its position, so the steps of speculative decoding follow from the references alone. At
    generated position i the context is prompt + reference[: i + 1] (the root, reference[i], was
    emitted last); the drafter proposes candidates; the step accepts the longest trie path equal
    to reference[i + 1 :] and emits it plus the bonus token; i moves past them. The first token
    (the prompt's forward) is not a step. The last step's bonus token is the reference's last, so
    at most len(reference) - 2 - i drafts are accepted at position i. (The engine also caps a
    draft at the tokens still wanted, so an answer cut at max_new_tokens may take it a step or two
    more; answers that end with EOS take the same steps.)

    Example: reference [5, 6, 7, 8, 9], candidates always [[6, 7], [6, 9]]: at i = 0 (root 5)
    [6, 7] is accepted, 6 7 8 are emitted; at i = 3 (root 8) nothing is accepted, 9 is emitted →
    2 steps, 4 tokens, τ = 2.0.
    """
    stats = ReplayStats()
    for run in runs:
        full = np.asarray(run.prompt + run.reference, dtype=np.int64)
        start, n = len(run.prompt), len(run.reference)
        i = 0
        while i < n - 1:
            candidates = propose(full[: start + i + 1])
            target = run.reference[i + 1 :]
            accepted = min(accepted_length(candidates, target), len(target) - 1)
            stats.observe_step(accepted, draft_nodes(candidates))
            i += accepted + 1
    return stats


def specdraft_proposer(retriever: Any, cfg: RetrievalConfig, fuse_separator: int | None = None) -> Propose:
    """The ``rest`` drafter itself (``RestDrafter.retrieve``) over ``retriever``: the candidates'
    paths it would draft from; with ``fuse_separator`` the context's own continuations fused in
    (``rest``'s default, ``ctx=1``)."""
    from llm_worker.drafters.base import DraftContext, RequestState
    from llm_worker.drafters.rest import RestDrafter

    drafter = RestDrafter(retriever, cfg, fuse_separator=fuse_separator)
    request_state = RequestState()  # one replay is one request: pinned to one version

    def propose(context: np.ndarray) -> list[tuple[int, ...]]:
        result = drafter.retrieve(
            DraftContext(np.asarray(context, dtype=np.int64), 0, request_state=request_state)
        )
        return [c.tokens for c in result.candidates] if result is not None else []

    return propose


def greedy_references(
    engine: Any, tokenizer: Tokenizer, questions: Sequence[Any], max_new_tokens: int
) -> list[tuple[str, int, ReferenceRun]]:
    """(question id, turn, run) per turn: ``ar``'s answers, prompted exactly as ``specdraft bench`` does."""
    from client.bench.runner import run_turns
    from client.bench.runners import RunOutcome, engine_runner

    ar = engine_runner(engine, "ar")
    prompts: list[list[int]] = []  # the prompts of the current question's turns

    def recording(prompt: list[int], max_new: int) -> RunOutcome:
        prompts.append(list(prompt))
        return ar(prompt, max_new)

    out: list[tuple[str, int, ReferenceRun]] = []
    for question in questions:
        prompts.clear()
        outcomes = run_turns(recording, tokenizer, question, max_new_tokens)
        for turn, (prompt, outcome) in enumerate(zip(prompts, outcomes, strict=True)):
            out.append((question.question_id, turn, ReferenceRun(tuple(prompt), tuple(outcome.token_ids))))
    return out


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def save_references(
    path: str | Path, runs: Sequence[tuple[str, int, ReferenceRun]], meta: dict[str, Any]
) -> None:
    """``meta`` (who generated, how many new tokens) and the runs as JSON, written atomically."""
    payload = {
        **meta,
        "runs": [
            {"question_id": qid, "turn": turn, "prompt": list(r.prompt), "reference": list(r.reference)}
            for qid, turn, r in runs
        ],
    }
    atomic_write_text(path, json.dumps(payload) + "\n")


def load_references(path: str | Path) -> tuple[dict[str, Any], list[ReferenceRun]]:
    """The meta fields and runs ``save_references`` wrote; ValueError if the file is not one."""
    try:
        payload = json.loads(Path(path).read_text())
        runs = [ReferenceRun(tuple(r["prompt"]), tuple(r["reference"])) for r in payload.pop("runs")]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path} is not a references file: {exc!r}") from None
    return payload, runs
