"""The CLI contract: JSON shape, exit codes, error messages, bench output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from client.cli import main

STATS_KEYS = {
    "new_tokens",
    "target_forwards",
    "tau",
    "acceptance_rate",
    "draft_seconds",
    "verify_seconds",
    "seconds",
    "tokens_per_second",
}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_contract(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "generate",
        "--model",
        str(tiny_dir),
        "--mode",
        "pld",
        "--max-new-tokens",
        "20",
        "--json",
        "hello hello",
    )
    assert code == 0
    payload = json.loads(out)  # exactly one JSON object on stdout
    assert {"text", "token_ids", "mode", "stats", "provenance"} <= set(payload)
    assert payload["mode"] == "pld"
    assert set(payload["stats"]) >= STATS_KEYS
    assert payload["stats"]["new_tokens"] == len(payload["token_ids"]) <= 20
    assert isinstance(payload["provenance"], list)


def test_generate_chat_stream_and_sampling(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", str(tiny_dir), "--chat", "--max-new-tokens", "12", "--temperature", "0.7"]
    code, out, err = run(capsys, *argv, "--seed", "3", "--stream", "--json", "hi")
    assert code == 0
    first = json.loads(out)
    code, out, _ = run(capsys, *argv, "--seed", "3", "--json", "hi")
    assert json.loads(out)["token_ids"] == first["token_ids"]
    assert err.strip() == first["text"].strip()  # the stream went to stderr


def test_generate_stop_logprobs_and_penalties(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", str(tiny_dir), "--mode", "pld", "--max-new-tokens", "30", "--json"]
    full = json.loads(run(capsys, *argv, "hello hello hello")[1])
    text = full["text"]
    stop = next(
        p
        for p in (text[i : i + 3] for i in range(len(text) // 2, len(text) - 3))
        if p.strip() and "\ufffd" not in p
    )
    code, out, err = run(
        capsys, *argv, "--stop", stop, "--stop", "zzz", "--logprobs", "2", "--stream", "hello hello hello"
    )
    payload = json.loads(out)
    assert code == 0 and payload["text"] == text[: text.find(stop)] and err == payload["text"] + "\n"
    assert (payload["finish_reason"], payload["stop_reason"]) == ("stop", stop)
    assert payload["token_ids"] == full["token_ids"][: len(payload["token_ids"])]
    assert [lp["token_id"] for lp in payload["logprobs"]] == payload["token_ids"]
    assert all(len(lp["top"]) == 2 for lp in payload["logprobs"])
    stop_id = full["token_ids"][5]
    payload = json.loads(run(capsys, *argv, "--stop-token-id", str(stop_id), "hello hello hello")[1])
    assert payload["stop_reason"] == stop_id and payload["token_ids"][-1] == stop_id
    penalised = ["--presence-penalty", "0.5", "--frequency-penalty", "0.5", "--repetition-penalty", "1.5"]
    payload = json.loads(run(capsys, *argv, *penalised, "hello hello hello")[1])
    assert payload["token_ids"] != full["token_ids"] and "logprobs" not in payload


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--logprobs", "21"], "logprobs must be in [0, 20], got 21"),
        (["--stop", ""], "a stop string is empty"),
        (["--stop", "a"] * 5, "at most 4 stop strings, got 5"),
        (["--repetition-penalty", "0"], "repetition_penalty must be a finite number > 0"),
        (["--mode", "nope"], "unknown mode 'nope'"),
        (["--mode", "pld:window=3"], "takes options"),
        (["--mode", "pld+h:layer=99"], "outside"),
        (["--max-new-tokens", "5000"], "exceeds the model's context"),
        (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
        (["--temperature", "0.5", "--top-p", "0"], "top_p must be in (0, 1]"),
    ],
)
def test_bad_input_is_a_clear_error(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    code, out, err = run(capsys, "generate", "--model", str(tiny_dir), *extra, "hello")
    assert code == 2
    assert out == ""
    assert message in err and err.startswith("specdraft: error:")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device_is_a_clear_error(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "generate", "--model", str(tiny_dir), "--device", "cuda", "hello")
    assert code == 2 and "CUDA is not available" in err


def test_missing_model_dir_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "generate", "--model", str(tmp_path), "hello")
    assert code == 2 and "not a Hugging Face model directory" in err


def test_bench_reports_fuse_accepted_tokens_by_source(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mode that drafts from several sources reports, per source, the accepted tokens it had
    proposed over the timed run (warm-up excluded): each accepted token counts for at least one."""
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        json.dumps({"question_id": "a", "category": "copy", "turns": ["Repeat: a b c a b c", "Again"]}) + "\n"
    )
    out_json = tmp_path / "r.json"
    code, out, _ = run(
        capsys, "bench", "--model", str(tiny_dir), "--questions", str(questions), "--modes", "fuse",
        "--max-new-tokens", "64", "--json-out", str(out_json),
    )  # fmt: skip
    assert code == 0
    fused = json.loads(out_json.read_text())["modes"]["fuse"]
    assert fused["identical_to_ar"] and fused["acceptance_rate"]
    by_source = fused["accepted_by_source"]  # a source's count is at most every accepted token
    assert by_source and set(by_source) <= {"pld", "suffix", "recycle"}
    assert all(v["tokens"] > 0 and 0 < v["share"] <= 1 for v in by_source.values()), by_source
    assert "fuse: accepted draft tokens by source:" in out


