"""GLIDE and CAPE on tiny models: greedy identity with ``ar`` and the exact sampling distribution,
with drafts accepted; checkpoints (round trip, another model refused, corruption); the pieces of
the network's masks and CAPE's table."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.glide import train_tiny_glide
from helpers.models import (
    CPU_LIKE_CURVE,
    FLAT_CURVE,
    assert_modes_equal_ar,
    prompts,
    rss_bytes,
    tiny_model,
)
from helpers.stats import VOCAB, assert_sampling_exact
from llm_worker.assembly import load_model
from llm_worker.config import EngineConfig, ModelConfig, SamplingParams
from llm_worker.drafters import DRAFTERS, DraftResources, ModeUnavailableError, UnknownModeError
from llm_worker.drafters.base import DraftContext, storage_bytes
from llm_worker.drafters.checkpoint import CheckpointMismatchError, load_checkpoint
from llm_worker.drafters.glide import GlideDrafter, cape_siblings, parse_cape
from llm_worker.drafters.glide_net import GlideConfig, GlideNet, block_limit, cross_allowed
from llm_worker.engine import Engine
from llm_worker.model import wrap_model
from llm_worker.model.target import TargetModel
from llm_worker.planner import CostCurve
from llm_worker.training.cape import CapeStats, derive_table
from llm_worker.types import ArtifactNeeds

MODES = ["glide", "glide:vanilla=1", "glide+cape", "glide:window=8"]


@pytest.fixture(scope="module")
def tiny_glide(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    """A tiny Llama and a directory with its trained ``glide`` and ``glide-vanilla`` (a draft
    vocabulary of 64 of its 96 tokens)."""
    model = tiny_model("llama", vocab=96)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    out = tmp_path_factory.mktemp("glide")
    train_tiny_glide(model, target.info, out, vocab=64)
    train_tiny_glide(model, target.info, out, vocab=64, vanilla=True)
    return model, out


@pytest.mark.parametrize("backend", ["fast", "hf"])
@pytest.mark.parametrize("curve", [FLAT_CURVE, CPU_LIKE_CURVE], ids=["flat", "cpu"])
def test_greedy_equals_ar_and_drafts_are_accepted(
    tiny_glide: tuple[object, Path], backend: str, curve: CostCurve
) -> None:
    model, directory = tiny_glide
    target = wrap_model(model, None, ModelConfig(backend=backend))
    engine = Engine(target, EngineConfig(), curve=curve, resources=DraftResources(drafters_dir=directory))
    assert_modes_equal_ar(engine, target, MODES, 64, backend)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)],
    ids=["t1", "t0.7-k5-p0.9"],
)
def test_sampling_matches_the_exact_distribution(params: SamplingParams, tmp_path: Path) -> None:
    model = tiny_model("llama", vocab=VOCAB, seed=3)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    train_tiny_glide(model, target.info, tmp_path, steps=60, vocab=6)  # two tokens the draft cannot name
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    engine = Engine(target, EngineConfig(), curve=FLAT_CURVE, resources=DraftResources(drafters_dir=tmp_path))
    assert_sampling_exact(engine, model, prompt, ["glide", "glide+cape"], params)


def test_training_loss_falls_and_resume_continues(tmp_path: Path) -> None:
    model = tiny_model("llama", vocab=96)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    _, trainer = train_tiny_glide(model, target.info, tmp_path, steps=40)
    first, last = sum(trainer.losses[:5]) / 5, sum(trainer.losses[-5:]) / 5
    assert last < first * 0.9, (first, last)
    # a second run with more steps starts where the first stopped
    _, resumed = train_tiny_glide(model, target.info, tmp_path, steps=50)
    assert len(resumed.losses) == 50 and resumed.losses[:40] == trainer.losses


def test_a_resume_on_other_data_or_settings_is_refused(
    tiny_glide: tuple[object, Path], tmp_path: Path
) -> None:
    """A training state is resumed only by the run it belongs to: another draft vocabulary (the
    data changed) or other settings are refused by name, and a damaged state file is a clear
    error, not a pickle traceback."""
    from dataclasses import replace

    model, _ = tiny_glide
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    _, trainer = train_tiny_glide(model, target.info, tmp_path, steps=3)
    state = tmp_path / "glide.train-state.pt"
    assert trainer.load_state(state)
    trainer.cfg = replace(trainer.cfg, steps=10)  # more steps: the same run, extended
    assert trainer.load_state(state)
    trainer.cfg = replace(trainer.cfg, lr=1e-4)
    with pytest.raises(ValueError, match="other settings \\(lr\\)"):
        trainer.load_state(state)
    trainer.cfg = replace(trainer.cfg, lr=2e-3)
    trainer.d2t = trainer.d2t.flip(0)
    with pytest.raises(ValueError, match="another draft vocabulary"):
        trainer.load_state(state)
    state.write_bytes(b"not a state")
    with pytest.raises(ValueError, match="not a readable training state"):
        trainer.load_state(state)


def test_checkpoint_round_trips(tiny_glide: tuple[object, Path]) -> None:
    model, directory = tiny_glide
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    ckpt = load_checkpoint(directory / "glide.json", target.info.weights_id)
    assert ckpt.kind == "glide" and len(ckpt.d2t) == 64 and ckpt.command
    net = GlideNet(GlideConfig.from_json(ckpt.config))
    net.load_state_dict(ckpt.weights)  # every tensor present, shapes right
    # stored in fp16: reloaded weights are the fp16 roundings
    state = torch.load(directory / "glide.train-state.pt", weights_only=False)["net"]
    for key, value in state.items():
        assert torch.equal(ckpt.weights[key], value.half().float()), key


def test_another_models_checkpoint_is_refused(tiny_glide: tuple[object, Path]) -> None:
    _, directory = tiny_glide
    other = wrap_model(tiny_model("llama", vocab=96, seed=5), None, ModelConfig(backend="fast"))
    with pytest.raises(CheckpointMismatchError, match="trained for target"):
        load_checkpoint(directory / "glide.json", other.info.weights_id)
    with pytest.raises(ModeUnavailableError, match="trained for target"):
        DRAFTERS.create("glide", other, DraftResources(drafters_dir=directory))


def test_corrupt_or_missing_checkpoint_is_unavailable(
    tiny_glide: tuple[object, Path], tmp_path: Path
) -> None:
    model, directory = tiny_glide
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    with pytest.raises(ModeUnavailableError, match="no glide drafter"):
        DRAFTERS.create("glide", target, DraftResources(drafters_dir=tmp_path))
    for name in ("glide.json", "glide.safetensors"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    data = bytearray((tmp_path / "glide.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / "glide.safetensors").write_bytes(bytes(data))
    with pytest.raises(ModeUnavailableError, match="checksum"):
        DRAFTERS.create("glide", target, DraftResources(drafters_dir=tmp_path))
    (tmp_path / "glide.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(ModeUnavailableError, match="not a format-1"):
        DRAFTERS.create("glide", target, DraftResources(drafters_dir=tmp_path))


def _rewrite(directory: Path, out: Path, edit_json=None, edit_tensors=None) -> None:  # type: ignore[no-untyped-def]
    """A copy of ``directory``'s glide checkpoint in ``out``, its JSON and tensors edited (the JSON's
    checksum follows the edited tensors)."""
    from safetensors.torch import load_file, save_file

    from specdraft.common import sha256_file

    record = json.loads((directory / "glide.json").read_text())
    tensors = load_file(str(directory / "glide.safetensors"))
    if edit_tensors is not None:
        edit_tensors(tensors)
    save_file(tensors, str(out / "glide.safetensors"))
    record["weights"]["sha256"] = sha256_file(out / "glide.safetensors")
    if edit_json is not None:
        edit_json(record)
    (out / "glide.json").write_text(json.dumps(record))


@pytest.mark.parametrize(
    ("edit_json", "edit_tensors", "message"),
    [
        (lambda r: r.pop("weights"), None, "malformed"),
        (lambda r: r.update(target="x"), None, "malformed"),
        (lambda r: r.update(config=None), None, "malformed"),
        (lambda r: r["config"].update(hidden_size="big"), None, "not a usable GLIDE checkpoint"),
        (lambda r: r["config"].update(surprise=1), None, "not a usable GLIDE checkpoint"),
        (lambda r: r["config"].update(intermediate_size=32), None, "not a usable GLIDE checkpoint"),
        (None, lambda t: t.update(draft_to_target=t["draft_to_target"] - 1), "not a list of token ids"),
        (None, lambda t: t.update(draft_to_target=t["draft_to_target"] + 1000), "beyond the target"),
        (None, lambda t: t.update(draft_to_target=t["draft_to_target"][:10]), "does not fit"),
    ],
    ids=["no-weights", "target", "config", "type", "field", "shapes", "negative", "beyond", "short"],
)
def test_a_malformed_checkpoint_is_unavailable_with_a_reason(
    tiny_glide: tuple[object, Path],
    tmp_path: Path,
    edit_json,
    edit_tensors,
    message: str,  # type: ignore[no-untyped-def]
) -> None:
    """Every way a checkpoint can be wrong is a ``ModeUnavailableError`` naming it, never a raw
    ``KeyError`` or ``RuntimeError``, and the worker's other modes stay listed."""
    model, directory = tiny_glide
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    _rewrite(directory, tmp_path, edit_json, edit_tensors)
    with pytest.raises(ModeUnavailableError, match=message):
        DRAFTERS.create("glide", target, DraftResources(drafters_dir=tmp_path))


