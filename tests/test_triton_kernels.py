"""The Triton kernels of the CUDA forward (``llm_worker.model.triton_kernels``) and the operations
over them (``ops_triton.TritonOps``): each kernel row-invariant (row i of an M-row call is bit for
bit row i alone, for M = 1, 3, 16, 17, 40) and accurate against a plain torch reference, in
float32, bfloat16 and float16; then whole forwards of a tiny Llama: a token's logits the same
alone, in a draft tree and beside another request, and greedy speculative modes equal to ``ar``.

On a machine with CUDA the kernels run compiled on the GPU; elsewhere on CPU tensors under
Triton's interpreter, on in the test process only (``conftest.pytest_configure``: the environment
variable while the test modules are imported, then Triton's knob), so no subprocess of a test
sees it. Without triton the module is skipped. The interpreter is slow: shapes are tiny.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers.models import DraftTally, engine_for, prompts, tiny_model
from llm_worker.config import ModelConfig
from llm_worker.engine import GenerationRequest
from llm_worker.model import wrap_model
from llm_worker.model.fast_llama import FastLlamaTarget, _pick_ops
from llm_worker.model.ops import OpsContext
from llm_worker.model.target import ForwardCall, SequenceState
from llm_worker.types import ArtifactNeeds
from llm_worker.verify.tree import tree_buffers

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (the dev extra pins it on x86-64 Linux)", allow_module_level=True)

# made now: on CPU for Triton's interpreter, on while test modules are imported (conftest.py)
from llm_worker.model import ops_triton, triton_jit, triton_kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

if not triton_kernels.available():
    pytest.skip("no CUDA, and triton was imported before its interpreter was on", allow_module_level=True)
assert DEVICE.type == "cuda" or triton_jit.INTERPRETED
# On a GPU every test here is also a ``cuda`` test: ``make gpu-check`` (``pytest -m cuda``) runs the
# compiled kernels' invariance and accuracy, the rope and attention kernels included. On CPU they
# are unmarked and run under the interpreter in the ordinary suite.
pytestmark = [pytest.mark.cuda] if DEVICE.type == "cuda" else []

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROWS = (1, 3, 16, 17, 40)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float16: 2**-9}
"""Relative error allowed against a float64 reference: two of the dtype's ulps (Triton's
interpreter rounds bfloat16 towards zero) and float32's accumulation."""
NEEDS = ArtifactNeeds(hidden_layers=frozenset({1, 2}), query_heads=((0, 1), (1, 3)))


def rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within ``TOLERANCE`` of the largest reference value."""
    err = (got.double() - want.double()).abs().max().item()
    assert err <= TOLERANCE[dtype] * max(1.0, want.abs().max().item()), (err, dtype)


def assert_rows_invariant(op, x: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    """``op`` over the first M rows of x equals its rows of the whole call, for every M in ROWS,
    and each row alone equals its row of the whole call."""
    whole = op(x)
    for m in ROWS:
        assert torch.equal(op(x[:m]), whole[:m]), m
    for i in (0, 1, 9, 16, 33, len(x) - 1):
        assert torch.equal(op(x[i : i + 1])[0], whole[i]), i


# -- GEMM ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,bias", [(80, 96, True), (24, 40, False)])
def test_linear_rows_are_invariant_and_accurate(dtype: torch.dtype, n: int, k: int, bias: bool) -> None:
    x, w = rand(max(ROWS), k, dtype=dtype, seed=1), rand(n, k, dtype=dtype, seed=2, scale=0.2)
    b = rand(n, dtype=dtype, seed=3) if bias else None
    assert_rows_invariant(lambda rows: triton_kernels.linear(rows, w, b), x)
    assert_rows_invariant(lambda rows: triton_kernels.linear(rows, w, b, out_dtype=torch.float32), x)
    want = F.linear(x.double(), w.double(), b.double() if b is not None else None)
    got = triton_kernels.linear(x, w, b)
    assert got.dtype == dtype
    assert_close(got, want, dtype)
    logits = triton_kernels.linear(x, w, b, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    assert_close(logits, want, torch.float32 if dtype == torch.float32 else torch.float16)


def test_gemm_tiles_depend_on_the_weight_only() -> None:
    """One tile per weight shape and dtype, at least tl.dot's 16 in every dimension."""
    tiles = triton_kernels.gemm_tiles(576, 576, torch.bfloat16)
    assert (tiles.bm, tiles.bn, tiles.bk) == (32, 64, 64)
    assert triton_kernels.gemm_tiles(576, 576, torch.float32).bk == 32
    assert min(vars(triton_kernels.gemm_tiles(8, 8, torch.float16)).values()) >= 16


