"""The worker's domain layer: requests in domain terms, run on the engine, results out.

The gRPC servicer (``llm_worker.server``) only converts protobuf ⇄ these types; everything
here is testable without gRPC.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from llm_worker.chat import chat_prompt_ids, prompt_ids
from llm_worker.config import DEFAULT_MODE, SamplingParams
from llm_worker.drafters import DRAFTERS, ModeUnavailableError, UnknownModeError
from llm_worker.engine import Engine, GenerationRequest, InvalidRequestError, StepOutput
from llm_worker.model.target import TargetInfo
from llm_worker.results import GenerationResult
from llm_worker.stopping import StopStrings, cut_at_stop
from specdraft.common import shorten
from specdraft.tokenizer import Tokenizer

CHAT_ROLES = ("system", "user", "assistant")


class BadRequest(ValueError):
    """Input the worker refuses: maps to INVALID_ARGUMENT."""


@dataclass(frozen=True)
class WorkRequest:
    """A generation request before tokenization. Exactly one of text / token_ids / chat."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    chat: tuple[tuple[str, str], ...] | None = None  # (role, content)
    mode: str = DEFAULT_MODE
    max_new_tokens: int = 0  # 0 = the worker's default
    sampling: SamplingParams = field(default_factory=SamplingParams)
    draft_budget: int = 0  # 0 = the engine's choice
    speculation_off: bool = False
    ignore_eos: bool = False
    tenant: str = ""  # online drafting's namespace (``GenerationRequest.tenant``)
    stop: tuple[str, ...] = ()
    """Stop strings (at most 4, none empty): the text ends before the first one reached."""
    stop_token_ids: tuple[int, ...] = ()
    """Stop after generating any of these token ids (they are kept in the output)."""
    logprobs: int | None = None
    """None: none; 0: each generated token's log-probability; k in 1..20: plus its k likeliest
    alternatives."""


@dataclass(frozen=True)
class ModeDescription:
    name: str
    summary: str
    options: tuple[str, ...]
    available: bool
    unavailable_reason: str


class Worker:
    """One model, one engine, and the rules for turning requests into engine calls.

    ``chat_template``: a Jinja chat template that chat requests are rendered with instead of the
    tokenizer's own (``--chat-template``); None keeps the tokenizer's.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        worker_id: str | None = None,
        default_max_new_tokens: int = 256,
        chat_template: str | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.worker_id = worker_id or uuid.uuid4().hex[:12]
        self.default_max_new_tokens = default_max_new_tokens
        self.chat_template = chat_template

    # -- requests ---------------------------------------------------------------------------

    def encode(self, req: WorkRequest) -> list[int]:
        given = [x is not None for x in (req.text, req.token_ids, req.chat)]
        if sum(given) != 1:
            raise BadRequest("give exactly one prompt: text, token_ids or chat")
        if req.token_ids is not None:
            return list(req.token_ids)
        if self.tokenizer is None:
            raise BadRequest("this worker has no tokenizer: send token_ids")
        if req.text is not None:
            if not req.text:
                raise BadRequest("the prompt is empty")
            return prompt_ids(self.tokenizer, req.text)
        assert req.chat is not None
        if not req.chat:
            raise BadRequest("the chat has no messages")
        for role, _ in req.chat:
            if role not in CHAT_ROLES:
                raise BadRequest(f"chat role {shorten(role)!r} is not one of {CHAT_ROLES}")
        try:
            messages = [{"role": r, "content": c} for r, c in req.chat]
            return chat_prompt_ids(self.tokenizer, messages, self.chat_template)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    def to_engine(self, req: WorkRequest) -> GenerationRequest:
        """Validate and convert; raises BadRequest with a precise message. The request it
        returns (or one ``dataclasses.replace`` gave a ``cancel`` event) goes to ``stream``."""
        ids = self.encode(req)
        mode = DEFAULT_MODE if req.speculation_off or not req.mode else req.mode
        if req.draft_budget < 0 or req.max_new_tokens < 0:
            raise BadRequest("draft_budget and max_new_tokens must be >= 0")
        stop = None
        if req.stop:
            if self.tokenizer is None:
                raise BadRequest("this worker has no tokenizer: stop strings need one (send stop_token_ids)")
            try:
                stop = StopStrings(req.stop, self.decode)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        gen = GenerationRequest(
            prompt_ids=tuple(ids),
            max_new_tokens=req.max_new_tokens or self.default_max_new_tokens,
            mode=mode,
            sampling=req.sampling,
            stop_at_eos=not req.ignore_eos,
            draft_budget=req.draft_budget or None,
            tenant=req.tenant,
            stop_token_ids=tuple(req.stop_token_ids),
            stop=stop,
            logprobs=req.logprobs,
        )
        try:
            self.engine.validate(gen)
            self.engine.runtime(mode)
        except (InvalidRequestError, UnknownModeError, ModeUnavailableError) as exc:
            raise BadRequest(str(exc)) from None
        if req.speculation_off and req.mode:
            self._check_unused_mode(req.mode)
        return gen

    def _check_unused_mode(self, mode: str) -> None:
        """A request with ``speculation_off`` decodes as ``ar`` but must still name a mode with
        valid options: ``nosuchmode:n=1`` and ``pld:max_n=x`` are BadRequest as without it (they
        are mistakes a client should hear of), while a real mode this worker cannot run (``rest``
        without a datastore) is fine, since nothing drafts."""
        try:
            self.engine.runtime(mode)
        except ModeUnavailableError:
            pass
        except UnknownModeError as exc:
            raise BadRequest(str(exc)) from None

    def stream(self, gen: GenerationRequest) -> Iterator[StepOutput | GenerationResult]:
        """The engine's steps of ``gen``, a request ``to_engine`` validated (not checked again)."""
        return self.engine.stream(gen, validated=True)

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of generated tokens, special tokens (``<|im_end|>``, ``<|endoftext|>``) left
        out: ``[504, 2]`` → ``"The"`` on SmolLM2, whose id 2 is ``<|im_end|>``."""
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def text(self, result: GenerationResult, stop: Sequence[str] = ()) -> str:
        """The result's text: its tokens decoded, ending before the first of the request's
        ``stop`` strings (the token that completed it stays in ``result.token_ids``)."""
        return cut_at_stop(self.decode(result.token_ids), stop)

    # -- descriptions -----------------------------------------------------------------------

    @property
    def model_info(self) -> TargetInfo:
        """The model this worker serves: name, fingerprint, vocabulary, context, dtype, device."""
        return self.engine.target.info

    def modes(self) -> list[ModeDescription]:
        out = []
        for name in DRAFTERS.names():
            spec = DRAFTERS.spec(name)
            reason = ""
            try:
                self.engine.runtime(name)
            except ModeUnavailableError as exc:
                reason = str(exc)
            out.append(ModeDescription(name, spec.summary, spec.options, not reason, reason))
        return out

    def available_modes(self) -> list[str]:
        return [m.name for m in self.modes() if m.available]
