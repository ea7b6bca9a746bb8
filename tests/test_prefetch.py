"""Retrieval from remote shards asked one step ahead (``rest``'s prefetch): what a prefetched
answer says after the step's tokens, losslessness over real shards on loopback, a slow shard that
costs candidates but no wait, and cancellation when a request ends or is abandoned."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datastore_svc.fanout import PendingSparse, RemoteDatastore
from datastore_svc.retrieval import Candidate, Retrieval, RetrievalConfig
from datastore_svc.shard import ShardState
from datastore_svc.store import DatastoreVersion, write_version
from helpers.datastores import datastore_engine, datastore_for, tiny_identity
from helpers.models import (
    FLAT_CURVE,
    DraftTally,
    assert_greedy_identical,
    engine_for,
    greedy_tokens,
    prompts,
    tiny_target,
)
from helpers.servers import ShardThread, SlowShard
from llm_worker.drafters.rest import continued
from llm_worker.engine import GenerationRequest

VOCAB = 96


class RecordingRemote(RemoteDatastore):
    """A ``RemoteDatastore`` that keeps every fan-out it prefetched."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[PendingSparse] = []

    def prefetch(self, context: np.ndarray, cfg: RetrievalConfig, version: str = "") -> PendingSparse:
        pending = super().prefetch(context, cfg, version)
        self.sent.append(pending)
        return pending


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 5, size=60).astype(np.int32) for _ in range(20)]  # few symbols: many matches
    path = tmp_path_factory.mktemp("prefetch") / "v1"
    write_version(docs, path, VOCAB, tiny_identity(VOCAB), shards=1)
    return path


def trie(result: Retrieval) -> dict[tuple[int, ...], int]:
    """Every path of a result's candidates with its count: the draft tree it makes."""
    return {c.tokens[: i + 1]: n for c in result.candidates for i, n in enumerate(c.counts)}


@settings(max_examples=60, deadline=None)
@given(
    context=st.lists(st.integers(0, 4), min_size=2, max_size=6),
    committed=st.lists(st.integers(0, 4), min_size=0, max_size=3),
)
def test_a_continued_answer_is_the_answer_for_the_longer_context(
    corpus: Path, context: list[int], committed: list[int]
) -> None:
    """Without sampling or pruning, an answer continued by the tokens committed since is the
    store's own answer for the longer context (brute force: the store asked again) — whenever it
    has candidates at all (else a shorter suffix of the longer context may match elsewhere) and
    the longer match stays within ``c_max``."""
    store = DatastoreVersion(corpus)
    unbounded = {"max_occurrences": 20_000, "max_nodes": 1024, "max_candidates": 1024}
    ahead = RetrievalConfig(c_max=16, max_length=9, **unbounded)
    later = RetrievalConfig(c_max=16, max_length=4, **unbounded)
    first = store.retrieve(np.array(context), ahead)
    got = continued(first, np.array(committed, dtype=np.int64), later.max_length)
    if not got.candidates or first.match_length + len(committed) > later.c_max:
        return
    want = store.retrieve(np.array(context + committed), later)
    assert got.match_length == want.match_length
    assert trie(got) == trie(want)


def test_continued_example_from_its_docstring() -> None:
    result = Retrieval((Candidate((9, 4, 5, 6), (5, 3, 2, 2)), Candidate((9, 2), (5, 2))), 3, 40, 5)
    got = continued(result, np.array([9, 4]), 10)
    assert [(c.tokens, c.counts) for c in got.candidates] == [((5, 6), (2, 2))]
    assert (got.match_length, got.sampled) == (5, 3)
    assert continued(result, np.array([7]), 10).candidates == ()
    cut = continued(result, np.array([], dtype=np.int64), 2)
    assert [c.tokens for c in cut.candidates] == [(9, 4), (9, 2)] and cut.occurrences == 40


@pytest.fixture()
def tiny_shards(tmp_path: Path) -> Iterator[tuple[Any, Path]]:
    target = tiny_target("llama")
    datastore_for(target, tmp_path / "v", shards=2)
    yield target, tmp_path / "v"


