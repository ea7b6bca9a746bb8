"""Rows for ``recycle`` written before the first request: a hot start from the target's own answers.

A worker's Token Recycling rows start empty and fill as it serves: its first requests draft from
little. A seed is what those rows would hold after the target had read a corpus of its own
answers: for every answer position, the target's k likeliest next tokens, written under the
position's token and its last two and three tokens (``recycle_store.update_matrix``), as one
verify forward over the whole conversation would write them. Built once (``specdraft datastore
recycle-seed``: a prefill of each conversation, no training), loaded by the worker in
milliseconds (``--recycle-seed FILE``); every tenant's rows then start as a copy of it and learn
on from there. The seed comes from the operator's corpus, never from a tenant's requests, so
tenants stay apart: each reads the seed and its own writes, never another's.

The file: a compressed ``.npz`` of the one-token rows and the context table, and a JSON record
(format, tokenizer fingerprint, vocabulary, k, slots, conversations and tokens read, the
command's note). A seed of another tokenizer, vocabulary or shape, or a file that is not one
(corrupt, or with rows no target writes: tokens outside the vocabulary, a token twice in a row),
is refused with the reason, before its arrays are decompressed where their headers already say so.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from llm_worker.drafters.recycle_store import (
    CONTEXT_ORDERS,
    CONTEXT_SLOTS,
    EMPTY,
    TenantMatrix,
    update_matrix,
)
from llm_worker.logits import top_k_rows
from llm_worker.model.target import TargetModel
from llm_worker.types import ArtifactNeeds
from specdraft.common import atomic_path

SEED_FORMAT = 1
SEED_MAX_TOKENS = 640
"""Tokens of a conversation a seed reads (prompt and answer; the rest is left out)."""


class SeedError(ValueError):
    """A seed file that cannot be used here: unreadable, foreign or of another shape."""


@dataclass(frozen=True)
class SeedInfo:
    tokenizer: str  # the tokenizer's fingerprint (``datastore_svc.store.tokenizer_identity``)
    vocab: int
    k: int
    slots: int
    conversations: int
    tokens: int  # answer positions written
    note: str = ""
    format: int = SEED_FORMAT


def seed_rows(
    target: TargetModel,
    examples: Iterable[tuple[Sequence[int], Sequence[int]]],
    k: int = 8,
    slots: int = CONTEXT_SLOTS,
    max_tokens: int = SEED_MAX_TOKENS,
    progress: Callable[[int], None] | None = None,
) -> tuple[TenantMatrix, int, int]:
    """The rows ``recycle`` would hold after verifying each example's answer in one forward:
    ``examples`` are (prompt ids, answer ids); from the prompt's last token on, each position's
    row becomes the target's top ``k`` there, under its token and its contexts. Later examples
    overwrite earlier ones, as later requests do. ``progress(n)`` after each example. Returns
    (rows, examples read, positions written); every row is written at clock 0, so a request
    sees seeded rows as old ones.

    Example: prompt [5, 6], answer [7] → rows of 6 and 7 (and of contexts [5, 6], [5, 6, 7],
    [6, 7]) hold the target's top k after ``[5, 6]`` and ``[5, 6, 7]``.
    """
    matrix = TenantMatrix.empty(target.info.vocab_size, k, slots)
    width = max(CONTEXT_ORDERS)
    read = written = 0
    for prompt, answer in examples:
        ids = [*prompt, *answer][:max_tokens]
        start = len(prompt) - 1  # the row whose candidates predict the answer's first token
        if not prompt or start >= len(ids) - 1:
            continue
        with torch.inference_mode():
            logits = target.forward(target.start(), torch.tensor(ids), None, ArtifactNeeds()).logits
        top = top_k_rows(logits[start:], min(k, logits.shape[-1]))
        texts = [tuple(ids[max(0, i - width + 1) : i + 1]) for i in range(start, len(ids))]
        update_matrix(matrix, np.array(ids[start:], dtype=np.int64), top, 0, texts)
        read += 1
        written += len(ids) - start
        if progress is not None:
            progress(read)
    return matrix, read, written


def save_seed(path: str | Path, matrix: TenantMatrix, info: SeedInfo) -> None:
    """Write ``matrix`` and ``info`` to ``path`` whole or not at all (``atomic_path``)."""
    record = np.frombuffer(json.dumps(asdict(info)).encode(), dtype=np.uint8)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez_compressed(
            f,
            info=record,
            next=matrix.next,
            context_key=matrix.context_key,
            context_next=matrix.context_next,
        )


def _declared(data: zipfile.ZipFile, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype an ``.npz`` member declares in its header, read before its data (a
    crafted file cannot make the loader decompress more than it declares)."""
    with data.open(f"{name}.npy") as member:
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(member)
        else:
            shape, _, dtype = np.lib.format.read_array_header_2_0(member)
    return tuple(shape), np.dtype(dtype)