def test_a_dotted_output_name_keeps_its_dots(tiny_glide: tuple[object, Path], tmp_path: Path) -> None:
    from llm_worker.drafters.checkpoint import save_checkpoint

    model, directory = tiny_glide
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    ckpt = load_checkpoint(directory / "glide.json", target.info.weights_id)
    for name in ("glide.v1", "glide.v2"):
        assert save_checkpoint(ckpt, tmp_path / name) == tmp_path / f"{name}.json"
        assert (tmp_path / f"{name}.safetensors").is_file()
        assert load_checkpoint(tmp_path / name).kind == "glide"


BAD_OPTIONS = (
    "glide:cape=1/1/1/1",
    "glide+cape:cape=9",
    "glide+cape:cape=a/b/c/d",
    "glide:depth=0",
    "glide:min_reach=nan",
    "glide:min_reach=inf",
    "glide+cape:min_reach=-inf",
    "glide:min_reach=1.5",
    "glide:window=-1",
    "glide:vanilla=2",
)


def test_mode_options_are_checked_before_the_checkpoint(
    tiny_glide: tuple[object, Path], tmp_path: Path
) -> None:
    """A bad option (NaN and infinities included) is refused as such (``UnknownModeError``), also
    where there is no checkpoint to load: the options are checked first."""
    model, directory = tiny_glide
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    DRAFTERS.create(
        "glide+cape:cape=3/2/1/0:depth=4:min_reach=0", target, DraftResources(drafters_dir=directory)
    )
    for bad in BAD_OPTIONS:
        for where in (directory, tmp_path):  # tmp_path: no checkpoint there
            with pytest.raises(UnknownModeError):
                DRAFTERS.create(bad, target, DraftResources(drafters_dir=where))
    with pytest.raises(ModeUnavailableError, match="no glide drafter"):
        DRAFTERS.create("glide", target, DraftResources(drafters_dir=tmp_path))


