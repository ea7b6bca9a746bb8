"""``make gpu-check``: the CUDA tests and a short benchmark on this machine, as ONE JSON and ONE
Markdown report (default ``bench-out/gpu-check/report.{json,md}``; docs/gpu.md).

1. the environment: GPU, driver, CUDA, torch, Triton and transformers versions;
2. ``pytest -m cuda`` over the test files that hold ``cuda`` tests, each test's outcome read
   from its JUnit XML (where torch sees no CUDA device they are all skipped, and counted so);
3. ``specdraft bench``'s run (``client.bench.runner.run_bench``): every mode the worker lists
   for the model (no datastore) in float32 and bfloat16, interleaved, one request at a time
   (concurrency 1), then every mode again as 16 concurrent users through the batch scheduler,
   plus transformers' ``generate`` (``hf-ar``) on the same weights; every output checked
   against ``ar``.

It installs nothing and reads nothing from the network: what a bare GPU machine lacks travels
beside the repository (``scripts/gpu/pack.sh``). Sized for about 8 minutes on an H100 with the
model load (not measured yet). A report is written after the tests and again after the
benchmark, so a run cut short still leaves one.

    python scripts/gpu/check.py                      # on the GPU machine (make gpu-check)
    python scripts/gpu/check.py --device cpu --model DIR --quick   # the harness on CPU, in seconds
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = Path("bench-out/gpu-check")
SUITE = "input-guided"
FULL = {"limit": 16, "max_new_tokens": 32, "concurrency": 16}
"""The GPU run: 16 questions (so that 16 users have a prompt each), 32 new tokens an answer."""
QUICK = {"limit": 2, "max_new_tokens": 8, "concurrency": 16}
"""``--quick``: the harness end to end on a tiny model in seconds; its figures mean nothing."""
DTYPES = ("float32", "bfloat16")


def say(line: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {line}", flush=True)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: str) -> dict[str, Any]:
    """What ran the check: the GPU and its driver (``nvidia-smi``), CUDA, torch, Triton,
    transformers, Python, the processor."""
    import torch

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "cuda_available": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "driver": None,
    }
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"]
        done = subprocess.run(query, capture_output=True, text=True, timeout=30, check=False)
        if done.returncode == 0 and done.stdout.strip():
            driver, memory = (part.strip() for part in done.stdout.splitlines()[0].split(",", 1))
            env["driver"], env["gpu_memory"] = driver, memory
    return env


def cuda_test_files(root: Path = REPO) -> list[Path]:
    """The test files holding ``cuda``-marked tests. Only those are collected: the others import
    packages a bare GPU machine does not have (the HTTP API's, kubernetes' schemas, ...)."""
    return sorted(p for p in (root / "tests").glob("test_*.py") if "pytest.mark.cuda" in p.read_text())


def junit_cases(path: Path) -> list[dict[str, Any]]:
    """Each test case of a JUnit XML file: its name, outcome (passed, failed, error, skipped),
    seconds and, unless it passed, the message.

    Example: ``<testcase classname="tests.test_cuda" name="test_x[float32]" time="0.5">`` with a
    ``<skipped message="no CUDA device"/>`` child → ``{"name": "tests/test_cuda.py::test_x[float32]",
    "outcome": "skipped", "seconds": 0.5, "message": "no CUDA device"}``."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        outcome, message = "passed", None
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = (child.get("message") or child.text or "").strip()[:2000]
                break
        name = f"{module}.py::{case.get('name')}" if module else str(case.get("name"))
        cases.append(
            {"name": name, "outcome": outcome, "seconds": float(case.get("time", 0)), "message": message}
        )
    return cases


def run_tests(files: list[Path], timeout_seconds: float, select: str | None = None) -> dict[str, Any]:
    """``pytest -m cuda`` over ``files`` (at least one) in a child process, ``-k select`` where
    given; each case's outcome."""
    assert files, "no test file holds cuda tests"
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider"]
        # a base temp of its own: pytest's shared one keeps the last three runs and removes older
        # ones, perhaps the calling test's
        command += [f"--junitxml={junit}", f"--basetemp={tmp}/pytest"]
        command += ["-k", select] if select else []
        command += [str(f.relative_to(REPO)) for f in files]
        say(f"running {' '.join(command[1:])}")
        began = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=REPO, timeout=timeout_seconds, check=False)
            exit_code: int | None = done.returncode
        except subprocess.TimeoutExpired:
            exit_code = None
        seconds = round(time.perf_counter() - began, 1)
        cases = junit_cases(junit) if junit.is_file() else []
    names = [str(f.relative_to(REPO)) for f in files]
    counts: dict[str, int] = {}
    for case in cases:
        counts[case["outcome"]] = counts.get(case["outcome"], 0) + 1
    return {
        "command": " ".join(["pytest -m cuda", *([f"-k '{select}'"] if select else []), *names]),
        "exit_code": exit_code,
        "timed_out": exit_code is None,
        "seconds": seconds,
        "counts": counts,
        "cases": cases,
    }


