"""EDD and PCT on tiny models: greedy identity with ``ar`` and the exact sampling distribution,
with drafts accepted; PCT's pruning against a brute-force expected-gain maximisation; the
drafter's incremental rows against the training forward's dual-block mask; options and
checkpoints; the trainer and its features on disk."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import torch

from helpers.models import (
    CPU_LIKE_CURVE,
    FLAT_CURVE,
    assert_modes_equal_ar,
    tiny_model,
)
from helpers.stats import VOCAB, assert_sampling_exact
from llm_worker.config import EngineConfig, ModelConfig, SamplingParams
from llm_worker.drafters import DRAFTERS, DraftResources, ModeUnavailableError, UnknownModeError
from llm_worker.drafters.base import DraftContext, RequestState, storage_bytes
from llm_worker.drafters.checkpoint import load_checkpoint
from llm_worker.drafters.edd import EddDrafter, EddNetwork, EddOptions, _State
from llm_worker.drafters.edd_net import EddNet, dual_block_allowed, edd_config_for, random_block_starts
from llm_worker.drafters.pct import acceptance, expand_order, gain, prune
from llm_worker.engine import Engine
from llm_worker.model import native, quant, wrap_model
from llm_worker.planner import CostCurve
from llm_worker.training.edd import EddTrainConfig, EddTrainer
from llm_worker.training.features import Sequence_, _teacher_forced
from llm_worker.training.trainer import batches
from llm_worker.types import DraftTree

MODES = ["edd", "edd+pct", "edd+pct:topk=2:width=2:depth=4"]


def own_sequences(model: Any, count: int, seed: int, layer: int, prompt_len: int = 12) -> list[Sequence_]:
    """``count`` random prompts continued greedily by ``model``, with layer ``layer``'s hidden
    states as EDD's features (``features.make_features`` stores them so); the loss covers the
    continuation."""
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    out = []
    for _ in range(count):
        prompt = torch.tensor([rng.integers(1, vocab - 1, size=prompt_len).tolist()])
        with torch.inference_mode():
            ids = model.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)[0].tolist()
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[prompt_len - 1 : -1] = True
        forced = _teacher_forced(model, [ids], None, (layer,))[0]
        states = {layer: forced.states[layer].half()}
        out.append(Sequence_(torch.tensor(ids), mask, None, None, forced.final[mask].half(), mask, states))
    return out


def train_tiny_edd(
    model: Any, info: Any, out_dir: Path, steps: int = 60, vocab: int | None = None
) -> tuple[Path, EddTrainer]:
    """Train ``edd`` for ``model`` on its own continuations and export it into ``out_dir``."""
    from llm_worker.drafters.edd_net import edd_config_for

    cfg = edd_config_for(model, vocab or model.config.vocab_size)
    train = own_sequences(model, 16, seed=1, layer=cfg.prompt_layer)
    heldout = own_sequences(model, 3, seed=2, layer=cfg.prompt_layer)
    counts = torch.bincount(torch.cat([e.tokens for e in train]), minlength=model.config.vocab_size)
    d2t = torch.sort(torch.argsort(counts, descending=True)[: cfg.draft_vocab]).values
    trainer = EddTrainer(
        cfg, model, d2t, train, heldout, EddTrainConfig(steps=steps, lr=2e-3, tokens_per_batch=512)
    )
    trainer.fit(out_dir / "edd.train-state.pt")
    target = {
        "weights_id": info.weights_id or info.fingerprint,
        "name": info.name,
        "vocab_size": info.vocab_size,
    }
    return trainer.export(out_dir / "edd", target, "tests/test_edd.py", {}), trainer


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """One torch thread for this module: the tiny forwards are far faster without a pool that
    spins on shared cores (10 training steps: 7 s with two threads on a loaded 2-core box, 0.05 s
    with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_edd(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, EddTrainer]:
    """A tiny Llama and a directory with its trained ``edd`` (64 of its 96 tokens drafted)."""
    model = tiny_model("llama", vocab=96)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    out = tmp_path_factory.mktemp("edd")
    _, trainer = train_tiny_edd(model, target.info, out, vocab=64)
    return model, out, trainer


def _reader(states: torch.Tensor) -> Callable[[int], torch.Tensor]:
    """A hand-built context's hidden-state reader: ``states`` [T-1, hidden] for the one layer."""
    return lambda layer: states


# -- losslessness ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["fast", "hf"])
@pytest.mark.parametrize("curve", [FLAT_CURVE, CPU_LIKE_CURVE], ids=["flat", "cpu"])
def test_greedy_equals_ar_and_drafts_are_accepted(
    tiny_edd: tuple[Any, Path, EddTrainer], backend: Literal["fast", "hf"], curve: CostCurve
) -> None:
    model, directory, _ = tiny_edd
    target = wrap_model(model, None, ModelConfig(backend=backend))
    engine = Engine(target, EngineConfig(), curve=curve, resources=DraftResources(drafters_dir=directory))
    assert_modes_equal_ar(engine, target, MODES, 48, backend)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)],
    ids=["t1", "t0.7-k5-p0.9"],
)
def test_sampling_matches_the_exact_distribution(params: SamplingParams, tmp_path: Path) -> None:
    model = tiny_model("llama", vocab=VOCAB, seed=3)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    train_tiny_edd(model, target.info, tmp_path, steps=30, vocab=6)  # two tokens the draft cannot name
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    engine = Engine(target, EngineConfig(), curve=FLAT_CURVE, resources=DraftResources(drafters_dir=tmp_path))
    assert_sampling_exact(engine, model, prompt, ["edd", "edd+pct"], params)


