"""Continuous batching: requests share forwards, and each one's output is its output alone.

The fast backend's ``forward_many`` against each call alone (bit for bit: logits, hidden states,
queries); the engine with a batch scheduler against solo ``ar`` for concurrent requests of mixed
modes and lengths that join and leave mid-run (greedy, float32 and bfloat16), seeded sampling in
distribution, cancellation, a bad request beside good ones, and the planner under load.
"""

from __future__ import annotations

import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers.models import CPU_LIKE_CURVE, FLAT_CURVE, engine_for, prompts, tiny_model
from helpers.stats import SAMPLES, VOCAB, chi_square_p, exact_distribution
from llm_worker.batching import BatchingConfig
from llm_worker.config import EngineConfig, ModelConfig, PlannerConfig, SamplingParams
from llm_worker.drafters import DraftResources
from llm_worker.drafters.heads import HeadScore, HeadsFile, save_heads
from llm_worker.engine import Engine, GenerationRequest
from llm_worker.model import wrap_model
from llm_worker.model.fast_llama import FastLlamaTarget
from llm_worker.model.target import ForwardCall, TargetModel
from llm_worker.planner import ALONE, BatchLoad, CostCurve, DraftPlanner
from llm_worker.results import GenerationResult
from llm_worker.types import ArtifactNeeds, DraftTree
from llm_worker.verify.tree import tree_buffers

NEEDS = ArtifactNeeds(hidden_layers=frozenset({1, 2}), query_heads=((0, 1), (1, 3)))
MODES = ("ar", "pld", "pld+h:layer=1", "pld+a")


def fast_target(dtype: torch.dtype = torch.float32, vocab: int = 96, seed: int = 0) -> FastLlamaTarget:
    model = tiny_model("llama", vocab=vocab, seed=seed).to(dtype)
    target = wrap_model(model, None, ModelConfig(backend="fast", dtype=str(dtype).removeprefix("torch.")))
    assert isinstance(target, FastLlamaTarget)
    return target


@pytest.fixture(scope="module")
def heads_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("heads") / "tiny.json"
    return save_heads(HeadsFile("tiny", "x", (HeadScore(1, 0, 0.9), HeadScore(1, 3, 0.5)), 10, 1), path)


def batched(target: TargetModel, curve: CostCurve, heads: Path | None = None, **cfg: object) -> Engine:
    return Engine(
        target,
        EngineConfig(planner=PlannerConfig()),
        curve=curve,
        resources=DraftResources(heads_file=heads),
        batching=BatchingConfig(**cfg),  # type: ignore[arg-type]
    )


