"""``specdraft bench``: every mode on the same prompts, in one process, interleaved.

For each question the modes run one after another in an order that rotates from question to
question, so that machine noise (a shared, busy CPU) falls on all modes alike. Multi-turn
questions feed each mode its own earlier answers. Reported per mode and per category:
tokens/s (all new tokens over all seconds), speed-up vs ``ar``, τ, acceptance rate, and whether
every output is token-identical to ``ar``'s.
"""

from __future__ import annotations

import datetime
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from llm_worker.bench.runners import Outcome, Runner, make_runners
from llm_worker.bench.suite import Question
from llm_worker.chat import chat_prompt_ids
from llm_worker.engine import Engine


@dataclass
class Tally:
    new_tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    outputs: int = 0
    identical: int = 0

    def add(self, o: Outcome, identical: bool) -> None:
        self.new_tokens += len(o.token_ids)
        self.seconds += o.seconds
        self.forwards += o.target_forwards
        self.drafted += o.drafted
        self.accepted += o.accepted
        self.outputs += 1
        self.identical += int(identical)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def summary(self, ar: Tally | None) -> dict[str, Any]:
        tps = self.tokens_per_second
        return {
            "tokens_per_second": round(tps, 3),
            "speedup_vs_ar": round(tps / ar.tokens_per_second, 3) if ar and ar.tokens_per_second else None,
            "tau": round(self.new_tokens / self.forwards, 3) if self.forwards else None,
            "acceptance_rate": round(self.accepted / self.drafted, 3) if self.drafted else None,
            "identical_to_ar": self.identical == self.outputs,
            "outputs": self.outputs,
            "outputs_identical_to_ar": self.identical,
            "new_tokens": self.new_tokens,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class BenchResult:
    modes: list[str]
    overall: dict[str, Tally] = field(default_factory=dict)
    per_category: dict[str, dict[str, Tally]] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        modes: dict[str, Any] = {}
        ar = self.overall.get("ar")
        for mode in self.modes:
            entry = self.overall[mode].summary(ar)
            for base in ("hf-ar", "hf-pld"):
                other = self.overall.get(base)
                if other is not None and other.tokens_per_second and mode != base:
                    entry[f"speedup_vs_{base}"] = round(
                        self.overall[mode].tokens_per_second / other.tokens_per_second, 3
                    )
            entry["per_category"] = {
                cat: tallies[mode].summary(tallies.get("ar")) for cat, tallies in self.per_category.items()
            }
            modes[mode] = entry
        return {"modes": modes, "machine": self.machine, "config": self.config}


def machine_info(engine: Engine) -> dict[str, Any]:
    import transformers

    info = engine.target.info
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    import os

    curve = engine.cost_curve
    ctx = 512
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "model": info.name,
        "model_fingerprint": info.fingerprint,
        "dtype": info.dtype,
        "device": info.device,
        "backend": info.backend,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "verify_cost_ms_at_512": {str(n): round(1000 * curve.t(n, ctx), 2) for n in (1, 2, 4, 8, 16, 32, 64)},
    }


def run_bench(
    engine: Engine,
    tokenizer: Any,
    questions: Sequence[Question],
    modes: Sequence[str],
    max_new_tokens: int,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    modes = list(dict.fromkeys(["ar", *modes]))  # ar is the reference: always run, always first in reports
    runners = make_runners(engine, modes)
    result = BenchResult(modes)
    result.machine = machine_info(engine)  # also measures the cost curve before any timing
    result.config = {"max_new_tokens": max_new_tokens, "questions": len(questions), "modes": modes}
    _warm_up(runners, tokenizer)
    for mode in modes:
        result.overall[mode] = Tally()
    for qi, question in enumerate(questions):
        shift = qi % len(modes)
        order = modes[shift:] + modes[:shift]
        outputs: dict[str, list[Outcome]] = {
            mode: _run_turns(runners[mode], tokenizer, question, max_new_tokens) for mode in order
        }
        cat = result.per_category.setdefault(question.category, {m: Tally() for m in modes})
        for mode in modes:
            for turn, outcome in enumerate(outputs[mode]):
                same = outcome.token_ids == outputs["ar"][turn].token_ids
                result.overall[mode].add(outcome, same)
                cat[mode].add(outcome, same)
        if progress is not None:
            progress(f"[{qi + 1}/{len(questions)}] {question.question_id}")
    return result


def _run_turns(runner: Runner, tokenizer: Any, question: Question, max_new: int) -> list[Outcome]:
    messages: list[dict[str, str]] = []
    outcomes = []
    for turn in question.turns:
        messages.append({"role": "user", "content": turn})
        outcome = runner(chat_prompt_ids(tokenizer, messages), max_new)
        outcomes.append(outcome)
        messages.append(
            {"role": "assistant", "content": tokenizer.decode(outcome.token_ids, skip_special_tokens=True)}
        )
    return outcomes


def _warm_up(runners: dict[str, Runner], tokenizer: Any) -> None:
    prompt = chat_prompt_ids(
        tokenizer, [{"role": "user", "content": "Repeat: one two three, one two three."}]
    )
    for runner in runners.values():
        runner(prompt, 8)