# -- PCT ------------------------------------------------------------------------------------------


def _random_tree(rng: random.Random, n: int) -> tuple[list[int], list[float]]:
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    confidence = [rng.choice([rng.random(), 0.5, 1.0]) for _ in range(n)]  # ties included
    return parents, confidence


def _closed(parents: list[int], nodes: tuple[int, ...]) -> bool:
    chosen = set(nodes)
    return all(parents[i] < 0 or parents[i] in chosen for i in nodes)


@pytest.mark.parametrize("seed", range(40))
def test_pct_prune_equals_brute_force(seed: int) -> None:
    """On small random trees and cost curves (linear, convex, concave, none), ``prune`` keeps a
    parent-closed set within the budget whose expected gain is the best of every such set."""
    rng = random.Random(seed)
    parents, confidence = _random_tree(rng, rng.randrange(1, 10))
    accept = acceptance(parents, confidence)
    base, slope, power = rng.uniform(0.02, 0.1), rng.uniform(0.0, 0.05), rng.choice([0.5, 1.0, 1.7])
    curves = [None, lambda n: base + slope * n**power]
    budget = rng.randrange(0, len(parents) + 2)
    for curve in curves:
        kept = prune(parents, accept, curve, budget)
        assert kept == sorted(kept) and len(kept) <= budget and _closed(parents, tuple(kept))
        best = max(
            gain(accept, subset, curve)
            for size in range(min(budget, len(parents)) + 1)
            for subset in itertools.combinations(range(len(parents)), size)
            if _closed(parents, subset)
        )
        assert gain(accept, kept, curve) == pytest.approx(best, abs=1e-12), (parents, accept, kept)


def test_pct_worked_examples() -> None:
    assert acceptance([-1, 0], [0.5, 0.5]) == [0.5, 0.25]
    chain = [-1, 0, 1]
    assert prune(chain, [0.9, 0.5, 0.2], lambda n: 1 + 0.3 * n, budget=8) == [0, 1]  # gains .6, .8, .7
    assert prune(chain, [0.9, 0.5, 0.2], None, budget=2) == [0, 1]
    assert prune(chain, [0.9, 0.5, 0.2], lambda n: 1 + 2.0 * n, budget=8) == []  # nothing pays
    # a free verify (a GPU's flat curve) expands whatever reaches min_reach, best first
    assert expand_order([1, 2], [0.9, 0.6, 0.01], 4, 0.05, None) == [1]
    assert expand_order([0, 1, 2], [0.9, 0.6, 0.3], 2, 0.0, lambda n: 1.0) == [0, 1]
    # on a steep curve only the likeliest node's children could pay
    assert expand_order([0, 1], [0.9, 0.2], 4, 0.0, lambda n: 1 + 0.5 * n) == [0]


# -- the network ----------------------------------------------------------------------------------


