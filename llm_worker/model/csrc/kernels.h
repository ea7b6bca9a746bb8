// Fused, row-invariant CPU kernels for the fast forward (llm_worker/model/native.py,
// llm_worker/model/ops_cpu.py): the operations bindings.cpp exposes, one source file each.
//
// Every kernel computes each output row with the same sequence of floating-point operations,
// whatever the number of rows, the row's place in the tensor, or how the rows are split between
// threads: reductions run in one fixed order per row (never split across threads or re-blocked
// by size), elementwise work pads its tail to a full vector and runs the same vector code on it.
// So a token's numbers do not depend on what else is in its forward (batch invariance).
//
// AVX2 + FMA, 8 float lanes, with AVX-512 versions of the attention and the packed GEMM where the
// processor has it; built with -ffp-contract=off so that only the FMAs written here are fused.
// Tensors in float32 or bfloat16 (converted to float32 on load, rounded to nearest even on store,
// as torch does); RoPE tables and attention's arithmetic run in float32, over a KV cache held in
// float32 or bfloat16 (widened exactly as it is read).
//
// Files: vec.h (vector helpers), pool.h / pool.cpp (the thread pool and ``for_rows``), tensors.h
// (argument checks, dtype dispatch), features.cpp (AVX-512, AVX512-BF16), norm.cpp (residual add +
// RMSNorm), activation.cpp (SiLU·up), rope.cpp (RoPE + the cache write), attention.cpp,
// gemm.h + quant_gemm.cpp (the GEMM over exactly quantised weights), bf16_gemm.cpp (the GEMM over
// bfloat16 weights), bindings.cpp (the Python module).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace specdraft {

// norm.cpp: (h + delta, rms_norm(h + delta) * weight); without delta, (h, rms_norm(h) * weight).
std::vector<torch::Tensor> add_rms_norm(
    torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps);

// activation.cpp: gate_up [n, 2 I] (gate, then up) -> silu(gate) * up [n, I].
torch::Tensor silu_mul(torch::Tensor gate_up);

// rope.cpp: rotated queries into q, rotated keys and the values into the cache.
void rope_store(
    torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor q, torch::Tensor keys,
    torch::Tensor values, torch::Tensor rows, torch::Tensor slot, torch::Tensor cache_pos);

// attention.cpp: softmax attention of query rows over their visible cached keys (a shared prefix
// read from another slot that holds the same bytes: ``source``, ``shared``).
void attention(
    torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor rows, torch::Tensor slot,
    torch::Tensor start, torch::Tensor visible, double scale, torch::Tensor out,
    c10::optional<torch::Tensor> source, c10::optional<torch::Tensor> shared);

// logits.cpp: each row's k largest entries (largest first, ties by index; a row with a NaN all
// -1), and a row's softmax's largest probability (NaN for a NaN or no finite entry).
torch::Tensor top_k_rows(torch::Tensor x, int64_t k);
double top_probability(torch::Tensor row);

// quant_gemm.cpp: x [M, K] float32 @ the packed weight^T (+ bias) -> [M, N] float32.
torch::Tensor quant_linear(
    torch::Tensor x, torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> offsets,
    c10::optional<torch::Tensor> bias, int64_t n);

// bf16_gemm.cpp: x [M, K] bfloat16 @ the packed weight^T (+ float32 bias) -> [M, N] bfloat16.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n);

// features.cpp: whether the AVX-512 variants run here; whether the bfloat16 GEMM (AVX512-BF16) does.
bool has_avx512();
bool has_bf16_dot();

// pool.cpp: the number of threads the kernels share their rows between; whether this thread's
// kernels share rows on the pool (or on torch's OpenMP threads).
void configure(int64_t threads);
void use_pool(bool yes);

}  // namespace specdraft
