"""The fused CPU kernels (llm_worker/model/native.py, csrc/) against plain torch
references, and the row invariance they promise: a row's result alone equals it inside 2, 4, 9,
17, 33 and 65 rows, at the first, middle and last place, in float32 and bfloat16."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from llm_worker.model import native

SIZES = (2, 4, 9, 17, 33, 65)
DTYPES = (torch.float32, torch.bfloat16)


def places(n: int) -> list[int]:
    return sorted({0, n // 2, n - 1})


def rms_reference(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm."""
    x = h.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 64, 13])  # a tail of 5 lanes in the last
def test_add_rms_norm_matches_torch_and_is_row_invariant(
    fused: ModuleType, dtype: torch.dtype, width: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    h = (3 * torch.randn(max(SIZES), width, generator=gen)).to(dtype)
    delta = torch.randn(max(SIZES), width, generator=gen).to(dtype)
    w = torch.randn(width, generator=gen).to(dtype)
    total, normed = fused.add_rms_norm(h, delta, w, 1e-5)
    assert torch.equal(total, h + delta)  # the add is exact: one rounding, as torch's
    torch.testing.assert_close(
        normed, rms_reference(h + delta, w, 1e-5), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5
    )
    same, normed_alone = fused.add_rms_norm(h, None, w, 1e-5)
    assert same is h
    torch.testing.assert_close(
        normed_alone, rms_reference(h, w, 1e-5), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5
    )
    for n in SIZES:
        _, out = fused.add_rms_norm(h[:n].clone(), delta[:n].clone(), w, 1e-5)
        for i in places(n):
            _, alone = fused.add_rms_norm(h[i : i + 1].clone(), delta[i : i + 1].clone(), w, 1e-5)
            assert torch.equal(out[i], alone[0]), (n, i)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 12])
def test_silu_mul_matches_torch_and_is_row_invariant(
    fused: ModuleType, dtype: torch.dtype, width: int
) -> None:
    gen = torch.Generator().manual_seed(1)
    gate_up = (4 * torch.randn(max(SIZES), 2 * width, generator=gen)).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    out = fused.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(
        out, F.silu(gate) * up, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6
    )
    for n in SIZES:
        out = fused.silu_mul(gate_up[:n].clone())
        for i in places(n):
            assert torch.equal(out[i], fused.silu_mul(gate_up[i : i + 1].clone())[0]), (n, i)


HEADS, KV, D = 6, 2, 16