def test_dual_block_mask() -> None:
    starts = torch.tensor([[0, 0, 2, 2, 2]])
    allowed = dual_block_allowed(starts)[0, 0]  # [5 rows, 5 prompt + 5 token keys]
    assert allowed[3].tolist() == [True, True, False, False, False, False, False, True, True, False]
    assert allowed[1].tolist() == [False] * 5 + [True, True, False, False, False]
    starts = random_block_starts(40, 2, 3, torch.Generator().manual_seed(0))
    sizes = torch.unique_consecutive(starts, return_counts=True)[1].tolist()
    assert all(2 <= s <= 3 for s in sizes[:-1]) and starts[0] == 0


def test_drafter_rows_equal_the_training_forward(tiny_edd: tuple[Any, Path, EddTrainer]) -> None:
    """A chain drafted from root r, teacher-forced along the sequence, reads what the training
    forward reads with a block starting at r: the same logits at every depth."""
    model, directory, trainer = tiny_edd
    target = wrap_model(model, None, ModelConfig(backend="hf"))
    drafter = DRAFTERS.create("edd", target, DraftResources(drafters_dir=directory))
    assert isinstance(drafter, EddDrafter)
    example = trainer.heldout[0]
    ids = example.tokens.tolist()
    root, depth = 20, 4
    hidden = example.prompt.float()
    ctx = DraftContext(np.asarray(ids[: root + 1]), depth, hidden=_reader(hidden[:root]))
    with torch.inference_mode():
        state = drafter._catch_up(ctx)
        rows, block = drafter._rows(state, None, [ids[root]], root, [-1])
        chain = [rows[0]]
        for d in range(1, depth):
            rows, block = drafter._rows(state, block, [ids[root + d]], root + d, [d - 1])
            chain.append(rows[0])
        t = trainer._batch([example], torch.Generator().manual_seed(0))
        positions = torch.arange(len(ids))
        t["starts"] = torch.where(positions >= root, root, positions)[None]
        t["mask"] = ((positions >= root) & (positions < root + depth))[None]
        trainer.net.eval()
        full = trainer._logits(t)
    net = trainer.net  # the checkpoint holds fp16 roundings of these weights: compare loosely
    assert net.cfg == drafter.cfg
    torch.testing.assert_close(torch.stack(chain), full, atol=0.05, rtol=0.02)
    assert torch.equal(torch.stack(chain).argmax(-1), full.argmax(-1))