def test_every_spelling_of_a_mode_shares_one_network(tiny_glide: tuple[object, Path]) -> None:
    """20 spellings of ``glide`` and ``glide+cape`` hold one network, one fused copy and one pair
    of RoPE tables: the engine's drafters hold no more tensor bytes than one drafter does; the
    network is released with the last drafter that holds it."""
    model, directory = tiny_glide
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    engine = Engine(
        target, EngineConfig(), curve=FLAT_CURVE, resources=DraftResources(drafters_dir=directory)
    )
    first = engine.runtime("glide").drafter
    assert isinstance(first, GlideDrafter)
    one = engine.drafter_bytes
    assert one == storage_bytes(first.tensors()) > 0
    for i in range(20):
        drafter = engine.runtime(f"glide{'+cape' if i % 2 else ''}:window={1000 + i}").drafter
        assert isinstance(drafter, GlideDrafter)
        assert drafter.network is first.network and drafter.net is first.net and drafter.fast is first.fast
    assert engine.cached_modes == 21 and engine.drafter_bytes == one
    assert len(engine.resources.networks) == 1
    vanilla = engine.runtime("glide:vanilla=1").drafter
    assert isinstance(vanilla, GlideDrafter) and vanilla.network is not first.network  # another checkpoint
    assert len(engine.resources.networks) == 2
    del first, drafter, vanilla
    engine._modes.clear()
    gc.collect()
    assert len(engine.resources.networks) == 0


