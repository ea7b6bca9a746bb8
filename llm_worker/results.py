"""A generation's result and its two wire forms: ``GenerationResult.to_json`` (what
``specdraft generate --json`` prints, in process or through a worker) and ``to_response`` (the
gRPC message; ``from_response`` reads it back). No torch here: a client imports this to print a
worker's answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llm_worker.stats import GenerationStats
from specdraft.stubs import common_pb2, generation_pb2


@dataclass
class CopiedSpan:
    """Provenance of accepted draft tokens copied from the context.

    Output tokens ``[output_start, output_start + length)`` (indices into the generated tokens)
    were drafted by copying context tokens ``[source_start, source_start + length)`` (indices
    into prompt + generated tokens) and accepted by the verifier.
    """

    output_start: int
    source_start: int
    length: int
    drafter: str = ""

    def to_json(self) -> dict[str, int | str]:
        return {
            "output_start": self.output_start,
            "source_start": self.source_start,
            "length": self.length,
            "drafter": self.drafter,
        }


@dataclass
class Provenance:
    """Accumulates copied spans, merging a span that continues the previous one."""

    spans: list[CopiedSpan] = field(default_factory=list)

    def add(self, output_index: int, source: int, drafter: str) -> None:
        if source < 0:
            return
        last = self.spans[-1] if self.spans else None
        if (
            last is not None
            and last.drafter == drafter
            and last.output_start + last.length == output_index
            and last.source_start + last.length == source
        ):
            last.length += 1
        else:
            self.spans.append(CopiedSpan(output_index, source, 1, drafter))


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the target, and its likeliest alternatives.

    The raw model's: the log-softmax of the target's logits row that decided the token, before
    penalties, temperature, top-k or top-p (vLLM's default, ``raw_logprobs``). ``top``: the k
    likeliest tokens of that row, likeliest first (it may or may not hold ``token_id``).
    Example: TokenLogprob(42, -0.105, ((42, -0.105), (7, -2.41))).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # [k] (token id, log-probability)

    def to_json(self) -> dict[str, Any]:
        return {
            "token_id": self.token_id,
            "logprob": self.logprob,
            "top": [{"token_id": t, "logprob": lp} for t, lp in self.top],
        }


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens only (an end-of-sequence or stop token included)
    mode: str
    finish_reason: str  # "stop" (end-of-sequence token, stop token id or stop string) or "length"
    stats: GenerationStats
    provenance: list[CopiedSpan]
    datastore_version: str = ""  # the datastore version that drafted, if any
    stop_reason: str | int | None = None
    """Which stop ended it: the stop string, or the stop token id; None for an end-of-sequence
    token or the length limit (vLLM's ``stop_reason``)."""
    logprobs: list[TokenLogprob] | None = None  # [len(token_ids)] when the request asked for them

    def to_json(self, text: str, prompt_tokens: int) -> dict[str, Any]:
        """The result as ``specdraft generate --json`` prints it, in process or through a worker
        (the one JSON form of a result; ``server.to_response`` is the one protobuf form)."""
        payload: dict[str, Any] = {
            "text": text,
            "token_ids": list(self.token_ids),
            "mode": self.mode,
            "finish_reason": self.finish_reason,
            "prompt_tokens": prompt_tokens,
            "stats": self.stats.to_json(),
            "provenance": [span.to_json() for span in self.provenance],
        }
        if self.datastore_version:
            payload["datastore_version"] = self.datastore_version
        if self.stop_reason is not None:
            payload["stop_reason"] = self.stop_reason
        if self.logprobs is not None:
            payload["logprobs"] = [lp.to_json() for lp in self.logprobs]
        return payload


def to_response(
    result: GenerationResult, text: str, prompt_tokens: int, worker_id: str
) -> generation_pb2.GenerateResponse:
    st = result.stats
    stats = common_pb2.GenerationStats(
        new_tokens=st.new_tokens,
        target_forwards=st.target_forwards,
        tau=st.tau,
        acceptance_rate=st.acceptance_rate,
        drafted_tokens=st.drafted_tokens,
        accepted_tokens=st.accepted_tokens,
        draft_seconds=st.draft_seconds,
        verify_seconds=st.verify_seconds,
        seconds=st.seconds,
        tokens_per_second=st.tokens_per_second,
        cached_prompt_tokens=st.cached_prompt_tokens,
    )
    spans = [
        common_pb2.CopiedSpan(
            output_start=s.output_start, source_start=s.source_start, length=s.length, drafter=s.drafter
        )
        for s in result.provenance
    ]
    resp = generation_pb2.GenerateResponse(
        text=text,
        token_ids=result.token_ids,
        mode=result.mode,
        finish_reason=result.finish_reason,
        prompt_tokens=prompt_tokens,
        stats=stats,
        provenance=spans,
        worker_id=worker_id,
        datastore_version=result.datastore_version,
    )
    if isinstance(result.stop_reason, str):
        resp.stop_string = result.stop_reason
    elif result.stop_reason is not None:
        resp.stop_token_id = result.stop_reason
    for lp in result.logprobs or ():
        top = [generation_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
        resp.logprobs.append(generation_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=top))
    return resp


def from_response(resp: generation_pb2.GenerateResponse) -> GenerationResult:
    """The result ``to_response`` sent (``resp.text`` and ``resp.prompt_tokens`` beside it):
    a client prints it through ``GenerationResult.to_json`` as the in-process path does."""
    s = resp.stats
    stats = GenerationStats(
        new_tokens=s.new_tokens,
        target_forwards=s.target_forwards,
        drafted_tokens=s.drafted_tokens,
        accepted_tokens=s.accepted_tokens,
        draft_seconds=s.draft_seconds,
        verify_seconds=s.verify_seconds,
        seconds=s.seconds,
        cached_prompt_tokens=s.cached_prompt_tokens,
    )
    spans = [CopiedSpan(p.output_start, p.source_start, p.length, p.drafter) for p in resp.provenance]
    kind = resp.WhichOneof("stop_reason")
    stop_reason: str | int | None = None
    if kind == "stop_string":
        stop_reason = resp.stop_string
    elif kind == "stop_token_id":
        stop_reason = resp.stop_token_id
    logprobs = [
        TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
        for lp in resp.logprobs
    ]
    return GenerationResult(
        token_ids=list(resp.token_ids),
        mode=resp.mode,
        finish_reason=resp.finish_reason,
        stats=stats,
        provenance=spans,
        datastore_version=resp.datastore_version,
        stop_reason=stop_reason,
        logprobs=logprobs or None,  # a generation has at least one token: none means not asked
    )