def test_bench_json_table_and_plot(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        json.dumps({"question_id": "a", "category": "copy", "turns": ["Repeat: a b c a b c", "Again"]})
        + "\n"
        + json.dumps({"question_id": "b", "category": "open", "turns": ["Say something."]})
        + "\n"
    )
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    code, out, _ = run(
        capsys,
        "bench",
        "--model",
        str(tiny_dir),
        "--questions",
        str(questions),
        "--modes",
        "pld,pld+h,hf-ar,hf-pld",
        "--max-new-tokens",
        "64",  # long enough for the tiny model's answers to repeat themselves: pld drafts in both dtypes
        "--json-out",
        str(out_json),
        "--plot",
        str(out_png),
        "--also-dtype",
        "bfloat16",
    )
    assert code == 0
    report = json.loads(out_json.read_text())
    assert list(report["modes"]) == [
        "ar", "pld", "pld+h", "hf-ar", "hf-pld", "ar@bfloat16", "pld@bfloat16", "pld+h@bfloat16"
    ]  # fmt: skip
    for name in ("pld@bfloat16", "pld+h@bfloat16"):  # compared with bfloat16's own ar: bit-exact too
        assert report["modes"][name]["identical_to_ar"], name
        assert "speedup_vs_primary_ar" in report["modes"][name]
    machine = report["machine"]
    assert machine["memory_read_gb_per_s"] > 0
    for dtype in ("float32", "bfloat16"):
        info = machine["dtypes"][dtype]
        assert info["weight_bytes"] > 0 and set(info["gemm_kernels"]) == {
            "qkv",
            "o",
            "gate_up",
            "down",
            "lm_head",
        }
        assert info["bandwidth_limit_tokens_per_second"] > 0
        assert info["ar_fraction_of_bandwidth_limit"] > 0
        assert 0 < info["weight_bytes_read"] <= info["weight_bytes"]
        assert info["read_bandwidth_limit_tokens_per_second"] >= info["bandwidth_limit_tokens_per_second"]
        for role, kernel in info["gemm_kernels"].items():
            assert info["gemm_kernel_candidates"]["invariant"][role][kernel]
    assert (
        machine["ar_fraction_of_bandwidth_limit"]
        == machine["dtypes"]["float32"]["ar_fraction_of_bandwidth_limit"]
    )
    assert machine["dtype_comparison"]["bfloat16"]["outputs"] == 3
    for name, mode in report["modes"].items():
        assert {"tokens_per_second", "speedup_vs_ar", "tau", "acceptance_rate", "identical_to_ar"} <= set(
            mode
        )
        assert set(mode["per_category"]) == {"copy", "open"}
        assert mode["outputs"] == 3
        if name in ("pld", "pld+h", "pld@bfloat16", "pld+h@bfloat16"):  # greedy and lossless: ar's tokens
            assert mode["identical_to_ar"], name
            # ... with drafts verified and some accepted (acceptance_rate is None when nothing drafted)
            assert mode["acceptance_rate"] and mode["tau"] > 1, (name, mode["acceptance_rate"], mode["tau"])
    assert report["modes"]["ar"]["tau"] == pytest.approx(1.0)
    assert {"cpu", "torch", "dtype", "verify_cost_ms_at_512"} <= set(report["machine"])
    assert out_png.stat().st_size > 1000
    assert "tok/s" in out