def run_benchmark(
    device: str,
    model: str | None,
    limit: int,
    max_new_tokens: int,
    concurrency: int,
    quick: bool,
    ops: str = "auto",
    dtypes: tuple[str, ...] = DTYPES,
    graphs: bool = False,
    questions_file: Path | None = None,
) -> dict[str, Any]:
    """Every mode, float32 and bfloat16, alone and ``concurrency`` at once, plus ``hf-ar``:
    ``run_bench``'s report. ``quick``: a fixed cost curve instead of the one measured here (whose
    check measures it again whenever a busy CPU's forwards disagree with it); ``ops``: the
    forward's operations (``ModelConfig.ops``; auto: the Triton kernels on CUDA); ``graphs``:
    beside each dtype's engine, one whose steps replay CUDA graphs (``mode@DTYPE+graphs``);
    ``questions_file``: a JSONL of questions (``specdraft bench --questions``'s) instead of the
    built-in input-guided suite."""
    from client.bench.runner import engine_label, run_bench
    from client.bench.suite import builtin_suite, load_questions
    from llm_worker.assembly import ResourceConfig, build_resources, load_model
    from llm_worker.config import ModelConfig
    from llm_worker.drafters import DRAFTERS
    from llm_worker.engine import Engine
    from llm_worker.planner import CostCurve

    curve = CostCurve.linear(0.05, 0.003) if quick else None
    engines = []
    for dtype, captured in [(d, g) for d in dtypes for g in ((False, True) if graphs else (False,))]:
        steps = "CUDA graphs" if captured else "eager steps"
        say(f"loading the model ({model or 'the default model'}, {dtype}, {device}, {ops} ops, {steps})")
        config = ModelConfig(path=model, dtype=dtype, device=device, ops=ops, cuda_graphs=captured)  # type: ignore[arg-type]
        target, tokenizer = load_model(config)
        resources = build_resources(ResourceConfig(), tokenizer)
        engines.append((Engine(target, curve=curve, resources=resources), target, tokenizer))
    engine, target, tokenizer = engines[0]
    questions = (load_questions(questions_file) if questions_file else builtin_suite(SUITE))[:limit]
    modes, failed = working_modes(
        [e for e, _, _ in engines], DRAFTERS.available(target, engine.resources), questions[0], tokenizer
    )
    modes.append("hf-ar")
    say(f"bench: {len(modes)} modes x {dtypes}, {len(questions)} questions, {max_new_tokens} new tokens")
    result = run_bench(
        engine,
        tokenizer,
        questions,
        modes,
        max_new_tokens,
        progress=say,
        others=[e for e, _, _ in engines[1:]],
        concurrency=[concurrency],
    )
    report = result.to_json()
    report["failed_modes"] = failed
    report["kernel_info"] = {engine_label(e): e.target.kernel_info() for e, _, _ in engines}
    report["operations"] = {
        engine_label(e): getattr(getattr(t, "ops", None), "name", None) for e, t, _ in engines
    }
    report["graphs"] = {
        engine_label(e): captured_steps.describe()
        for e, t, _ in engines
        if (captured_steps := getattr(t, "graphs", None)) is not None
    }
    return report


def working_modes(
    engines: list[Any], modes: list[str], question: Any, tokenizer: Any
) -> tuple[list[str], dict[str, str]]:
    """The modes that write a few tokens on every engine, and why each other one failed (the
    benchmark runs the rest: one broken mode does not cost a scarce GPU run its figures)."""
    from llm_worker.chat import chat_prompt_ids
    from llm_worker.engine import GenerationRequest

    prompt = tuple(chat_prompt_ids(tokenizer, question.messages()))
    failed: dict[str, str] = {}
    for mode in modes:
        for engine in engines:
            try:
                engine.generate(GenerationRequest(prompt, 4, mode, stop_at_eos=False))
            except Exception as exc:
                failed[mode] = f"{engine.target.info.dtype}: {type(exc).__name__}: {exc}"[:2000]
                say(f"{mode} failed, left out of the benchmark: {failed[mode]}")
                break
    return [m for m in modes if m not in failed], failed