# -- one forward over several requests ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_many_equals_each_call_alone(dtype: torch.dtype) -> None:
    """A prefill chunk (last logits only), a decode row, a chain and a branching tree of four
    requests at different lengths in one forward: each output bit for bit as alone."""
    target = fast_target(dtype)
    gen = torch.Generator().manual_seed(0)

    def states() -> list:
        prefixes = torch.Generator().manual_seed(1)
        out = []
        for length in (0, 30, 250, 7):  # 250: the chain crosses a key-chunk boundary
            state = target.start()
            if length:
                target.forward(state, torch.randint(0, 96, (length,), generator=prefixes), None, NEEDS)
                target.commit(state, range(length))
            out.append(state)
        return out

    tokens = [torch.randint(0, 96, (n,), generator=gen) for n in (40, 1, 9, 4)]
    trees = [None, None, None, tree_buffers((-1, 0, -1))]
    last_only = [True, False, False, False]
    with torch.inference_mode():
        alone_states, together_states = states(), states()
        alone = [
            target.forward(s, t, tr, NEEDS, lo)
            for s, t, tr, lo in zip(alone_states, tokens, trees, last_only, strict=True)
        ]
        calls = [
            ForwardCall(s, t, tr, NEEDS, lo)
            for s, t, tr, lo in zip(together_states, tokens, trees, last_only, strict=True)
        ]
        together = target.forward_many(calls)
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert torch.equal(a.logits, b.logits), i
        assert a.hidden.keys() == b.hidden.keys() and a.queries.keys() == b.queries.keys()
        for layer in a.hidden:
            assert torch.equal(a.hidden[layer], b.hidden[layer]), (i, layer)
        for key in a.queries:
            assert torch.equal(a.queries[key], b.queries[key]), (i, key)
    for a, b in zip(alone_states, together_states, strict=True):  # the caches were written alike
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_grouped_attention_over_the_pool_equals_caches_of_their_own() -> None:
    """Two requests in a two-slot pool (their decode rows and trees attend as one group, or in one
    call of the fused attention), two
    beyond it (caches of their own, attention per call), one growing the pool's capacity past
    its first 512 positions: every output bit for bit that of a target without a pool; states
    that are collected give their slots back."""
    base = fast_target()
    pooled = FastLlamaTarget(base.model, base.info, base.kernels, pool_slots=2)
    private = FastLlamaTarget(base.model, base.info, base.kernels, pool_slots=0)
    if not pooled.grouped_attention and pooled.fused is None:
        pytest.skip("batched attention GEMMs are not batch-invariant on this machine")
    gen = torch.Generator().manual_seed(3)
    lengths = (5, 300, 40, 510)  # the last one's step crosses 512: the pool grows under the others
    prefixes = [torch.randint(0, 96, (n,), generator=gen) for n in lengths]
    steps = [torch.randint(0, 96, (n,), generator=gen) for n in (1, 4, 1, 3)]
    trees = [None, tree_buffers((-1, 0, 0)), None, None]

    def run(target: FastLlamaTarget) -> tuple[list, list]:
        states = []
        with torch.inference_mode():
            for prefix in prefixes:
                state = target.start()
                target.forward(state, prefix, None, NEEDS)
                target.commit(state, range(len(prefix)))
                states.append(state)
            calls = [ForwardCall(s, t, tr, NEEDS) for s, t, tr in zip(states, steps, trees, strict=True)]
            return target.forward_many(calls), states

    (together, states), (alone, _) = run(pooled), run(private)
    assert [s.pool is not None for s in states] == [True, True, False, False]
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert torch.equal(a.logits, b.logits), i
        for layer in a.hidden:
            assert torch.equal(a.hidden[layer], b.hidden[layer]), (i, layer)
    del states, together
    gc.collect()
    again = [pooled.start() for _ in range(3)]
    assert [s.pool is not None for s in again] == [True, True, False]


# -- the engine with a scheduler ----------------------------------------------------------------


def run_concurrently(engine: Engine, requests: list[GenerationRequest], stagger: float = 0.0) -> list:
    """Each request in its own thread, the i-th started ``i * stagger`` seconds after the first."""

    def one(i: int) -> GenerationResult:
        time.sleep(i * stagger)
        return engine.generate(requests[i])

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, range(len(requests))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_concurrent_requests_of_mixed_modes_equal_solo_ar(dtype: torch.dtype, heads_file: Path) -> None:
    """Eight requests (four modes, lengths 9 to 60, started 2 ms apart so that they join and
    leave while others run) through one scheduler: each output is solo ``ar``'s, and the
    forwards were shared."""
    target = fast_target(dtype)
    solo = engine_for(target, CPU_LIKE_CURVE, heads_file)
    engine = batched(target, CPU_LIKE_CURVE, heads_file)
    try:
        ps = prompts(target.info.vocab_size)
        requests = [
            GenerationRequest(tuple(ps[i % len(ps)]), 9 + 7 * i, MODES[i % len(MODES)], stop_at_eos=False)
            for i in range(8)
        ]
        results = run_concurrently(engine, requests, stagger=0.002)
        for req, res in zip(requests, results, strict=True):
            ref = solo.generate(
                GenerationRequest(req.prompt_ids, req.max_new_tokens, "ar", stop_at_eos=False)
            )
            assert res.token_ids == ref.token_ids, (dtype, req.mode, req.max_new_tokens)
        assert sum(r.stats.drafted_tokens for r in results) > 0
        assert sum(r.stats.accepted_tokens for r in results) > 0
        assert engine.scheduler is not None and engine.scheduler.mean_batch_size > 1.5
        assert engine.scheduler.active == 0  # every request left
    finally:
        engine.close()


