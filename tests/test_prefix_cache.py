"""The prefix cache: blocks against a brute-force model of what should be cached, eviction under
its memory bound, tenants kept apart, and reuse that changes no bit (the KV a hit copies equals a
fresh prefill's; every mode's output equals ``ar``'s without the cache, alone and batched, greedy
and seeded sampling, on the tiny model and the real one)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch

from helpers.models import CPU_LIKE_CURVE, tiny_model
from llm_worker.batching import BatchingConfig
from llm_worker.config import EngineConfig, ModelConfig, PlannerConfig, SamplingParams
from llm_worker.drafters import DraftResources
from llm_worker.engine import Engine, GenerationRequest
from llm_worker.model import ops_cpu, wrap_model
from llm_worker.model.fast_llama import FastLlamaTarget
from llm_worker.model.kv_pool import KVState
from llm_worker.model.ops import CallRows, shared_prefixes
from llm_worker.model.target import ForwardCall
from llm_worker.prefix_cache import PrefixCache, block_names
from llm_worker.types import ArtifactKey, ArtifactNeeds
from llm_worker.verify.tree import tree_buffers

VOCAB = 96
BLOCK = 8
KEY: ArtifactKey[Any] = ArtifactKey("hidden", 1)


def fake_export(tokens: list[int], recorded: bool = True) -> Any:
    """KV whose entries are the token ids, so a hit's content can be checked against the prompt
    (``recorded``: with a recorded artifact, the ids again)."""

    def export(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, dict[Any, torch.Tensor]]:
        ids = torch.tensor(tokens[start:stop], dtype=torch.float32)
        keys = ids.reshape(1, 1, -1, 1).expand(2, 1, -1, 4).clone()  # [layers, kv, n, d]
        values = ids.reshape(1, 1, -1, 1).expand(2, 1, -1, 5).clone()
        return keys, values, ({KEY: ids[:, None].clone()} if recorded else {})

    return export


def test_blocks_reused_by_longest_shared_prefix_and_last_token_always_runs() -> None:
    cache = PrefixCache(1 << 20, block_tokens=4)
    first = list(range(10))  # reusable: 9 tokens → 2 blocks
    assert cache.insert("", first, fake_export(first)) == 2
    second = [*range(8), 50, 51, 52]
    hit = cache.lookup("", second)
    assert hit is not None and hit.tokens == 8
    assert hit.keys[0, 0, :, 0].tolist() == list(range(8))
    # a prompt of exactly two blocks reuses one: its last token must run
    assert cache.lookup("", list(range(8))).tokens == 4  # type: ignore[union-attr]
    # diverging inside block 0: nothing
    assert cache.lookup("", [0, 1, 9, 3, 4, 5, 6, 7, 8]) is None
    # the namespace is part of every name: another tenant finds nothing
    assert cache.lookup("tenant-b", second) is None
    assert cache.stats.hit_tokens == 8 + 4
    assert cache.stats.queried_tokens == 8 + 4 + 8 + 8


def test_matches_a_brute_force_model_of_the_cache() -> None:
    """Random prompts over a small alphabet (many shared prefixes); with an unbounded cache a
    lookup must return exactly the longest prefix, in whole blocks, some earlier prompt covered."""
    rng = np.random.default_rng(3)
    cache = PrefixCache(1 << 30, block_tokens=3)
    seen: list[list[int]] = []
    for _ in range(200):
        prompt = rng.integers(0, 3, size=int(rng.integers(1, 14))).tolist()
        reusable = (len(prompt) - 1) // 3 * 3
        best = 0
        for earlier in seen:
            covered = (len(earlier) - 1) // 3 * 3
            n = 0
            while n + 3 <= min(reusable, covered) and earlier[n : n + 3] == prompt[n : n + 3]:
                n += 3
            best = max(best, n)
        hit = cache.lookup("", prompt)
        assert (hit.tokens if hit else 0) == best
        if hit:
            assert hit.keys[0, 0, :, 0].tolist() == prompt[:best]
        cache.insert("", prompt, fake_export(prompt))
        seen.append(prompt)


def test_eviction_keeps_the_bound_and_takes_deep_blocks_first() -> None:
    one_block = PrefixCache(1 << 20, block_tokens=4)
    one_block.insert("", list(range(5)), fake_export(list(range(5))))
    block_bytes = one_block.stored_bytes
    cache = PrefixCache(3 * block_bytes, block_tokens=4)
    a = list(range(13))  # 3 blocks
    cache.insert("", a, fake_export(a))
    assert cache.blocks == 3 and cache.stored_bytes <= cache.max_bytes
    b = [*range(4), 90, 91, 92, 93, 94]  # shares a's first block, adds one
    cache.insert("", b, fake_export(b))
    assert cache.stored_bytes <= cache.max_bytes and cache.blocks == 3
    assert cache.stats.evicted_blocks == 1
    # a's deepest block went; the shared first block and b's own stayed
    assert cache.lookup("", b).tokens == 8  # type: ignore[union-attr]
    assert cache.lookup("", a).tokens == 8  # type: ignore[union-attr]


def test_recorded_artifacts_join_blocks_cached_without_them() -> None:
    cache = PrefixCache(1 << 20, block_tokens=4)
    prompt = list(range(9))
    cache.insert("", prompt, fake_export(prompt, recorded=False))
    assert cache.lookup("", prompt, [KEY]) is None  # cached, but without the hidden states
    assert cache.insert("", prompt, fake_export(prompt), [KEY]) == 2
    hit = cache.lookup("", prompt, [KEY])
    assert hit is not None and hit.recorded[KEY][:, 0].tolist() == prompt[:8]


def test_off_when_sized_zero() -> None:
    cache = PrefixCache(0, block_tokens=4)
    assert cache.insert("", list(range(20)), fake_export(list(range(20)))) == 0
    assert cache.lookup("", list(range(20))) is None


# -- on a model ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target() -> FastLlamaTarget:
    wrapped = wrap_model(tiny_model("llama", vocab=VOCAB, seed=1), None, ModelConfig(backend="fast"))
    assert isinstance(wrapped, FastLlamaTarget)
    return wrapped


def engine(target: Any, cache_bytes: int, batching: BatchingConfig | None = None) -> Engine:
    config = EngineConfig(planner=PlannerConfig(), prefix_cache_bytes=cache_bytes, prefix_block_tokens=BLOCK)
    return Engine(target, config, curve=CPU_LIKE_CURVE, resources=DraftResources(), batching=batching)


def shared_prompts(count: int = 4, seed: int = 5) -> list[tuple[int, ...]]:
    """A 27-token 'system prompt' (copyable: it repeats itself) shared by every prompt, then each
    its own few tokens."""
    rng = np.random.default_rng(seed)
    system = rng.integers(1, VOCAB - 1, size=18).tolist()
    system = system + system[:9]
    return [tuple(system + rng.integers(1, VOCAB - 1, size=5 + i).tolist()) for i in range(count)]


def test_a_hit_copies_exactly_the_kv_a_fresh_prefill_computes(target: FastLlamaTarget) -> None:
    prompts = shared_prompts()
    cached = engine(target, 1 << 24)
    cached.generate(GenerationRequest(prompts[0], 4))
    hit = cached.prefix_cache.lookup("", prompts[1])  # type: ignore[union-attr]
    assert hit is not None and hit.tokens == 24
    state = target.start()
    target.forward(state, torch.tensor(prompts[1][:24]), None, ArtifactNeeds())
    target.commit(state, range(24))
    keys, values = target.export_kv(state, 0, 24)
    assert torch.equal(keys, hit.keys) and torch.equal(values, hit.values)


MODES = ("ar", "pld", "pld+h:layer=1", "suffix", "recycle", "fuse:sources=pld.suffix")


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_with_the_cache_equals_ar_without_it(target: FastLlamaTarget, mode: str) -> None:
    prompts = shared_prompts()
    plain = engine(target, 0)
    cached = engine(target, 1 << 24)
    for prompt in prompts:
        ref = plain.generate(GenerationRequest(prompt, 24, "ar"))
        got = cached.generate(GenerationRequest(prompt, 24, mode))
        assert got.token_ids == ref.token_ids
    assert got.stats.cached_prompt_tokens == 24
    assert cached.prefix_cache.stats.hit_tokens == 3 * 24  # type: ignore[union-attr]


def test_seeded_sampling_unchanged_by_the_cache(target: FastLlamaTarget) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    prompts = shared_prompts()
    plain, cached = engine(target, 0), engine(target, 1 << 24)
    for prompt in prompts:
        for mode in ("ar", "pld"):
            ref = plain.generate(GenerationRequest(prompt, 24, mode, params))
            got = cached.generate(GenerationRequest(prompt, 24, mode, params))
            assert got.token_ids == ref.token_ids


def test_tenants_do_not_share_prefixes(target: FastLlamaTarget) -> None:
    prompts = shared_prompts()
    cached = engine(target, 1 << 24)
    cached.generate(GenerationRequest(prompts[0], 4, tenant="a"))
    other = cached.generate(GenerationRequest(prompts[1], 4, tenant="b"))
    same = cached.generate(GenerationRequest(prompts[2], 4, tenant="a"))
    assert other.stats.cached_prompt_tokens == 0
    assert same.stats.cached_prompt_tokens == 24


def test_concurrent_batched_requests_equal_ar(target: FastLlamaTarget) -> None:
    prompts = shared_prompts(8, seed=9)
    plain = engine(target, 0)
    refs = [plain.generate(GenerationRequest(p, 20, "ar")).token_ids for p in prompts]
    batched = engine(target, 1 << 24, BatchingConfig())
    try:
        batched.generate(GenerationRequest(prompts[0], 2))  # the system prompt is cached once
        modes = ["ar", "pld", "suffix", "pld+h:layer=1"] * 2
        with ThreadPoolExecutor(8) as pool:
            results = list(
                pool.map(lambda i: batched.generate(GenerationRequest(prompts[i], 20, modes[i])), range(8))
            )
    finally:
        batched.close()
    assert [r.token_ids for r in results] == refs
    # modes that record no artifact reuse the warm-up's blocks (pld+h needs hidden states too:
    # its first requests prefill in full and add them)
    assert all(
        r.stats.cached_prompt_tokens >= 24 for r, m in zip(results, modes, strict=True) if "+h" not in m
    )


def test_the_transformers_path_never_uses_it() -> None:
    hf = wrap_model(tiny_model("llama", vocab=VOCAB, seed=1), None, ModelConfig(backend="hf"))
    assert not hf.prefix_reuse
    eng = engine(hf, 1 << 24)
    prompt = shared_prompts()[0]
    eng.generate(GenerationRequest(prompt, 2))
    assert eng.generate(GenerationRequest(prompt, 2)).stats.cached_prompt_tokens == 0


@pytest.mark.slow
@pytest.mark.parametrize("model", ["real_model", "real_model_bf16"])
def test_real_model_chat_with_a_shared_system_prompt_equals_ar(
    request: pytest.FixtureRequest, model: str, real_engine: Engine
) -> None:
    """Greedy and seeded sampling, float32 and bfloat16: with the cache, what ``ar`` gives
    without it (the float32 curve prices the bfloat16 drafts: planning only, never tokens)."""
    from llm_worker.chat import chat_prompt_ids

    target, tokenizer = request.getfixturevalue(model)
    system = (
        "You are the support assistant of a bicycle shop. Answer briefly and politely. The shop "
        "opens at nine and closes at six, repairs take two days, and every bike comes with a "
        "free first service within three months of purchase."
    )
    questions = ["When do you open?", "How long does a repair take?", "Is the first service free?"]
    prompts = [
        tuple(
            chat_prompt_ids(
                tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": q}]
            )
        )
        for q in questions
    ]
    curve, resources = real_engine.cost_curve, real_engine.resources
    plain = Engine(target, EngineConfig(prefix_cache_bytes=0), curve=curve, resources=resources)
    cached = Engine(target, EngineConfig(), curve=curve, resources=resources)
    for params in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=5)):
        for prompt in prompts:
            ref = plain.generate(GenerationRequest(prompt, 32, "ar", params))
            for mode in ("ar", "pld"):
                got = cached.generate(GenerationRequest(prompt, 32, mode, params))
                assert got.token_ids == ref.token_ids, (model, params, mode)
    assert cached.prefix_cache is not None and cached.prefix_cache.stats.hit_tokens > 0


def test_cli_default_agrees_with_the_engine_config() -> None:
    from client.cli.common import PREFIX_CACHE_MB

    assert EngineConfig().prefix_cache_bytes == PREFIX_CACHE_MB << 20


def test_shared_prefix_suite_shares_its_system_prompt() -> None:
    from client.bench.suite import builtin_suite, parse_question

    questions = builtin_suite("shared-prefix")
    assert len(questions) == 16 and len({q.system for q in questions}) == 1
    assert len(questions[0].system.split()) > 300
    assert questions[0].messages()[0] == {"role": "system", "content": questions[0].system}
    assert parse_question({"turns": ["hi"], "system": "be brief"}, "x:1", 1).system == "be brief"
    with pytest.raises(ValueError, match="'system' must be a string"):
        parse_question({"turns": ["hi"], "system": 3}, "x:1", 1)


def calls_of(*specs: tuple[int, int, tuple[bytes, ...]]) -> list[CallRows]:
    """(slot, committed length, names) → pooled calls of one row each, names in blocks of 4."""
    calls = []
    for row, (slot, start, names) in enumerate(specs):
        state = KVState(None, slot)
        state.prefix_names, state.prefix_block = names, 4
        calls.append(CallRows(state, row, 1, start, None, torch.tensor([start])))
    return calls


def test_shared_prefixes_read_the_longest_committed_common_prefix_from_the_lowest_slot() -> None:
    a, b, c, d = (bytes([i]) for i in range(4))
    x, y = b"x", b"y"
    plan = shared_prefixes(
        calls_of(
            (5, 20, (a, b, c)),  # the system prompt a b c
            (3, 14, (a, b, c, x)),  # 3 blocks of 4 committed (a b c): reads its own
            (6, 30, (a, b, c, x, y)),  # x y its own: slot 3 has not committed x
            (7, 9, (a, b, d)),  # 2 blocks committed: a b
            (2, 40, (d,)),  # nothing in common
            (1, 3, (a,)),  # its first block not committed yet
        )
    )
    assert plan == [(3, 12), (3, 0), (3, 12), (3, 8), (2, 0), (1, 0)]


def test_shared_prefixes_of_calls_without_names_share_nothing() -> None:
    assert shared_prefixes(calls_of((0, 10, ()), (1, 10, ()))) == [(0, 0), (1, 0)]


def test_batched_requests_under_one_system_prompt_equal_ar(target: FastLlamaTarget) -> None:
    """With or without the prefix cache, concurrent requests under one system prompt (which the
    forwards they share read from one slot: the next test) still decode ``ar``'s tokens alone."""
    prompts = shared_prompts(6, seed=21)
    plain = engine(target, 0)
    refs = [plain.generate(GenerationRequest(p, 20, "ar")).token_ids for p in prompts]
    modes = ["ar", "pld", "suffix"] * 2
    for cache_bytes in (0, 1 << 24):
        batched = engine(target, cache_bytes, BatchingConfig(max_wait_seconds=0.05))
        try:
            with ThreadPoolExecutor(6) as pool:
                requests = [GenerationRequest(p, 20, m) for p, m in zip(prompts, modes, strict=True)]
                results = list(pool.map(batched.generate, requests))
        finally:
            batched.close()
        assert [r.token_ids for r in results] == refs