def summarize(bench: dict[str, Any], concurrency: int) -> dict[str, Any]:
    """The figures the issue's criteria read, per mode: tokens/s and speed-up alone, whether its
    outputs equal ``ar``'s alone and under ``concurrency`` users, τ; and ``ar`` against
    ``hf-ar`` (transformers' generate on the same GPU and weights, float32)."""
    rows: dict[str, Any] = {}
    for mode, entry in bench["modes"].items():
        under = entry.get("concurrency", {}).get(str(concurrency), {})
        rows[mode] = {
            "tokens_per_second": entry["tokens_per_second"],
            "speedup_vs_ar": entry["speedup_vs_ar"],
            "tau": entry["tau"],
            "identical_to_ar": entry["identical_to_ar"],
            f"tokens_per_second_x{concurrency}": under.get("aggregate_tokens_per_second"),
            f"identical_to_ar_x{concurrency}": under.get("identical_to_ar"),
        }
    engine_modes = [m for m in rows if not m.startswith("hf-")]
    ar, hf = rows.get("ar", {}).get("tokens_per_second"), rows.get("hf-ar", {}).get("tokens_per_second")
    ratio = round(ar / hf, 3) if ar and hf else None
    return {
        "modes": rows,
        "failed_modes": sorted(bench.get("failed_modes", {})),
        "every_mode_identical_alone": all(rows[m]["identical_to_ar"] for m in engine_modes),
        f"every_mode_identical_x{concurrency}": all(
            rows[m][f"identical_to_ar_x{concurrency}"] is not False for m in engine_modes
        ),
        "ar_vs_hf_ar": ratio,
        "ar_at_least_2x_transformers": ratio is not None and ratio >= 2,
    }