def test_requests_that_stop_at_the_end_token_in_a_batch_equal_their_solo_runs(heads_file: Path) -> None:
    """Seeded requests that stop at the end-of-sequence token (some do, mid-batch; the others
    run to their length) through one scheduler: each equals its solo run, token for token."""
    target = fast_target()
    solo = engine_for(target, CPU_LIKE_CURVE, heads_file)
    engine = batched(target, CPU_LIKE_CURVE, heads_file)
    try:
        ps = prompts(target.info.vocab_size)
        requests = [
            GenerationRequest(
                tuple(ps[i % len(ps)]), 60, MODES[i % len(MODES)], SamplingParams(temperature=1.5, seed=i)
            )
            for i in range(8)
        ]
        results = run_concurrently(engine, requests, stagger=0.002)
        for req, res in zip(requests, results, strict=True):
            ref = solo.generate(req)
            assert (res.token_ids, res.finish_reason) == (ref.token_ids, ref.finish_reason), req.mode
        assert {r.finish_reason for r in results} == {"stop", "length"}
        assert engine.scheduler is not None and engine.scheduler.active == 0
    finally:
        engine.close()


def test_seeded_sampling_in_a_batch_follows_the_exact_distribution(heads_file: Path) -> None:
    """SAMPLES seeded generations, eight at a time through one scheduler, per mode: χ² against
    the enumerated distribution; and each equals its own seed's solo generation."""
    params = SamplingParams(temperature=1.3)
    model = tiny_model("llama", vocab=VOCAB, seed=3)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    dist = exact_distribution(model, prompt, params)
    solo = engine_for(target, FLAT_CURVE, heads_file)
    engine = batched(target, FLAT_CURVE, heads_file)
    try:
        for mode in ("ar", "pld"):

            def request(seed: int, mode: str = mode) -> GenerationRequest:
                sp = SamplingParams(params.temperature, seed=seed)
                return GenerationRequest(tuple(prompt), 3, mode, sp, stop_at_eos=False)

            with ThreadPoolExecutor(8) as pool:
                results = list(pool.map(lambda s: engine.generate(request(s)), range(SAMPLES)))
            counts: dict[tuple[int, ...], int] = {}
            for res in results:
                counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
            p = chi_square_p(counts, dist, SAMPLES)
            assert p > 1e-3, f"{mode}: batched samples do not follow the target distribution (p = {p:.2g})"
            for seed in range(0, SAMPLES, 250):
                assert results[seed].token_ids == solo.generate(request(seed)).token_ids, (mode, seed)
        assert engine.scheduler is not None and engine.scheduler.mean_batch_size > 1.5
    finally:
        engine.close()


def test_cancelling_one_request_leaves_the_others_unchanged(heads_file: Path) -> None:
    target = fast_target()
    solo = engine_for(target, CPU_LIKE_CURVE, heads_file)
    engine = batched(target, CPU_LIKE_CURVE, heads_file)
    try:
        ps = prompts(target.info.vocab_size)
        requests = [GenerationRequest(tuple(ps[i]), 48, MODES[i % 4], stop_at_eos=False) for i in range(4)]
        stopped = threading.Event()

        def cancelled() -> None:
            steps = engine.stream(GenerationRequest(tuple(ps[5]), 48, "pld", stop_at_eos=False))
            for _ in range(3):
                next(steps)
            steps.close()  # what the server does when a call is cancelled or its deadline passes
            stopped.set()

        canceller = threading.Thread(target=cancelled)
        canceller.start()
        results = run_concurrently(engine, requests)
        canceller.join()
        assert stopped.is_set()
        for req, res in zip(requests, results, strict=True):
            assert (
                res.token_ids
                == solo.generate(GenerationRequest(req.prompt_ids, 48, "ar", stop_at_eos=False)).token_ids
            )
        assert engine.scheduler is not None and engine.scheduler.active == 0
    finally:
        engine.close()


