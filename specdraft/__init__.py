"""specdraft's bottom layer: the generated gRPC stubs (``specdraft.v1``, from ``proto/``), their
loader (``stubs``) and the few utilities every layer above shares (``common``).

Nothing here imports ``datastore_svc``, ``llm_worker`` or ``client`` (the layers contract in
``.importlinter``), with one stated exception: the Python API's names, ``from specdraft import
LLM, SamplingParams`` (as ``from vllm import LLM``), are exported lazily. They live in
``client.api``, which a module ``__getattr__`` imports by name when one of them is first asked
for; ``import specdraft`` alone loads neither torch nor any upper layer.
"""

from __future__ import annotations

import importlib
from typing import Any

API = ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput")
"""The names ``specdraft`` exports from ``client.api`` when asked for."""


def __getattr__(name: str) -> Any:
    if name in API:
        return getattr(importlib.import_module("client.api"), name)
    raise AttributeError(f"module 'specdraft' has no attribute {name!r}")
