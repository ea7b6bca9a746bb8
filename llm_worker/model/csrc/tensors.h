// Checks of the kernels' tensor arguments, and dispatch on their dtype (float32 or bfloat16).
#pragma once

#include <torch/extension.h>

#include <type_traits>

#include "vec.h"

namespace specdraft {

static inline void check_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// f(pointer to t's data) with the pointer typed float* or BF16* by t's dtype.
template <typename F>
static inline void with_data(const torch::Tensor& t, const char* name, const F& f) {
  if (t.scalar_type() == at::kFloat) {
    f(t.data_ptr<float>());
  } else {
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16");
    f(t.data_ptr<BF16>());
  }
}

// f(keys' data, values' data), typed float* or BF16* by the cache's dtype (one for both).
template <typename F>
static inline void with_cache(const torch::Tensor& keys, const torch::Tensor& values, const F& f) {
  TORCH_CHECK(keys.scalar_type() == values.scalar_type(), "keys and values of one dtype");
  with_data(keys, "keys", [&](auto* kp) { f(kp, values.data_ptr<std::remove_pointer_t<decltype(kp)>>()); });
}

// A GEMM's optional bias: [N] float32 (nullptr: none).
static inline const float* bias_data(const c10::optional<torch::Tensor>& bias, int64_t n) {
  if (!bias.has_value()) return nullptr;
  check_cpu(*bias, "bias");
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() >= n, "bias [N] float32");
  return bias->data_ptr<float>();
}

}  // namespace specdraft
