"""``specdraft bench``: every mode on the same prompts, in one process, interleaved.

For each question the modes run one after another in an order that rotates from question to
question, so that machine noise (a shared, busy CPU) falls on all modes alike. Multi-turn
questions feed each mode its own earlier answers. Reported per mode and per category:
tokens/s (all new tokens over all seconds), speed-up vs ``ar``, τ, acceptance rate, and whether
every output is token-identical to ``ar``'s.

With ``others`` (e.g. the same model loaded in bfloat16 beside float32), every engine mode also
runs on each other engine as ``MODE@DTYPE``, in the same interleaved loop; each is compared with
its own dtype's ``ar`` (``ar@DTYPE``), and ``ar@DTYPE``'s outputs with the primary ``ar``'s.

The machine section reports what bounds decoding: the memory read bandwidth measured here, the
weight bytes one forward reads, their quotient (the bandwidth limit in tokens/s) and ``ar``'s
tokens/s as a fraction of it, per dtype, and the GEMM kernel chosen (``llm_worker.model.kernels``)
with the measured times of every invariant candidate.
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from client.bench.concurrency import NO_PREFIX_CACHE
from client.bench.runners import Runner, RunOutcome, make_runners
from client.bench.suite import Question
from llm_worker.chat import chat_prompt_ids
from llm_worker.engine import Engine
from specdraft.tokenizer import Tokenizer


@dataclass
class Tally:
    new_tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    outputs: int = 0
    identical: int = 0
    prefill_seconds: float | None = 0.0  # None once an outcome did not report it
    depth_reached: list[int] = field(default_factory=list)
    depth_accepted: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0

    def add(self, o: RunOutcome, identical: bool) -> None:
        self.draft_seconds += o.draft_seconds
        for d, (r, a) in enumerate(zip(o.depth_reached, o.depth_accepted, strict=True)):
            if d == len(self.depth_reached):
                self.depth_reached.append(0)
                self.depth_accepted.append(0)
            self.depth_reached[d] += r
            self.depth_accepted[d] += a
        if self.prefill_seconds is not None and o.prefill_seconds is not None:
            self.prefill_seconds += o.prefill_seconds
        else:
            self.prefill_seconds = None
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

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens after the first of each output over the seconds after the prefill."""
        if self.prefill_seconds is None or self.seconds <= self.prefill_seconds:
            return None
        return (self.new_tokens - self.outputs) / (self.seconds - self.prefill_seconds)

    def draft_cost(self, ar: Tally | None) -> float | None:
        """c: drafting seconds per drafted token ÷ ``ar``'s seconds per decoded token (what one
        draft token costs in target forwards; planning and a drafter's catch-up included)."""
        return self._drafting_per(self.drafted, ar)

    def step_draft_cost(self, ar: Tally | None) -> float | None:
        """Drafting seconds per target forward ÷ ``ar``'s seconds per decoded token: what drafting
        adds to a step, in target steps (c times the draft tokens a step)."""
        return self._drafting_per(self.forwards, ar)

    def _drafting_per(self, count: int, ar: Tally | None) -> float | None:
        """Drafting seconds per one of ``count`` in ``ar``'s decode steps (None: nothing drafted,
        nothing counted or no ``ar`` speed)."""
        if not self.drafted or not count or ar is None:
            return None
        per_ar_token = ar.decode_tokens_per_second or ar.tokens_per_second
        if not per_ar_token:
            return None
        return round(self.draft_seconds / count * per_ar_token, 4)

    def summary(self, ar: Tally | None) -> dict[str, Any]:
        tps = self.tokens_per_second
        return {
            "tokens_per_second": round(tps, 3),
            "speedup_vs_ar": round(tps / ar.tokens_per_second, 3) if ar and ar.tokens_per_second else None,
            "tau": round(self.new_tokens / self.forwards, 3) if self.forwards else None,
            "acceptance_rate": round(self.accepted / self.drafted, 3) if self.drafted else None,
            "acceptance_by_depth": [
                round(a / r, 3) for a, r in zip(self.depth_accepted[:8], self.depth_reached[:8], strict=True)
            ],
            "draft_cost": self.draft_cost(ar),
            "draft_cost_per_step": self.step_draft_cost(ar),
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
    concurrency: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # mode -> c -> figures
    by_source: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per mode that drafts from several sources (``fuse``): accepted draft tokens each source had
    proposed over the timed run (a token several proposed counts for each)."""

    def to_json(self) -> dict[str, Any]:
        modes: dict[str, Any] = {}
        primary_ar = self.overall.get("ar")
        for mode in self.modes:
            ar = self.overall.get(reference_of(mode))
            entry = self.overall[mode].summary(ar)
            if reference_of(mode) != "ar" and primary_ar is not None and primary_ar.tokens_per_second:
                entry["speedup_vs_primary_ar"] = round(
                    self.overall[mode].tokens_per_second / primary_ar.tokens_per_second, 3
                )
            for base in ("hf-ar", "hf-pld"):
                other = self.overall.get(base)
                if other is not None and other.tokens_per_second and mode != base:
                    entry[f"speedup_vs_{base}"] = round(
                        self.overall[mode].tokens_per_second / other.tokens_per_second, 3
                    )
            entry["per_category"] = {
                cat: tallies[mode].summary(tallies.get(reference_of(mode)))
                for cat, tallies in self.per_category.items()
            }
            if mode in self.concurrency:
                entry["concurrency"] = self.concurrency[mode]
            if mode + NO_PREFIX_CACHE in self.concurrency:
                entry["concurrency_no_prefix_cache"] = self.concurrency[mode + NO_PREFIX_CACHE]
            if mode in self.by_source:
                tally = self.overall[mode]
                entry["accepted_by_source"] = {
                    source: {
                        "tokens": n,
                        "share": round(n / tally.accepted, 3) if tally.accepted else None,
                        "per_forward": round(n / tally.forwards, 3) if tally.forwards else None,
                    }
                    for source, n in sorted(self.by_source[mode].items(), key=lambda kv: -kv[1])
                }
            modes[mode] = entry
        return {"modes": modes, "machine": self.machine, "config": self.config}


def engine_label(engine: Engine) -> str:
    """An engine's name in a report (``mode@label``): its dtype, with ``+graphs`` where its steps
    replay CUDA graphs. Example: ``bfloat16+graphs``."""
    graphs = getattr(engine.target, "graphs", None)
    return engine.target.info.dtype + ("+graphs" if graphs is not None else "")


def reference_of(mode: str) -> str:
    """The ``ar`` a mode is compared with: ``pld@bfloat16`` → ``ar@bfloat16``, ``pld`` → ``ar``."""
    _, at, dtype = mode.partition("@")
    return f"ar@{dtype}" if at else "ar"


def measure_read_bandwidth(megabytes: int = 512, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes per second this process reads from ``device``'s memory (where the target's weights
    are): the best of ``repeats`` sums of a float32 array far larger than the caches, with torch's
    threads on a CPU (what a decode step has)."""
    x = torch.ones(megabytes * 2**20 // 4, device=device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    best = float("inf")
    for _ in range(repeats + 1):  # the first touches the pages
        sync()
        begin = time.perf_counter()
        x.sum()
        sync()
        best = min(best, time.perf_counter() - begin)
    return x.numel() * 4 / best


def dtype_info(engine: Engine, bandwidth: float) -> dict[str, Any]:
    """What bounds one engine's decoding: its weight bytes per forward and the kernel choice."""
    target = engine.target
    out: dict[str, Any] = {"backend": target.info.backend}
    nbytes = target.weight_bytes()
    if nbytes:
        out["weight_bytes"] = nbytes
        out["bandwidth_limit_tokens_per_second"] = round(bandwidth / nbytes, 2)
    kernels = target.kernel_info()
    if kernels.get("weight_bytes_read"):  # packed weights: the limit of the bytes a forward reads
        out["read_bandwidth_limit_tokens_per_second"] = round(bandwidth / kernels["weight_bytes_read"], 2)
    return out | kernels


def machine_info(engine: Engine) -> dict[str, Any]:
    import transformers

    info = engine.target.info
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
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


def _limits(result: BenchResult, engines: Mapping[str, Engine]) -> None:
    """``ar``'s tokens/s (the suite's, prefill included, and decode alone) as fractions of each
    dtype's bandwidth limit."""
    machine = result.machine
    for suffix, engine in engines.items():
        info = machine["dtypes"][engine_label(engine)]
        limit = info.get("bandwidth_limit_tokens_per_second")
        tally = result.overall.get("ar" + suffix)
        if tally is None or not limit:
            continue
        decode = tally.decode_tokens_per_second
        info["ar_tokens_per_second"] = round(tally.tokens_per_second, 3)
        info["ar_fraction_of_bandwidth_limit"] = round(tally.tokens_per_second / limit, 3)
        if decode is not None:
            info["ar_decode_tokens_per_second"] = round(decode, 3)
            info["ar_decode_fraction_of_bandwidth_limit"] = round(decode / limit, 3)
    primary = machine["dtypes"].get(engine_label(engines[""]), {})
    machine["ar_fraction_of_bandwidth_limit"] = primary.get("ar_fraction_of_bandwidth_limit")


def source_counts(engine: Engine, modes: Sequence[str]) -> dict[str, Counter[str]]:
    """Per mode whose drafter counts accepted tokens by source (``fuse``'s ``accepted``): a copy
    of its counts so far."""
    out = {}
    for mode in modes:
        if mode.startswith("hf-"):
            continue
        accepted = getattr(engine.runtime(mode).drafter, "accepted", None)
        if isinstance(accepted, Counter):
            out[mode] = Counter(accepted)
    return out


def one_minute_load() -> float | None:
    """The 1-minute load average (``os.getloadavg``), None where the system keeps none."""
    import os

    try:
        return os.getloadavg()[0]
    except OSError:
        return None


@dataclass
class LoadSamples:
    """The 1-minute load average sampled through a run (at its start, between modes, at its
    end), against the cores: more runnable threads than cores means other processes took CPU
    time the bench's timings counted."""

    cores: int
    source: Callable[[], float | None] = one_minute_load
    samples: list[float] = field(default_factory=list)

    def sample(self) -> None:
        value = self.source()
        if value is not None:
            self.samples.append(round(value, 2))

    def to_json(self) -> dict[str, Any]:
        return {"cores": self.cores, "samples": self.samples, "max": max(self.samples, default=None)}


def time_left(elapsed: float, done: int, total: int) -> str:
    """The rest of a run of ``total`` equal parts, ``done`` of them in ``elapsed`` seconds, in
    words. Example: ``time_left(30, 3, 12)`` → "about 1.5 min left"; nothing done yet → ""."""
    if done <= 0 or done >= total:
        return ""
    left = elapsed / done * (total - done)
    return f"about {left:.0f} s left" if left < 90 else f"about {left / 60:.1f} min left"


def run_bench(
    engine: Engine,
    tokenizer: Tokenizer,
    questions: Sequence[Question],
    modes: Sequence[str],
    max_new_tokens: int,
    progress: Callable[[str], None] | None = None,
    others: Sequence[Engine] = (),
    concurrency: Sequence[int] = (),
    without_prefix_cache: bool = False,
    load: Callable[[], float | None] = one_minute_load,
) -> BenchResult:
    """``concurrency``: after the interleaved run, every engine mode again at each of these
    concurrencies through the worker's batch scheduler (``client.bench.concurrency``) on the
    questions' first turns, compared with ``ar``'s first-turn outputs of the run;
    ``without_prefix_cache``: each also without the prefix cache. ``progress`` gets a line per
    stage and per mode run, with the time left; ``load`` is sampled at the start, between modes
    and at the end (``machine.load_average``)."""
    say = progress or (lambda line: None)
    modes = list(dict.fromkeys(["ar", *modes]))  # ar is the reference: always run, always first in reports
    runners = make_runners(engine, modes)
    engines = {"": engine}
    all_modes = list(modes)
    for other in others:
        suffix = "@" + engine_label(other)
        own = [m for m in modes if not m.startswith("hf-")]
        runners.update(make_runners(other, own, suffix))
        engines[suffix] = other
        all_modes += [m + suffix for m in own]
    result = BenchResult(all_modes)
    loads = LoadSamples(os.cpu_count() or 1, load)
    loads.sample()
    result.machine = machine_info(engine)  # also measures the cost curve before any timing
    for other in others:
        other.cost_curve  # noqa: B018  # measured (or read) before any timing
    say("measuring the memory read bandwidth (a few seconds)")
    bandwidth = measure_read_bandwidth(device=engine.target.info.device)
    result.machine["memory_read_gb_per_s"] = round(bandwidth / 1e9, 2)
    result.machine["dtypes"] = {engine_label(e): dtype_info(e, bandwidth) for e in engines.values()}
    result.config = {
        "max_new_tokens": max_new_tokens,
        "questions": len(questions),
        "questions_per_category": dict(Counter(q.category for q in questions)),
        "modes": all_modes,
    }
    say(f"warming up {len(runners)} modes (8 tokens each; a learned drafter loads now)")
    _warm_up(runners, tokenizer)
    counted_before = source_counts(engine, modes)  # the warm-up's drafts are not the run's
    for mode in all_modes:
        result.overall[mode] = Tally()
    same_as_primary_ar = {suffix: [0, 0] for suffix in engines if suffix}  # [identical, outputs]
    first_turns: dict[str, list[list[int]]] = {suffix: [] for suffix in engines}  # ar's first answers
    began, runs = time.monotonic(), len(questions) * len(all_modes)
    for qi, question in enumerate(questions):
        shift = qi % len(all_modes)
        order = all_modes[shift:] + all_modes[:shift]
        outputs: dict[str, list[RunOutcome]] = {}
        for mode in order:
            outputs[mode] = run_turns(runners[mode], tokenizer, question, max_new_tokens)
            loads.sample()
            tokens = sum(len(o.token_ids) for o in outputs[mode])
            seconds = sum(o.seconds for o in outputs[mode])
            left = time_left(time.monotonic() - began, qi * len(all_modes) + len(outputs), runs)
            say(
                f"[{qi + 1}/{len(questions)} {question.category}] {mode}: {tokens} tokens in {seconds:.1f} s"
                + (f" ({left})" if left else "")
            )
        cat = result.per_category.setdefault(question.category, {m: Tally() for m in all_modes})
        for mode in all_modes:
            for turn, outcome in enumerate(outputs[mode]):
                same = outcome.token_ids == outputs[reference_of(mode)][turn].token_ids
                result.overall[mode].add(outcome, same)
                cat[mode].add(outcome, same)
        for suffix, answers in first_turns.items():
            answers.append(outputs["ar" + suffix][0].token_ids)
        for suffix, counts in same_as_primary_ar.items():
            for turn, outcome in enumerate(outputs["ar" + suffix]):
                counts[0] += outcome.token_ids == outputs["ar"][turn].token_ids
                counts[1] += 1
    _limits(result, engines)
    for mode, after in source_counts(engine, modes).items():
        result.by_source[mode] = dict(after - counted_before.get(mode, Counter()))
    primary = engine_label(engine)
    result.machine["dtype_comparison"] = {
        suffix[1:]: {f"ar_outputs_identical_to_{primary}_ar": same, "outputs": total}
        for suffix, (same, total) in same_as_primary_ar.items()
    }
    if concurrency:
        from client.bench.concurrency import run_concurrency_levels

        prompts = [chat_prompt_ids(tokenizer, q.messages()) for q in questions]
        for suffix, other in engines.items():
            own = [m for m in modes if not m.startswith("hf-")]
            levels = run_concurrency_levels(
                other,
                prompts,
                first_turns[suffix],
                own,
                concurrency,
                max_new_tokens,
                progress,
                without_prefix_cache,
            )
            for mode, by_level in levels.items():
                result.concurrency[mode + suffix] = by_level
        result.config["concurrency"] = list(concurrency)
    loads.sample()
    result.machine["load_average"] = loads.to_json()
    return result


def run_turns(runner: Runner, tokenizer: Tokenizer, question: Question, max_new: int) -> list[RunOutcome]:
    messages = question.messages(0)  # the system message, if any
    outcomes = []
    for turn in question.turns:
        messages.append({"role": "user", "content": turn})
        outcome = runner(chat_prompt_ids(tokenizer, messages), max_new)
        outcomes.append(outcome)
        messages.append(
            {"role": "assistant", "content": tokenizer.decode(outcome.token_ids, skip_special_tokens=True)}
        )
    return outcomes


def _warm_up(runners: dict[str, Runner], tokenizer: Tokenizer) -> None:
    prompt = chat_prompt_ids(
        tokenizer, [{"role": "user", "content": "Repeat: one two three, one two three."}]
    )
    for runner in runners.values():
        runner(prompt, 8)
