"""The verify cost curve: not cached from a loaded machine, checked against timed forwards and
measured again when they disagree, and the progress lines of long first-run steps."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from helpers.models import tiny_target
from llm_worker import costs
from llm_worker.config import CostConfig, EngineConfig, PlannerConfig
from llm_worker.costs import (
    CostCurve,
    CurveCheck,
    cost_cache_path,
    load_or_measure_curve,
    measure_cost_curve,
    measure_curve_and_cache,
)
from llm_worker.engine import Engine, GenerationRequest
from llm_worker.model.target import TargetModel
from llm_worker.types import ArtifactNeeds
from specdraft.common import FOREIGN_LOAD_LIMIT, LoadWatch, Progress, foreign_cores

SMALL = CostConfig(sizes=(1, 2, 4, 8), contexts=(32,), repeats=3)
MAX_SIZE = 8
ON_LINUX = Path("/proc/stat").is_file() and hasattr(os, "sched_getaffinity")


# -- whether other processes used the cores ---------------------------------------------------


def test_foreign_cores_counts_what_others_took_beyond_the_spare_cores() -> None:
    # 2 cores, 2 threads, 1 s: the machine busy 2 s, this process 1 s → another had a core
    assert foreign_cores(2.0, 1.0, 1.0, cpus=2, threads=2, tick=0.01) == pytest.approx(0.98)
    # the same on 16 cores of which this process uses 8: it ran on spare cores
    assert foreign_cores(2.0, 1.0, 1.0, cpus=16, threads=8, tick=0.01) == 0.0
    # a quiet machine: a daemon's hundredth of a core, within the ticks' rounding
    assert foreign_cores(2.01, 2.0, 1.0, cpus=2, threads=2, tick=0.01) == 0.0
    # a few ticks over a short window are rounding, not load
    assert foreign_cores(0.02, 0.0, 0.05, cpus=2, threads=2, tick=0.01) == 0.0
    assert foreign_cores(1.0, 0.0, 0.0, cpus=2, threads=2, tick=0.01) == 0.0
    # just over the limit: a fifth of a core over 10 s
    assert foreign_cores(12.0, 9.78, 10.0, cpus=2, threads=2, tick=0.01) > FOREIGN_LOAD_LIMIT


@pytest.fixture
def busy_loops() -> Iterator[None]:
    """One busy-looping process per core this process may use, spinning before the block."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", "print('spinning', flush=True)\nwhile True: pass"], stdout=subprocess.PIPE
        )
        for _ in os.sched_getaffinity(0)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == b"spinning"
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def target() -> TargetModel:
    """A tiny model on the fast backend, its kernels chosen (and its fused kernels built) under
    the usual cache before a test points ``SPECDRAFT_CACHE`` elsewhere."""
    return tiny_target("llama")


