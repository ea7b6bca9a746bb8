"""Tiny models, targets and engines; greedy identity with ``ar`` and the drafting that makes it
mean something; cost curves; the tiny models' test prompts; the process's resident memory."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llm_worker.config import EngineConfig, ModelConfig, PlannerConfig
from llm_worker.drafters import DraftResources
from llm_worker.engine import Engine, GenerationRequest
from llm_worker.model import wrap_model
from llm_worker.model.target import TargetModel
from llm_worker.planner import CostCurve
from llm_worker.stats import GenerationStats
from llm_worker.types import ArtifactNeeds

# -- cost curves ---------------------------------------------------------------------------------

FLAT_CURVE = CostCurve.linear(0.05, 0.0)
"""GPU-like: a forward costs the same at any size, so the planner verifies every node it gets."""

CPU_LIKE_CURVE = CostCurve.linear(0.05, 0.003)
"""CPU-like: verifying n tokens costs 1 + 0.06 (n - 1) single-token forwards."""

BACKEND_CASES = [
    ("llama", "fast", FLAT_CURVE),
    ("llama", "fast", CPU_LIKE_CURVE),
    ("llama", "hf", CPU_LIKE_CURVE),
    ("gpt2", "hf", FLAT_CURVE),
]
"""(model kind, backend, cost curve) for the lossless tests of datastore modes."""
BACKEND_IDS = ["llama-fast-flat", "llama-fast-cpu", "llama-hf-cpu", "gpt2-hf-flat"]


# -- tiny models ---------------------------------------------------------------------------------


def tiny_model(
    kind: str = "llama", vocab: int = 96, seed: int = 0, layers: int = 2, head_dim: int = 16
) -> Any:
    """A randomly initialised causal LM small enough to run thousands of forwards in a test
    (``head_dim``: a Llama's)."""
    import transformers

    torch.manual_seed(seed)
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=vocab - 1,
        bos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, head_dim=head_dim)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=None)
        model = transformers.MistralForCausalLM(cfg)
    elif kind == "gpt2":  # not Llama-family: exercises the generic transformers backend
        cfg = transformers.GPT2Config(
            vocab_size=vocab, n_embd=64, n_layer=layers, n_head=4, n_positions=1024, eos_token_id=vocab - 1
        )
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        raise ValueError(kind)
    # Random init has tiny logits; scale the output layer so that the distribution is peaked
    # enough to produce repeats (drafts sometimes right) yet not degenerate.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval().requires_grad_(False)


