"""Captured steps (``llm_worker.model.graphs``): a forward replayed at its bucket of rows, padded
with rows in a slot of their own, gives bit for bit the eager forward's logits, artifacts and
cache entries. On CPU the same static buffers and padding run eagerly under Triton's interpreter
(no CUDA graph); on a GPU ``tests/test_cuda.py`` records and replays them."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers.models import FLAT_CURVE, DraftTally, engine_for, prompts, tiny_model
from llm_worker.config import ModelConfig
from llm_worker.engine import GenerationRequest
from llm_worker.model import wrap_model
from llm_worker.model.fast_llama import FastLlamaTarget
from llm_worker.model.graphs import BUCKETS, StepGraphs, bucket_of
from llm_worker.model.target import ForwardCall, ForwardOutput
from llm_worker.types import ArtifactNeeds
from llm_worker.verify.tree import tree_buffers

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (the dev extra pins it on x86-64 Linux)", allow_module_level=True)

# made now: Triton's interpreter is on while test modules are imported (conftest.py)
from llm_worker.model import ops_triton, triton_jit, triton_kernels

if not triton_kernels.available() or torch.cuda.is_available():
    # on a GPU, tests/test_cuda.py records and replays the steps
    pytest.skip("the interpreter's run of the captured steps", allow_module_level=True)
assert triton_jit.INTERPRETED

NEEDS = ArtifactNeeds(hidden_layers=frozenset({1, 2}), query_heads=((0, 1), (1, 3)))


def tiny(dtype: torch.dtype, graphs: bool, pool_slots: int = 16) -> FastLlamaTarget:
    """The same tiny random Llama (2 layers) on the Triton operations, with or without captured
    steps."""
    model = tiny_model("llama", layers=2).to(dtype=dtype)
    cfg = ModelConfig(
        backend="fast", dtype=str(dtype)[6:], ops="triton", cuda_graphs=graphs, kv_pool_slots=pool_slots
    )
    target = wrap_model(model, None, cfg)
    assert isinstance(target, FastLlamaTarget) and isinstance(target.ops, ops_triton.TritonOps)
    assert (target.graphs is not None) == graphs
    return target


def assert_same(got: list[ForwardOutput], want: list[ForwardOutput]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.logits, w.logits)
        assert g.artifacts.keys() == w.artifacts.keys()
        for key, value in w.artifacts.items():
            assert torch.equal(g.artifacts[key], value), key


def test_bucket_of_picks_the_smallest_bucket_that_holds_the_rows() -> None:
    assert [bucket_of(n) for n in (1, 2, 3, 5, 9, 33, 64, 65)] == [1, 2, 4, 8, 16, 64, 64, None]
    assert BUCKETS[-1] == 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_replayed_step_equals_the_eager_forward(dtype: torch.dtype) -> None:
    """A prefill that fits a bucket, a draft tree, two requests' rows in one forward and a prefill
    past the largest bucket (run eagerly): the same logits, artifacts and cache as the eager
    forward's."""
    eager, captured = tiny(dtype, False), tiny(dtype, True)
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 96, (61,), generator=gen)
    long_prompt = torch.randint(0, 96, (70,), generator=gen)  # past the largest bucket
    toks = torch.tensor([11, 22, 33, 44, 55])
    tree = tree_buffers((-1, 0, 1, -1))
    with torch.inference_mode():
        states = {t: (t.start(), t.start()) for t in (eager, captured)}
        outs: dict[FastLlamaTarget, list[list[ForwardOutput]]] = {eager: [], captured: []}
        for t, (state, other) in states.items():
            outs[t].append(t.forward_many([ForwardCall(state, prefix, None, NEEDS)]))
            t.commit(state, range(len(prefix)))
            outs[t].append(t.forward_many([ForwardCall(other, prefix[:9], None, NEEDS, True)]))
            t.commit(other, range(9))
            outs[t].append(t.forward_many([ForwardCall(state, toks, tree, NEEDS)]))
            two = [
                ForwardCall(other, torch.tensor([5, 6]), None, NEEDS),
                ForwardCall(state, toks, tree, NEEDS),
            ]
            outs[t].append(t.forward_many(two))
            t.commit(state, [0, 1])
            outs[t].append(t.forward_many([ForwardCall(other, long_prompt, None, NEEDS)]))
        for got, want in zip(outs[captured], outs[eager], strict=True):
            assert_same(got, want)
        for (state, other), (want_state, want_other) in ((states[captured], states[eager]),):
            for s, w in ((state, want_state), (other, want_other)):
                pairs = zip(captured.export_kv(s, 0, s.length), eager.export_kv(w, 0, w.length), strict=True)
                for got, want in pairs:  # the padding rows never wrote into a request's cache
                    assert torch.equal(got, want)
    graphs = captured.graphs
    assert isinstance(graphs, StepGraphs)
    # buckets 64, 16, 8 and 8 again (recorded once); the 70 rows ran eagerly
    assert graphs.replays == 4 and graphs.recorded == 3
    assert graphs.describe()["cuda_graphs"] is False