@pytest.mark.skipif(not ON_LINUX, reason="reads /proc/stat")
def test_a_cost_curve_measured_beside_a_busy_process_is_used_but_not_cached(
    target: TargetModel,
    busy_loops: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    with LoadWatch(torch.get_num_threads()) as watch, torch.inference_mode():
        begin = time.monotonic()
        while time.monotonic() - begin < 0.5:
            target.forward(target.start(), torch.arange(8), None, ArtifactNeeds())
    assert watch.busy, watch.describe()
    # tenths of a second beside them: a shorter window may see the scheduler give them no time
    long_enough = CostConfig(sizes=SMALL.sizes, contexts=SMALL.contexts, repeats=40)
    with caplog.at_level(logging.WARNING, logger="llm_worker.costs"):
        curve = load_or_measure_curve(target, long_enough, MAX_SIZE)
    assert curve.sizes == (1, 2, 4, 8)
    assert not cost_cache_path(target).exists()
    assert "measured under load" in caplog.text and "not cached" in caplog.text


class _Quiet:
    """``LoadWatch`` on a machine nothing else uses (this one may be shared while tests run)."""

    busy = False

    def __init__(self, threads: int) -> None:
        pass

    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def describe(self) -> str:
        return "quiet"


class _Busy(_Quiet):
    busy = True


def test_a_quiet_measurement_is_cached_and_read_back(
    target: TargetModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "LoadWatch", _Quiet)
    curve = load_or_measure_curve(target, SMALL, MAX_SIZE)
    assert CostCurve.from_json(json.loads(cost_cache_path(target).read_text())) == curve
    monkeypatch.setattr(costs, "measure_cost_curve", lambda *a: pytest.fail("measured again"))
    assert load_or_measure_curve(target, SMALL, MAX_SIZE) == curve


# -- the check against timed forwards ---------------------------------------------------------


class _Measure:
    """A fake ``measure``: returns the given curves in turn and counts its calls."""

    def __init__(self, *curves: CostCurve) -> None:
        self.curves = list(curves)
        self.calls = 0

    def __call__(self) -> CostCurve:
        self.calls += 1
        return self.curves[min(self.calls, len(self.curves)) - 1]


def test_a_curve_that_agrees_with_the_forwards_is_kept() -> None:
    curve = CostCurve.linear(0.010, 0.001)
    measure = _Measure(curve)
    check = CurveCheck(curve, measure, window=8)
    for i in range(100):  # within the band: 1.3× (verify on top of the forward), noisy
        assert not check.observe(1 + i % 5, 100, 1.3 * curve.t(1 + i % 5, 100) * (1.5 if i % 7 == 0 else 1))
    assert measure.calls == 0 and check.curve is curve
    assert check.ratio() == pytest.approx(1.3)


def test_a_curve_ten_times_too_slow_is_measured_again_once() -> None:
    busy, quiet = CostCurve.linear(0.105, 0.010), CostCurve.linear(0.0105, 0.001)
    measure = _Measure(quiet)
    check = CurveCheck(busy, measure, window=8)
    replaced = [check.observe(1 + i % 3, 200, quiet.t(1 + i % 3, 200)) for i in range(40)]
    assert replaced == [False] * 7 + [True] + [False] * 32  # the first full window, then agreement
    assert check.curve is quiet and measure.calls == 1 and check.measurements == 1


def test_a_disagreement_the_curve_cannot_fix_backs_off() -> None:
    """A model whose verify costs three times its forward: each new measurement agrees with the
    old, so the check measures after 8, then 16, 32 … forwards, not every 8."""
    curve = CostCurve.linear(0.001, 0.0)
    measure = _Measure(curve)
    check = CurveCheck(curve, measure, window=8, max_window=32)
    replaced = [i for i in range(200) if check.observe(1, 10, 0.003)]
    assert replaced == [7, 7 + 16] + [7 + 16 + 32 * k for k in range(1, 6)]
    assert measure.calls == len(replaced)


def test_a_deferred_measurement_reports_the_disagreement_that_made_it_due(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A deferred check logs the last disagreement it saw before the measurement ran, not the
    median of the forwards that came after it (those may agree again by the time it runs)."""
    busy, quiet = CostCurve.linear(0.105, 0.010), CostCurve.linear(0.0105, 0.001)
    check = CurveCheck(quiet, _Measure(quiet), window=4, deferred=True)
    for _ in range(4):
        check.observe(1, 10, busy.t(1, 10))  # 10× the price: due
    assert check.due
    for _ in range(4):
        check.observe(1, 10, quiet.t(1, 10))  # agreeing again before it runs
    with caplog.at_level(logging.WARNING, logger="llm_worker.costs"):
        assert check.measure_if_due()
    logged = float(caplog.text.split("took ")[1].split("×")[0])
    assert logged > check.band[1], caplog.text  # before the fix: 1.00×, within the band


def test_a_measurement_that_fails_keeps_the_curve(caplog: pytest.LogCaptureFixture) -> None:
    curve = CostCurve.linear(0.1, 0.0)

    def broken() -> CostCurve:
        raise RuntimeError("out of memory")

    check = CurveCheck(curve, broken, window=4)
    with caplog.at_level(logging.ERROR, logger="llm_worker.costs"):
        assert not any(check.observe(1, 10, 0.001) for _ in range(4))
    assert check.curve is curve and "failed" in caplog.text


def _decode_alone(target: TargetModel, check: CurveCheck, steps: int) -> None:
    """What the engine does per step of a request alone in its forward: a forward of the root
    and a few draft tokens after the tokens cached so far, timed with its verify, observed."""
    torch.manual_seed(0)
    vocab = target.info.vocab_size
    with torch.inference_mode():
        state = target.start()
        prompt = torch.randint(0, vocab, (24,))
        target.forward(state, prompt, None, ArtifactNeeds())
        target.commit(state, range(len(prompt)))
        for step in range(steps):
            rows = 1 + step % 4  # the root and 0 to 3 draft tokens
            context = state.length
            tokens = torch.randint(0, vocab, (rows,))
            begin = time.perf_counter()
            out = target.forward(state, tokens, None, ArtifactNeeds())
            accepted = int(out.logits.argmax(-1)[0]) % rows  # stands in for the verify
            target.commit(state, range(1 + accepted))
            check.observe(rows, context, time.perf_counter() - begin)


def _scaled(curve: CostCurve, factor: float) -> CostCurve:
    return CostCurve(
        curve.sizes, curve.contexts, tuple(tuple(factor * t for t in row) for row in curve.seconds)
    )


@pytest.mark.parametrize("quiet", [True, False])
def test_a_cost_curve_recorded_under_a_busy_machine_is_corrected(
    quiet: bool, target: TargetModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A curve cached by a start-up that shared its cores (every forward ten times too slow) is
    what the next run loads; the forwards it then times alone disagree, so it measures the curve
    again and plans with the new one, and rewrites the cache if nothing else ran meanwhile."""
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "LoadWatch", _Quiet if quiet else _Busy)
    measured = measure_cost_curve(target, SMALL, MAX_SIZE)
    recorded = _scaled(measured, 10.0)
    path = cost_cache_path(target)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(recorded.to_json()))

    curve = load_or_measure_curve(target, SMALL, MAX_SIZE)
    assert curve == recorded
    check = CurveCheck(curve, lambda: measure_curve_and_cache(target, SMALL, MAX_SIZE), window=16)
    _decode_alone(target, check, 40)

    assert check.measurements == 1
    for n in (1, 4, 8):
        assert check.curve.t(n, 30) < recorded.t(n, 30) / 3, n  # near the quiet figure, not 10×
    cached = CostCurve.from_json(json.loads(path.read_text()))
    assert cached == (check.curve if quiet else recorded)


