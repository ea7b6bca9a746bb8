"""The CUDA path (``pytest -m cuda``): skipped, and counted as skipped, where torch sees no CUDA
device (``tests/conftest.py``); ``make gpu-check`` (``scripts/gpu/check.py``) runs them on a GPU
machine and puts each one's outcome in its report.

- the row-invariant Triton kernels (``llm_worker.model.triton_kernels``) on CUDA tensors: row i
  of an M-row call is bitwise the 1-row call of that row, for every M in 1..64, in bfloat16 and
  float16 (the interpreter runs the same kernels on CPU in ``tests/test_triton_kernels.py``);
- the default model on the GPU in bfloat16 and float32, on the operations the forward picks
  there by default (``TritonOps``; the torch operations, cuBLAS and SDPA, are not invariant):
  every mode the worker lists writes exactly ``ar``'s tokens on 10 varied prompts of 64 new
  tokens, with drafts accepted, alone and as 16 concurrent requests through the batch scheduler.
"""

from __future__ import annotations

import os
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from test_lossless_real import varied_prompts

from helpers.models import FLAT_CURVE, DraftTally, assert_greedy_identical, chat_ids, engine_for
from llm_worker.batching import BatchingConfig
from llm_worker.config import ModelConfig
from llm_worker.drafters import DRAFTERS
from llm_worker.engine import Engine, GenerationRequest
from llm_worker.model import load_target
from llm_worker.model.target import TargetModel

pytestmark = pytest.mark.cuda

NEW_TOKENS = 64
CONCURRENT = 16
MAX_ROWS = 64  # the kernels' invariance is checked for every row count 1..MAX_ROWS
KERNEL_DTYPES = [torch.bfloat16, torch.float16]
HIDDEN, QKV, INTERMEDIATE = 576, 960, 1536  # the default model's shapes (SmolLM2-135M)


# -- the kernels ------------------------------------------------------------------------------------


def _kernels() -> Any:
    """The kernels' module, compiled for the GPU: not Triton's interpreter, which a CPU test
    module may have switched on for the whole process (``TRITON_INTERPRET=1``)."""
    from llm_worker.model import triton_kernels

    assert triton_kernels.available(), "triton is not importable here"
    assert os.environ.get("TRITON_INTERPRET", "0") == "0", "TRITON_INTERPRET is set: not the compiled kernels"
    return triton_kernels


