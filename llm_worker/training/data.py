"""Prompts and the target's own answers, made here (no data set can be downloaded).

Prompts come from three places:

- *self-generated instructions*: the target gets its chat template up to the start of a user turn
  and writes the user message itself (sampled, then deduplicated and filtered for length and
  language: ``keep_instruction``);
- *tasks over local text*: summarise / explain / rewrite passages of ``/usr/share/doc`` and of the
  standard library's docstrings and source (modules a benchmark uses can be excluded);
- *multi-turn follow-ups*: for some conversations the target also writes the user's next turn
  after its own first answer, and answers that too.

Each prompt lands in the ``train`` or the ``heldout`` split by a hash of its text, so the split
does not depend on the order or the number of prompts made; training never reads ``heldout``.

Answers are the target's own (greedy for half the conversations, sampled for the other half), made
in batches by a ``Completes``: the target's own batched forward (``generate.TargetCompleter``, the
fast backend) or a transformers model's forward in a decode loop of its own (``Completer``, left
padding). Both files are JSON lines written
record by record (flushed, fsynced), and a second run skips the ids already written: the
pipeline resumes after an interruption.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import re
import string
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from specdraft.tokenizer import Tokenizer

USER_SLOT = "\x00USER\x00"


@dataclass(frozen=True)
class DataConfig:
    """How many prompts of each kind, and how answers are made."""

    instructions: int = 600
    """Self-generated instructions (before deduplication losses, at most this many)."""
    local_tasks: int = 300
    """Tasks over local text."""
    follow_up_fraction: float = 0.25
    """Share of conversations that get a second, self-generated user turn."""
    heldout_fraction: float = 0.05
    max_answer_tokens: int = 192
    max_instruction_tokens: int = 64
    batch_size: int = 16
    sampled_fraction: float = 0.5
    """Share of conversations answered by sampling (temperature ``temperature``, top-p 0.95)."""
    temperature: float = 0.8
    seed: int = 0
    deadline: float | None = None
    """``time.monotonic()`` after which no new batch of prompts or answers starts (what is written
    stays; a rerun continues); None: no limit."""

    def past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


@dataclass
class Prompt:
    id: str
    kind: str  # "self" | "local"
    text: str
    split: str = "train"
    follow_up: bool = False
    round: int = -1
    """The generation round that wrote a self-generated instruction (a resumed run goes on from
    the next); -1 for local tasks."""


@dataclass
class Conversation:
    id: str
    kind: str
    split: str
    messages: list[dict[str, str]] = field(default_factory=list)
    sampled: bool = False


def split_of(text: str, heldout_fraction: float) -> str:
    """``heldout`` for a stable ``heldout_fraction`` of texts (a hash of the text decides)."""
    return "heldout" if unit_hash(text.strip().lower()) < heldout_fraction else "train"


def unit_hash(text: str) -> float:
    """A number in [0, 1) that ``text`` alone decides (SHA-256): choices that a resumed run makes
    as the first run did, whatever came before."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def keep_instruction(text: str) -> bool:
    """A usable self-generated instruction: 15–600 characters, at least four words, English-like
    (printable ASCII almost throughout), no chat-template markup. Example: "Give me three tips for
    a job interview." → True; "ok" → False."""
    text = text.strip()
    if not 15 <= len(text) <= 600 or len(text.split()) < 4:
        return False
    if "<|" in text or "|>" in text:
        return False
    printable = sum(ch in string.printable for ch in text)
    return printable / len(text) >= 0.97 and sum(ch.isalpha() for ch in text) / len(text) >= 0.5


def normal_key(text: str) -> str:
    """Deduplication key: lower case, letters and digits only."""
    return re.sub(r"[^a-z0-9]+", "", text.lower())


# -- JSON lines, resumable --------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of ``path``; a trailing partial line (a crash mid-write) is cut off the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


