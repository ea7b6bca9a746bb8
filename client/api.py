"""The Python API, shaped as vLLM's offline one: ``from specdraft import LLM, SamplingParams``.

::

    from specdraft import LLM, SamplingParams

    llm = LLM(mode="pld")  # the default model, loaded in this process
    params = SamplingParams(max_tokens=32)
    out = llm.generate("def fibonacci(n):", params)[0]
    print(out.outputs[0].text, out.stats.tau)
    out = llm.chat([{"role": "user", "content": "Name three primes."}], params, mode="ar")[0]

``LLM`` loads the model once (``llm_worker.assembly.load_engine``) and runs every request through
the worker's own rules (``llm_worker.worker.Worker``): the same prompt encoding, validation,
messages and decoding as a gRPC worker, so its outputs are the worker's outputs. Requests of one
call run one after another; for concurrent users serve a worker (``specdraft serve worker``).
Every refusal is a ``ValueError`` with the worker's one-line message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

from llm_worker.assembly import ResourceConfig, load_engine
from llm_worker.chat import chat_prompt_ids
from llm_worker.config import DEFAULT_MODE, DType, ModelConfig
from llm_worker.config import SamplingParams as EngineSampling
from llm_worker.drafters import DRAFTERS
from llm_worker.results import CopiedSpan, GenerationResult, TokenLogprob
from llm_worker.stats import GenerationStats
from llm_worker.worker import Worker, WorkRequest

Messages = Sequence[Mapping[str, str]]
"""One conversation: ``[{"role": "system" | "user" | "assistant", "content": "..."}, ...]``."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (vLLM's names).

    Unlike vLLM, ``temperature`` defaults to 0: greedy decoding, where every mode's output is
    token for token that of ``ar``. Stops, logprobs and penalties are exact in every mode too
    (docs/losslessness.md).
    """

    temperature: float = 0.0
    """0 = greedy; above 0, sampling (every mode keeps ``ar``'s distribution)."""
    top_p: float = 1.0
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or vLLM's -1) keeps all."""
    seed: int | None = None
    """Makes sampling repeatable: the same seed gives the same tokens in every mode."""
    max_tokens: int = 128
    """New tokens at most (vLLM's default is 16)."""
    ignore_eos: bool = False
    """Go on past the end-of-sequence token up to ``max_tokens``."""
    stop: str | Sequence[str] | None = None
    """Stop strings (at most 4): the text ends before the first one generated."""
    stop_token_ids: Sequence[int] | None = None
    """Token ids that end the generation, as the end-of-sequence token does."""
    logprobs: int | None = None
    """None: none; k: each generated token's log-probability under the model, with its k
    likeliest alternatives (0..20), in ``CompletionOutput.logprobs``."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """OpenAI's presence and frequency penalties (over generated tokens, in [-2, 2]) and the
    transformers / vLLM repetition penalty (over prompt and generated tokens, > 0; 1 = none)."""


@dataclass(frozen=True)
class CompletionOutput:
    """One generated sequence (``RequestOutput.outputs[0]``)."""

    index: int
    text: str
    """The generated text, special tokens (``<|im_end|>``) left out."""
    token_ids: list[int]
    """The generated tokens, an end-of-sequence token included if one was produced."""
    finish_reason: str
    """``stop`` (end of sequence, a stop string or stop token id) or ``length`` (``max_tokens``)."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended it; None otherwise (vLLM's field)."""
    logprobs: list[TokenLogprob] | None = None
    """Per generated token when ``SamplingParams.logprobs`` asked for them: its log-probability
    and its likeliest alternatives (token id, log-probability)."""


@dataclass(frozen=True)
class RequestOutput:
    """The result of one prompt: vLLM's fields, and the speculation's statistics."""

    prompt: str
    """The prompt as the model saw it: the text given, or a chat rendered by the template."""
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    result: GenerationResult = field(repr=False)
    """The engine's result: what ``specdraft generate --json`` prints (``to_json``)."""

    @property
    def mode(self) -> str:
        return self.result.mode

    @property
    def stats(self) -> GenerationStats:
        """``tau`` (new tokens per target forward), ``drafted_tokens``, ``accepted_tokens``,
        ``acceptance_rate``, ``tokens_per_second``, ``seconds``, ...: see docs/cli.md."""
        return self.result.stats

    @property
    def provenance(self) -> list[CopiedSpan]:
        return self.result.provenance

    def to_json(self) -> dict[str, object]:
        """The object ``specdraft generate --json`` prints for the same request."""
        return self.result.to_json(self.outputs[0].text, len(self.prompt_token_ids))


def work_request(
    params: SamplingParams,
    mode: str,
    *,
    text: str | None = None,
    chat: Messages | None = None,
    tenant: str = "",
) -> WorkRequest:
    """The worker's request for ``text`` or ``chat`` under ``params``; the one place that maps
    this API's options (the worker checks their values: ``Worker.to_engine``)."""
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
    sampling = EngineSampling(
        params.temperature,
        params.top_p,
        max(params.top_k, 0),
        params.seed,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
    )
    stop = (params.stop,) if isinstance(params.stop, str) else tuple(params.stop or ())
    turns = None if chat is None else tuple((m["role"], m["content"]) for m in chat)
    return WorkRequest(
        text=text,
        chat=turns,
        mode=mode,
        max_new_tokens=params.max_tokens,
        sampling=sampling,
        ignore_eos=params.ignore_eos,
        tenant=tenant,
        stop=stop,
        stop_token_ids=tuple(params.stop_token_ids or ()),
        logprobs=params.logprobs,
    )


class LLM:
    """A model in this process, decoding in a drafting mode; ``generate`` and ``chat`` as vLLM's.

    ``model``: None (SmolLM2-135M-Instruct), a Hugging Face model directory, or a Hub id in the
    local Hugging Face cache (``"HuggingFaceTB/SmolLM2-135M-Instruct"``; nothing is downloaded).
    ``mode``: the default drafting mode with its options (``"pld+h:layer=12"``); a mistyped
    mode or option name is refused before the model loads. ``max_model_len``: a cap on prompt +
    new tokens below the model's context. ``chat_template``: Jinja text rendering chats instead
    of the tokenizer's template. ``datastore`` / ``datastore_addresses``, ``heads_file``,
    ``drafters_dir``: what ``rest``/``dresd``, ``pld+a`` and the learned drafters read, as the
    CLI's options of those names. ``tenant``: the namespace modes that learn online draft from.
    """

    def __init__(
        self,
        model: str | None = None,
        mode: str = DEFAULT_MODE,
        dtype: DType = "float32",
        *,
        device: str = "cpu",
        threads: int | None = None,
        backend: str = "auto",
        kernel: str = "auto",
        fused_kernels: bool = True,
        max_model_len: int | None = None,
        chat_template: str | None = None,
        datastore: str | None = None,
        datastore_addresses: Sequence[str] = (),
        heads_file: str | None = None,
        drafters_dir: str | None = None,
        tenant: str = "",
    ) -> None:
        DRAFTERS.check(mode)  # before the model loads
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if backend not in ("auto", "fast", "hf"):
            raise ValueError(f"backend must be auto, fast or hf, not {backend!r}")
        config = ModelConfig(
            path=model,
            dtype=dtype,
            device=device,
            threads=threads,
            max_context=max_model_len,
            kernel=kernel,
            fused_kernels=fused_kernels,
            backend=backend,  # type: ignore[arg-type]  # checked above
        )
        resources = ResourceConfig(
            datastore_path=datastore,
            datastore_addresses=tuple(datastore_addresses),
            device=device,
            heads_file=heads_file,
            drafters_dir=drafters_dir,
        )
        engine, _target, tokenizer = load_engine(config, resources)
        self.worker = Worker(engine, tokenizer, chat_template=chat_template)
        if chat_template is not None:  # fails now, not at the first chat
            chat_prompt_ids(tokenizer, [{"role": "user", "content": "hello"}], chat_template)
        engine.runtime(mode)  # an unavailable mode (no datastore, no checkpoint) fails now
        self.mode = mode
        self.tenant = tenant

    def generate(
        self,
        prompts: str | Sequence[str],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        mode: str | None = None,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order. ``sampling_params``: one for every prompt
        or one each (None: greedy, 128 tokens); ``mode``: this call's mode instead of the LLM's."""
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        requests = [
            work_request(p, mode or self.mode, text=t, tenant=self.tenant)
            for t, p in zip(texts, self._params(sampling_params, len(texts)), strict=True)
        ]
        return [self._run(r) for r in requests]

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        mode: str | None = None,
        system_prompt: str | None = None,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per conversation (``messages`` is one, or a list of them), each
        answered as the assistant's next turn. ``system_prompt``: a system turn put first in
        every conversation that has none of its own."""
        one = not messages or isinstance(messages[0], Mapping)
        chats = cast(list[Messages], [messages] if one else list(messages))
        system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        conversations = [list(c) if c and c[0].get("role") == "system" else [*system, *c] for c in chats]
        requests = [
            work_request(p, mode or self.mode, chat=c, tenant=self.tenant)
            for c, p in zip(conversations, self._params(sampling_params, len(conversations)), strict=True)
        ]
        return [self._run(r) for r in requests]

    def _params(
        self, given: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if given is None or isinstance(given, SamplingParams):
            return [given or SamplingParams()] * count
        if len(given) != count:
            raise ValueError(f"{len(given)} sampling_params for {count} prompts: give one, or one each")
        return list(given)

    def _run(self, req: WorkRequest) -> RequestOutput:
        gen = self.worker.to_engine(req)  # BadRequest, a ValueError, with the worker's message
        result = self.worker.engine.generate(gen)
        tokenizer = self.worker.tokenizer
        prompt = req.text if req.text is not None else tokenizer.decode(list(gen.prompt_ids))
        text = self.worker.text(result, req.stop)
        output = CompletionOutput(
            0, text, list(result.token_ids), result.finish_reason, result.stop_reason, result.logprobs
        )
        return RequestOutput(prompt, list(gen.prompt_ids), [output], result)