def _rows(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to("cuda", dtype)


def _assert_rows_invariant(call: Any, x: torch.Tensor) -> None:
    """``call``'s output rows over x[:m] are bitwise its 1-row outputs, for every m ≤ len(x)."""
    alone = torch.cat([call(x[i : i + 1]) for i in range(x.shape[0])])
    for m in range(1, x.shape[0] + 1):
        together = call(x[:m])
        assert torch.equal(together, alone[:m]), f"rows differ from their 1-row calls at m = {m}"


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("out_features, bias", [(QKV, False), (INTERMEDIATE, True)])
def test_linear_rows_are_invariant_on_cuda(dtype: torch.dtype, out_features: int, bias: bool) -> None:
    kernels = _kernels()
    weight = _rows((out_features, HIDDEN), dtype, 1) / HIDDEN**0.5
    b = _rows((out_features,), dtype, 2) if bias else None
    x = _rows((MAX_ROWS, HIDDEN), dtype, 3)
    _assert_rows_invariant(lambda rows: kernels.linear(rows, weight, b), x)
    out = kernels.linear(x, weight, b)
    reference = x.double() @ weight.double().T + (b.double() if b is not None else 0)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_rms_norm_rows_are_invariant_on_cuda(dtype: torch.dtype) -> None:
    kernels = _kernels()
    weight = _rows((HIDDEN,), dtype, 4)
    h, delta = _rows((MAX_ROWS, HIDDEN), dtype, 5), _rows((MAX_ROWS, HIDDEN), dtype, 6)
    both = torch.stack((h, delta), dim=1)  # [rows, 2, hidden]: one tensor for the row helper

    def call(rows: torch.Tensor) -> torch.Tensor:
        return torch.cat(kernels.rms_norm(rows[:, 0], rows[:, 1], weight, 1e-5), dim=-1)

    _assert_rows_invariant(call, both)
    h_sum, normed = kernels.rms_norm(h, delta, weight, 1e-5)
    total = h.float() + delta.float()
    reference = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()
    torch.testing.assert_close(h_sum.float(), total, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(normed.float(), reference, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_silu_mul_rows_are_invariant_on_cuda(dtype: torch.dtype) -> None:
    kernels = _kernels()
    gate_up = _rows((MAX_ROWS, 2 * INTERMEDIATE), dtype, 7)
    _assert_rows_invariant(kernels.silu_mul, gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(
        kernels.silu_mul(gate_up).float(), torch.nn.functional.silu(gate) * up, rtol=2e-2, atol=2e-2
    )


# -- the default model on the GPU -----------------------------------------------------------------


@pytest.fixture(scope="module", params=["bfloat16", "float32", "bfloat16-graphs", "float32-graphs"])
def cuda_model(request: pytest.FixtureRequest) -> tuple[TargetModel, Any]:
    """The default model on CUDA with the forward's default operations there, its steps eager or
    replayed from CUDA graphs (``-graphs``: ``ModelConfig.cuda_graphs``)."""
    dtype, _, graphs = request.param.partition("-")
    return load_target(ModelConfig(dtype=dtype, device="cuda", cuda_graphs=bool(graphs)))


@pytest.fixture(scope="module")
def cuda_prompts(cuda_model: tuple[TargetModel, Any]) -> list[list[int]]:
    return [chat_ids(cuda_model[1], text) for text in varied_prompts()]


def _modes(target: TargetModel) -> list[str]:
    """Every mode the worker lists for this model (no datastore here), ``ar`` aside."""
    return [m for m in DRAFTERS.available(target) if m != "ar"]


def _each_mode(modes: list[str], check: Any) -> None:
    """``check(mode)`` for every mode, then one failure naming each mode that failed and why: a
    GPU run is scarce, so one broken mode must not hide how the others did."""
    failed = []
    for mode in modes:
        try:
            check(mode)
        except Exception as exc:  # reported below, with the mode and where it was raised
            where = traceback.extract_tb(exc.__traceback__)[-1]
            first = str(exc).splitlines()[0] if str(exc) else ""
            failed.append(f"{mode}: {type(exc).__name__} at {where.filename}:{where.lineno}: {first}")
    assert not failed, f"{len(failed)} of {len(modes)} modes failed: " + "; ".join(failed)


def _references(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    refs = [
        engine.generate(GenerationRequest(tuple(p), NEW_TOKENS, "ar", stop_at_eos=False)).token_ids
        for p in prompts
    ]
    assert all(len(r) == NEW_TOKENS for r in refs)
    return refs


def test_the_forward_runs_on_the_gpu_with_the_triton_operations(cuda_model) -> None:
    target, _ = cuda_model
    assert target.info.backend == "fast"
    assert target.ops.name == "triton", "the invariant operations are the default on CUDA"
    assert target.cos.device.type == "cuda"
    assert target.start().keys.device.type == "cuda"  # the KV cache


def test_captured_steps_write_the_eager_steps_tokens_on_cuda(cuda_model, cuda_prompts) -> None:
    """``ar`` on steps replayed from CUDA graphs (padded to their bucket of rows) against ``ar``
    on eager steps of the same model: the same tokens, and the graphs were replayed."""
    target, _ = cuda_model
    graphs = getattr(target, "graphs", None)
    if graphs is None:
        pytest.skip("eager steps: nothing to compare")
    eager, _ = load_target(ModelConfig(dtype=target.info.dtype, device="cuda"))
    refs = _references(engine_for(eager, FLAT_CURVE), cuda_prompts)
    got = _references(engine_for(target, FLAT_CURVE), cuda_prompts)
    for i, (ref, tokens) in enumerate(zip(refs, got, strict=True)):
        assert_greedy_identical(
            target, cuda_prompts[i], ref, tokens, f"cuda/{target.info.dtype}/graphs/prompt{i}"
        )
    assert graphs.replays > 0 and graphs.recorded > 0


@pytest.mark.timeout(1200)
def test_every_mode_alone_is_bit_identical_to_ar_on_cuda(cuda_model, cuda_prompts) -> None:
    target, _ = cuda_model
    engine = engine_for(target, FLAT_CURVE)  # GPU-like: a node costs little, drafts are verified
    refs = _references(engine, cuda_prompts)
    tally = DraftTally()
    dtype = target.info.dtype

    def check(mode: str) -> None:
        for i, (prompt, ref) in enumerate(zip(cuda_prompts, refs, strict=True)):
            res = engine.generate(GenerationRequest(tuple(prompt), NEW_TOKENS, mode, stop_at_eos=False))
            assert_greedy_identical(target, prompt, ref, res.token_ids, f"cuda/{dtype}/{mode}/prompt{i}")
            tally.observe(mode, res.stats)

    _each_mode(_modes(target), check)
    tally.assert_every_mode_drafted_and_accepted(f"cuda/{dtype}")


@pytest.mark.timeout(1200)
def test_every_mode_under_16_concurrent_requests_is_bit_identical_to_ar_on_cuda(
    cuda_model, cuda_prompts
) -> None:
    """16 requests of one mode at once through the batch scheduler (the worker's), each
    compared with its prompt's ``ar`` alone: the other rows of a forward never change a row."""
    target, _ = cuda_model
    solo = engine_for(target, FLAT_CURVE)
    refs = _references(solo, cuda_prompts)
    batched = Engine(
        target, solo.config, curve=FLAT_CURVE, resources=solo.resources, batching=BatchingConfig()
    )
    tally = DraftTally()
    dtype = target.info.dtype
    which = [i % len(cuda_prompts) for i in range(CONCURRENT)]

    def check(mode: str) -> None:
        requests = [
            GenerationRequest(tuple(cuda_prompts[i]), NEW_TOKENS, mode, stop_at_eos=False) for i in which
        ]
        with ThreadPoolExecutor(CONCURRENT) as pool:
            results = list(pool.map(batched.generate, requests))
        for i, res in zip(which, results, strict=True):
            label = f"cuda/{dtype}/{mode}/x{CONCURRENT}/prompt{i}"
            assert_greedy_identical(target, cuda_prompts[i], refs[i], res.token_ids, label)
            tally.observe(mode, res.stats)

    try:
        _each_mode(_modes(target), check)
        assert batched.scheduler is not None and batched.scheduler.mean_batch_size > 1
    finally:
        batched.close()
    tally.assert_every_mode_drafted_and_accepted(f"cuda/{dtype}/x{CONCURRENT}")
