"""Typed gRPC clients for LLM workers: sync and async, with deadlines, retries and fail-over.

- Every call has a deadline (``timeout``, default 300 s for generation, 10 s otherwise).
- gRPC's own retry policy retries UNAVAILABLE with exponential backoff on one worker, throttled
  as gRFC A6 says (retries stop while more than half the recent calls failed); when a worker
  stays unavailable, is at its limit (RESOURCE_EXHAUSTED) or cancelled the call while shutting
  down (CANCELLED), the client fails over to the next address it knows.
- ``security`` (``specdraft.security.ClientSecurity``): TLS, mutual TLS and a bearer token.
- A stream is only retried or failed over before its first chunk arrived (afterwards the
  output would be duplicated).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from llm_worker.config import DEFAULT_MODE
from llm_worker.stats import GenerationStats
from specdraft.security import ClientSecurity
from specdraft.stubs import common_pb2, generation_pb2, generation_pb2_grpc

RETRY_POLICY = {
    "methodConfig": [
        {
            "name": [{"service": "specdraft.v1.Generation"}],
            "retryPolicy": {
                "maxAttempts": 4,
                "initialBackoff": "0.1s",
                "maxBackoff": "2s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ],
    "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1},
}
FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED)
"""Statuses after which a call (before its first chunk) is tried on the next worker. CANCELLED
reaches a caller that cancelled nothing when a worker shut down while the call waited for its
handler: gRPC's core cancels such calls instead of answering UNAVAILABLE (grpc/grpc#41785; seen
in ``specdraft chaos`` when a worker was terminated under load). A generation has no side
effects, so trying it elsewhere is safe."""
CHANNEL_OPTIONS = [
    ("grpc.enable_retries", 1),
    ("grpc.service_config", json.dumps(RETRY_POLICY)),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),  # find a dead worker on an idle connection
    ("grpc.keepalive_timeout_ms", 10_000),
]


@dataclass(frozen=True)
class RequestOptions:
    """What a caller may set per request (see proto/specdraft/v1/generation.proto)."""

    mode: str = DEFAULT_MODE
    max_new_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    draft_budget: int = 0
    speculation_off: bool = False
    ignore_eos: bool = False
    tenant: str = ""  # online drafting's namespace, inside the caller's token's own
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one reached
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: none; k: each token's, with k alternatives (0..20)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


def build_request(
    *,
    text: str | None = None,
    token_ids: Sequence[int] | None = None,
    chat: Sequence[tuple[str, str]] | None = None,
    options: RequestOptions = RequestOptions(),
) -> generation_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        repetition_penalty=options.repetition_penalty,
    )
    if options.seed is not None:
        sampling.seed = options.seed
    req = generation_pb2.GenerateRequest(
        mode=options.mode,
        max_new_tokens=options.max_new_tokens,
        sampling=sampling,
        draft_budget=options.draft_budget,
        speculation_off=options.speculation_off,
        ignore_eos=options.ignore_eos,
        tenant=options.tenant,
        stop=options.stop,
        stop_token_ids=options.stop_token_ids,
    )
    if options.logprobs is not None:
        req.logprobs = options.logprobs
    if text is not None:
        req.text = text
    elif token_ids is not None:
        req.token_ids.ids.extend(int(t) for t in token_ids)
    elif chat is not None:
        req.chat.messages.extend(common_pb2.ChatMessage(role=r, content=c) for r, c in chat)
    return req


@dataclass(frozen=True)
class Completion:
    """A worker's answer, as ``GenerationClient.complete`` returns it."""

    text: str
    """The generated text, special tokens (``<|im_end|>``) left out."""
    token_ids: list[int]
    finish_reason: str
    """``stop`` (end of sequence) or ``length``."""
    mode: str
    prompt_tokens: int
    stats: GenerationStats
    """``tau``, ``drafted_tokens``, ``accepted_tokens``, ``acceptance_rate``,
    ``tokens_per_second``, ``seconds``, ... (docs/cli.md, ``--json``)."""
    worker_id: str


