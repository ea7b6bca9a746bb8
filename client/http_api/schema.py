"""The OpenAI API's request bodies and answers, and the one function that turns a body into the
worker's ``WorkRequest``.

Bodies are pydantic models with ``extra="forbid"``: an unknown field is a 400 naming it, as
OpenAI's own API answers ("Unrecognized request argument"). The speculation options are extra
fields of the body, as vLLM takes ``extra_body``: ``mode``, ``draft_budget``,
``speculation_off``, ``ignore_eos``, ``tenant`` (and ``top_k``). Parameters the engine cannot
honour yet are refused by ``to_work_request`` with a precise message, never ignored.

Example: ``{"model": "m", "prompt": "def f(x):", "max_tokens": 16, "temperature": 0,
"mode": "pld"}`` → ``WorkRequest(text="def f(x):", mode="pld", max_new_tokens=16,
sampling=SamplingParams(temperature=0.0))``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llm_worker.config import DEFAULT_MODE, SamplingParams
from llm_worker.results import GenerationResult
from llm_worker.worker import WorkRequest
from specdraft.common import MAX_ERROR_CHARS, shorten

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` of ``/v1/completions`` (chat's default is the worker's)."""


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
    504: "timeout",
}
"""OpenAI's error ``type`` of each status."""


class ApiError(Exception):
    """An answer other than 200: the HTTP status and OpenAI's error object.

    Example: ``ApiError(404, "The model 'gpt-4' does not exist", code="model_not_found",
    param="model")`` → 404 ``{"error": {"message": "The model 'gpt-4' does not exist", "type":
    "invalid_request_error", "param": "model", "code": "model_not_found"}}``.
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status, "server_error")
        message = shorten(self.message, MAX_ERROR_CHARS)
        return {"error": {"message": message, "type": kind, "param": self.param, "code": self.code}}


# -- request bodies ---------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints take: OpenAI's, vLLM's extras, and specdraft's speculation options."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    """None: the served model."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    user: str | None = None
    """Accepted and ignored (OpenAI uses it for abuse monitoring)."""
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    # speculation (specdraft's extra body fields)
    mode: str = DEFAULT_MODE
    draft_budget: int = 0
    speculation_off: bool = False
    ignore_eos: bool = False
    tenant: str = ""


class CompletionBody(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = COMPLETION_DEFAULT_MAX_TOKENS
    best_of: int | None = None
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: refused in to_work_request
    role: str
    content: str | list[dict[str, Any]] | None = None
    """Text, or parts of which only ``{"type": "text", "text": ...}`` are supported."""


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None


# -- body → WorkRequest -------------------------------------------------------------------------


def _refuse(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param=param)


NOT_YET = "not supported yet by this server"
ROLES = {"developer": "system"}
"""OpenAI's newer name of a role → the chat template's (other roles pass as they are)."""


def to_work_request(body: CompletionBody | ChatBody) -> WorkRequest:
    """The worker's request for ``body``, or ``ApiError`` 400 for a parameter it cannot honour.

    The one place where OpenAI parameters meet the engine: when the engine learns stop strings,
    logprobs and penalties (``WorkRequest.stop`` etc.), they are wired here and nowhere else.
    ``tenant`` is the body's own; the caller puts it inside the credential's namespace.
    """
    if body.n != 1:
        raise _refuse("n", "only n=1 is supported: send one request per completion")
    if body.logit_bias:
        raise _refuse("logit_bias", "not supported: it would change the target's distribution")
    if body.seed is not None and not 0 <= body.seed < 2**64:
        raise _refuse("seed", f"must be in [0, 2**64), got {body.seed}")
    sampling = SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
    )
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    common: dict[str, Any] = dict(
        stop=stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        mode=body.mode or DEFAULT_MODE,
        sampling=sampling,
        draft_budget=body.draft_budget,
        speculation_off=body.speculation_off,
        ignore_eos=body.ignore_eos,
        tenant=body.tenant,
    )
    if isinstance(body, CompletionBody):
        if body.best_of not in (None, 1):
            raise _refuse("best_of", "only best_of=1 is supported")
        if body.echo:
            raise _refuse("echo", "not supported")
        if body.suffix:
            raise _refuse("suffix", "not supported (no fill-in-the-middle)")
        text, ids = _one_prompt(body.prompt)
        count = _max_tokens(body.max_tokens)
        return WorkRequest(text=text, token_ids=ids, max_new_tokens=count, logprobs=body.logprobs, **common)
    if body.top_logprobs is not None and not body.logprobs:
        raise _refuse("top_logprobs", "needs logprobs: true")
    for name in ("tools", "tool_choice", "functions", "function_call"):
        if getattr(body, name) not in (None, [], "none"):
            raise _refuse(name, "tools and function calls are not supported")
    if body.response_format and body.response_format.get("type") != "text":
        raise _refuse("response_format", "only {'type': 'text'} is supported")
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    chat = tuple((ROLES.get(m.role, m.role), _content(m, i)) for i, m in enumerate(body.messages))
    top = (body.top_logprobs or 0) if body.logprobs else None
    return WorkRequest(chat=chat, max_new_tokens=_max_tokens(limit, default=0), logprobs=top, **common)