# -- RMSNorm, SiLU·up ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_are_invariant_and_accurate(dtype: torch.dtype) -> None:
    h, delta = rand(max(ROWS), 96, dtype=dtype, seed=4, scale=3), rand(max(ROWS), 96, dtype=dtype, seed=5)
    w = rand(96, dtype=dtype, seed=6)
    eps = 1e-5
    both = torch.cat((h, delta), dim=1)

    def norm(rows: torch.Tensor) -> torch.Tensor:
        total, normed = triton_kernels.rms_norm(rows[:, :96], rows[:, 96:], w, eps)
        return torch.cat((total, normed), dim=1)

    assert_rows_invariant(norm, both)
    assert_rows_invariant(lambda rows: triton_kernels.rms_norm(rows, None, w, eps)[1], h)
    total, normed = triton_kernels.rms_norm(h, delta, w, eps)
    s = h.double() + delta.double()
    assert_close(total, s, dtype)
    assert_close(normed, F.rms_norm(s, (96,), w.double(), eps), dtype)
    same, _ = triton_kernels.rms_norm(h, None, w, eps)
    assert same is h


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_rows_are_invariant_and_accurate(dtype: torch.dtype) -> None:
    gate_up = rand(max(ROWS), 2 * 80, dtype=dtype, seed=7, scale=2)
    assert_rows_invariant(triton_kernels.silu_mul, gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    assert_close(triton_kernels.silu_mul(gate_up), F.silu(gate) * up, dtype)


# -- RoPE + the cache write, attention ---------------------------------------------------------

HEADS, KV, D = 4, 2, 16
CAPACITY = 160  # three 64-key chunks of attention's online softmax


def rope_tables(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin [n, D] of positions 0, 7, 14, ... (as ``fast_llama`` builds them)."""
    pos = torch.arange(n, dtype=torch.float64)[:, None] * 7
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.cat((pos * inv, pos * inv), dim=1)
    half = D // 2
    sin = angles.sin()
    return angles.cos().to(DEVICE, torch.float32), torch.cat((-sin[:, :half], sin[:, half:]), 1).to(
        DEVICE, torch.float32
    )


def cache(dtype: torch.dtype, slots: int = 2, seed: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Random keys [slots, kv, capacity, d] and values [..., d + 1] (last column 1, as the pool's)."""
    keys = rand(slots, KV, CAPACITY, D, dtype=dtype, seed=seed)
    values = rand(slots, KV, CAPACITY, D + 1, dtype=dtype, seed=seed + 1)
    values[..., -1] = 1
    return keys, values


def index(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_rotates_as_torch_and_writes_each_row_alone_as_in_a_batch(dtype: torch.dtype) -> None:
    m = max(ROWS)
    qkv = rand(m, (HEADS + 2 * KV) * D, dtype=dtype, seed=10)
    cos, sin = rope_tables(m)

    def run(rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.zeros(m, HEADS, D, device=DEVICE)
        keys, values = cache(dtype)
        slots = [r % 2 for r in rows]
        positions = [100 + r for r in rows]
        triton_kernels.rope_store(qkv, cos, sin, q, keys, values, index(rows), index(slots), index(positions))
        return q, keys, values

    q, keys, values = run(list(range(m)))
    for rows in ([0], [3], [16, 17], list(range(17))):
        q_part, k_part, v_part = run(rows)
        for r in rows:
            slot, pos = r % 2, 100 + r
            assert torch.equal(q_part[r], q[r]), r
            assert torch.equal(k_part[slot, :, pos], keys[slot, :, pos]), r
            assert torch.equal(v_part[slot, :, pos], values[slot, :, pos]), r
    from llm_worker.model.ops_torch import TorchOps

    x = qkv.float()[:, : (HEADS + KV) * D].view(m, HEADS + KV, D)
    want = TorchOps._rotate(x.double(), cos[:, None].double(), sin[:, None].double())
    assert_close(q, want[:, :HEADS], torch.float32)
    r = torch.arange(m, device=DEVICE)
    assert_close(keys[r % 2, :, 100 + r], want[:, HEADS:], dtype)
    v = qkv[:, (HEADS + KV) * D :].view(m, KV, D)
    assert torch.equal(values[r % 2, :, 100 + r, :D], v)


def reference_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot: int, positions: list[int]
) -> torch.Tensor:
    """Softmax attention of q [heads, d] over ``positions`` of ``slot`` in float64: [heads · d]."""
    k = keys[slot, :, positions].double().repeat_interleave(HEADS // KV, 0)  # [heads, n, d]
    v = values[slot, :, positions, :D].double().repeat_interleave(HEADS // KV, 0)
    w = torch.softmax((k @ q.double()[:, :, None])[..., 0] / D**0.5, dim=-1)  # [heads, n]
    return (w[:, None] @ v)[:, 0].reshape(-1)


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: list[tuple[int, int, int, list[int]]],
    dtype: torch.dtype,
) -> torch.Tensor:
    """``triton_kernels.attention`` of (row, slot, start, visible new rows) each: [rows, heads · d]."""
    width = max(len(seen) for *_, seen in rows)
    news = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, (*_, seen) in enumerate(rows):
        news[i, : len(seen)] = torch.tensor(seen)
    out = torch.zeros(q.shape[0], HEADS * D, dtype=dtype, device=DEVICE)
    triton_kernels.attention(
        q,
        keys,
        values,
        out,
        index([r for r, *_ in rows]),
        index([s for _, s, *_ in rows]),
        index([start for _, _, start, _ in rows]),
        news.to(DEVICE),
        index([start + len(seen) for _, _, start, seen in rows]),
        D**-0.5,
    )
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rows_are_invariant_and_accurate_with_a_tree_and_pooled_requests(
    dtype: torch.dtype,
) -> None:
    """Rows of two requests in one call (slot 0: a tree after 70 committed keys, crossing a 64-key
    chunk; slot 1: a 3-row chain after 126), each against a float64 reference and bit for bit the
    same as in calls of 1 row and of other sizes."""
    keys, values = cache(dtype)
    q = rand(8, HEADS, D, seed=12)
    tree = tree_buffers((-1, 0, 1, -1))  # root → a → b, root → c: rows 0..4
    rows = [(r, 0, 70, tree.mask[r].nonzero()[:, 0].tolist()) for r in range(5)]
    rows += [(5 + r, 1, 126, list(range(r + 1))) for r in range(3)]
    whole = attend(q, keys, values, rows, dtype)
    for i, (row, slot, start, seen) in enumerate(rows):
        positions = list(range(start)) + [start + s for s in seen]
        assert_close(whole[row], reference_attention(q[row], keys, values, slot, positions), dtype)
        assert torch.equal(attend(q, keys, values, [rows[i]], dtype)[row], whole[row]), i
    for part in (rows[:3], rows[4:7], rows[::2]):
        got = attend(q, keys, values, part, dtype)
        for row, *_ in part:
            assert torch.equal(got[row], whole[row]), row


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tree_node_attends_as_the_token_decoded_alone_after_its_ancestors(dtype: torch.dtype) -> None:
    """Node b of root → a → b and root → c sits at cache position start + 3 behind its sibling
    branch; decoded alone its ancestors sit at start, start + 1 and it at start + 2: the same keys
    in the same order, so bit for bit the same result."""
    keys, values = cache(dtype)
    q = rand(1, HEADS, D, seed=13)
    start = 62  # the tree's keys straddle the 64-key chunk boundary
    in_tree = attend(q, keys, values, [(0, 0, start, [0, 1, 3])], dtype)  # c at row 2 is unseen
    alone_keys, alone_values = keys.clone(), values.clone()
    for depth, row in enumerate((0, 1, 3)):
        alone_keys[0, :, start + depth] = keys[0, :, start + row]
        alone_values[0, :, start + depth] = values[0, :, start + row]
    alone = attend(q, alone_keys, alone_values, [(0, 0, start + 2, [0])], dtype)
    assert torch.equal(in_tree, alone)


def test_visible_rows_lists_each_rows_ancestors_in_order() -> None:
    mask = tree_buffers((-1, -1, 0)).mask  # root → a, root → b, a → c
    rows, counts = ops_triton.visible_rows(mask)
    assert counts.tolist() == [1, 2, 2, 3]
    assert [rows[i, : int(c)].tolist() for i, c in enumerate(counts)] == [[0], [0, 1], [0, 2], [0, 1, 3]]


# -- whole forwards -------------------------------------------------------------------------------


def tiny_triton(dtype: torch.dtype) -> FastLlamaTarget:
    """A tiny random Llama (2 layers) on the Triton operations (``--ops triton``)."""
    model = tiny_model("llama", layers=2).to(DEVICE, dtype)
    cfg = ModelConfig(backend="fast", dtype=str(dtype)[6:], device=str(DEVICE), ops="triton")
    target = wrap_model(model, None, cfg)
    assert isinstance(target, FastLlamaTarget) and isinstance(target.ops, ops_triton.TritonOps)
    return target


def decoded_alone(
    target: FastLlamaTarget, prefix: SequenceState, length: int, tokens: list[int]
) -> list[torch.Tensor]:
    """Each of ``tokens`` decoded alone after the first ``length`` positions of ``prefix``'s
    cache (copied: no forward recomputes them): its logits [vocab]."""
    state = target.start()
    target.import_kv(state, *target.export_kv(prefix, 0, length))
    out = []
    for t in tokens:
        out.append(target.forward(state, torch.tensor([t]), None, NEEDS).logits[0])
        target.commit(state, [0])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_has_the_same_logits_alone_in_a_tree_and_beside_another_request(dtype: torch.dtype) -> None:
    """A prefill's rows, a tree's nodes (crossing a 64-key chunk) and the same tree beside another
    request's rows, each bit for bit the token decoded alone; and close to the torch operations."""
    target = tiny_triton(dtype)
    info = target.kernel_info()
    assert info["gemm_kernels"]["qkv"] == "triton:1" and info["kv_cache_dtype"] == str(dtype)[6:]
    assert target.kernel_variant.endswith("-triton-k64") and target.ops.describe()["ops"] == "triton"
    gen = torch.Generator().manual_seed(14)
    prefix = torch.randint(0, 96, (61,), generator=gen)
    toks = [11, 22, 33, 44, 55]  # root 11 → 22 → 33 → 44, and 55 a sibling of 22: keys 61..65
    with torch.inference_mode():
        state, other = target.start(), target.start()
        prefill = target.forward(state, prefix, None, NEEDS).logits
        target.commit(state, range(len(prefix)))
        target.forward(other, prefix[:9], None, NEEDS)
        target.commit(other, range(9))
        assert target.branching_rows_limit(state) is None
        for j in (1, 30, 60):  # row j of the prefill: token j decoded after the j before it
            assert torch.equal(prefill[j], decoded_alone(target, state, j, [int(prefix[j])])[0]), j
        tree = target.forward(state, torch.tensor(toks), tree_buffers((-1, 0, 1, -1)), NEEDS).logits
        together = target.forward_many(
            [
                ForwardCall(other, torch.tensor([5, 6]), None, NEEDS),
                ForwardCall(state, torch.tensor(toks), tree_buffers((-1, 0, 1, -1)), NEEDS),
            ]
        )[1].logits
        for path, rows in (([11, 22, 33, 44], [0, 1, 2, 3]), ([11, 55], [0, 4])):
            alone = decoded_alone(target, state, len(prefix), path)
            for step, row in enumerate(rows):
                assert torch.equal(tree[row], alone[step]), (path, row)
                assert torch.equal(together[row], alone[step]), (path, row)
    if DEVICE.type == "cpu":  # the same model on torch operations: the same function, other roundings
        torch_ops = FastLlamaTarget(target.model, target.info, "aten:1", ops="torch")
        with torch.inference_mode():
            want = torch_ops.forward(torch_ops.start(), prefix, None, NEEDS).logits
        assert_close(prefill, want, dtype if dtype == torch.float32 else torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_pld_and_a_tree_mode_equal_ar_on_the_triton_operations(dtype: torch.dtype) -> None:
    """Every token as ``ar``'s, with drafts proposed and accepted (a chain mode and a tree one)."""
    target = tiny_triton(dtype)
    engine = engine_for(target)
    tally = DraftTally()
    for prompt in prompts(96)[:2]:
        ref = engine.generate(GenerationRequest(tuple(prompt), 10, "ar")).token_ids
        for mode in ("pld", "recycle"):
            res = engine.generate(GenerationRequest(tuple(prompt), 10, mode))
            assert res.token_ids == ref, (mode, dtype)
            tally.observe(mode, res.stats)
    tally.assert_every_mode_drafted_and_accepted(str(dtype))


# -- compiled for a GPU ---------------------------------------------------------------------------

COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llm_worker.model import triton_jit as jit

FLOATS = ("eps", "scale")
INT32 = ("rows_ptr", "slots_ptr", "cache_ptr", "starts_ptr", "lengths_ptr", "news_ptr")

def build(kernel, dt, out, consts):  # pointers to dt; out and the queries to float32
    names = kernel.arg_names
    def kind(name):
        if name in consts:
            return "constexpr"
        if name in FLOATS:
            return "fp32"
        if name in INT32:
            return "*i32"
        if name in ("q_ptr", out):
            return "*fp32"
        return "*" + dt if name.endswith("_ptr") else "i32"
    source = ASTSource(kernel, {n: kind(n) for n in names}, {(names.index(k),): v for k, v in consts.items()})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    print(kernel.fn.__name__, dt, "mma" in ptx)

for dt in ("fp32", "bf16", "fp16"):
    gemm = dict(HAS_BIAS=True, PRECISION="ieee" if dt == "fp32" else None, BY_SUM=False, BM=32, BN=64, BK=64)
    build(jit.linear_kernel, dt, None, gemm)
    build(jit.linear_kernel, dt, "y_ptr", gemm)  # the logits: float32 out
    build(jit.rms_norm_kernel, dt, None, dict(HAS_DELTA=True, BLOCK=1024))
    build(jit.silu_mul_kernel, dt, None, dict(BLOCK=1024))
    rope = dict(HEADS=9, KV=3, D=64, HALF=32, HEADS_PAD=16, KV_PAD=4, HALF_PAD=32, D_PAD=64)
    build(jit.rope_store_kernel, dt, None, rope)
    build(jit.attention_kernel, dt, None, dict(GROUP=3, GROUP_PAD=16, D=64, D_PAD=64, BLOCK_N=64))
"""


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU the tests above compile and run them")
def test_every_kernel_compiles_for_an_h100(tmp_path: Path) -> None:
    """The kernels through Triton's whole compiler for an H100 (sm_90, PTX and its assembler; no
    GPU needed), in every dtype, at the default model's shapes (9 query heads, 3 KV heads of 64):
    what the interpreter cannot check (with this triton, not a GPU image's own). The 16-bit GEMMs
    run on the tensor cores (mma)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run(
        [sys.executable, "-c", COMPILE], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    assert len([line for line in lines if line]) == 18
    assert "linear_kernel bf16 True" in lines and "linear_kernel fp16 True" in lines


# -- choosing the operations ----------------------------------------------------------------------


def test_auto_picks_the_triton_operations_on_cuda_and_the_knob_picks_any() -> None:
    """``--ops auto`` on a CUDA device is TritonOps (the context alone decides: nothing is
    allocated); on CPU the fused kernels or torch; ``--ops`` names one."""
    base = wrap_model(tiny_model("llama", layers=1), None, ModelConfig(backend="fast", kernel="aten:1"))
    assert isinstance(base, FastLlamaTarget)
    cuda = OpsContext(base.info, torch.device("cuda"), torch.bfloat16, torch.bfloat16, 256)
    assert isinstance(_pick_ops(None, True, cuda), ops_triton.TritonOps)
    assert base.ops.name in ("cpu-fused", "torch")
    # the kernels run on CPU tensors under the interpreter only (on a GPU machine the knob's
    # Triton operations are checked on the CUDA model, tests/test_cuda.py)
    knobs = (("torch", "torch"),) if DEVICE.type == "cuda" else (("torch", "torch"), ("triton", "triton"))
    for knob, name in knobs:
        cfg = ModelConfig(backend="fast", kernel="aten:1" if knob == "torch" else "auto", ops=knob)
        target = wrap_model(tiny_model("llama", layers=1), None, cfg)
        assert isinstance(target, FastLlamaTarget) and target.ops.name == name


def test_a_cpu_worker_never_imports_the_kernels() -> None:
    """Our modules import no triton (it takes seconds), and a CPU target with the default
    operations never imports the kernels. (Building a transformers model imports triton anyway
    where it is installed: torch's compiler probes for it.)"""
    code = (
        "import sys\n"
        "sys.path.insert(0, 'tests')\n"
        "import client.cli, llm_worker.model.fast_llama\n"
        "from llm_worker.config import ModelConfig\n"
        "from llm_worker.model import wrap_model\n"
        "print('triton' in sys.modules)\n"
        "from helpers.models import tiny_model\n"
        "wrap_model(tiny_model('llama', layers=1), None, ModelConfig(backend='fast', kernel='aten:1'))\n"
        "print('llm_worker.model.triton_jit' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out.stderr