def markdown(report: dict[str, Any]) -> str:
    env, tests, bench = report["environment"], report["tests"], report.get("bench")
    lines = [
        f"# gpu-check, {env['date']}",
        "",
        f"- GPU: {env['gpu'] or 'none (CPU run)'}; driver {env['driver']}; CUDA (torch) {env['torch_cuda']}",
        f"- torch {env['torch']}, Triton {env['triton']}, transformers {env['transformers']}, "
        f"Python {env['python']}",
        f"- options: {json.dumps(report['options'])}",
        "",
        "## Tests (`pytest -m cuda`)",
        "",
    ]
    if tests is None:
        lines.append("not run (`--skip-tests`)")
    else:
        counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(tests["counts"].items())) or "none"
        lines += [
            f"{counts}; exit code {tests['exit_code']}{' (timed out)' if tests['timed_out'] else ''}, "
            f"{tests['seconds']} s",
            "",
            "| test | outcome | s | message |",
            "|---|---|---|---|",
        ]
        for case in tests["cases"]:
            message = case["message"].splitlines()[0][:120].replace("|", "\\|") if case["message"] else ""
            lines.append(f"| `{case['name']}` | {case['outcome']} | {case['seconds']:.1f} | {message} |")
    lines += ["", "## Benchmark", ""]
    if bench is None:
        lines.append("not run (`--skip-bench`)")
    elif "error" in bench:
        lines.append(f"failed: `{bench['error']}`")
    else:
        if "auto_ops_error" in bench:
            lines += [
                f"The default operations failed (`{bench['auto_ops_error']}`); these figures are "
                f"the fallback's, operations `{bench['fallback_ops']}` (not batch-invariant).",
                "",
            ]
        summary, c = bench["summary"], report["options"]["concurrency"]
        for label, same in bench.get("machine", {}).get("dtype_comparison", {}).items():
            counts = ", ".join(f"{k.removeprefix('ar_outputs_')}: {v}" for k, v in same.items())
            lines.append(f"- `ar@{label}`: {counts}")
        for mode, why in bench.get("failed_modes", {}).items():
            lines.append(f"- `{mode}` failed and was left out: `{why.splitlines()[0][:300]}`")
        lines += [
            f"ar / hf-ar (transformers' generate, {report['options']['dtypes'].split(',')[0]}): "
            f"{summary['ar_vs_hf_ar']}; every mode "
            f"identical to ar alone: {summary['every_mode_identical_alone']}, with {c} users: "
            f"{summary[f'every_mode_identical_x{c}']}; {bench['seconds']} s",
            "",
            f"| mode | tokens/s | × ar | τ | = ar | tokens/s ×{c} users | = ar ×{c} |",
            "|---|---|---|---|---|---|---|",
        ]
        for mode, row in summary["modes"].items():
            cells = [
                mode,
                *(row[k] for k in ("tokens_per_second", "speedup_vs_ar", "tau", "identical_to_ar")),
            ]
            cells += [row[f"tokens_per_second_x{c}"], row[f"identical_to_ar_x{c}"]]
            lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def write(report: dict[str, Any], out: Path) -> None:
    """Both reports, each replaced whole (a run cut short leaves the last complete ones)."""
    from specdraft.common import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "report.json", json.dumps(report, indent=1) + "\n")
    atomic_write_text(out / "report.md", markdown(report))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--device", default="cuda", help="torch device of the benchmark (cpu: the harness alone)")
    p.add_argument("--model", default=None, help="a model directory (default: the default model)")
    p.add_argument("--quick", action="store_true", help="2 questions of 8 tokens (a tiny model on CPU)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where report.json and report.md go")
    p.add_argument("--limit", type=int, help="questions of the suite (default 16; --quick 2)")
    p.add_argument("--max-new-tokens", type=int, help="tokens an answer (default 32; --quick 8)")
    p.add_argument("--concurrency", type=int, help="users of the concurrent run (default 16)")
    p.add_argument(
        "--questions",
        type=Path,
        help="a JSONL of questions (specdraft bench --questions) instead of the input-guided suite",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="beside each dtype's engine, one whose steps replay CUDA graphs (mode@DTYPE+graphs)",
    )
    p.add_argument(
        "--ops",
        choices=("auto", "triton", "torch"),
        default="auto",
        help="the benchmark's forward operations (auto: Triton on CUDA; on CUDA, when auto fails,\n"
        "the benchmark runs again on torch's, reported as such)",
    )
    p.add_argument("--tests-timeout", type=float, default=330.0, help="seconds pytest -m cuda may take")
    p.add_argument("--skip-tests", action="store_true", help="the benchmark alone")
    p.add_argument("-k", dest="select", help="pytest -k: the cuda tests to run (default: all)")
    p.add_argument(
        "--dtypes",
        default=",".join(DTYPES),
        help="the benchmark's dtypes, comma-separated (default: %(default)s; the first runs hf-ar)",
    )
    p.add_argument("--skip-bench", action="store_true", help="the tests alone")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """0 when every test passed or was skipped and every mode equalled ``ar`` (the speed
    criteria are reported, not enforced); 1 otherwise."""
    args = parse_args(argv)
    sizes = dict(QUICK if args.quick else FULL)
    for key in sizes:
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    report: dict[str, Any] = {
        "environment": environment(args.device),
        "options": {
            "device": args.device,
            "model": args.model,
            "quick": args.quick,
            "ops": args.ops,
            "select": args.select,
            "dtypes": args.dtypes,
            "cuda_graphs": args.cuda_graphs,
            "questions": str(args.questions) if args.questions else SUITE,
            **sizes,
        },
        "tests": None,
        "bench": None,
    }
    say(f"environment: {json.dumps(report['environment'])}")
    ok = True
    if not args.skip_tests:
        report["tests"] = run_tests(cuda_test_files(), args.tests_timeout, args.select)
        ok = report["tests"]["exit_code"] in (0, 5) and not report["tests"]["counts"].get("failed")
        write(report, args.out)
    if not args.skip_bench:
        began = time.perf_counter()
        dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
        bench_args = (args.device, args.model, sizes["limit"], sizes["max_new_tokens"], sizes["concurrency"])
        try:
            bench = run_benchmark(*bench_args, args.quick, args.ops, dtypes, args.cuda_graphs, args.questions)
        except Exception as exc:  # reported, with the tests' outcomes kept
            bench, ok = {"error": f"{type(exc).__name__}: {exc}"}, False
            say(f"the benchmark failed: {bench['error']}")
            if args.device.startswith("cuda") and args.ops == "auto":
                # the speed of the ordinary fast path at least (cuBLAS: not batch-invariant)
                say("running the benchmark again on the torch operations")
                try:
                    fallback = run_benchmark(*bench_args, args.quick, "torch", dtypes, False, args.questions)
                    bench = {**fallback, "auto_ops_error": bench["error"], "fallback_ops": "torch"}
                except Exception as again:
                    bench["fallback_error"] = f"{type(again).__name__}: {again}"
        if "error" not in bench:
            bench["summary"] = summarize(bench, sizes["concurrency"])
            summary = bench["summary"]
            ok = (
                ok
                and "auto_ops_error" not in bench
                and not summary["failed_modes"]
                and summary["every_mode_identical_alone"]
                and summary[f"every_mode_identical_x{sizes['concurrency']}"]
            )
        bench["seconds"] = round(time.perf_counter() - began, 1)
        report["bench"] = bench
    write(report, args.out)
    say(f"wrote {args.out / 'report.json'} and {args.out / 'report.md'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # run as a script from anywhere: the project's packages
    sys.exit(main())
