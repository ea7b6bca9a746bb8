"""What the HTTP front end generates with: a worker in this process, or a pool of gRPC workers.

Both are a ``Backend``: ``stream(work)`` yields ``Delta`` events (the tokens a decode step
committed and their text) and one ``Final`` (the result, its whole text, the prompt's length),
and raises ``ApiError`` for a request it refuses, with the status the gRPC side would map to:

=========================================  ==========================  ====
refusal                                    gRPC status                 HTTP
=========================================  ==========================  ====
bad input (``BadRequest``)                 INVALID_ARGUMENT            400
more than ``max_concurrent`` generations   RESOURCE_EXHAUSTED          429
no worker reachable, a worker draining     UNAVAILABLE                 503
past ``max_generation_seconds``            DEADLINE_EXCEEDED           504
=========================================  ==========================  ====

The engine is synchronous: ``InProcessBackend`` runs validation and every decode step on a
thread pool, so the event loop keeps serving; a consumer that stops early (a client gone
mid-stream) sets the request's ``cancel`` event and the generation is closed once the step
running then returns, which frees its slot and its KV cache (as ``llm_worker.server`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol

import grpc

from client.grpc_client import AsyncGenerationClient, RequestOptions, build_request
from client.http_api.schema import ApiError
from llm_worker.engine import StepOutput
from llm_worker.registry import Registry, discover
from llm_worker.results import GenerationResult, from_response
from llm_worker.server import close_after
from llm_worker.textstream import TextStream
from llm_worker.worker import BadRequest, Worker, WorkRequest
from specdraft.security import ClientSecurity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Delta:
    """The tokens one decode step committed and their text (``TextStream``: never half a
    character, so the deltas joined are the final text)."""

    token_ids: tuple[int, ...]
    text: str


def token_id_text(token_id: int) -> str:
    """A token's text where no tokenizer is at hand (a pool's front end): vLLM's
    ``return_tokens_as_token_ids`` form, ``"token_id:42"``."""
    return f"token_id:{token_id}"


@dataclass(frozen=True)
class Final:
    result: GenerationResult
    text: str
    prompt_tokens: int
    token_text: Callable[[int], str] = token_id_text
    """A token's own text, for logprobs (the tokenizer's, special tokens included)."""


Event = Delta | Final


class Backend(Protocol):
    async def model_name(self) -> str:
        """The name ``/v1/models`` lists and requests' ``model`` must give."""
        ...

    def stream(self, work: WorkRequest) -> AsyncGenerator[Event, None]:
        """One generation's events; ``ApiError`` for a refusal."""
        ...

    async def healthy(self) -> bool: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


def served_name(model: str) -> str:
    """A model's name as clients see it: ``TargetInfo.name`` without its note
    (``"HuggingFaceTB/SmolLM2-135M-Instruct (converted from GGUF Q4_1)"`` →
    ``"HuggingFaceTB/SmolLM2-135M-Instruct"``; a directory's name stays as it is)."""
    return model.split(" (", 1)[0]


def prompt_bytes(work: WorkRequest) -> int:
    """The prompt's size before tokenizing, as the gRPC worker counts it: text bytes, chat role
    and content bytes, or 4 per token id."""
    if work.text is not None:
        return len(work.text.encode())
    if work.chat is not None:
        return sum(len(role.encode()) + len(content.encode()) for role, content in work.chat)
    return 4 * len(work.token_ids or ())


# -- a worker in this process ---------------------------------------------------------------------

_DONE = object()


@dataclass(frozen=True)
class Limits:
    max_concurrent: int = 4
    """Generations at once; more are refused (429) at once, never queued."""
    max_prompt_bytes: int = 256 * 1024
    """A longer prompt is refused (400) before it is tokenized."""
    max_generation_seconds: float = 600.0
    """Wall time one generation may take (then 504)."""