def test_a_bad_forward_fails_its_request_alone() -> None:
    """A request whose forward cannot run (here: past the model's context) gets the error; the
    requests that shared the forward get their outputs."""
    target = fast_target()
    engine = batched(target, FLAT_CURVE)
    try:
        assert engine.scheduler is not None
        good, bad = engine.scheduler.session(), engine.scheduler.session()
        state_good, state_bad = target.start(), target.start()
        state_bad.length = target.info.max_context  # as if full
        outputs: dict[str, object] = {}

        def call(name: str, session, state) -> None:
            try:
                outputs[name] = session.forward(state, torch.tensor([1, 2]), None, ArtifactNeeds())
            except ValueError as exc:
                outputs[name] = exc

        threads = [
            threading.Thread(target=call, args=("good", good, state_good)),
            threading.Thread(target=call, args=("bad", bad, state_bad)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert isinstance(outputs["bad"], ValueError) and "exceeds" in str(outputs["bad"])
        alone = target.forward(target.start(), torch.tensor([1, 2]), None, ArtifactNeeds())
        assert torch.equal(outputs["good"].logits, alone.logits)  # type: ignore[union-attr]
        good.close()
        bad.close()
    finally:
        engine.close()


def test_a_failed_forward_lets_go_of_its_request_state_at_once() -> None:
    """The error of a forward that failed does not keep the request's KV state alive (its
    traceback holds the scheduler's frame, which holds the request): without the garbage
    collector, the state is gone once the request has handled the error."""
    import weakref

    target = fast_target()
    engine = batched(target, FLAT_CURVE)
    gc.disable()
    try:
        assert engine.scheduler is not None
        session = engine.scheduler.session()
        states = [target.start()]
        states[0].length = target.info.max_context  # as if full: the forward fails
        ref = weakref.ref(states[0])
        seen: list[str] = []

        def call() -> None:
            try:
                session.forward(states.pop(), torch.tensor([1, 2]), None, ArtifactNeeds())
            except ValueError as exc:
                seen.append(str(exc))

        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
        assert seen and "exceeds" in seen[0]
        assert ref() is None, "the failed request's KV state is still referenced"
        session.close()
    finally:
        gc.enable()
        engine.close()


def test_a_fault_of_the_scheduler_fails_requests_instead_of_hanging_them() -> None:
    """A failing ``on_batch`` (the metrics) costs nothing; a fault in the scheduler's own loop
    fails the forwards waiting and every later one at once, and never leaves a request waiting."""
    target = fast_target()
    engine = batched(target, FLAT_CURVE)
    try:
        scheduler = engine.scheduler
        assert scheduler is not None

        def broken_metrics(record: object) -> None:
            raise ZeroDivisionError("metrics")

        scheduler.on_batch = broken_metrics
        req = GenerationRequest((1, 2, 3, 4), 6, "ar", stop_at_eos=False)
        assert len(engine.generate(req).token_ids) == 6

        def broken_take() -> list:
            raise RuntimeError("scheduler bug")

        scheduler._take = broken_take  # type: ignore[method-assign]
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(engine.generate, req) for _ in range(2)]
            for future in futures:
                with pytest.raises(RuntimeError, match="has stopped"):
                    future.result(timeout=30)
        with pytest.raises(RuntimeError, match="has stopped"):
            engine.generate(req)
    finally:
        engine.close()


def test_only_requests_expected_in_the_next_forward_count_as_load() -> None:
    """A request between steps for longer than the wait (a slow reader, or done but not closed)
    adds no load; one inside a step does."""
    engine = batched(fast_target(), FLAT_CURVE, max_wait_seconds=0.05)
    try:
        assert engine.scheduler is not None
        me, other = engine.scheduler.session(), engine.scheduler.session()
        other.last_rows, other.last_tokens = 3, 2.0
        other.step_ended = time.perf_counter() - 1.0  # left its last step a second ago
        assert me.load() == ALONE
        with other.step():
            assert me.load().rows == 3 and me.load().tokens == 2.0
        assert me.load().rows == 3  # just out of its step: still expected
        time.sleep(0.06)
        assert me.load() == ALONE
        me.close()
        other.close()
    finally:
        engine.close()


def test_forwards_respect_the_row_cap() -> None:
    target = fast_target()
    seen: list[int] = []
    engine = batched(target, FLAT_CURVE, max_rows=64)
    assert engine.scheduler is not None
    engine.scheduler.on_batch = lambda record: seen.append(record.rows)
    try:
        ps = prompts(96)
        long_prompt = tuple(ps[0] * 10)  # 320 tokens: a prefill chunk of 256 (EngineConfig.prefill_chunk)
        requests = [GenerationRequest(long_prompt, 8, "ar")] + [
            GenerationRequest(tuple(p), 8, "ar") for p in ps[1:4]
        ]
        run_concurrently(engine, requests)
        assert 256 in seen  # the first waiting forward always goes, whatever its size
        assert all(rows <= 64 for rows in seen if rows != 256)
    finally:
        engine.close()


def two_users_share(max_wait: float, a_inside: float, a_outside: float, b_delay: float) -> list[int]:
    """Requests per forward when A runs two steps and B one, over a target whose forward takes
    50 ms: A's steps do ``a_inside`` s of work after their forward inside the step and
    ``a_outside`` s after it; B starts its step ``b_delay`` s after A's first forward began."""
    target = fast_target()
    inner = target.forward_many
    running = threading.Event()

    def slow(calls):  # type: ignore[no-untyped-def]
        running.set()
        time.sleep(0.05)
        return inner(calls)

    target.forward_many = slow  # type: ignore[method-assign]
    records: list[int] = []
    engine = batched(target, FLAT_CURVE, max_wait_seconds=max_wait)
    assert engine.scheduler is not None
    engine.scheduler.on_batch = lambda record: records.append(record.requests)
    a, b = engine.scheduler.session(), engine.scheduler.session()

    def user_a() -> None:
        state = target.start()
        for _ in range(2):
            with a.step():
                a.forward(state, torch.tensor([1, 2]), None, ArtifactNeeds())
                target.commit(state, [0, 1])
                time.sleep(a_inside)
            time.sleep(a_outside)

    def user_b() -> None:
        running.wait()
        time.sleep(b_delay)
        with b.step():
            b.forward(target.start(), torch.tensor([3]), None, ArtifactNeeds())

    try:
        threads = [threading.Thread(target=user_a), threading.Thread(target=user_b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return records
    finally:
        a.close()
        b.close()
        engine.close()


def test_a_request_that_waited_through_a_forward_waits_for_those_it_woke() -> None:
    """B sends its forward while A's runs alone; when A's ends, B waits (up to ``max_wait``,
    counted from that end) for A's next one instead of going alone: one forward of both, not
    two half-full forwards alternating for ever."""
    assert two_users_share(max_wait=0.02, a_inside=0.002, a_outside=0.0, b_delay=0.0) == [1, 2]


def test_a_request_that_just_left_its_step_is_waited_for() -> None:
    """A server passes a step's tokens to its client between steps: B's forward (sent after A's
    first ended) waits for A's, whose request left its step a moment ago (within ``max_wait``),
    and both share one."""
    assert two_users_share(max_wait=0.5, a_inside=0.0, a_outside=0.1, b_delay=0.1) == [1, 2]


# -- the planner under load ---------------------------------------------------------------------


def draft_chain(k: int) -> DraftTree:
    return DraftTree.chain(list(range(1, k + 1)))


@pytest.mark.parametrize("per_token", [0.001, 0.003])
def test_speculation_backs_off_as_the_forward_fills(per_token: float) -> None:
    """With a curve whose every extra row costs ``per_token`` of a 10 ms forward: alone, a likely
    chain is verified; beside other requests in a big forward each node must pay for slowing them
    all, so fewer nodes are kept, and none once the forward is full; the drafts come back when
    the load goes."""
    curve = CostCurve.linear(0.010, per_token, sizes=(1, 65, 1025))
    planner = DraftPlanner(curve, PlannerConfig(prior_accept=0.7, prior_weight=1000.0))
    chain = draft_chain(8)

    def kept(load: BatchLoad) -> int:
        return len(planner.plan(chain, 100, 0.9, load=load).tree)

    alone = kept(ALONE)
    light = kept(BatchLoad(rows=3, tokens=3))
    heavy = kept(BatchLoad(rows=63, tokens=63))
    assert alone > 0
    assert light <= alone
    assert heavy == 0
    for _ in range(40):  # off means off: no exploring under load
        assert kept(BatchLoad(rows=63, tokens=63)) == 0
    assert kept(ALONE) == alone


def test_under_load_a_plan_pays_for_the_drafting_time_too() -> None:
    """Between forwards the scheduler waits for every request's step, so under load a plan is
    charged the request's drafting time: a draft whose nodes just pay for their rows is dropped
    once drafting takes a tenth of the forward; alone the time changes nothing (it is spent)."""
    curve = CostCurve.linear(0.010, 0.0005, sizes=(1, 65))
    planner = DraftPlanner(curve, PlannerConfig(prior_accept=0.5, prior_weight=1000.0))
    chain = draft_chain(2)

    def kept(load: BatchLoad) -> int:
        return len(planner.plan(chain, 100, 0.5, load=load).tree)

    assert kept(BatchLoad(rows=7, tokens=7)) > 0
    assert kept(BatchLoad(rows=7, tokens=7, draft_seconds=0.0015)) == 0
    assert kept(replace(ALONE, draft_seconds=0.0015)) == kept(ALONE) > 0
    load = BatchLoad(rows=7, tokens=7, draft_seconds=0.002)
    assert load.drafting_cost(curve, 1, 100) == load.cost(curve, 1, 100)  # the root alone: no drafting
    assert load.drafting_cost(curve, 3, 100) == pytest.approx(load.cost(curve, 3, 100) + 0.002)


def test_a_measured_batch_forward_prices_drafts_by_what_it_took() -> None:
    """The curve was measured with one request; a shared forward that took longer than t(rows)
    (each request's attention) makes extra rows relatively cheaper, never dearer."""
    curve = CostCurve.linear(0.010, 0.002, sizes=(1, 65))
    load = BatchLoad(rows=7, tokens=7, forward_rows=8, forward_seconds=0.05)
    assert load.cost(curve, 1, 100) == pytest.approx(0.05)
    assert load.cost(curve, 3, 100) == pytest.approx(0.05 + 2 * 0.002)
    assert ALONE.cost(curve, 3, 100) == pytest.approx(curve.t(3, 100))


def test_bench_concurrency_reports_the_documented_figures(heads_file: Path) -> None:
    from client.bench.concurrency import run_concurrency_levels

    target = fast_target()
    engine = engine_for(target, CPU_LIKE_CURVE, heads_file)
    ps = [list(p) for p in prompts(96)]
    refs = [engine.generate(GenerationRequest(tuple(p), 24, "ar")).token_ids for p in ps]
    report = run_concurrency_levels(engine, ps, refs, ["ar", "pld"], [1, 4], 24)
    keys = {
        "aggregate_tokens_per_second",
        "latency_p50_seconds",
        "latency_p95_seconds",
        "ttft_p50_seconds",
        "ttft_p95_seconds",
        "mean_batch_size",
        "draft_tokens_per_request_step",
        "identical_to_ar",
    }
    for mode in ("ar", "pld"):
        assert set(report[mode]) == {"1", "4"}
        for figures in report[mode].values():
            assert keys <= set(figures)
            assert figures["identical_to_ar"] is True and figures["outputs"] == len(ps)
        assert report[mode]["1"]["mean_batch_size"] == 1.0
        assert report[mode]["4"]["mean_batch_size"] > 1.0