class GenerationClient:
    """Blocking client over one or more worker addresses (``host:port``), tried in order."""

    def __init__(
        self, addresses: Sequence[str], timeout: float = 300.0, security: ClientSecurity | None = None
    ) -> None:
        if not addresses:
            raise ValueError("no worker address given")
        self.addresses = list(addresses)
        self.timeout = timeout
        security = security or ClientSecurity()
        self._channels = {a: security.channel(a, CHANNEL_OPTIONS) for a in self.addresses}
        self._stubs = {a: generation_pb2_grpc.GenerationStub(c) for a, c in self._channels.items()}

    def _call(self, method: str, request: Any, timeout: float) -> Any:
        last: grpc.RpcError | None = None
        for address in self.addresses:
            try:
                return getattr(self._stubs[address], method)(request, timeout=timeout)
            except grpc.RpcError as exc:
                if exc.code() not in FAILOVER_CODES:
                    raise
                last = exc
        assert last is not None
        raise last

    def generate(self, request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateResponse:
        return self._call("Generate", request, self.timeout)

    def generate_stream(
        self, request: generation_pb2.GenerateRequest
    ) -> Iterator[generation_pb2.GenerateChunk]:
        last: grpc.RpcError | None = None
        for address in self.addresses:
            started = False
            try:
                for chunk in self._stubs[address].GenerateStream(request, timeout=self.timeout):
                    started = True
                    yield chunk
                return
            except grpc.RpcError as exc:
                if started or exc.code() not in FAILOVER_CODES:
                    raise
                last = exc
        assert last is not None
        raise last

    def complete(
        self, prompt: str | Sequence[Mapping[str, str]], *, system_prompt: str | None = None, **options: Any
    ) -> Completion:
        """Generate for ``prompt``, a text or a chat's messages (``[{"role": "user", "content":
        "..."}]``, rendered by the worker's chat template), and return the text and statistics.
        ``system_prompt``: a system turn before a chat that has none. ``options``:
        ``RequestOptions``' fields, e.g. ``complete("def f(x):", mode="pld", max_new_tokens=32)``.
        Errors are ``grpc.RpcError`` as from ``generate``."""
        from llm_worker.results import from_response

        request_options = RequestOptions(**options)
        if isinstance(prompt, str):
            if system_prompt is not None:
                raise ValueError("system_prompt applies to a chat: give messages, not text")
            request = build_request(text=prompt, options=request_options)
        else:
            turns = [(m["role"], m["content"]) for m in prompt]
            if system_prompt is not None and not (turns and turns[0][0] == "system"):
                turns.insert(0, ("system", system_prompt))
            request = build_request(chat=turns, options=request_options)
        response = self.generate(request)
        result = from_response(response)
        return Completion(
            text=response.text,
            token_ids=result.token_ids,
            finish_reason=result.finish_reason,
            mode=result.mode,
            prompt_tokens=response.prompt_tokens,
            stats=result.stats,
            worker_id=response.worker_id,
        )

    def list_modes(self) -> generation_pb2.ListModesResponse:
        return self._call("ListModes", generation_pb2.ListModesRequest(), 10.0)

    def model_info(self) -> generation_pb2.ModelInfo:
        return self._call("GetModelInfo", generation_pb2.ModelInfoRequest(), 10.0)

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGenerationClient:
    """The same over ``grpc.aio``."""

    def __init__(
        self, addresses: Sequence[str], timeout: float = 300.0, security: ClientSecurity | None = None
    ) -> None:
        if not addresses:
            raise ValueError("no worker address given")
        self.addresses = list(addresses)
        self.timeout = timeout
        self.security = security or ClientSecurity()
        self._channels = {a: self.security.aio_channel(a, CHANNEL_OPTIONS) for a in self.addresses}
        self._stubs = {a: generation_pb2_grpc.GenerationStub(c) for a, c in self._channels.items()}

    def channel(self, address: str) -> grpc.aio.Channel:
        """The channel to ``address``; one to an address not given at construction (a worker
        discovered since) is opened on first use and kept until ``close``."""
        if address not in self._channels:
            self._channels[address] = self.security.aio_channel(address, CHANNEL_OPTIONS)
            self._stubs[address] = generation_pb2_grpc.GenerationStub(self._channels[address])
        return self._channels[address]

    def _stub(self, address: str) -> generation_pb2_grpc.GenerationStub:
        self.channel(address)
        return self._stubs[address]

    async def generate(self, request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateResponse:
        last: grpc.RpcError | None = None
        for address in self.addresses:
            try:
                return await self._stubs[address].Generate(request, timeout=self.timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in FAILOVER_CODES:
                    raise
                last = exc
        assert last is not None
        raise last

    async def generate_stream(
        self, request: generation_pb2.GenerateRequest, addresses: Sequence[str] | None = None
    ) -> AsyncIterator[generation_pb2.GenerateChunk]:
        """The chunks of one generation. ``addresses``: the workers to try, in this order,
        instead of the client's own (a pool's round robin). A caller that stops iterating early
        (``aclose``, a cancelled task) cancels the call, so the worker stops decoding."""
        last: grpc.RpcError | None = None
        for address in addresses or self.addresses:
            started = False
            call = self._stub(address).GenerateStream(request, timeout=self.timeout)
            try:
                async for chunk in call:
                    started = True
                    yield chunk
                return
            except grpc.aio.AioRpcError as exc:
                if started or exc.code() not in FAILOVER_CODES:
                    raise
                last = exc
            finally:
                call.cancel()  # nothing once the call has ended
        assert last is not None
        raise last

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


def response_to_json(resp: generation_pb2.GenerateResponse) -> dict[str, Any]:
    """The CLI's JSON object: the worker's result through the one serializer the in-process path
    uses (``GenerationResult.to_json``)."""
    from llm_worker.results import from_response

    return from_response(resp).to_json(resp.text, resp.prompt_tokens)