def test_an_engine_corrects_the_busy_curve_it_loaded_and_its_planners_use_the_new_one(
    target: TargetModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through the engine: a request decoded alone shows the check its forwards; the
    curve is measured again before the next request starts (never inside a stream), and the
    engine's planners (here `pld`'s, made before) plan with the corrected curve."""
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "LoadWatch", _Quiet)
    recorded = _scaled(measure_cost_curve(target, SMALL, MAX_SIZE), 10.0)
    path = cost_cache_path(target)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(recorded.to_json()))
    config = EngineConfig(planner=PlannerConfig(max_draft_tokens=MAX_SIZE - 1), cost=SMALL)
    engine = Engine(target, config)
    assert engine.cost_curve == recorded
    planner = engine.runtime("pld").planners[True]
    assert planner is not None and planner.curve == recorded

    prompt = tuple(range(5, 29))
    first = engine.generate(GenerationRequest(prompt, 48, "ar", stop_at_eos=False))
    assert engine.cost_curve == recorded  # due, but not measured inside the request
    second = engine.generate(GenerationRequest(prompt, 8, "ar", stop_at_eos=False))
    assert second.token_ids == first.token_ids[:8]

    corrected = engine.cost_curve
    assert corrected.t(1, 30) < recorded.t(1, 30) / 3
    assert planner.curve is corrected
    assert CostCurve.from_json(json.loads(path.read_text())) == corrected


# -- progress lines ---------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_says_when_a_step_starts_and_how_long_is_left(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    with caplog.at_level(logging.INFO, logger="specdraft.progress"):
        progress = Progress("measuring the thing", 30.0, clock=clock)
        clock.now += 2
        progress.update(0.1)  # before the first interval: nothing
        clock.now += 4
        progress.update(0.4)  # 6 s for 40 %: 9 s left
        clock.now += 1
        progress.update(0.5)  # too soon after the last line
        clock.now += 6
        progress.update(1.0)
        progress.done()
    assert [r.getMessage() for r in caplog.records] == [
        "measuring the thing (once; about 30 s)…",
        "measuring the thing: 40% (9 s left)",
        "measuring the thing: 100% (0 s left)",
        "measuring the thing: done in 13 s",
    ]


def test_a_short_step_writes_one_line_and_long_estimates_read_in_minutes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="specdraft.progress"):
        Progress("converting", 300.0, note="").done()
        Progress("choosing", None).done()
    assert [r.getMessage() for r in caplog.records] == ["converting (about 5 min)…", "choosing (once)…"]


def test_progress_of_a_call_that_reports_none_ticks_from_a_thread(caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level(logging.INFO, logger="specdraft.progress"),
        Progress("converting", 0.2, every=0.05).ticking(),
    ):
        time.sleep(0.4)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "converting (once; about 1 s)…" and lines[-1].startswith("converting: done in")
    assert any("99%" in line for line in lines[1:-1])


def test_measuring_the_cost_curve_shows_progress(
    target: TargetModel, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="specdraft.progress"):
        measure_cost_curve(target, SMALL, MAX_SIZE)
    first = caplog.records[0].getMessage()
    assert first.startswith("measuring the verify cost curve on this machine (once; about ")
    assert first.endswith(" s)…")


def test_progress_shows_where_the_cli_logs_only_warnings() -> None:
    """The CLI configures the root logger at WARNING without -v; progress lines still reach it."""
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.WARNING, stream=sys.stderr)\n"
        "from specdraft.common import Progress\n"
        "Progress('measuring the thing', 12.0).done()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "measuring the thing (once; about 12 s)…" in proc.stderr


# -- the kernel choice ------------------------------------------------------------------------


@pytest.mark.parametrize("busy", [False, True])
def test_a_kernel_choice_timed_under_load_is_reused_for_half_an_hour_only(
    busy: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Workers started together share one choice (the same logits); a start an hour later
    chooses again, unless the choice was timed quietly."""
    from llm_worker.model import kernels
    from llm_worker.model.kernels import KernelReport

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "LoadWatch", _Busy if busy else _Quiet)
    chosen = dict.fromkeys(kernels.ROLES, "aten:4")
    calls: list[int] = []

    def fake_measure(*args: object, **kw: object) -> KernelReport:
        calls.append(1)
        return KernelReport(dict(chosen), {r: {"aten:4": True} for r in chosen}, {})

    monkeypatch.setattr(kernels, "measure_kernels", fake_measure)

    def load() -> KernelReport:
        return kernels.load_or_measure_kernels("fp", {}, torch.device("cpu"), torch.float32)

    with caplog.at_level(logging.WARNING, logger="llm_worker.model.kernels"):
        load()
    assert ("timed under load" in caplog.text) == busy
    assert load().chosen == chosen
    assert len(calls) == 1
    path = kernels.cache_path("fp", "float32", "cpu")
    hour_ago = time.time() - 3600
    os.utime(path, (hour_ago, hour_ago))
    load()
    assert len(calls) == (2 if busy else 1)