class JsonlWriter:
    """Appends records, each flushed and fsynced before the next."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        self.handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.handle.flush()
        os.fsync(self.handle.fileno())

    def close(self) -> None:
        self.handle.close()


# -- generation -------------------------------------------------------------------------------------


class Completes(Protocol):
    """What writes prompts and answers: ``Completer`` (a transformers model) or
    ``llm_worker.training.generate.TargetCompleter`` (the target's own batched forward)."""

    batch_size: int

    def complete(
        self,
        prefixes: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float,
        seed: int,
        seeds: Sequence[int] | None = None,
    ) -> list[tuple[list[int], bool]]: ...


class Completer:
    """Batched completions of token prefixes by a transformers model (left padding, its own
    decode loop over a ``DynamicCache``).

    ``generate`` keeps every row of a batch until the longest answer ends, pads the batch to its
    longest prompt and sorts the whole vocabulary of every row at every sampled step (the first
    GPU run: 3.4 k answer tokens/s on an H100 at 2 048 rows). This loop takes the prefixes of one
    call in order of length (rows of a batch are about as long), bounds a batch by the tokens its
    cache will hold (``batch_size`` rows of ``ROW_TOKENS``), drops finished rows from the cache
    once an eighth of the batch has finished, and samples top-p from the 1 024 likeliest tokens
    (the whole vocabulary only for a row whose nucleus is wider)."""

    ROW_TOKENS = 640
    """Cache tokens one row of ``batch_size`` stands for: a batch of longer rows has fewer."""
    NUCLEUS_FIRST = 1024

    def __init__(
        self, model: Any, tokenizer: Tokenizer, eos_ids: Sequence[int], batch_size: int, top_p: float = 0.95
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.eos_ids = list(eos_ids)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.batch_size = batch_size
        self.top_p = top_p

    def complete(
        self,
        prefixes: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float,
        seed: int,
        seeds: Sequence[int] | None = None,
    ) -> list[tuple[list[int], bool]]:
        """Per prefix: the generated ids (the end token cut off) and whether it ended by itself.
        ``temperature`` 0 = greedy. ``seeds`` is ignored: a batch samples from one generator
        seeded by ``seed`` and the batch's place, so a sampled answer depends on its batch."""
        results: list[tuple[list[int], bool]] = [([], False)] * len(prefixes)
        order = sorted((i for i in range(len(prefixes)) if prefixes[i]), key=lambda i: len(prefixes[i]))
        budget = self.batch_size * self.ROW_TOKENS
        lo = 0
        while lo < len(order):
            rows = 1
            while lo + rows < len(order) and rows < self.batch_size:
                if (rows + 1) * (len(prefixes[order[lo + rows]]) + max_new_tokens) > budget:
                    break
                rows += 1
            batch = order[lo : lo + rows]
            outs = self._batch([list(prefixes[i]) for i in batch], max_new_tokens, temperature, seed + lo)
            for i, out in zip(batch, outs, strict=True):
                results[i] = out
            lo += rows
        return results

    @torch.inference_mode()
    def _batch(
        self, batch: list[list[int]], max_new_tokens: int, temperature: float, seed: int
    ) -> list[tuple[list[int], bool]]:
        from transformers import DynamicCache

        device = self.model.device
        width = max(len(p) for p in batch)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        eos = torch.tensor(self.eos_ids, device=device)
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        cache = DynamicCache()
        rows = torch.arange(len(batch), device=device)  # each cache row's place in ``batch``
        out = torch.full((len(batch), max_new_tokens), -1, dtype=torch.long, device=device)
        ended = torch.zeros(len(batch), dtype=torch.bool, device=device)
        finished = torch.zeros(len(batch), dtype=torch.bool, device=device)  # per cache row
        step_ids, step_positions = ids, positions
        for step in range(max_new_tokens):
            logits = self.model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=step_positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1, :]
            token = self._choose(logits, temperature, generator)
            live = rows[~finished]
            out[live, step] = token[~finished]
            stop = torch.isin(token, eos) & ~finished
            ended[rows[stop]] = True
            finished |= stop
            done = int(finished.sum())
            if done == finished.numel() or step + 1 == max_new_tokens:
                break
            if done and 8 * done >= finished.numel():  # drop the finished rows from the cache
                keep = (~finished).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                rows, mask, token, finished = rows[keep], mask[keep], token[keep], finished[keep]
                step_positions = step_positions[keep]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            step_ids = token[:, None]
            step_positions = step_positions[:, -1:] + 1
        results = []
        for row, end in zip(out.tolist(), ended.tolist(), strict=True):
            tokens = [t for t in row if t >= 0]
            if end:
                tokens = tokens[:-1]  # the end token
            results.append((tokens, end))
        return results

    def _choose(self, logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
        """Each row's next token: the argmax, or a top-p sample at ``temperature``."""
        if temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        k = min(self.NUCLEUS_FIRST, probs.shape[-1])
        top, index = probs.topk(k, dim=-1)  # likeliest first
        if bool((top.sum(-1) < self.top_p).any()):  # a nucleus wider than the head: all of it
            top, index = probs.sort(dim=-1, descending=True)
        before = top.cumsum(-1) - top  # mass of the likelier tokens
        top = top.masked_fill(before >= self.top_p, 0.0)  # the first always kept
        pick = torch.multinomial(top, 1, generator=generator)
        return index.gather(-1, pick).squeeze(1)


def template_ids(tokenizer: Tokenizer, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def user_turn_prefix(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The chat template of ``messages`` followed by the opening of a user turn, as ids: what the
    target continues to write a user message itself."""
    text = tokenizer.apply_chat_template(
        [*messages, {"role": "user", "content": USER_SLOT}], add_generation_prompt=False, tokenize=False
    )
    head = text[: text.index(USER_SLOT)]
    return list(tokenizer(head, add_special_tokens=False)["input_ids"])


def self_instructions(
    completer: Completes,
    tokenizer: Tokenizer,
    cfg: DataConfig,
    count: int,
    seen: set[str],
    first_round: int = 0,
) -> Iterator[tuple[int, str]]:
    """Up to ``count`` new instructions written by the target, each passing ``keep_instruction``
    and not a duplicate of ``seen`` (which grows), with the round that wrote it. Round r's batch
    is sampled with a seed of its own; a resumed run starts at ``first_round`` (the rounds before
    it would only write what is already there). Stops after as many rounds as it takes, at most
    ``4 · count / batch`` of them."""
    prefix = user_turn_prefix(tokenizer, [])
    made, rounds = 0, first_round
    while made < count and rounds < first_round + max(4, 4 * count // completer.batch_size + 1):
        if cfg.past_deadline():
            return
        outs = completer.complete(
            [prefix] * completer.batch_size, cfg.max_instruction_tokens, 1.0, cfg.seed * 1000003 + rounds
        )
        for ids, ended in outs:
            text = tokenizer.decode(ids, skip_special_tokens=True).strip()
            key = normal_key(text)
            if not ended or not keep_instruction(text) or key in seen:
                continue
            seen.add(key)
            made += 1
            yield rounds, text
            if made >= count:
                return
        rounds += 1


# -- tasks over local text --------------------------------------------------------------------------

_TEXT_TASKS = (
    "Summarize the following text in a few sentences.\n\n{text}",
    "What are the main points of this text? Answer as a short list.\n\n{text}",
    "Explain the following passage in simple words for a beginner.\n\n{text}",
    "Write a short title and a one-paragraph abstract for this text.\n\n{text}",
    "Rewrite this text to be clearer and more concise.\n\n{text}",
)
_CODE_TASKS = (
    "Explain what this Python code does.\n\n```python\n{text}\n```",
    "Describe the purpose of each part of this code.\n\n```python\n{text}\n```",
    "Suggest improvements to this Python code and explain them.\n\n```python\n{text}\n```",
    "Write a short usage example for this code.\n\n```python\n{text}\n```",
)


def _passages(text: str, lo: int = 300, hi: int = 1200) -> Iterator[str]:
    """Runs of whole paragraphs between ``lo`` and ``hi`` characters."""
    chunk: list[str] = []
    size = 0
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        if not para:
            continue
        if size + len(para) > hi and size >= lo:
            yield "\n\n".join(chunk)
            chunk, size = [], 0
        if len(para) > hi:
            continue
        chunk.append(para)
        size += len(para) + 2
    if size >= lo:
        yield "\n\n".join(chunk)


def doc_files(root: Path = Path("/usr/share/doc"), limit_bytes: int = 200_000) -> list[Path]:
    """Plain-text documentation files under ``root`` (README*, *.txt, *.md), sorted."""
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.rglob("*")):
        name = path.name.lower()
        if not path.is_file() or path.is_symlink() or path.stat().st_size > limit_bytes:
            continue
        if name.startswith("readme") or name.endswith((".txt", ".md")):
            found.append(path)
    return found


def stdlib_modules(exclude: Iterable[str] = ()) -> list[str]:
    """Pure-Python standard-library modules (top level), minus ``exclude`` (and their children)."""
    excluded = set(exclude)
    names = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in excluded or name in {"antigravity", "this", "idlelib", "test"}:
            continue
        names.append(name)
    return names


def local_passages(
    exclude_modules: Iterable[str] = (),
    doc_root: Path = Path("/usr/share/doc"),
    enough: int | None = None,
    seed: int = 0,
) -> list[tuple[str, bool]]:
    """(passage, is_code) from documentation files and stdlib modules (docstrings and source),
    sources visited in an order ``seed`` shuffles; stops once ``enough`` are found."""
    import importlib.util

    rng = random.Random(seed)
    files, modules = doc_files(doc_root), stdlib_modules(exclude_modules)
    rng.shuffle(files)
    rng.shuffle(modules)
    out: list[tuple[str, bool]] = []
    for path in files:
        if enough is not None and len(out) >= enough // 2:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out.extend((p, False) for p in _passages(text))
    for name in modules:
        if enough is not None and len(out) >= enough:
            break
        spec = importlib.util.find_spec(name) if name.isidentifier() else None
        origin = getattr(spec, "origin", None) if spec is not None else None
        if not origin or not origin.endswith(".py"):
            continue
        try:
            source = Path(origin).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        out.extend((p, False) for p in _passages(ast.get_docstring(tree) or ""))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                block = ast.get_source_segment(source, node) or ""
                if 300 <= len(block) <= 1500:
                    out.append((block, True))
    return out


def local_tasks(
    count: int, seed: int, exclude_modules: Iterable[str] = (), doc_root: Path = Path("/usr/share/doc")
) -> list[str]:
    """``count`` task prompts over local passages, chosen and worded by ``seed``."""
    rng = random.Random(seed)
    passages = local_passages(exclude_modules, doc_root, enough=3 * count, seed=seed)
    rng.shuffle(passages)
    prompts = []
    for text, is_code in passages[:count]:
        template = rng.choice(_CODE_TASKS if is_code else _TEXT_TASKS)
        prompts.append(template.format(text=text))
    return prompts


# -- the pipeline's first two stages ----------------------------------------------------------------


def make_prompts(
    completer: Completes,
    tokenizer: Tokenizer,
    cfg: DataConfig,
    out: Path,
    exclude_modules: Iterable[str] = (),
    progress: Callable[[int], None] | None = None,
) -> dict[str, int]:
    """Append prompts to ``out`` until it holds ``cfg.instructions`` self-generated ones and
    ``cfg.local_tasks`` local ones (resumes: counts what is there)."""
    have = read_jsonl(out)
    seen = {normal_key(r["text"]) for r in have}
    counts = {"self": 0, "local": 0}
    for r in have:
        counts[r["kind"]] = counts.get(r["kind"], 0) + 1
    writer = JsonlWriter(out)
    try:

        def add(kind: str, text: str, round: int = -1) -> None:
            number = counts[kind]
            counts[kind] += 1
            prompt = Prompt(
                f"{kind}-{number}",
                kind,
                text,
                split_of(text, cfg.heldout_fraction),
                follow_up=unit_hash(f"follow-up {cfg.seed} {text}") < cfg.follow_up_fraction,
                round=round,
            )
            writer.write(prompt.__dict__)
            if progress is not None:
                progress(1)

        if counts["local"] < cfg.local_tasks:
            for text in local_tasks(cfg.local_tasks, cfg.seed, exclude_modules)[counts["local"] :]:
                if normal_key(text) not in seen:
                    seen.add(normal_key(text))
                    add("local", text)
        if counts["self"] < cfg.instructions:
            first = 1 + max((int(r.get("round", -1)) for r in have if r["kind"] == "self"), default=-1)
            wanted = cfg.instructions - counts["self"]
            for round, text in self_instructions(completer, tokenizer, cfg, wanted, seen, first):
                add("self", text, round)
    finally:
        writer.close()
    return counts


def make_conversations(
    completer: Completes,
    tokenizer: Tokenizer,
    cfg: DataConfig,
    prompts: Path,
    out: Path,
    progress: Callable[[int], None] | None = None,
) -> dict[str, int]:
    """The target's answers to every prompt of ``prompts`` not yet in ``out`` (batched: the
    first turns of a batch together, then the follow-ups together)."""
    records = [Prompt(**r) for r in read_jsonl(prompts)]
    done = {r["id"] for r in read_jsonl(out)}
    todo = [p for p in records if p.id not in done]
    writer = JsonlWriter(out)
    written, stopped = 0, False
    try:
        for lo in range(0, len(todo), cfg.batch_size):
            if cfg.past_deadline():
                stopped = True
                break
            batch = todo[lo : lo + cfg.batch_size]
            convs = []
            for p in batch:
                sampled = split_of("sample:" + p.id, 1.0 - cfg.sampled_fraction) == "train"
                convs.append(
                    Conversation(p.id, p.kind, p.split, [{"role": "user", "content": p.text}], sampled)
                )
            seed = cfg.seed * 7919 + int(hashlib.sha256(batch[0].id.encode()).hexdigest()[:6], 16)
            _answer(completer, tokenizer, cfg, convs, seed)
            follow = [
                c for c, p in zip(convs, batch, strict=True) if p.follow_up and c.messages[-1]["content"]
            ]
            if follow:
                prefixes = [user_turn_prefix(tokenizer, c.messages) for c in follow]
                own = [_own_seed(cfg, "follow-up", c.id) for c in follow]
                outs = completer.complete(prefixes, cfg.max_instruction_tokens, 1.0, seed + 1, own)
                asked = []
                for conv, (ids, ended) in zip(follow, outs, strict=True):
                    text = tokenizer.decode(ids, skip_special_tokens=True).strip()
                    if ended and keep_instruction(text):
                        conv.messages.append({"role": "user", "content": text})
                        asked.append(conv)
                _answer(completer, tokenizer, cfg, asked, seed + 2)
            for conv in convs:
                if conv.messages[-1]["role"] == "assistant" and conv.messages[-1]["content"]:
                    writer.write(conv.__dict__)
                    written += 1
            if progress is not None:
                progress(len(batch))
    finally:
        writer.close()
    return {"prompts": len(records), "skipped": len(done), "written": written, "stopped_at_deadline": stopped}


def _own_seed(cfg: DataConfig, what: str, conversation: str) -> int:
    """The seed of one sampled text of one conversation: its id and the data seed alone decide
    it, so a resumed run (other batches) samples what an uninterrupted one did."""
    return int(unit_hash(f"{cfg.seed} {what} {conversation}") * 2**63)


def _answer(
    completer: Completes, tokenizer: Tokenizer, cfg: DataConfig, convs: list[Conversation], seed: int
) -> None:
    """Append the target's answer to each conversation (greedy ones, then sampled ones)."""
    for sampled in (False, True):
        group = [c for c in convs if c.sampled == sampled]
        if not group:
            continue
        prefixes = [template_ids(tokenizer, c.messages, generation_prompt=True) for c in group]
        temperature = cfg.temperature if sampled else 0.0
        own = [_own_seed(cfg, f"answer {len(c.messages)}", c.id) for c in group]
        outs = completer.complete(prefixes, cfg.max_answer_tokens, temperature, seed + int(sampled), own)
        for conv, (ids, _ended) in zip(group, outs, strict=True):
            conv.messages.append(
                {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
            )