def test_one_forward_over_requests_under_one_prompt_reads_it_once_with_the_same_logits(
    target: FastLlamaTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three pooled requests whose prompts share 24 tokens (3 blocks): in one forward the last two
    read those positions from the first one's slot, and every row's logits are bitwise those of
    its request's forward alone (a decode row, a chain of three, a tree)."""
    plans: list[list[tuple[int, int]]] = []

    def spy(calls: Any) -> list[tuple[int, int]]:
        plan = shared_prefixes(calls)
        plans.append(plan)
        return plan

    monkeypatch.setattr(ops_cpu, "shared_prefixes", spy)
    states = []
    for prompt in shared_prompts(3, seed=4):
        state = target.start()
        state.prefix_block = BLOCK
        state.prefix_names = tuple(block_names("", prompt, BLOCK, len(prompt) // BLOCK))
        target.forward(state, torch.tensor(prompt), None, ArtifactNeeds())
        target.commit(state, range(len(prompt)))
        states.append(state)
    tree = tree_buffers((-1, -1, 1))  # root, two children, a grandchild under the second
    calls = [
        ForwardCall(states[0], torch.tensor([5]), None, ArtifactNeeds()),
        ForwardCall(states[1], torch.tensor([7, 8, 9]), None, ArtifactNeeds()),
        ForwardCall(states[2], torch.tensor([3, 4, 6, 2]), tree, ArtifactNeeds()),
    ]
    alone = [target.forward(c.state, c.tokens, c.tree, c.needs).logits.clone() for c in calls]
    plans.clear()
    together = target.forward_many(calls)
    slots = [s.slot for s in states]  # type: ignore[attr-defined]
    assert plans == [[(min(slots), 24 if s != min(slots) else 0) for s in slots]]
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a, b.logits)