@pytest.mark.slow
def test_generate_on_the_default_model_in_a_subprocess() -> None:
    """The installed console script, the default model, the documented flags."""
    cmd = [sys.executable, "-m", "client.cli", "generate", "--mode", "pld+h", "--chat", "--json"]
    cmd += ["--max-new-tokens", "24", "Repeat exactly: the quick brown fox jumps over the lazy dog."]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)
    assert payload["mode"] == "pld+h"
    assert payload["stats"]["new_tokens"] == len(payload["token_ids"]) > 0
    assert torch.tensor(payload["token_ids"]).max() < 49152


def test_usage_errors_follow_the_contract(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--threads", "-1", "hi"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("specdraft: error:") and err.count("\n") == 1


def test_worker_bounds_of_the_online_stores_reach_the_stores() -> None:
    """``serve worker --suffix-max-tokens / --recycle-max-tenants`` become the bounds of the stores
    the worker's drafters share; without them, the stores' own defaults."""
    from client.cli import build_parser
    from client.cli.common import resource_config
    from llm_worker.assembly import build_resources
    from llm_worker.drafters.recycle_store import RecycleStore
    from llm_worker.drafters.suffix_tree import SuffixStore

    args = build_parser().parse_args(
        ["serve", "worker", "--suffix-max-tokens", "1000", "--recycle-max-tenants", "3"]
    )
    resources = build_resources(resource_config(args), None)
    assert resources.suffixes.max_tokens == 1000 and resources.recycling.max_tenants == 3
    defaults = build_resources(resource_config(build_parser().parse_args(["serve", "worker"])), None)
    assert defaults.suffixes.max_tokens == SuffixStore().max_tokens == 262_144
    assert defaults.recycling.max_tenants == RecycleStore().max_tenants == 16
    generate = build_resources(resource_config(build_parser().parse_args(["generate", "hi"])), None)
    assert generate.suffixes.max_tokens == 262_144 and generate.recycling.max_tenants == 16


@pytest.mark.parametrize("flag", ["--suffix-max-tokens", "--recycle-max-tenants"])
@pytest.mark.parametrize("value", ["0", "-5", "many"])
def test_worker_refuses_a_non_positive_store_bound(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "worker", flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specdraft: error: argument {flag}:") and err.count("\n") == 1, err
    assert value == "many" or f"must be >= 1, got {value}" in err


def test_up_passes_the_online_store_bounds_to_its_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``specdraft up --suffix-max-tokens N --recycle-max-tenants N`` starts every worker with those
    bounds (its arguments parse as ``serve worker``'s), and without them with the workers' own
    defaults, which are the stores'."""
    import client.stack
    from client.cli import build_parser
    from client.cli.common import resource_config
    from llm_worker.assembly import ResourceConfig

    started: list[client.stack.StackConfig] = []

    def fake_up(cfg: client.stack.StackConfig, state_dir: Path, log: object) -> None:
        started.append(cfg)
        raise client.stack.StackError("not started: a test")

    monkeypatch.setattr(client.stack, "up", fake_up)
    base = ["up", "--no-warm", "--state-dir", str(tmp_path)]
    assert main([*base, "--suffix-max-tokens", "1000", "--recycle-max-tenants", "3"]) == 1
    assert main(base) == 1
    capsys.readouterr()
    bounded, default = (build_parser().parse_args(["serve", "worker", *c.worker_args]) for c in started)
    assert (bounded.suffix_max_tokens, bounded.recycle_max_tenants) == (1000, 3)
    assert resource_config(default) == resource_config(build_parser().parse_args(["serve", "worker"]))
    defaults = ResourceConfig()
    assert (default.suffix_max_tokens, default.recycle_max_tenants) == (
        defaults.suffix_max_tokens,
        defaults.recycle_max_tenants,
    )


def test_pld_a_refuses_a_head_file_of_another_model(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llm_worker.drafters.heads import HeadScore, HeadsFile, save_heads

    heads = save_heads(HeadsFile("other", "x", (HeadScore(20, 5, 1.0),), 1, 1), tmp_path / "h.json")
    code, _, err = run(
        capsys, "generate", "--model", str(tiny_dir), "--heads-file", str(heads), "--mode", "pld+a", "hi"
    )
    assert code == 2 and "calibrated for another model" in err
    code, _, err = run(capsys, "generate", "--model", str(tiny_dir), "--mode", f"pld+a:file={heads}", "hi")
    assert code == 2 and "not ['file']" in err  # a request never names a file
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"\xff\x00 not json")
    for bad in (garbage, Path("/dev/zero")):
        code, _, err = run(
            capsys, "generate", "--model", str(tiny_dir), "--heads-file", str(bad), "--mode", "pld+a", "hi"
        )
        assert code == 2 and ("not valid" in err or "not a file" in err), err
        assert "Traceback" not in err and "errno" not in err.lower()


def test_version_names_the_package_torch_transformers_and_the_kernels(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["specdraft", "torch", "transformers", "native", "compiled"]
    assert lines[1] == f"torch {torch.__version__}"
    assert lines[3].startswith(("native kernels: yes", "native kernels: no: "))
    assert lines[4].startswith(("compiled retrieval: yes", "compiled retrieval: no: "))


def test_a_mistyped_mode_is_refused_before_the_model_loads() -> None:
    """The mode is checked before the model loads: with a model that does not exist, the mode's
    error is the one reported, one line, exit 2, in the time Python and torch take to start."""
    base = [sys.executable, "-m", "client.cli", "generate", "--model", "/nonexistent", "--mode"]
    for mode, message in (("pdl", "unknown mode 'pdl'"), ("pld+h:layr=3", "takes options")):
        cmd = [*base, mode, "hi"]
        began = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        seconds = time.monotonic() - began
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.startswith("specdraft: error:") and message in proc.stderr
        assert proc.stderr.count("\n") == 1
        assert seconds < 20, f"{seconds:.1f} s"  # about 2 s on an idle 2-core machine


def test_system_prompt_and_chat_template_reach_the_prompt(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llm_worker.assembly import load_tokenizer
    from llm_worker.chat import chat_prompt_ids

    tokenizer, _ = load_tokenizer(str(tiny_dir))
    argv = ["generate", "--model", str(tiny_dir), "--chat", "--max-new-tokens", "2", "--json"]

    def prompt_tokens(*extra: str) -> int:
        code, out, err = run(capsys, *argv, *extra, "Name a prime.")
        assert code == 0, err
        return int(json.loads(out)["prompt_tokens"])

    user = {"role": "user", "content": "Name a prime."}
    system = {"role": "system", "content": "Be terse."}
    assert prompt_tokens() == len(chat_prompt_ids(tokenizer, [user]))
    assert prompt_tokens("--system", "Be terse.") == len(chat_prompt_ids(tokenizer, [system, user]))
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    rendered = tokenizer("<system>Be terse.<user>Name a prime.<assistant>", add_special_tokens=False)
    own = prompt_tokens("--system", "Be terse.", "--chat-template", str(template))
    assert own == len(rendered["input_ids"])


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--system", "Be terse."], "--system and --chat-template apply to chat prompts"),
        (["--chat", "--chat-template", "/nonexistent.jinja"], "--chat-template /nonexistent.jinja"),
        (["--chat", "--chat-template", "x.jinja", "--server", "127.0.0.1:1"], "to serve worker"),
        (["--max-model-len", "16", "--max-new-tokens", "20"], "exceeds the model's context of 16 tokens"),
    ],
)
def test_chat_and_context_options_are_checked(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    code, out, err = run(capsys, "generate", "--model", str(tiny_dir), *extra, "hello")
    assert code == 2 and out == ""
    assert message in err and err.startswith("specdraft: error:")


def _hub_cache(root: Path, repo_id: str, model_dir: Path) -> None:
    """A Hugging Face cache under ``root`` holding ``model_dir`` as ``repo_id``'s main snapshot
    (the layout ``huggingface_hub`` writes: blobs linked from ``snapshots/REV``, ``refs/main``)."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True)
    for file in model_dir.iterdir():
        (snapshot / file.name).symlink_to(file)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)


def test_a_hub_id_is_found_in_the_hugging_face_cache(tiny_dir: Path, tmp_path: Path) -> None:
    _hub_cache(tmp_path, "tiny-org/tiny-llama", tiny_dir)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    base = [sys.executable, "-m", "client.cli", "generate", "--max-new-tokens", "3", "--json", "--model"]
    found = subprocess.run([*base, "tiny-org/tiny-llama", "hi"], env=env, capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    assert len(json.loads(found.stdout)["token_ids"]) == 3
    absent = subprocess.run([*base, "tiny-org/absent", "hi"], env=env, capture_output=True, text=True)
    assert absent.returncode == 2 and absent.stderr.count("\n") == 1
    assert "tiny-org/absent is neither a model directory nor a Hub model in the Hugging Face cache" in (
        absent.stderr
    )
    assert f"({tmp_path})" in absent.stderr and "hf download tiny-org/absent" in absent.stderr


def test_modes_lines_are_aligned_with_reasons_and_json_carries_them(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``specdraft modes``: the summaries start in one column however long the names, every
    unavailable mode says why (ListModes' reason), and ``--json`` gives the same as data."""
    code, out, _ = run(capsys, "modes", "--model", str(tiny_dir), "--json")
    assert code == 0
    modes = json.loads(out)
    by_name = {m["name"]: m for m in modes}
    assert by_name["ar"]["available"] and by_name["ar"]["unavailable_reason"] == ""
    unavailable = [m for m in modes if not m["available"]]
    assert by_name["rest"] in unavailable  # no datastore given
    assert all(m["unavailable_reason"] for m in unavailable), unavailable
    assert set(modes[0]) == {"name", "summary", "options", "available", "unavailable_reason"}

    code, out, _ = run(capsys, "modes", "--model", str(tiny_dir))
    assert code == 0
    lines = out.splitlines()
    column = max(len(m["name"]) for m in modes) + 2
    for m in modes:
        line = next(line for line in lines if line.startswith(m["name"] + " "))
        assert line[column:].startswith(m["summary"]), line
    for m in unavailable:
        assert " " * column + "unavailable here: " + m["unavailable_reason"] in lines, m["name"]


def test_the_ops_option_reaches_the_model_config_and_the_workers_it_starts() -> None:
    """``--ops`` (the forward's operations) is a model option: in the ``ModelConfig`` and passed on
    to the ``serve worker`` processes a command starts; its default is left out of their lines."""
    import argparse

    from client.cli.common import add_model_args, model_config, worker_model_args

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    torch_ops = parser.parse_args(["--device", "cuda", "--ops", "torch"])
    assert model_config(torch_ops).ops == "torch"
    line = worker_model_args(torch_ops, None)
    assert line[line.index("--ops") + 1] == "torch"
    default = parser.parse_args([])
    assert model_config(default).ops == "auto" and "--ops" not in worker_model_args(default, None)
    with pytest.raises(SystemExit):
        parser.parse_args(["--ops", "cublas"])
    graphs = parser.parse_args(["--device", "cuda", "--cuda-graphs"])
    assert model_config(graphs).cuda_graphs and "--cuda-graphs" in worker_model_args(graphs, None)
    assert not model_config(default).cuda_graphs and "--cuda-graphs" not in worker_model_args(default, None)