class InProcessBackend:
    """``Worker`` in this process, under the gRPC worker's limits (``Limits``)."""

    def __init__(self, worker: Worker, limits: Limits = Limits(), name: str | None = None) -> None:
        self.worker = worker
        self.limits = limits
        self.name = name or served_name(worker.model_info.name)
        self.active = 0
        self._lock = threading.Lock()
        self.executor = ThreadPoolExecutor(max_workers=limits.max_concurrent, thread_name_prefix="decode")

    async def model_name(self) -> str:
        return self.name

    async def healthy(self) -> bool:
        return True

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _admit(self, work: WorkRequest) -> None:
        size = prompt_bytes(work)
        if size > self.limits.max_prompt_bytes:
            limit = self.limits.max_prompt_bytes
            raise ApiError(400, f"the prompt has {size} bytes; this server takes at most {limit}")
        with self._lock:
            if self.active >= self.limits.max_concurrent:
                raise ApiError(
                    429,
                    f"the server is at its limit of {self.limits.max_concurrent} concurrent generations; "
                    "retry later",
                )
            self.active += 1

    def _release(self, step: Future[Any] | None, steps: Iterator[Any] | None) -> None:
        """Free the slot once the generation is closed: at once without one, else after the step
        still running returns (off the event loop; it holds a pool thread and the model)."""

        def done(_: object = None) -> None:
            with self._lock:
                self.active -= 1

        if steps is None:
            done()
            return
        try:
            self.executor.submit(close_after, step, steps).add_done_callback(done)
        except RuntimeError:  # the pool is shut down: nothing runs any more
            done()

    def _token_text(self, token_id: int) -> str:
        tokenizer = self.worker.tokenizer
        return str(tokenizer.decode([token_id])) if tokenizer is not None else token_id_text(token_id)

    async def stream(self, work: WorkRequest) -> AsyncGenerator[Event, None]:
        self._admit(work)
        loop = asyncio.get_running_loop()
        steps: Iterator[StepOutput | GenerationResult] | None = None
        step: Future[Any] | None = None  # the step running on the pool, if any
        cancel = threading.Event()  # set when the consumer stops early: a prefill stops at its next chunk
        ends = time.monotonic() + self.limits.max_generation_seconds
        try:
            try:
                gen = await loop.run_in_executor(self.executor, self.worker.to_engine, work)
            except BadRequest as exc:
                raise ApiError(400, str(exc)) from None
            steps = self.worker.stream(replace(gen, cancel=cancel))
            text = TextStream(self.worker.decode, work.stop)
            while True:
                step = self.executor.submit(next, steps, _DONE)
                item = await asyncio.wrap_future(step)
                if item is _DONE:
                    return
                if isinstance(item, GenerationResult):
                    rest = text.finish()  # text held back for a character the tokens never finished
                    if rest:
                        yield Delta((), rest)
                    yield Final(
                        item, self.worker.text(item, work.stop), len(gen.prompt_ids), self._token_text
                    )
                    continue
                assert isinstance(item, StepOutput)
                yield Delta(tuple(item.token_ids), text.push(item.token_ids))
                if time.monotonic() > ends:
                    limit = self.limits.max_generation_seconds
                    raise ApiError(504, f"the generation ran past this server's limit of {limit:g} s")
        finally:
            cancel.set()
            self._release(step, steps)


# -- a pool of gRPC workers -----------------------------------------------------------------------

GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.CANCELLED: 503,  # a worker that shut down while the call waited (client.grpc_client)
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
"""A worker's refusal as the front end's status; any other (UNAUTHENTICATED: the front end's
worker token is wrong, INTERNAL) is 502, the gateway's fault, with the worker's text."""


def to_grpc_request(work: WorkRequest) -> Any:
    """``work`` as the worker's ``GenerateRequest`` (``client.grpc_client.build_request``)."""
    s = work.sampling
    options = RequestOptions(
        mode=work.mode,
        max_new_tokens=work.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        draft_budget=work.draft_budget,
        speculation_off=work.speculation_off,
        ignore_eos=work.ignore_eos,
        tenant=work.tenant,
        stop=work.stop,
        stop_token_ids=work.stop_token_ids,
        logprobs=work.logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
    )
    return build_request(text=work.text, token_ids=work.token_ids, chat=work.chat, options=options)


