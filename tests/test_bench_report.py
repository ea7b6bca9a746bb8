"""The bench's output for a person: tables that fit 80 and 200 columns without cutting a cell,
the legend, the headline, the machine as plain lines, the load warning, progress, the plot."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from client.bench.report import LEGEND, headline, load_warning, machine_lines, plot, render_table
from client.bench.runner import run_bench, time_left
from client.bench.suite import Question
from helpers.models import CPU_LIKE_CURVE
from llm_worker.config import EngineConfig, ModelConfig
from llm_worker.engine import Engine
from llm_worker.model import load_target

MODES = (
    "ar",
    "pld",
    "pld+h",
    "glide",
    "fuse:sources=pld.suffix.recycle",
    "pld+h@bfloat16",
    "hf-ar",
    "hf-pld",
)
CATEGORIES = {
    "summarization": 1,
    "code-editing": 1,
    "short-text-editing": 1,
    "long-text-editing": 1,
    "multi-turn": 1,
}


def summary(tps: float, speedup: float | None, identical: int = 6, outputs: int = 6) -> dict[str, Any]:
    """One mode's figures, shaped as ``Tally.summary`` makes them."""
    return {
        "tokens_per_second": tps,
        "speedup_vs_ar": speedup,
        "tau": 1.0 if speedup == 1.0 else 1.8,
        "acceptance_rate": None if speedup == 1.0 else 0.41,
        "draft_cost": None if speedup == 1.0 else 0.0123,
        "identical_to_ar": identical == outputs,
        "outputs": outputs,
        "outputs_identical_to_ar": identical,
    }


def fake_report(differ: str = "", load_max: float = 0.5) -> dict[str, Any]:
    """A report of ``MODES`` on the five built-in categories; ``differ``: a mode with 5/6 outputs
    identical to ar."""
    speedups = {
        "ar": 1.0,
        "pld": 1.14,
        "pld+h": 1.09,
        "glide": 0.71,
        "fuse:sources=pld.suffix.recycle": 1.02,
        "pld+h@bfloat16": 1.31,
    }
    modes: dict[str, Any] = {}
    for name in MODES:
        entry = summary(20.0 * speedups.get(name, 0.9), speedups.get(name, 1.1), 5 if name == differ else 6)
        if name != "hf-ar":
            entry["speedup_vs_hf-ar"] = 1.1
        if name != "hf-pld":
            entry["speedup_vs_hf-pld"] = 1.05
        entry["per_category"] = {cat: summary(20.0, speedups.get(name, 0.9), 1, 1) for cat in CATEGORIES}
        modes[name] = entry
    machine = {
        "cpu": "Intel(R) Xeon(R) Processor @ 2.10GHz",
        "cores": 2,
        "torch": "2.13.0",
        "torch_threads": 2,
        "transformers": "4.57.0",
        "python": "3.11.9",
        "model": "SmolLM2-135M-Instruct",
        "dtype": "float32",
        "device": "cpu",
        "backend": "fast",
        "verify_cost_ms_at_512": {
            "1": 11.2,
            "2": 13.05,
            "4": 15.0,
            "8": 19.4,
            "16": 27.0,
            "32": 44.1,
            "64": 80.3,
        },
        "memory_read_gb_per_s": 12.5,
        "dtypes": {
            "float32": {
                "weight_bytes": 538_000_000,
                "weight_bytes_read": 111_600_000,
                "bandwidth_limit_tokens_per_second": 23.2,
                "read_bandwidth_limit_tokens_per_second": 112.0,
                "ar_tokens_per_second": 20.0,
                "ar_fraction_of_bandwidth_limit": 0.86,
                "gemm_kernels": {"qkv": "quant:1", "o": "quant:1", "gate_up": "quant:1", "lm_head": "native"},
                "fused_kernels": True,
            }
        },
        "load_average": {"cores": 2, "samples": [0.2, load_max], "max": load_max},
    }
    config = {
        "questions": 5,
        "questions_per_category": CATEGORIES,
        "max_new_tokens": 96,
        "modes": list(MODES),
    }
    return {"modes": modes, "machine": machine, "config": config}


