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


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens only (an end-of-sequence token included)
    mode: str
    finish_reason: str  # "stop" (end-of-sequence token) or "length"
    stats: GenerationStats
    provenance: list[CopiedSpan]
    datastore_version: str = ""  # the datastore version that drafted, if any

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
    return generation_pb2.GenerateResponse(
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
    )
    spans = [CopiedSpan(p.output_start, p.source_start, p.length, p.drafter) for p in resp.provenance]
    return GenerationResult(
        token_ids=list(resp.token_ids),
        mode=resp.mode,
        finish_reason=resp.finish_reason,
        stats=stats,
        provenance=spans,
        datastore_version=resp.datastore_version,
    )