def load_seed(
    path: str | Path, tokenizer: str | None, k: int, slots: int, vocab: int | None = None
) -> tuple[TenantMatrix, SeedInfo]:
    """The rows and record of the seed at ``path``, checked against the worker's tokenizer
    fingerprint and vocabulary (None: not checked), k and context slots; SeedError names what
    does not fit. The arrays are read-only: tenants copy them before writing."""
    names = ("next", "context_key", "context_next")
    dtypes = {name: np.dtype(np.uint64 if name == "context_key" else np.int32) for name in names}
    try:
        raw = Path(path).read_bytes()
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            declared = {name: _declared(archive, name) for name in names}
        with np.load(io.BytesIO(raw), allow_pickle=False) as data:
            fields = json.loads(bytes(data["info"]).decode())
            info = SeedInfo(**fields)
            checks = (
                isinstance(info.tokenizer, str),
                *(isinstance(v, int) and v >= 0 for v in (info.vocab, info.k, info.slots, info.format)),
            )
            if not all(checks):
                raise SeedError(f"recycle seed {path}: a malformed record {fields}")
            if info.format != SEED_FORMAT:
                raise SeedError(f"recycle seed {path}: format {info.format}, this worker reads {SEED_FORMAT}")
            if tokenizer is not None and info.tokenizer != tokenizer:
                raise SeedError(
                    f"recycle seed {path} was built with another tokenizer ({info.tokenizer[:12]})"
                )
            if vocab is not None and info.vocab != vocab:
                raise SeedError(f"recycle seed {path} has a vocabulary of {info.vocab}, this model {vocab}")
            if (info.k, info.slots) != (k, slots):
                raise SeedError(
                    f"recycle seed {path} has k={info.k}, {info.slots} slots; this worker keeps {k}, {slots}"
                )
            shapes = {"next": (info.vocab, k), "context_key": (slots,), "context_next": (slots, k)}
            for name in names:  # before any array is decompressed
                if declared[name] != (shapes[name], dtypes[name]):
                    shape, dtype = declared[name]
                    found, wanted = f"{dtype}{list(shape)}", list(shapes[name])
                    raise SeedError(f"recycle seed {path}: {name} is {found}, not {wanted}")
            arrays = {name: data[name] for name in names}
    except SeedError:
        raise
    except Exception as exc:  # zip, zlib, header, JSON, record fields, memory: all "not a seed"
        raise SeedError(f"recycle seed {path}: not a readable seed ({type(exc).__name__}: {exc})") from None
    for name in ("next", "context_next"):
        rows = arrays[name]
        if (rows < EMPTY).any() or (rows >= info.vocab).any():
            raise SeedError(f"recycle seed {path}: a row of {name} names a token outside the vocabulary")
        ordered = np.sort(rows, axis=1)
        if ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] != EMPTY)).any():
            raise SeedError(f"recycle seed {path}: a row of {name} names a token twice")
    matrix = TenantMatrix(
        arrays["next"],
        np.where(arrays["next"][:, 0] != EMPTY, 0, -1).astype(np.int64),
        arrays["context_key"],
        arrays["context_next"],
        np.where(arrays["context_key"] != 0, 0, -1).astype(np.int64),
    )
    for array in (
        matrix.next,
        matrix.written,
        matrix.context_key,
        matrix.context_next,
        matrix.context_written,
    ):
        array.flags.writeable = False
    return matrix, info
