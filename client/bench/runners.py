"""What the benchmark can run: an engine mode, or a transformers ``generate`` baseline.

Each runner turns prompt ids into an ``RunOutcome``; the bench times them side by side.

- an engine mode (``ar``, ``pld``, ``pld+h``, ...): ``Engine.generate``, greedy;
- ``hf-ar``: transformers ``generate``, greedy, on the same weights;
- ``hf-pld``: transformers ``generate`` with ``prompt_lookup_num_tokens=10``.

Target forwards of the baselines are counted with a forward pre-hook, so τ is comparable.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from llm_worker.config import SamplingParams
from llm_worker.engine import Engine, GenerationRequest

HF_PLD_TOKENS = 10


@dataclass
class RunOutcome:
    token_ids: list[int]
    seconds: float
    target_forwards: int
    drafted: int = 0
    accepted: int = 0
    prefill_seconds: float | None = None  # None: not known (transformers' generate)
    depth_reached: list[int] = field(default_factory=list)  # per draft depth (``GenerationStats``)
    depth_accepted: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0  # proposing and planning drafts (``GenerationStats``)


Runner = Callable[[list[int], int], RunOutcome]


def bench_tenant(mode: str) -> str:
    """The tenant a benchmark's requests of ``mode`` run as: modes that learn from what the
    service said (``suffix``, ``recycle``, ``fuse``) each learn only from their own outputs, never
    from another mode's answer to the same question, which would be the very text they then draft."""
    return f"bench/{mode}"


def engine_runner(engine: Engine, mode: str) -> Runner:
    def run(prompt: list[int], max_new: int) -> RunOutcome:
        request = GenerationRequest(tuple(prompt), max_new, mode, SamplingParams(), tenant=bench_tenant(mode))
        res = engine.generate(request)
        s = res.stats
        return RunOutcome(
            res.token_ids,
            s.seconds,
            s.target_forwards,
            s.drafted_tokens,
            s.accepted_tokens,
            s.prefill_seconds,
            list(s.depth_reached),
            list(s.depth_accepted),
            s.draft_seconds,
        )

    return run


class _ForwardCounter:
    def __init__(self, model: Any) -> None:
        self.calls = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, module: Any, args: Any) -> None:
        self.calls += 1


def hf_runner(model: Any, eos_ids: tuple[int, ...], prompt_lookup: int | None) -> Runner:
    counter = _ForwardCounter(model)
    extra: dict[str, Any] = {}
    if prompt_lookup:
        extra["prompt_lookup_num_tokens"] = prompt_lookup

    def run(prompt: list[int], max_new: int) -> RunOutcome:
        ids = torch.tensor([prompt], device=model.device)
        before = counter.calls
        began = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new,
                eos_token_id=list(eos_ids) or None,
                pad_token_id=eos_ids[0] if eos_ids else None,
                temperature=None,
                top_p=None,
                top_k=None,
                **extra,
            )
        seconds = time.perf_counter() - began
        return RunOutcome(out[0, len(prompt) :].tolist(), seconds, counter.calls - before)

    return run


def make_runners(engine: Engine, modes: list[str], suffix: str = "") -> dict[str, Runner]:
    """A runner per mode name (keyed ``mode + suffix``); ``hf-*`` names need the fast or hf
    target's transformers model."""
    runners: dict[str, Runner] = {}
    model = getattr(engine.target, "model", None)
    for mode in modes:
        key = mode + suffix
        if mode in ("hf-ar", "hf-pld"):
            if model is None:
                raise ValueError(f"{mode} needs a transformers model behind the target")
            lookup = HF_PLD_TOKENS if mode == "hf-pld" else None
            runners[key] = hf_runner(model, engine.target.info.eos_token_ids, lookup)
        else:
            engine.runtime(mode)  # fail early on unknown / unavailable modes
            runners[key] = engine_runner(engine, mode)
    return runners