def cache(slots: int, capacity: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(slots, KV, capacity, D, generator=gen)
    values = torch.cat(
        (torch.randn(slots, KV, capacity, D, generator=gen), torch.ones(slots, KV, capacity, 1)), -1
    )
    return keys, values


def long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_rotates_and_writes_the_cache(fused: ModuleType, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    n = 5
    qkv = torch.randn(n, (HEADS + 2 * KV) * D, generator=gen).to(dtype)
    cos, sin = torch.randn(n, D, generator=gen), torch.randn(n, D, generator=gen)
    keys, values = cache(3, 64, 3)
    before_keys, before_values = keys.clone(), values.clone()
    q = torch.empty(n, HEADS, D)
    rows, slots, where = long([0, 1, 2, 3, 4]), long([2, 2, 0, 0, 0]), long([7, 8, 30, 31, 32])
    fused.rope_store(qkv, cos, sin, q, keys, values, rows, slots, where)

    def rotate(x: torch.Tensor) -> torch.Tensor:  # [n, h, D]
        swapped = x.view(n, -1, 2, D // 2).flip(2).reshape(n, -1, D)
        return x * cos[:, None] + swapped * sin[:, None]

    x = qkv.float()
    torch.testing.assert_close(q, rotate(x[:, : HEADS * D].view(n, HEADS, D)))
    k = rotate(x[:, HEADS * D : (HEADS + KV) * D].view(n, KV, D))
    v = x[:, (HEADS + KV) * D :].view(n, KV, D)
    for r in range(n):
        torch.testing.assert_close(keys[slots[r], :, where[r]], k[r])
        assert torch.equal(values[slots[r], :, where[r], :D], v[r])
        keys[slots[r], :, where[r]] = before_keys[slots[r], :, where[r]]
        values[slots[r], :, where[r]] = before_values[slots[r], :, where[r]]
    assert torch.equal(keys, before_keys) and torch.equal(values, before_values)  # nothing else written
    with pytest.raises(RuntimeError, match="out of range"):
        fused.rope_store(qkv, cos, sin, q, keys, values, rows, slots, long([7, 8, 30, 31, 64]))


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [24, 40, 8])  # halves of 12, 20 and 4: not whole vectors of 8
def test_rope_store_rotates_heads_whose_half_is_not_whole_vectors(
    fused: ModuleType, head_dim: int, cache_dtype: torch.dtype
) -> None:
    """Each half of a head rotates with its own partners up to its last lane, and nothing past a
    head is read or written: every query and key equals torch's rotation of the same row."""
    gen = torch.Generator().manual_seed(4)
    n, heads, kv, d = 3, 3, 1, head_dim
    qkv = torch.randn(n, (heads + 2 * kv) * d, generator=gen)
    cos, sin = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    keys = torch.zeros(2, kv, 8, d, dtype=cache_dtype)
    values = torch.zeros(2, kv, 8, d + 1, dtype=cache_dtype)
    q = torch.full((n, heads, d), float("nan"))
    fused.rope_store(qkv, cos, sin, q, keys, values, long([0, 1, 2]), long([1, 1, 0]), long([0, 1, 5]))
    x = qkv.view(n, heads + 2 * kv, d)
    swapped = x.view(n, -1, 2, d // 2).flip(2).reshape(n, -1, d)
    rotated = x * cos[:, None] + swapped * sin[:, None]  # [n, heads + 2 kv, d]
    torch.testing.assert_close(q, rotated[:, :heads])
    for r, (slot, at) in enumerate(((1, 0), (1, 1), (0, 5))):
        want = rotated[r, heads : heads + kv].to(cache_dtype)
        torch.testing.assert_close(
            keys[slot, :, at], want, atol=1e-5, rtol=1e-2 if cache_dtype != torch.float32 else 1e-5
        )
        assert torch.equal(values[slot, :, at, :d], x[r, heads + kv :].to(cache_dtype))
        keys[slot, :, at] = 0
        values[slot, :, at, :d] = 0
    assert not keys.any() and not values.any()  # nothing else written


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_into_a_bfloat16_cache_rounds_the_float32_keys(
    fused: ModuleType, dtype: torch.dtype
) -> None:
    """A bfloat16 cache holds what a float32 one would, rounded to nearest even (keys after RoPE;
    values exact from bfloat16 qkv); the queries do not change."""
    gen = torch.Generator().manual_seed(3)
    n = 4
    qkv = torch.randn(n, (HEADS + 2 * KV) * D, generator=gen).to(dtype)
    cos, sin = torch.randn(n, D, generator=gen), torch.randn(n, D, generator=gen)
    rows, slots, where = long([0, 1, 2, 3]), long([1, 1, 0, 1]), long([2, 3, 9, 4])
    written = []
    for cache_dtype in (torch.float32, torch.bfloat16):
        keys, values = (t.bfloat16().to(cache_dtype) for t in cache(2, 16, 3))  # equal before
        q = torch.empty(n, HEADS, D)
        fused.rope_store(qkv, cos, sin, q, keys, values, rows, slots, where)
        written.append((q, keys, values))
    (q32, k32, v32), (q16, k16, v16) = written
    assert torch.equal(q32, q16)
    assert torch.equal(k32.bfloat16(), k16) and torch.equal(v32.bfloat16(), v16)
    if dtype == torch.bfloat16:
        assert torch.equal(v32, v16.float())  # bfloat16 values lose nothing


@pytest.mark.parametrize("head_dim", [16, 64])  # 64: the value sums' several-heads path
def test_attention_over_a_bfloat16_cache_is_attention_over_its_float32_copy(
    fused: ModuleType, head_dim: int
) -> None:
    """bfloat16 keys and values are widened exactly as they are read: the same bits as the float32
    kernel on the cache's float32 copy, for decode rows, a prefill chunk, a tree and several slots."""
    heads, kv, capacity = 9, 3, 320
    gen = torch.Generator().manual_seed(11)
    keys = torch.randn(3, kv, capacity, head_dim, generator=gen).bfloat16()
    values = torch.randn(3, kv, capacity, head_dim + 1, generator=gen).bfloat16()
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    cases = {  # name: (slot of each row, committed length of each row, visible new rows)
        "decode rows of three slots": ([0, 1, 2], [7, 250, 300], torch.ones(3, 1, dtype=torch.bool)),
        "prefill chunk": ([1] * 40, [200] * 40, chain(40)),
        "tree": ([2] * 4, [130] * 4, tree),
    }
    for name, (slots, starts, visible) in cases.items():
        m = len(slots)
        q = torch.randn(m, heads, head_dim, generator=gen)
        outs = []
        for k, v in ((keys, values), (keys.float(), values.float())):
            out = torch.empty(m, heads * head_dim)
            fused.attention(q, k, v, long(list(range(m))), long(slots), long(starts), visible, 0.125, out)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), name
    with pytest.raises(RuntimeError, match="one dtype"):
        fused.attention(q, keys, values.float(), long([0]), long([0]), long([3]), chain(1), 0.125, out[:1])


@pytest.mark.parametrize("head_dim", [16, 24, 64])  # 64: the grouped value sums; 24: the 8-lane path
@pytest.mark.parametrize("dtype", DTYPES)  # the cache's
def test_attention_reads_a_shared_prefix_from_another_slot_with_the_same_bits(
    fused: ModuleType, head_dim: int, dtype: torch.dtype
) -> None:
    """Rows that read cache positions [0, shared) from another slot holding the same bytes get the
    bits their own copy gives: decode rows of several slots, a tree, a prefill chunk, prefixes that
    end on and off the kernel's blocks of 8 and 64 keys. And they read exactly there: a change to the
    copy's last shared key or value changes every row, one just past it none."""
    heads, kv, capacity = 9, 3, 320
    gen = torch.Generator().manual_seed(13)
    keys = torch.randn(4, kv, capacity, head_dim, generator=gen).to(dtype)
    values = torch.randn(4, kv, capacity, head_dim + 1, generator=gen).to(dtype)
    keys[1:, :, :200], values[1:, :, :200] = keys[0, :, :200], values[0, :, :200]  # one prompt's 200 tokens
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    cases = {  # name: (slot, committed length, shared length of each row, visible new rows)
        "decode rows of three slots": (
            [1, 2, 3],
            [230, 250, 300],
            [200, 200, 64],
            torch.ones(3, 1, dtype=torch.bool),
        ),
        "a tree": ([2] * 4, [210] * 4, [37] * 4, tree),
        "a prefill chunk": ([3] * 40, [200] * 40, [200] * 40, chain(40)),
        "a prefill chunk sharing a prefix off the blocks": ([1] * 40, [200] * 40, [37] * 40, chain(40)),
        "mixed": (
            [1, 2, 2, 2, 2, 3],
            [201, 130, 130, 130, 130, 199],
            [129, 65, 65, 65, 65, 8],
            torch.cat((torch.ones(1, 4, dtype=torch.bool), tree, torch.ones(1, 4, dtype=torch.bool))),
        ),
    }
    for name, (slots, starts, shared, visible) in cases.items():
        m = len(slots)
        q = torch.randn(m, heads, head_dim, generator=gen)
        call = (q, keys, values, long(list(range(m))), long(slots), long(starts), visible, 0.125)

        def run(call: tuple[Any, ...], source: list[int] | None, length: list[int] | None) -> torch.Tensor:
            out = torch.empty(call[0].shape[0], heads * head_dim)
            fused.attention(
                *call, out, None if source is None else long(source), None if length is None else long(length)
            )
            return out

        own = run(call, None, None)
        assert torch.equal(run(call, [0] * m, shared), own), name
        assert torch.equal(run(call, slots, [0] * m), own), name  # nothing shared: the same call
        # slot 0's copy changed at a row's last shared position, or just past it: exactly the rows
        # whose shared prefix covers that position see it, through the keys and through the values
        for cache in (keys, values):
            for p in sorted({length + offset for length in shared for offset in (-1, 0)}):
                saved = cache[0, :, p].clone()
                cache[0, :, p] += 1.0
                changed = run(call, [0] * m, shared)
                cache[0, :, p] = saved
                rows_changed = [not torch.equal(changed[j], own[j]) for j in range(m)]
                assert rows_changed == [p < length for length in shared], (name, p)
    q = torch.randn(2, heads, head_dim)
    out = torch.empty(2, heads * head_dim)
    args = (
        q,
        keys,
        values,
        long([0, 1]),
        long([1, 2]),
        long([50, 50]),
        torch.ones(2, 1, dtype=torch.bool),
        0.1,
        out,
    )
    with pytest.raises(RuntimeError, match="out of range"):  # a shared prefix past the committed length
        fused.attention(*args, long([0, 0]), long([51, 10]))
    with pytest.raises(RuntimeError, match="out of range"):
        fused.attention(*args, long([0, 4]), long([10, 10]))
    with pytest.raises(RuntimeError, match="both or neither"):
        fused.attention(*args, long([0, 0]), None)


def attention_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, visible: torch.Tensor
) -> torch.Tensor:
    """q [n, H, D]; keys/values [KV, capacity, ...] of one slot; row i sees [0, start) and the new
    rows visible[i] → [n, H · D] (float64 softmax attention)."""
    n, width = visible.shape
    mask = torch.zeros(n, start + width, dtype=torch.bool)
    mask[:, :start] = True
    mask[:, start:] = visible
    k = keys[:, : start + width].double().repeat_interleave(HEADS // KV, 0)  # [H, T, D]
    v = values[:, : start + width, :D].double().repeat_interleave(HEADS // KV, 0)
    scores = torch.einsum("nhd,htd->nht", q.double(), k) / math.sqrt(D)
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("nht,htd->nhd", scores.softmax(-1), v).reshape(n, HEADS * D)


def chain(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start", [0, 3, 250, 300])
def test_attention_matches_softmax_and_is_row_invariant(
    fused: ModuleType, dtype: torch.dtype, start: int
) -> None:
    keys, values = cache(2, 512, 4)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(max(SIZES), HEADS, D, generator=gen)
    scale = 1 / math.sqrt(D)

    def run(rows: list[int], qs: torch.Tensor, begin: int, visible: torch.Tensor) -> torch.Tensor:
        out = torch.empty(qs.shape[0], HEADS * D, dtype=dtype)
        m = len(rows)
        fused.attention(qs, keys, values, long(rows), long([1] * m), long([begin] * m), visible, scale, out)
        return out

    for n in SIZES:
        out = run(list(range(n)), q[:n], start, chain(n))
        expected = attention_reference(q[:n], keys[1], values[1], start, chain(n)).to(dtype)
        torch.testing.assert_close(out, expected, rtol=1e-4 if dtype == torch.float32 else 1e-2, atol=1e-5)
        for i in places(n):  # the row decoded alone: start + i keys committed, itself the new row
            alone = run([0], q[i : i + 1].clone(), start + i, torch.ones(1, 1, dtype=torch.bool))
            assert torch.equal(out[i], alone[0]), (n, i)


def test_attention_skips_keys_a_row_does_not_see(fused: ModuleType) -> None:
    """Tree rows: a node's siblings' keys between its ancestors' change nothing, and rows of other
    slots in the same call change nothing."""
    keys, values = cache(3, 64, 6)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(4, HEADS, D, generator=gen)
    # root (row 0) → row 2 → row 3; row 1 a sibling of row 2. Keys of rows at 20 + row.
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    out = torch.empty(4, HEADS * D)
    fused.attention(q, keys, values, long([0, 1, 2, 3]), long([0] * 4), long([20] * 4), tree, 0.25, out)
    # row 3 as a chain: keys 0..19, then the root, row 2 and itself moved next to each other
    moved_keys, moved_values = keys.clone(), values.clone()
    for dest, src in ((21, 22), (22, 23)):
        moved_keys[0, :, dest], moved_values[0, :, dest] = keys[0, :, src], values[0, :, src]
    alone = torch.empty(1, HEADS * D)
    fused.attention(
        q[3:4].clone(),
        moved_keys,
        moved_values,
        long([0]),
        long([0]),
        long([22]),
        torch.ones(1, 1, dtype=torch.bool),
        0.25,
        alone,
    )
    assert torch.equal(out[3], alone[0])
    # the same rows in slot 2, beside rows of slot 1 in one call
    keys[2], values[2] = keys[0], values[0]
    mixed = torch.empty(8, HEADS * D)
    rows = long([0, 1, 2, 3, 4, 5, 6, 7])
    visible = torch.cat((tree, chain(4)))
    fused.attention(
        torch.cat((q, q)),
        keys,
        values,
        rows,
        long([2] * 4 + [1] * 4),
        long([20] * 4 + [9] * 4),
        visible,
        0.25,
        mixed,
    )
    assert torch.equal(mixed[:4], out)


def test_bad_arguments_are_errors_not_crashes(fused: ModuleType) -> None:
    keys, values = cache(1, 32, 8)
    q = torch.randn(2, HEADS, D)
    out = torch.empty(2, HEADS * D)
    with pytest.raises(RuntimeError, match="out of range"):  # the new rows would pass the capacity
        fused.attention(q, keys, values, long([0, 1]), long([0, 0]), long([31, 31]), chain(2), 0.25, out)
    with pytest.raises(RuntimeError, match="out of range"):
        fused.attention(q, keys, values, long([0, 1]), long([0, 1]), long([3, 3]), chain(2), 0.25, out)
    with pytest.raises(RuntimeError):
        fused.silu_mul(torch.randn(2, 3))


def test_unavailable_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDRAFT_NATIVE", "0")
    assert native.unavailable_reason() == "turned off by SPECDRAFT_NATIVE=0"


def test_kernels_called_from_many_threads_at_once_give_the_same_rows(fused: ModuleType) -> None:
    """The kernels' own thread pool serves one call at a time; a call from another thread meanwhile
    runs its rows itself: the same numbers either way, on the pool or on torch's threads."""
    from concurrent.futures import ThreadPoolExecutor

    gen = torch.Generator().manual_seed(9)
    gate_up = torch.randn(257, 2 * 1536, generator=gen)
    expected = fused.silu_mul(gate_up)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: fused.silu_mul(gate_up), range(16)))
    assert all(torch.equal(r, expected) for r in results)
    fused.use_pool(False)  # this thread: torch's OpenMP threads
    try:
        assert torch.equal(fused.silu_mul(gate_up), expected)
    finally:
        fused.use_pool(True)


def test_a_forked_child_makes_its_own_pool(fused: ModuleType) -> None:
    """fork() copies no worker threads: the child's first call must not wait for them. (The child
    runs only the kernel: torch's own OpenMP operations are not fork-safe once the parent used
    them.)"""
    import os
    import time

    gate_up = torch.randn(257, 2 * 1536, generator=torch.Generator().manual_seed(10))
    expected = fused.silu_mul(gate_up).numpy().tobytes()  # the parent's pool exists now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            os.write(write, b"ok" if fused.silu_mul(gate_up).numpy().tobytes() == expected else b"no")
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):  # still running
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    answer = os.read(read, 2)
    os.close(read)
    assert answer == b"ok", "the forked child's kernel call hung or differed"


def test_the_avx2_kernels_pass_these_tests_too(fused: ModuleType) -> None:
    """Where the processor has AVX-512, the kernels use it; the AVX2 versions (what an AVX2-only
    processor runs) are checked here in a process kept on them."""
    import os
    import subprocess
    import sys

    if not fused.wide():
        pytest.skip("no AVX-512 here: the tests above ran the AVX2 kernels")
    env = os.environ | {"SPECDRAFT_NATIVE_AVX512": "0"}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not avx2"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
