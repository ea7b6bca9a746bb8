"""Shared fixtures (a tiny model saved with the real tokenizer, the real default model, a throwaway
redis-server) and the end-of-run report of excused near-tie divergences. Plain helpers live in
``tests/helpers``."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest
import torch

from helpers.models import EXCUSED_DIVERGENCES, engine_for, tiny_model
from llm_worker.config import ModelConfig
from llm_worker.engine import Engine
from llm_worker.model import load_target, native
from llm_worker.model.target import TargetModel

if TYPE_CHECKING:  # imported where used: a bare GPU machine runs `pytest -m cuda` without redis-py
    from helpers.servers import RedisServer


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fuzz-requests",
        type=int,
        default=600,
        help="requests tests/test_fuzz.py sends over all its fuzz tests (make fuzz: 10 000)",
    )


_TRITON_INTERPRET = pytest.StashKey[str | None]()
"""``TRITON_INTERPRET`` as it was before ``pytest_configure`` turned Triton's interpreter on."""


def pytest_configure(config: pytest.Config) -> None:
    """On a machine without CUDA, Triton's interpreter for the CUDA kernels' tests
    (``tests/test_triton_kernels.py``). Triton reads ``TRITON_INTERPRET`` when triton and the
    kernels are imported, whichever test module imports them first, so it is on from here to the
    end of collection (``pytest_collection_finish``); Triton's own knob then holds it in this
    process, and the environment no test's subprocess inherits is as it was."""
    if importlib.util.find_spec("triton") is None or torch.cuda.is_available():
        return
    config.stash[_TRITON_INTERPRET] = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_finish(session: pytest.Session) -> None:
    if _TRITON_INTERPRET not in session.config.stash:
        return
    previous = session.config.stash[_TRITON_INTERPRET]
    if previous is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = previous
    if "triton" in sys.modules:
        sys.modules["triton"].knobs.runtime.interpret = True


NO_CUDA = "no CUDA device"
"""The skip reason of a ``cuda``-marked test where torch sees no CUDA device (the summary lists it)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the ``cuda``-marked tests, visibly, where torch sees no CUDA device: each shows in
    ``-ra``'s summary as "SKIPPED ... no CUDA device" and counts as skipped."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    excused = EXCUSED_DIVERGENCES.excused
    terminalreporter.write_sep("-", f"near-tie greedy divergences excused: {len(excused)}")
    for line in excused:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def fused() -> ModuleType:
    """The fused CPU kernels (``llm_worker.model.native``), which must build on the test machines."""
    module = native.load()
    assert module is not None, (
        f"the fused kernels must build on the test machines: {native.unavailable_reason()}"
    )
    return module


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
    from helpers.servers import RedisServer

    server = RedisServer()
    yield server
    server.stop()