@pytest.mark.slow
def test_twenty_spellings_of_the_shipped_glide_cost_one_network(
    real_model: tuple[TargetModel, object],
) -> None:
    """Issue 34: each ``glide`` spelling loaded its own copy of the default model's drafter
    (+115 MiB RSS each). Now 20 spellings raise the process's RSS by less than one network's
    size plus 50 MB (the first spelling loads it)."""
    target, _ = real_model
    engine = Engine(target, EngineConfig(), curve=FLAT_CURVE)
    before = rss_bytes()
    network_bytes = 0
    for i in range(20):
        mode = f"glide{'+cape' if i % 2 else ''}:window={1000 + i}"
        engine.runtime(mode)
        network_bytes = network_bytes or engine.drafter_bytes
        grown = rss_bytes() - before
        assert grown < network_bytes + 50e6, (
            f"{mode}: RSS +{grown / 1e6:.0f} MB, a network {network_bytes / 1e6:.0f} MB"
        )
    assert engine.drafter_bytes == network_bytes and len(engine.resources.networks) == 1


def test_cape_table() -> None:
    assert [cape_siblings(c, (7, 5, 3, 1)) for c in (0.05, 0.3, 0.31, 0.7, 0.8, 0.95)] == [7, 7, 5, 3, 3, 1]
    assert parse_cape(None) == (7, 5, 3, 1) and parse_cape("4/3/2/0") == (4, 3, 2, 0)


def _root_context(target: TargetModel, prompt: list[int], budget: int) -> DraftContext:
    """A fresh request at its first decoding step: the target's cache holds all but the root."""
    state = target.start()
    target.forward(state, torch.tensor(prompt[:-1]), None, ArtifactNeeds(), last_logits_only=True)
    target.commit(state, range(len(prompt) - 1))
    return DraftContext(
        np.asarray(prompt, dtype=np.int64),
        budget,
        kv=lambda layer: target.kv(state, layer),
        kv_buffers=lambda layer: target.kv_buffers(state, layer),
    )


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_depth_ranks_see_what_the_chain_and_its_siblings_draft(
    tiny_glide: tuple[object, Path], backend: str
) -> None:
    """Teacher-forced along the draft's own greedy chain, every depth ranks the token first with
    the chain's confidence; CAPE's siblings at depth 1 are ranks 2 and 3."""
    model, directory = tiny_glide
    target = wrap_model(model, None, ModelConfig(backend=backend))
    resources = DraftResources(drafters_dir=directory)
    chain = DRAFTERS.create("glide:depth=4:min_reach=0", target, resources)
    cape = DRAFTERS.create("glide+cape:depth=1:cape=2/2/2/2", target, resources)
    assert isinstance(chain, GlideDrafter) and isinstance(cape, GlideDrafter)
    for prompt in prompts(target.info.vocab_size)[:3]:
        drafted = chain.propose(_root_context(target, prompt, 4))
        assert drafted.parents == (-1, 0, 1, 2)
        ranks = chain.depth_ranks(_root_context(target, prompt, 4), drafted.tokens)
        assert [rank for _, rank in ranks] == [1, 1, 1, 1]
        assert all(0 < top <= 1 for top, _ in ranks)
        first, second, third = cape.propose(_root_context(target, prompt, 3)).tokens
        for token, rank in ((first, 1), (second, 2), (third, 3)):
            assert chain.depth_ranks(_root_context(target, prompt, 1), [token])[0][1] == rank


def test_cape_table_is_derived_from_hit_rates() -> None:
    stats = CapeStats(ranks=6)
    for confidence, ranks in (
        (0.2, [1] * 50 + [2] * 20 + [3] * 20 + [4] * 1 + [0] * 9),
        (0.9, [1] * 98 + [2] * 2),
    ):
        for rank in ranks:
            stats.add(1, confidence, rank)
    # band (0, .3]: ranks 2 and 3 right 20 % of the time each, rank 4 1 %; band (.8, 1]: rank 2 2 %
    assert derive_table(stats, min_hit=0.05, min_positions=100) == (2, 5, 3, 0)  # bands 2, 3: the paper's
    assert derive_table(stats, min_hit=0.01, min_positions=100) == (3, 5, 3, 1)
    report = stats.to_json()
    assert report["positions"] == 200 and report["bands"][0]["hit_rate_by_rank"][:3] == [0.5, 0.2, 0.2]
    assert report["top1_accuracy_by_depth"] == {"1": 0.74}