class WorkerPool:
    """gRPC workers: a fixed list (``addresses``), health-checked every ``check_seconds``, or the
    live workers of a ``registry`` serving the request's mode. Requests go round robin over the
    healthy ones and fail over to the next (``AsyncGenerationClient``) before their first chunk.
    """

    def __init__(
        self,
        addresses: Sequence[str] = (),
        registry: Registry | None = None,
        security: ClientSecurity | None = None,
        timeout: float = 600.0,
        name: str | None = None,
        check_seconds: float = 2.0,
    ) -> None:
        if bool(addresses) == (registry is not None):
            raise ValueError("give worker addresses or a registry, not both")
        self.addresses = list(addresses)
        self.registry = registry
        self.security = security or ClientSecurity()
        self.timeout = timeout
        self.name = name
        self.check_seconds = check_seconds
        self.health: dict[str, bool] = dict.fromkeys(self.addresses, True)
        self._turn = itertools.count()
        self._client: AsyncGenerationClient | None = None
        self._checker: asyncio.Task[None] | None = None

    def client(self, addresses: Sequence[str]) -> AsyncGenerationClient:
        if self._client is None:
            self._client = AsyncGenerationClient(addresses, self.timeout, self.security)
        return self._client

    async def start(self) -> None:
        if self.addresses:
            await self._check()
            self._checker = asyncio.create_task(self._check_forever())

    async def close(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
        if self._client is not None:
            await self._client.close()

    async def _check(self) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        async def serving(address: str) -> bool:
            stub = health_pb2_grpc.HealthStub(self.client(self.addresses).channel(address))
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
            except grpc.aio.AioRpcError:
                return False
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

        states = await asyncio.gather(*(serving(a) for a in self.addresses))
        self.health = dict(zip(self.addresses, states, strict=True))

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.check_seconds)
            with contextlib.suppress(Exception):
                await self._check()

    async def _candidates(self, mode: str | None) -> list[str]:
        """Workers that may serve ``mode`` (None: any): the registry's live ones, or those of the
        list whose last health check said SERVING (all of them when none did)."""
        if self.registry is not None:
            try:
                return await asyncio.to_thread(discover, self.registry, mode)
            except Exception as exc:  # Redis down: no discovery, no worker
                raise ApiError(503, f"the worker registry is unavailable: {type(exc).__name__}") from None
        return [a for a in self.addresses if self.health.get(a)] or list(self.addresses)

    async def _order(self, mode: str | None) -> list[str]:
        """The workers to try for ``mode`` (None: any), the next in turn first."""
        found = await self._candidates(mode)
        if not found:
            what = "is live" if mode is None else f"serves mode {mode.split(':', 1)[0]!r}"
            raise ApiError(503, f"no live worker {what}")
        turn = next(self._turn) % len(found)
        return found[turn:] + found[:turn]

    async def model_name(self) -> str:
        if self.name is None:
            self.name = await self._ask_name()
        return self.name

    async def _ask_name(self) -> str:
        from specdraft.stubs import generation_pb2, generation_pb2_grpc

        if self.registry is not None:
            records = await asyncio.to_thread(self.registry.workers, None)
            if records:
                return served_name(records[0].model)
        else:
            for address in await self._order(None):
                with contextlib.suppress(grpc.aio.AioRpcError):
                    stub = generation_pb2_grpc.GenerationStub(self.client(self.addresses).channel(address))
                    info = await stub.GetModelInfo(generation_pb2.ModelInfoRequest(), timeout=10.0)
                    return served_name(info.name)
        raise ApiError(503, "no worker answered: the model's name is not known yet")

    async def healthy(self) -> bool:
        if self.registry is not None:
            return bool(await self._candidates(None))
        return any(self.health.values())

    async def stream(self, work: WorkRequest) -> AsyncGenerator[Event, None]:
        try:
            request = to_grpc_request(work)
        except ValueError as exc:  # a number the protocol cannot carry (max_tokens over 2**32)
            raise ApiError(400, f"a value is out of range: {exc}") from None
        order = await self._order(work.mode)
        try:
            async for chunk in self.client(order).generate_stream(request, order):
                if chunk.HasField("final"):
                    final = chunk.final
                    yield Final(from_response(final), final.text, final.prompt_tokens)
                else:
                    yield Delta(tuple(chunk.token_ids), chunk.text)
        except grpc.aio.AioRpcError as exc:
            status = GRPC_TO_HTTP.get(exc.code(), 502)
            raise ApiError(
                status, f"worker: {exc.details()}" if status == 502 else str(exc.details())
            ) from None