def test_prefetched_rest_over_real_shards_equals_ar_and_drafts(tiny_shards: tuple[Any, Path]) -> None:
    """``rest`` and ``rest-batch`` with prefetch: the same tokens as ``ar``, drafts accepted, each
    step's candidates from the fan-out sent during the step before (the first step drafts from the
    context alone); plain ``rest`` asks when drafting, as its shards are on this host."""
    target, path = tiny_shards
    servers = [ShardThread(ShardState.open(path, i)) for i in range(2)]
    try:
        remote = RecordingRemote([s.address for s in servers], deadline_seconds=5.0)
        engine = datastore_engine(target, remote)
        ref_engine = engine_for(target, FLAT_CURVE)
        tally = DraftTally()
        for mode in ("rest:prefetch=1", "rest-batch:prefetch=1", "rest:ctx=0:prefetch=1", "rest"):
            for i, prompt in enumerate(prompts(VOCAB)):
                ref = greedy_tokens(ref_engine, prompt, "ar", 40)
                res = engine.generate(GenerationRequest(tuple(prompt), 40, mode))
                assert_greedy_identical(target, prompt, ref, res.token_ids, f"{mode}/prompt{i}")
                tally.observe(mode, res.stats)
        tally.assert_every_mode_drafted_and_accepted("prefetch")
        times = remote.times.summary()
        assert times["prefetch"]["calls"] > 0
        assert times["sparse"]["calls"] > 0  # plain rest
        assert len(remote.sent) > times["sparse"]["calls"]
        assert all(call.done() for pending in remote.sent for call in pending.calls)  # none left open
        remote.close()
    finally:
        for s in servers:
            s.stop()


def test_a_slow_shard_costs_candidates_not_time(tmp_path: Path) -> None:
    """One shard answers in time, one only after 0.5 s (its deadline is 5 s, so asking when
    drafting, ``prefetch=0``, waits for it every step): with prefetch no step waits; the slow
    shard's late answers are counted and cancelled, and the output equals ``ar``'s."""
    target = tiny_target("llama")
    datastore_for(target, tmp_path / "v", shards=2)
    slow = SlowShard(DatastoreVersion(tmp_path / "v", shards=[1]), 1)
    servers = [ShardThread(ShardState.open(tmp_path / "v", 0)), ShardThread(slow)]
    try:
        remote = RecordingRemote([s.address for s in servers], deadline_seconds=5.0)
        engine = datastore_engine(target, remote)
        prompt = prompts(VOCAB)[0]
        ref = greedy_tokens(engine_for(target, FLAT_CURVE), prompt, "ar", 40)
        seconds = {}
        for mode in ("rest:prefetch=0", "rest:prefetch=1"):
            began = time.perf_counter()
            res = engine.generate(GenerationRequest(tuple(prompt), 40, mode))
            seconds[mode] = time.perf_counter() - began
            assert_greedy_identical(target, prompt, ref, res.token_ids, f"slow shard/{mode}")
        steps = len(remote.sent)  # rest's drafting steps, each sending the next one's retrieval
        assert steps >= 2 and remote.late[servers[1].address] >= steps - 1
        assert seconds["rest:prefetch=0"] >= 0.5  # it waited for the slow shard
        waited = f"the slow shard was waited for: {seconds}"
        assert seconds["rest:prefetch=1"] < seconds["rest:prefetch=0"] / 2, waited
        assert res.stats.accepted_tokens > 0  # the fast shard's candidates still drafted
        remote.close()
    finally:
        for s in servers:
            s.stop()


def test_prefetch_is_cancelled_when_a_stream_is_abandoned(tmp_path: Path) -> None:
    """A client that stops reading: the request's retrieval in flight is cancelled at once (its
    shard still sleeping), not left to run to its deadline."""
    target = tiny_target("llama")
    datastore_for(target, tmp_path / "v", shards=1)
    slow = SlowShard(DatastoreVersion(tmp_path / "v", shards=[0]), 0)
    server = ShardThread(slow)
    try:
        remote = RecordingRemote([server.address], deadline_seconds=30.0)
        engine = datastore_engine(target, remote)
        stream = engine.stream(GenerationRequest(tuple(prompts(VOCAB)[0]), 40, "rest:prefetch=1"))
        for _ in range(3):
            next(stream)
        assert remote.sent
        stream.close()
        last = remote.sent[-1].calls[0]
        assert last.done() and last.cancelled()
        remote.close()
    finally:
        server.stop()


def test_prefetch_by_default_only_from_shards_on_other_hosts() -> None:
    """Shards on loopback search on the cores the forward runs on: by default they are asked when
    drafting; shards elsewhere are asked ahead. ``prefetch=`` overrides either way."""
    from llm_worker.drafters.rest import RestDrafter

    cfg = RetrievalConfig()
    here = RemoteDatastore(["127.0.0.1:1", "localhost:2"])
    there = RemoteDatastore(["127.0.0.1:1", "shard-1.datastore:50061"])
    assert here.on_this_host and not there.on_this_host
    assert RestDrafter(here, cfg).prefetcher is None
    assert RestDrafter(here, cfg, prefetch=True).prefetcher is here
    assert RestDrafter(there, cfg).prefetcher is there
    assert RestDrafter(there, cfg, prefetch=False).prefetcher is None
    here.close()
    there.close()
