"""``make gpu-check`` (scripts/gpu/check.py) end to end on the CPU with a tiny model: the CUDA
tests are collected and counted as skipped, every mode runs in float32 and bfloat16, alone and
under 16 users, and one JSON and one Markdown report name what ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts" / "gpu"))

import check  # noqa: E402  # scripts/gpu/check.py


@pytest.mark.timeout(300)
def test_gpu_check_runs_the_whole_harness_on_cpu(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "gpu-check"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(REPO / "scripts/gpu/check.py"), "--device", "cpu", "--quick"]
    done = subprocess.run(
        [*command, "--model", str(tiny_dir), "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]
    report = json.loads((out / "report.json").read_text())

    env_info = report["environment"]
    assert env_info["torch"] and env_info["device"] == "cpu" and env_info["gpu"] is None
    tests = report["tests"]
    cuda_files = check.cuda_test_files()
    assert REPO / "tests/test_cuda.py" in cuda_files
    assert tests["cases"] and tests["counts"] == {"skipped": len(tests["cases"])}
    assert {c["message"] for c in tests["cases"]} == {"no CUDA device"}

    summary = report["bench"]["summary"]
    modes = summary["modes"]
    assert {"ar", "ar@bfloat16", "pld", "pld@bfloat16", "hf-ar"} <= set(modes)
    assert summary["every_mode_identical_alone"] and summary["every_mode_identical_x16"]
    assert modes["pld"]["identical_to_ar_x16"] is True and modes["pld"]["tokens_per_second_x16"] > 0
    assert summary["ar_vs_hf_ar"] > 0
    markdown = (out / "report.md").read_text()
    assert "| pld@bfloat16 |" in markdown and "no CUDA device" in markdown


def test_junit_cases_reads_each_outcome(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_cuda" name="test_a[float32]" time="1.5"/>'
        '<testcase classname="tests.test_cuda" name="test_b" time="0.1">'
        '<failure message="assert 1 == 2">trace</failure></testcase>'
        '<testcase classname="tests.test_cuda" name="test_c" time="0">'
        '<skipped type="pytest.skip" message="no CUDA device">skip</skipped></testcase>'
        "</testsuite></testsuites>"
    )
    cases = check.junit_cases(junit)
    assert [(c["name"], c["outcome"], c["seconds"], c["message"]) for c in cases] == [
        ("tests/test_cuda.py::test_a[float32]", "passed", 1.5, None),
        ("tests/test_cuda.py::test_b", "failed", 0.1, "assert 1 == 2"),
        ("tests/test_cuda.py::test_c", "skipped", 0.0, "no CUDA device"),
    ]


def test_a_failing_triton_benchmark_on_cuda_runs_again_on_the_torch_operations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the default operations fail on CUDA, the speed of the ordinary fast path is still
    reported, labelled as the fallback's and not invariant, and the check fails."""
    calls = []

    def fake_benchmark(*args: object) -> dict[str, object]:
        ops = args[6]  # (device, model, limit, new tokens, concurrency, quick, ops, ...)
        calls.append(ops)
        if ops == "auto":
            raise RuntimeError("no kernel image")
        under = {"16": {"aggregate_tokens_per_second": 500.0, "identical_to_ar": True}}
        row = {"tokens_per_second": 100.0, "speedup_vs_ar": 1.0, "tau": 1.0, "identical_to_ar": True}
        return {"modes": {"ar": {**row, "concurrency": under}}}

    monkeypatch.setattr(check, "run_benchmark", fake_benchmark)
    out = tmp_path / "gpu-check"
    assert check.main(["--device", "cuda", "--skip-tests", "--out", str(out)]) == 1
    assert calls == ["auto", "torch"]
    bench = json.loads((out / "report.json").read_text())["bench"]
    assert bench["fallback_ops"] == "torch" and "no kernel image" in bench["auto_ops_error"]
    assert bench["summary"]["modes"]["ar"]["tokens_per_second"] == 100.0
    assert "the fallback's, operations `torch`" in (out / "report.md").read_text()