def test_the_steps_are_recorded_again_when_the_pool_grows() -> None:
    eager, captured = tiny(torch.float32, False), tiny(torch.float32, True)
    with torch.inference_mode():
        for t in (eager, captured):
            state = t.start()
            t.forward(state, torch.tensor([1, 2, 3]), None, NEEDS)
            t.commit(state, range(3))
        graphs = captured.graphs
        assert graphs is not None
        recorded = graphs.recorded
        more = {t: [t.start() for _ in range(3)] for t in (eager, captured)}  # the pool's slots double
        got = captured.forward_many(
            [ForwardCall(s, torch.tensor([7, 8]), None, NEEDS) for s in more[captured]]
        )
        want = eager.forward_many([ForwardCall(s, torch.tensor([7, 8]), None, NEEDS) for s in more[eager]])
    assert_same(got, want)
    assert graphs.recorded > recorded


def test_requests_with_caches_of_their_own_run_eagerly() -> None:
    eager, captured = tiny(torch.float32, False, pool_slots=0), tiny(torch.float32, True, pool_slots=0)
    with torch.inference_mode():
        got = captured.forward(captured.start(), torch.tensor([1, 2, 3]), None, NEEDS)
        want = eager.forward(eager.start(), torch.tensor([1, 2, 3]), None, NEEDS)
    assert_same([got], [want])
    assert captured.graphs is not None and captured.graphs.replays == 0


def test_greedy_modes_on_captured_steps_equal_ar() -> None:
    """``ar``, a chain mode and a tree mode on captured steps write the eager ``ar``'s tokens,
    with drafts accepted."""
    eager_engine = engine_for(tiny(torch.bfloat16, False), FLAT_CURVE)
    engine = engine_for(tiny(torch.bfloat16, True), FLAT_CURVE)
    tally = DraftTally()
    for prompt in prompts(96)[:2]:
        ref = eager_engine.generate(GenerationRequest(tuple(prompt), 10, "ar")).token_ids
        for mode in ("ar", "pld", "recycle"):
            res = engine.generate(GenerationRequest(tuple(prompt), 10, mode))
            assert res.token_ids == ref, mode
            if mode != "ar":
                tally.observe(mode, res.stats)
    tally.assert_every_mode_drafted_and_accepted("captured steps")
    assert engine.target.graphs is not None and engine.target.graphs.replays > 0  # type: ignore[attr-defined]


def test_captured_steps_need_the_triton_operations() -> None:
    model = tiny_model("llama", layers=1)
    with pytest.raises(ValueError, match="Triton operations"):
        wrap_model(model, None, ModelConfig(backend="fast", ops="torch", kernel="aten:1", cuda_graphs=True))


def test_a_bench_names_an_engine_on_captured_steps() -> None:
    """``specdraft bench`` and ``make gpu-check`` tell the two engines of one dtype apart."""
    from client.bench.runner import engine_label

    assert engine_label(engine_for(tiny(torch.float32, True))) == "float32+graphs"
    assert engine_label(engine_for(tiny(torch.float32, False))) == "float32"


def test_steps_first_recorded_under_inference_mode_serve_later_steps() -> None:
    """The cost curve's measurement runs its forwards under inference mode: the step buffers
    recorded then still take the engine's later steps (outside it)."""
    eager, captured = tiny(torch.float32, False), tiny(torch.float32, True)
    outs = {}
    for t in (eager, captured):
        state = t.start()
        with torch.inference_mode():
            first = t.forward(state, torch.tensor([1, 2, 3]), None, NEEDS)
        t.commit(state, range(3))
        with torch.no_grad():
            outs[t] = [first, t.forward(state, torch.tensor([4, 5, 6]), None, NEEDS)]
    for got, want in zip(outs[captured], outs[eager], strict=True):
        assert_same([got], [want])
    assert captured.graphs is not None and captured.graphs.replays == 2


def test_a_step_that_cannot_be_recorded_leaves_the_eager_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    from llm_worker.model import graphs as graphs_module

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    eager, captured = tiny(torch.float32, False), tiny(torch.float32, True)
    monkeypatch.setattr(graphs_module, "_Step", broken)
    with torch.inference_mode():
        got = captured.forward(captured.start(), torch.tensor([1, 2, 3]), None, NEEDS)
        want = eager.forward(eager.start(), torch.tensor([1, 2, 3]), None, NEEDS)
    assert_same([got], [want])
    assert captured.graphs is not None and "stream is capturing" in str(captured.graphs.failed)
    assert captured.graphs.describe()["failed"] == captured.graphs.failed


def test_captured_steps_need_the_triton_gemms() -> None:
    """cuBLAS would multiply a bucket's rows, not the step's: other bits than the eager step."""
    with pytest.raises(ValueError, match="Triton GEMMs"):
        wrap_model(
            tiny_model("llama", layers=1),
            None,
            ModelConfig(backend="fast", ops="triton", kernel="aten:1", cuda_graphs=True),
        )