def _max_tokens(value: int | None, default: int = COMPLETION_DEFAULT_MAX_TOKENS) -> int:
    """``max_tokens`` as ``WorkRequest.max_new_tokens`` (0: the worker's default)."""
    if value is None:
        return default
    if value < 1:
        raise _refuse("max_tokens", f"must be >= 1, got {value}")
    return value


def _one_prompt(
    prompt: str | list[int] | list[str] | list[list[int]],
) -> tuple[str | None, tuple[int, ...] | None]:
    """(text, token ids) of a completion's prompt: a string, a list of token ids, or a list
    holding one of them. ``"hi"`` → ``("hi", None)``; ``[[1, 2]]`` → ``(None, (1, 2))``."""
    if isinstance(prompt, str):
        return prompt, None
    if prompt and all(isinstance(x, int) for x in prompt):
        return None, tuple(prompt)  # type: ignore[arg-type]
    if len(prompt) != 1:
        raise _refuse("prompt", f"one prompt per request (got {len(prompt)}): send them as separate requests")
    one = prompt[0]
    return (one, None) if isinstance(one, str) else (None, tuple(one))  # type: ignore[arg-type]


def _content(message: Message, index: int) -> str:
    """A message's text: a string, or text parts joined (images and tool messages refused)."""
    if message.model_extra:
        field = sorted(message.model_extra)[0]
        raise _refuse(f"messages[{index}].{field}", "not supported")
    if message.content is None:
        raise _refuse(f"messages[{index}].content", "a message needs content")
    if isinstance(message.content, str):
        return message.content
    texts = []
    for j, part in enumerate(message.content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = shorten(str(part.get("type")))
            raise _refuse(f"messages[{index}].content[{j}]", f"only text parts are supported, not {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


# -- answers ----------------------------------------------------------------------------------


def new_id(kind: Literal["cmpl", "chatcmpl"]) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's ``usage``; ``cached_tokens``: prompt tokens the prefix cache supplied."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(result: GenerationResult, token_text: Callable[[int], str]) -> dict[str, Any] | None:
    """A completion's ``logprobs`` as OpenAI's legacy completions give them: parallel lists of
    each token's text, its log-probability, its top alternatives ({text: logprob}) and the
    offset of its text in the answer; None when the request asked for none."""
    if result.logprobs is None:
        return None
    tokens = [token_text(lp.token_id) for lp in result.logprobs]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in result.logprobs],
        "top_logprobs": [{token_text(t): p for t, p in lp.top} for lp in result.logprobs],
        "text_offset": offsets,
    }


def chat_logprobs(result: GenerationResult, token_text: Callable[[int], str]) -> dict[str, Any] | None:
    """A chat answer's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    if result.logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]}
            for lp in result.logprobs
        ]
    }


def speculation(result: GenerationResult) -> dict[str, Any]:
    """What drafting did, under the answer's ``specdraft`` field: the mode that ran and the
    statistics ``specdraft generate --json`` prints (τ, drafted and accepted tokens, ...)."""
    out: dict[str, Any] = {"mode": result.mode, **result.stats.to_json()}
    if result.datastore_version:
        out["datastore_version"] = result.datastore_version
    return out
