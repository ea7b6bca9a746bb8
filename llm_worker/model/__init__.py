"""Loading the target model and wrapping it for the engine."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llm_worker.config import ModelConfig
from llm_worker.model import fast_llama
from llm_worker.model.fast_llama import FastLlamaTarget
from llm_worker.model.loading import MARKER, resolve_model_dir, torch_dtype
from llm_worker.model.target import HFTarget, TargetInfo, TargetModel, describe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backend:
    """A way to run a loaded transformers model as the engine's target."""

    unsupported: Callable[[Any], str | None]  # why it cannot run a model (None: it can)
    make: Callable[[Any, TargetInfo, ModelConfig], TargetModel]


OPS_NAMES = {"auto": None, "triton": "triton", "torch": "torch", "fused": "cpu-fused"}
"""``ModelConfig.ops`` → the implementation's name in ``ops.OPS`` (None: ``fast_llama``'s choice)."""


def _fast(model: Any, info: TargetInfo, cfg: ModelConfig) -> TargetModel:
    """The fast forward; its operations choose the GEMM kernels (``Ops.choose_kernels``: ``--kernel``
    "auto" or one kernel for every role)."""
    return FastLlamaTarget(
        model,
        info,
        cfg.kernel,
        cfg.attention_chunk,
        cfg.kv_pool_slots,
        fused=cfg.fused_kernels,
        ops=OPS_NAMES[cfg.ops],
        graphs=cfg.cuda_graphs,
    )


BACKENDS: dict[str, Backend] = {
    "fast": Backend(fast_llama.unsupported_reason, _fast),
    "hf": Backend(lambda model: None, lambda model, info, cfg: HFTarget(model, info)),
}
"""Backends by ``--backend`` name; ``auto`` takes the first that runs the model, in this order."""


def wrap_model(model: Any, tokenizer: Any, cfg: ModelConfig) -> TargetModel:
    """Wrap an already loaded transformers model (tests build tiny random ones)."""
    model.eval()
    if cfg.backend == "auto":
        reasons = {name: backend.unsupported(model) for name, backend in BACKENDS.items()}
        name = next(name for name, reason in reasons.items() if reason is None)
        for skipped, reason in reasons.items():
            if skipped == name:
                break
            log.info("%s backend unavailable (%s); using the %s backend", skipped, reason, name)
    else:
        name = cfg.backend
        reason = BACKENDS[name].unsupported(model)
        if reason:
            raise ValueError(f"--backend {name}: {reason}")
    info = describe(model, tokenizer, cfg.dtype, cfg.device, name, cfg.max_context)
    return BACKENDS[name].make(model, info, cfg)


def model_name(path: Path) -> str:
    """A readable model name: the source model id for our converted copies, else the directory."""
    marker = path / MARKER
    if marker.is_file():
        try:
            return str(json.loads(marker.read_text())["model_id"]) + " (converted from GGUF Q4_1)"
        except (ValueError, KeyError):
            pass
    return path.name


def check_device(device: str) -> None:
    """Refuse a device this machine does not have, with a clear message."""
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {device!r}: {exc}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA devices")
    elif dev.type != "cpu":
        raise ValueError(f"device {device!r}: only cpu and cuda are supported")


def load_target(cfg: ModelConfig) -> tuple[TargetModel, Any]:
    """Load the model directory of ``cfg`` (or the default model) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    path = resolve_model_dir(cfg.path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(cfg.dtype))
    model = model.to(torch.device(cfg.device))  # type: ignore[arg-type]  # transformers types .to oddly
    model.config._name_or_path = model_name(path)
    model.requires_grad_(False)
    return wrap_model(model, tokenizer, cfg), tokenizer
