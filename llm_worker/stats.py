"""Per-request statistics: a small dataclass with ``observe_*`` methods, nothing else.

τ (tau) is the mean number of tokens each target forward yields, the bonus token included:
new_tokens / target_forwards. Plain decoding has τ = 1; the prefill forward counts (it yields
the first token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_DEPTH_STATS = 16  # acceptance by depth is kept for depths 1 .. this


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_forwards: int = 0
    drafted_tokens: int = 0  # draft tokens sent to verification
    gated_steps: int = 0  # steps that did not draft because drafting had not paid (``DraftGate``)
    cached_prompt_tokens: int = 0  # prompt tokens whose KV the prefix cache supplied (not prefilled)
    accepted_tokens: int = 0  # of those, accepted
    draft_seconds: float = 0.0  # proposing and planning drafts
    verify_seconds: float = 0.0  # target forwards (prefill included) and accept / reject
    seconds: float = 0.0  # wall time of the whole request
    prefill_seconds: float = 0.0  # the prompt's forwards (part of verify_seconds; not in to_json)
    depth_reached: list[int] = field(default_factory=list)  # [depth - 1] steps whose draft reached depth
    depth_accepted: list[int] = field(default_factory=list)  # [depth - 1] of those, a node there accepted

    def observe_prefill(self, seconds: float) -> None:
        self.prefill_seconds += seconds
        self.target_forwards += 1
        self.new_tokens += 1
        self.verify_seconds += seconds

    def observe_step(
        self, drafted: int, accepted: int, emitted: int, draft_s: float, verify_s: float
    ) -> None:
        self.target_forwards += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.new_tokens += emitted
        self.draft_seconds += draft_s
        self.verify_seconds += verify_s

    def observe_depths(self, draft_depth: int, accepted: int) -> None:
        """One verified draft ``draft_depth`` deep with ``accepted`` tokens accepted: depth d was
        reached if d - 1 tokens were accepted, and passed if d were. Example: a chain of 4 with 2
        accepted reaches depths 1..3 and passes 1..2."""
        top = min(draft_depth, accepted + 1, MAX_DEPTH_STATS)
        while len(self.depth_reached) < top:
            self.depth_reached.append(0)
            self.depth_accepted.append(0)
        for d in range(top):
            self.depth_reached[d] += 1
            self.depth_accepted[d] += int(d < accepted)

    @property
    def tau(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "tau": round(self.tau, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "drafted_tokens": self.drafted_tokens,
            "gated_steps": self.gated_steps,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "accepted_tokens": self.accepted_tokens,
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "seconds": round(self.seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "acceptance_by_depth": [
                round(a / r, 4) if r else None
                for a, r in zip(self.depth_accepted, self.depth_reached, strict=True)
            ],
        }


@dataclass
class ThroughputWindow:
    """Generations a worker finished over a stretch of time, for its log: the periodic one-line
    summary (one window per interval) and the counts it logs when it stops (one since start)."""

    requests: int = 0
    new_tokens: int = 0
    target_forwards: int = 0

    def observe(self, stats: GenerationStats) -> None:
        self.requests += 1
        self.new_tokens += stats.new_tokens
        self.target_forwards += stats.target_forwards

    @property
    def tau(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    def line(self, seconds: float, running: int, waiting: int) -> str:
        """One line of the worker's log. Example: 3 requests of 40 tokens in 47 forwards over
        10 s with 2 running → "3 requests finished in 10 s, 120 tokens (12.0 tokens/s, τ 2.55);
        2 running, 0 waiting"."""
        rate = self.new_tokens / seconds if seconds > 0 else 0.0
        return (
            f"{self.requests} request{'' if self.requests == 1 else 's'} finished in {seconds:.0f} s, "
            f"{self.new_tokens} tokens "
            f"({rate:.1f} tokens/s, τ {self.tau:.2f}); {running} running, {waiting} waiting"
        )