def exact_blocks(w: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """``w`` [n, k] (k a multiple of 32) moved to the nearest weights that are exact blocks of 32:
    ``d * q + m`` with q in 0..15 (bits=4, GGUF's Q4_1) or ``d * q`` with q in -128..127 (bits=8,
    Q8_0), d and m float16 — as the default model's GGUF weights de-quantise."""
    blocks = w.float().reshape(w.shape[0], -1, 32)
    if bits == 4:
        m = blocks.amin(-1, keepdim=True).half().float()
        d = ((blocks.amax(-1, keepdim=True) - m) / 15).half().float()
        q = ((blocks - m) / torch.where(d > 0, d, 1)).round().clamp(0, 15)
        return (d * q + m).reshape(w.shape)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    q = (blocks / torch.where(d > 0, d, 1)).round().clamp(-128, 127) + 0.0  # no -0.0: an int8 has none
    return (d * q).reshape(w.shape)


def snap_to_blocks(model: Any) -> Any:
    """Every linear weight of ``model`` made exact 4-bit blocks and its LM head 8-bit blocks (the
    default model's GGUF layout), so that the ``quant`` GEMM kernel can run it."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(exact_blocks(module.weight, 8 if name == "lm_head" else 4))
    return model


def tiny_target(kind: str = "llama", backend: str = "auto", **kw: Any) -> TargetModel:
    return wrap_model(tiny_model(kind, **kw), None, ModelConfig(backend=backend))  # type: ignore[arg-type]


def engine_for(
    target: TargetModel,
    curve: CostCurve = CPU_LIKE_CURVE,
    heads_file: Path | None = None,
    **planner: Any,
) -> Engine:
    """An engine of ``target`` with ``curve``; ``heads_file``: the induction heads pld+a reads."""
    return Engine(
        target,
        EngineConfig(planner=PlannerConfig(**planner)),
        curve=curve,
        resources=DraftResources(heads_file=heads_file),
    )


def prompts(vocab: int) -> list[list[int]]:
    """Six prompts of a tiny model: even ones repeat their first 12 tokens (copyable), odd ones
    are random (drafts mostly wrong)."""
    rng = np.random.default_rng(7)
    out = []
    for i in range(6):
        body = rng.integers(1, vocab - 1, size=20).tolist()
        out.append(body + body[:12] if i % 2 == 0 else body)
    return out


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """One user turn through the model's chat template."""
    from llm_worker.chat import chat_prompt_ids

    return chat_prompt_ids(tokenizer, [{"role": "user", "content": text}])


# -- greedy identity with ar ----------------------------------------------------------------------


def greedy_tokens(engine: Engine, prompt: Sequence[int], mode: str, max_new: int) -> list[int]:
    return engine.generate(GenerationRequest(tuple(prompt), max_new, mode)).token_ids


NEAR_TIE = 1e-4


@dataclass
class DivergenceLog:
    """Greedy divergences excused at near-ties (top-2 margin < ``NEAR_TIE``) on the hf backend
    alone; ``conftest.pytest_terminal_summary`` reports them at the end of the run."""

    excused: list[str] = field(default_factory=list)


EXCUSED_DIVERGENCES = DivergenceLog()


def top2_margins(target: TargetModel, prompt: Sequence[int], generated: Sequence[int]) -> torch.Tensor:
    """[len(generated)] reference top-2 logit margin at each generated position (one
    teacher-forced forward)."""
    seq = torch.tensor([*prompt, *generated[:-1]], dtype=torch.long)
    with torch.inference_mode():
        state = target.start()
        out = target.forward(state, seq, None, ArtifactNeeds())
    top2 = out.logits[len(prompt) - 1 :].topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def assert_greedy_identical(
    target: TargetModel, prompt: Sequence[int], reference: Sequence[int], candidate: Sequence[int], label: str
) -> None:
    """Equal tokens. The fast backend's forward is batch-invariant, so there nothing is excused;
    on transformers' own forward (``--backend hf``, not batch-invariant) a divergence at a
    reference near-tie is excused and logged (reported at the end of the run).

    Equality proves nothing about a mode that never drafted or never had a draft accepted:
    count its statistics in a ``DraftTally`` too."""
    if list(reference) == list(candidate):
        return
    if target.info.backend == "fast":
        first = next((i for i, (a, b) in enumerate(zip(reference, candidate, strict=False)) if a != b), None)
        raise AssertionError(f"{label}: differs from ar at generated token {first} (fast backend: bit-exact)")
    first = next(
        (i for i, (a, b) in enumerate(zip(reference, candidate, strict=False)) if a != b),
        min(len(reference), len(candidate)),
    )
    if first < min(len(reference), len(candidate)):
        margin = float(top2_margins(target, prompt, reference)[first])
        if margin < NEAR_TIE:
            EXCUSED_DIVERGENCES.excused.append(
                f"{label}: diverged at generated token {first}, reference top-2 margin {margin:.2e}"
            )
            return
        raise AssertionError(
            f"{label}: diverged from ar at generated token {first} "
            f"({reference[first]} vs {candidate[first]}), "
            f"reference top-2 margin {margin:.3g} is not a near-tie"
        )
    raise AssertionError(
        f"{label}: lengths differ ({len(reference)} vs {len(candidate)}) with equal prefixes"
    )


@dataclass
class DraftTally:
    """Draft tokens sent to verification and accepted, per mode, summed over a test's generations.

    A mode that is "identical to ar" only because it never drafted, or because every draft was
    rejected, proves nothing about verification: a lossless test observes every generation and
    ends with ``assert_every_mode_drafted_and_accepted``. Summed because one prompt need not
    draft (a random prompt offers nothing to copy); e.g. after ``observe("pld", stats)`` with 12
    drafted and 5 accepted, ``pld`` passes.
    """

    drafted: Counter[str] = field(default_factory=Counter)
    accepted: Counter[str] = field(default_factory=Counter)

    def observe(self, mode: str, stats: GenerationStats) -> None:
        self.drafted[mode] += stats.drafted_tokens
        self.accepted[mode] += stats.accepted_tokens

    def assert_every_mode_drafted_and_accepted(self, label: str = "") -> None:
        assert self.drafted, f"{label}: no generation was observed"
        idle = {
            mode: f"drafted {self.drafted[mode]}, accepted {self.accepted[mode]}"
            for mode in self.drafted
            if not (self.drafted[mode] > 0 and self.accepted[mode] > 0)
        }
        assert not idle, f"{label}: equal to ar, but nothing was drafted or accepted: {idle}"


def assert_modes_equal_ar(
    engine: Engine, target: TargetModel, modes: Sequence[str], new: int, label: str
) -> None:
    """Greedy, each of ``modes`` writes exactly ``ar``'s tokens on every prompt of ``prompts``
    (``assert_greedy_identical``), and each drafted and had drafts accepted over them."""
    tally = DraftTally()
    for i, prompt in enumerate(prompts(target.info.vocab_size)):
        ref = engine.generate(GenerationRequest(tuple(prompt), new, "ar")).token_ids
        for mode in modes:
            res = engine.generate(GenerationRequest(tuple(prompt), new, mode))
            assert_greedy_identical(target, prompt, ref, res.token_ids, f"{label}/{mode}/prompt{i}")
            tally.observe(mode, res.stats)
    tally.assert_every_mode_drafted_and_accepted(label)


def rss_bytes() -> int:
    """This process's resident memory now (not its peak, which ``ru_maxrss`` gives)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