@pytest.mark.parametrize("width", [80, 200])
def test_the_tables_fit_the_terminal_without_cutting_a_cell(width: int) -> None:
    out = io.StringIO()
    render_table(fake_report(), Console(file=out, width=width, force_terminal=False))
    text = out.getvalue()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    for name in MODES:  # whole, on one line of the main table
        assert any(line.startswith(f"{name} ") for line in text.splitlines()), name
    for line in LEGEND:  # the legend under the table, wrapped but whole
        assert " ".join(line.split()) in " ".join(text.split())
    assert "(n): prompts in the category" in text
    assert "{" not in text  # the machine section has no dict reprs
    assert " ".join(text.split()).endswith(headline(fake_report()))  # the headline, last


def test_headline_says_the_best_mode_and_whether_every_output_was_ars() -> None:
    assert headline(fake_report()) == (
        "best: pld+h@bfloat16 1.31× ar@bfloat16 on 5 prompts; all 6/6 outputs of every mode identical to ar"
    )
    differs = headline(fake_report(differ="glide"))
    assert differs.endswith("; OUTPUTS DIFFER from ar: glide 5/6 identical"), differs
    baseline = headline(fake_report(differ="hf-pld"))
    assert baseline.endswith(
        "all 6/6 outputs of every mode identical to ar (hf-pld 5/6 identical: transformers' own decoding)"
    ), baseline


def test_machine_section_is_plain_lines() -> None:
    lines = machine_lines(fake_report())
    assert lines[0] == (
        "machine: Intel(R) Xeon(R) Processor @ 2.10GHz, 2 cores; torch 2.13.0 (2 threads), "
        "transformers 4.57.0, Python 3.11.9"
    )
    assert (
        "float32: GEMM kernels quant:1 (qkv, o, gate_up), native (lm_head); fused CPU kernels on; "
        in lines[2]
    )
    assert (
        "verify cost at 512 tokens of context, ms per forward of n rows: "
        "n=1 11.2 · 2 13.1 · 4 15.0 · 8 19.4 · 16 27.0 · 32 44.1 · 64 80.3"
    ) in lines


def test_load_warning_only_when_the_load_passed_the_cores() -> None:
    assert load_warning(fake_report(load_max=2.0)) is None
    warning = load_warning(fake_report(load_max=3.4))
    assert warning is not None and "reached 3.40 on 2 cores" in warning and "may be unreliable" in warning
    out = io.StringIO()
    render_table(fake_report(load_max=3.4), Console(file=out, width=100))
    assert "warning: the 1-minute load average reached 3.40" in out.getvalue()


def test_time_left() -> None:
    assert time_left(30, 3, 12) == "about 1.5 min left"
    assert time_left(10, 1, 3) == "about 20 s left"
    assert time_left(0, 0, 3) == "" and time_left(9, 3, 3) == ""


def test_a_bench_run_samples_the_load_and_reports_progress(tiny_dir: Path) -> None:
    """A run on the tiny model with a faked load source above the cores: the report carries the
    samples (start, after each mode, end) and renders the warning; progress names every stage and
    every mode run, with the time left once one has run."""
    target, tokenizer = load_target(ModelConfig(path=str(tiny_dir)))
    engine = Engine(target, EngineConfig(), curve=CPU_LIKE_CURVE)
    busy = float(2 * (os.cpu_count() or 1))
    lines: list[str] = []
    question = Question("q", "copy", ("Repeat: a b c a b c",))
    result = run_bench(engine, tokenizer, [question], ["pld"], 12, progress=lines.append, load=lambda: busy)
    report = result.to_json()
    load = report["machine"]["load_average"]
    assert load["samples"] == [busy] * 4 and load["max"] == busy  # start, ar, pld, end
    assert report["config"]["questions_per_category"] == {"copy": 1}
    assert any(line.startswith("warming up 2 modes") for line in lines), lines
    runs = [line for line in lines if line.startswith("[1/1 copy] ")]
    assert len(runs) == 2 and "left)" in runs[0] and "left" not in runs[1], runs
    out = io.StringIO()
    render_table(report, Console(file=out, width=80))
    assert "warning: the 1-minute load average reached" in out.getvalue()


def test_plot_writes_a_png(tmp_path: Path) -> None:
    path = plot(fake_report(differ="glide"), tmp_path / "plots" / "demo.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