@pytest.mark.skipif(native.load() is None, reason="the fused kernels do not build here")
def test_fused_network_matches_the_torch_network() -> None:
    """On the fused kernels (weights rounded to 8-bit blocks first, so that rounding is a no-op)
    the drafter's rows are the torch network's: a chain, then a tree's rows (two children of one
    node, each reading only its own path), after a catch-up in two pieces and a divergence."""
    model = tiny_model("llama", vocab=96)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    torch.manual_seed(1)
    net = EddNet(edd_config_for(model, 64))
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() == 2:
                p.copy_(quant.round_to_eight_bit(p * 4))
    drafter = EddDrafter(EddNetwork.build(target, net, torch.arange(64)), EddOptions())
    fast = drafter.fast
    assert fast is not None
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 90, size=40).tolist()
    hidden = torch.randn(40, net.cfg.hidden_size, generator=torch.Generator().manual_seed(2)) * 3
    states = {True: RequestState(), False: RequestState()}

    def rows(
        fused: bool, root: int, tokens: list[int], steps: list[tuple[list[int], list[int]]]
    ) -> list[torch.Tensor]:
        drafter.fast = fast if fused else None
        ctx = DraftContext(
            np.asarray(tokens[: root + 1]), 8, hidden=_reader(hidden[:root]), request_state=states[fused]
        )
        state = drafter._catch_up(ctx)
        out, block = drafter._rows(state, None, [tokens[root]], root, [-1])
        found = [out]
        for depth, (chosen, parents) in enumerate(steps, start=1):
            out, block = drafter._rows(state, block, chosen, root + depth, parents)
            found.append(out)
        return found

    chain = [([ids[21]], [0]), ([ids[22]], [1])]
    tree = [([5, 7], [0, 0]), ([9, 11, 13], [1, 2, 2])]
    with torch.inference_mode():
        for root, tokens, steps in [(12, ids, chain), (20, ids, tree), (16, ids[:16] + [3] * 24, tree)]:
            fused_rows = rows(True, root, tokens, steps)
            torch_rows = rows(False, root, tokens, steps)
            for a, b in zip(fused_rows, torch_rows, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    kept = states[True].drafter
    assert isinstance(kept, _State) and kept.fused is not None and kept.fused.length == 16


# -- options and checkpoints ----------------------------------------------------------------------


def test_mode_options_are_checked_before_the_checkpoint(
    tiny_edd: tuple[Any, Path, EddTrainer], tmp_path: Path
) -> None:
    model, directory, _ = tiny_edd
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    DRAFTERS.create(
        "edd+pct:topk=3:width=2:depth=5:min_reach=0.1", target, DraftResources(drafters_dir=directory)
    )
    for bad in (
        "edd:topk=2",
        "edd:depth=0",
        "edd:min_reach=2",
        "edd:min_reach=nan",
        "edd+pct:min_reach=-inf",
        "edd+pct:topk=0",
        "edd+pct:width=x",
    ):
        with pytest.raises(UnknownModeError):
            DRAFTERS.create(bad, target, DraftResources(drafters_dir=tmp_path))  # no checkpoint there
    with pytest.raises(ModeUnavailableError, match="no edd drafter"):
        DRAFTERS.create("edd+pct", target, DraftResources(drafters_dir=tmp_path))


def test_every_spelling_of_both_modes_shares_one_network(tiny_edd: tuple[Any, Path, EddTrainer]) -> None:
    """``edd`` and ``edd+pct`` spelled 20 ways hold one network and one fused copy: the engine's
    drafters hold no more tensor bytes than one drafter does."""
    model, directory, _ = tiny_edd
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    engine = Engine(
        target, EngineConfig(), curve=FLAT_CURVE, resources=DraftResources(drafters_dir=directory)
    )
    first = engine.runtime("edd").drafter
    assert isinstance(first, EddDrafter)
    one = engine.drafter_bytes
    assert one == storage_bytes(first.tensors()) > 0
    for i in range(20):
        drafter = engine.runtime(f"edd{'+pct' if i % 2 else ''}:depth={1 + i}").drafter
        assert isinstance(drafter, EddDrafter)
        assert drafter.network is first.network and drafter.fast is first.fast
    assert engine.cached_modes == 21 and engine.drafter_bytes == one
    assert len(engine.resources.networks) == 1


def test_another_models_checkpoint_is_refused(tiny_edd: tuple[Any, Path, EddTrainer]) -> None:
    _, directory, _ = tiny_edd
    other = wrap_model(tiny_model("llama", vocab=96, seed=5), None, ModelConfig(backend="fast"))
    for mode in ("edd", "edd+pct"):
        with pytest.raises(ModeUnavailableError, match="trained for target"):
            DRAFTERS.create(mode, other, DraftResources(drafters_dir=directory))


def test_checkpoint_round_trips_and_a_glide_checkpoint_is_not_edd(
    tiny_edd: tuple[Any, Path, EddTrainer], tmp_path: Path
) -> None:
    model, directory, trainer = tiny_edd
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    ckpt = load_checkpoint(directory / "edd.json", target.info.weights_id, kind="edd")
    assert len(ckpt.d2t) == 64 and ckpt.config["prompt_layer"] == 1
    for key, value in trainer.net.state_dict().items():
        assert torch.equal(ckpt.weights[key], value.half().float()), key
    for name in ("edd.json", "edd.safetensors"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    (tmp_path / "edd.json").write_text(
        (tmp_path / "edd.json").read_text().replace('"kind": "edd"', '"kind": "glide"')
    )
    with pytest.raises(ModeUnavailableError, match="not 'edd'"):
        DRAFTERS.create("edd", target, DraftResources(drafters_dir=tmp_path))


# -- training -------------------------------------------------------------------------------------


def test_training_loss_falls_and_resume_continues(
    tiny_edd: tuple[Any, Path, EddTrainer], tmp_path: Path
) -> None:
    model, _, trained = tiny_edd
    losses = trained.losses
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses
    report_accuracy, positions = trained.evaluate()
    assert len(report_accuracy) == trained.net_cfg.max_block and max(report_accuracy) > 0 and positions
    seqs = own_sequences(model, 6, seed=1, layer=trained.net_cfg.prompt_layer)

    def make(steps: int, **kw: Any) -> EddTrainer:
        cfg = EddTrainConfig(steps=steps, tokens_per_batch=512, eval_every=2, **kw)
        return EddTrainer(trained.net_cfg, model, trained.d2t, seqs, seqs[:2], cfg)

    first = make(3)
    first.fit(tmp_path / "state.pt")
    resumed = make(5)
    report = resumed.fit(tmp_path / "state.pt")
    assert len(resumed.losses) == 5 and resumed.losses[:3] == first.losses
    # the held-out curve goes on from the saved one (the first run's final evaluation came after
    # its last save), against the answer tokens seen so far
    assert [point["step"] for point in report.curve] == [2, 4, 5]
    seen = [point["answer_tokens_seen"] for point in report.curve]
    assert seen == sorted(seen) and seen[0] > 0 and seen[1] > seen[0]
    per_step = [int(e.loss_mask.sum()) for e in seqs]
    assert seen[-1] <= 5 * sum(per_step) and report.curve[-1]["positions"] == report.heldout_positions
    with pytest.raises(ValueError, match="kl_weight"):
        make(5, kl_weight=0.5).load_state(tmp_path / "state.pt")
    other = EddTrainer(trained.net_cfg, model, trained.d2t.flip(0), seqs, [], EddTrainConfig(steps=3))
    with pytest.raises(ValueError, match="another draft vocabulary"):
        other.load_state(tmp_path / "state.pt")


@pytest.mark.parametrize("seconds", [None, lambda n: 0.05 + 0.003 * n], ids=["no-curve", "cpu-curve"])
def test_proposals_are_a_chain_and_a_tree_within_the_budget(
    tiny_edd: tuple[Any, Path, EddTrainer], seconds: Any
) -> None:
    """``edd`` proposes a chain; ``edd+pct`` a tree of at most ``budget`` nodes whose siblings
    differ, deeper than one level and wider than one node somewhere."""
    model, directory, trainer = tiny_edd
    target = wrap_model(model, None, ModelConfig(backend="hf"))
    resources = DraftResources(drafters_dir=directory)
    chain = DRAFTERS.create("edd:min_reach=0", target, resources)
    tree = DRAFTERS.create("edd+pct:min_reach=0:topk=3:width=3", target, resources)
    shapes = []
    for example in trainer.heldout:
        ids, prompt = example.tokens.tolist()[:30], example.prompt.float()[:29]
        for drafter, budget in ((chain, 5), (tree, 12)):
            ctx = DraftContext(np.asarray(ids), budget, hidden=_reader(prompt), verify_seconds=seconds)
            draft = drafter.propose(ctx)
            assert isinstance(draft, DraftTree) and 0 < len(draft) <= budget
            if drafter is chain:
                assert draft.parents == tuple(range(-1, len(draft) - 1))
                continue
            siblings = list(zip(draft.parents, draft.tokens, strict=True))
            assert len(set(siblings)) == len(siblings)
            shapes.append((max(draft.parents), len(draft) - len(set(draft.parents))))
    assert any(deepest >= 0 and leaves > 1 for deepest, leaves in shapes), shapes


def test_batches_built_ahead_train_exactly_as_built_in_step(
    tiny_edd: tuple[Any, Path, EddTrainer], tmp_path: Path
) -> None:
    """``ahead`` builds the next batches on the host in a background thread: the losses and the
    weights are bit for bit those of building each batch when its step comes, across epochs."""
    model, _, trained = tiny_edd
    seqs = own_sequences(model, 6, seed=1, layer=trained.net_cfg.prompt_layer)
    runs = []
    for ahead in (0, 3):
        cfg = EddTrainConfig(steps=9, tokens_per_batch=256, eval_every=4, ahead=ahead)
        trainer = EddTrainer(trained.net_cfg, model, trained.d2t, seqs, seqs[:2], cfg)
        trainer.fit(tmp_path / f"state-{ahead}.pt")
        runs.append(trainer)
    epochs = len(batches(runs[0].train, 256, random.Random(0)))
    assert epochs < 9  # the run crossed an epoch
    assert runs[0].losses == runs[1].losses and len(runs[0].losses) == 9
    for name, weight in runs[0].net.state_dict().items():
        assert torch.equal(weight, runs[1].net.state_dict()[name]), name
