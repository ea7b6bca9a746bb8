"""The generated gRPC stubs match proto/ (regenerate with `python client/build_stubs.py`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_builder():
    spec = importlib.util.spec_from_file_location("build_stubs", ROOT / "client" / "build_stubs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_stubs"] = module
    spec.loader.exec_module(module)
    return module


def test_stubs_are_fresh() -> None:
    problems = load_builder().stale()
    assert problems == [], f"stale gRPC stubs: {problems}; run: python client/build_stubs.py"


def test_stubs_ship_type_stubs() -> None:
    package = ROOT / "specdraft" / "v1"
    for name in ("common", "generation", "datastore"):
        assert (package / f"{name}_pb2.pyi").is_file()
        assert (package / f"{name}_pb2_grpc.py").is_file()