def test_block_mask_makes_the_cache_stale_like_a_chain() -> None:
    positions = torch.arange(12)[None]
    assert block_limit(positions, 5)[0].tolist() == [0, 0, 0, 0, 0, 5, 5, 5, 5, 5, 10, 10]
    assert block_limit(positions, 5, shift=2)[0].tolist()[:8] == [-3, -3, 2, 2, 2, 2, 2, 7]
    allowed = cross_allowed(positions, 12, block_limit(positions, 5))[0, 0]  # [12 queries, 12 keys]
    assert allowed[7].tolist() == [True] * 5 + [False] * 7  # block 1 sees block 0 only
    assert allowed[2].tolist() == [True] + [False] * 11  # the first block sees position 0


def test_train_command_end_to_end_resumes_and_serves(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``specdraft train glide`` on a tiny model: prompts, answers, features, vocabulary, a few
    steps, a checkpoint; a second run with more steps continues; ``generate`` then runs the mode."""
    from client.cli import main

    out = tmp_path / "out" / "glide"
    argv = ["train", "glide", "--model", str(tiny_dir), "--work", str(tmp_path / "work"), "--out", str(out)]
    argv += [
        "--instructions",
        "2",
        "--local-tasks",
        "6",
        "--max-answer-tokens",
        "16",
        "--generate-batch",
        "8",
    ]
    argv += ["--vocab", "512", "--tokens-per-batch", "1024", "--data-dtype", "auto"]
    argv += ["--heldout-fraction", "0.3", "--quiet"]
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "data-dtype").write_text("float32\n")  # what an earlier run chose: kept
    assert main([*argv, "--steps", "3"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["data_dtype"] == "float32"
    assert first["answers"]["written"] >= 6 and first["features"]["train_tokens"] > 0
    assert first["vocabulary"]["coverage"] == 1.0 and first["training"]["steps"] == 3
    heldout = Path(first["heldout_questions"]).read_text().splitlines()
    assert heldout and all(json.loads(line)["category"].startswith("heldout-") for line in heldout)
    assert main([*argv, "--steps", "5"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["answers"]["skipped"] == first["answers"]["written"]  # nothing generated twice
    assert second["training"]["steps"] == 5
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["command"].startswith("specdraft train glide") and "--steps 5" in record["command"]
    gen = ["generate", "--model", str(tiny_dir), "--mode", "glide", "--drafters-dir", str(out.parent)]
    assert main([*gen, "--max-new-tokens", "8", "--json", "hello"]) == 0
    assert json.loads(capsys.readouterr().out)["mode"] == "glide"
    # CAPE's table from the held-out split train glide wrote, into the checkpoint's JSON
    cape = [
        "train",
        "cape",
        "--model",
        str(tiny_dir),
        "--work",
        str(tmp_path / "work"),
        "--checkpoint",
        str(out),
    ]
    assert main([*cape, "--max-new-tokens", "6", "--min-hit", "0.05", "--quiet"]) == 0
    derived = json.loads(capsys.readouterr().out)
    assert derived["turns"] == len(heldout) and derived["positions"] > 0
    meta = json.loads(out.with_suffix(".json").read_text())["meta"]
    assert meta["cape"]["table"] == derived["table"] and meta["cape"]["command"].startswith(
        "specdraft train cape"
    )
    load_checkpoint(out)  # the weights' checksum still holds
    target, _ = load_model(ModelConfig(path=str(tiny_dir), backend="fast"))
    drafter = DRAFTERS.create("glide+cape", target, DraftResources(drafters_dir=out.parent))
    assert isinstance(drafter, GlideDrafter) and drafter.cape == tuple(derived["table"])


def test_acceptance_by_depth() -> None:
    from llm_worker.stats import GenerationStats

    s = GenerationStats()
    s.observe_depths(4, 2)  # reaches 1..3, passes 1..2
    s.observe_depths(2, 0)  # reaches 1
    s.observe_depths(3, 3)  # reaches and passes 1..3
    assert s.depth_reached == [3, 2, 2] and s.depth_accepted == [2, 2, 1]
    assert s.to_json()["acceptance_by_depth"] == [round(2 / 3, 4), 1.0, 0.5]


def test_shipped_checkpoints_are_small_and_say_how_they_were_made() -> None:
    from llm_worker.drafters.checkpoint import load_checkpoint, shipped_dir

    root = shipped_dir("x").parent
    shipped = sorted(root.glob("*/*.json"))
    assert shipped, "no learned drafter ships with the package"
    for path in shipped:
        assert path.with_suffix(".safetensors").stat().st_size <= 20 * 2**20, path
        kind = json.loads(path.read_text())["kind"]
        ckpt = load_checkpoint(path, path.parent.name, kind=kind)  # the directory is the target's weights id
        assert ckpt.command.startswith(f"specdraft train {kind}"), ckpt.command


def test_logits_of_chosen_rows_equal_those_of_every_row() -> None:
    """The trainer asks for logits at loss positions only; they are the full forward's rows."""
    cfg = GlideConfig(32, 64, 4, 2, 8, draft_vocab=20, target_layer=0)
    torch.manual_seed(0)
    net = GlideNet(cfg).eval()
    x, cos, sin = torch.randn(2, 6, 32), torch.ones(2, 6, 8), torch.zeros(2, 6, 8)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    kv = (torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8))
    cross = cross_allowed(torch.arange(6)[None].expand(2, 6), 6, block_limit(torch.arange(6)[None], 3))
    rows = torch.rand(2, 6) > 0.5
    full, _ = net(x, cos, sin, allowed, kv, cross)
    chosen, _ = net(x, cos, sin, allowed, kv, cross, rows=rows)
    torch.testing.assert_close(chosen, full[rows])


