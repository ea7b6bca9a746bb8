"""Shared fixtures (a tiny model saved with the real tokenizer, the real default model, a throwaway
redis-server) and the end-of-run report of excused near-tie divergences. Plain helpers live in
``tests/helpers``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers.models import EXCUSED_DIVERGENCES, engine_for, tiny_model
from helpers.servers import RedisServer
from llm_worker.config import ModelConfig
from llm_worker.engine import Engine
from llm_worker.model import load_target
from llm_worker.model.target import TargetModel


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fuzz-requests",
        type=int,
        default=600,
        help="requests tests/test_fuzz.py sends over all its fuzz tests (make fuzz: 10 000)",
    )


def pytest_terminal_summary(terminalreporter: Any) -> None:
    excused = EXCUSED_DIVERGENCES.excused
    terminalreporter.write_sep("-", f"near-tie greedy divergences excused: {len(excused)}")
    for line in excused:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama saved with the real tokenizer (chat templates and decoding work)."""
    from transformers import AutoTokenizer

    from llm_worker.model.loading import default_model_dir

    path = tmp_path_factory.mktemp("tiny-model")
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    model = tiny_model("llama", vocab=len(tokenizer))
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def real_model() -> tuple[TargetModel, Any]:
    """The default model (SmolLM2-135M-Instruct), float32, fast backend."""
    threads = os.environ.get("SPECDRAFT_TEST_THREADS")
    return load_target(ModelConfig(threads=int(threads) if threads else None))


@pytest.fixture(scope="session")
def real_model_bf16() -> tuple[TargetModel, Any]:
    """The default model in bfloat16, fast backend."""
    threads = os.environ.get("SPECDRAFT_TEST_THREADS")
    return load_target(ModelConfig(dtype="bfloat16", threads=int(threads) if threads else None))


@pytest.fixture(scope="session")
def real_engine(real_model: tuple[TargetModel, Any]) -> Engine:
    return engine_for(real_model[0])


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A redis-server of this test alone (skips the test where redis-server is not installed)."""
    server = RedisServer()
    yield server
    server.stop()