def test_bulk_dtype_is_measured_and_one_of_the_candidates() -> None:
    from llm_worker.model.kernels import fastest_dtype

    assert fastest_dtype([torch.float32], 4, 16, 16) == torch.float32
    assert fastest_dtype([torch.float32, torch.bfloat16], 8, 64, 64) in (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("context_weight", [0.0, 0.5])
def test_prompt_positions_are_labels_only_when_weighted(context_weight: float) -> None:
    from helpers.glide import own_sequences
    from llm_worker.drafters.glide_net import glide_config_for
    from llm_worker.training.trainer import GlideTrainer, TrainConfig

    model = tiny_model("llama", vocab=96)
    seqs = own_sequences(model, 4, seed=3)
    d2t = torch.arange(96)
    cfg = TrainConfig(steps=2, context_weight=context_weight, tokens_per_batch=1024)
    trainer = GlideTrainer(glide_config_for(model, 96), model, d2t, seqs, seqs[:1], cfg)
    t = trainer._inputs(trainer.train[:2], [])
    rows, answers = int(t["labelled"].sum()), int(t["loss"].sum())
    assert rows == answers if context_weight == 0 else rows > answers
    assert len(t["labels"]) == len(t["hidden"]) == len(t["answer"]) == rows
    assert torch.isfinite(trainer.loss(trainer._inputs(trainer.train[:2], [0, 1])))


def test_a_drafters_state_matches_the_committed_tokens_up_to_their_first_difference() -> None:
    from llm_worker.drafters.base import shared_prefix

    assert shared_prefix(np.array([5, 6, 7]), np.array([5, 6, 9, 1])) == 2
    assert shared_prefix(np.array([5, 6]), np.array([5, 6, 9, 1])) == 2
    assert shared_prefix(np.empty(0, dtype=np.int64), np.array([5])) == 0
    assert shared_prefix(np.array([4, 6]), np.array([5, 6])) == 0


def test_batches_built_ahead_train_exactly_as_built_in_step(tmp_path: Path) -> None:
    """``ahead`` builds the next batches on the host in a background thread (each epoch's block
    shifts included): the losses and weights equal building each batch when its step comes."""
    from helpers.glide import own_sequences
    from llm_worker.drafters.glide_net import glide_config_for
    from llm_worker.training.trainer import GlideTrainer, TrainConfig

    model = tiny_model("llama", vocab=96)
    seqs = own_sequences(model, 6, seed=3)
    runs = []
    for ahead in (0, 3):
        cfg = TrainConfig(steps=9, tokens_per_batch=256, eval_every=4, ahead=ahead)
        trainer = GlideTrainer(glide_config_for(model, 96), model, torch.arange(96), seqs, seqs[:1], cfg)
        trainer.fit(tmp_path / f"state-{ahead}.pt")
        runs.append(trainer)
    assert runs[0].losses == runs[1].losses and len(runs[0].losses) == 9
    assert len(set(runs[0].shifts.values())) > 1
    for name, weight in runs[0].net.state_dict().items():
        assert torch.equal(weight, runs[1].net.state_dict()[name]), name
