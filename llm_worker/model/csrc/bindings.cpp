// The Python module of the fused kernels (llm_worker/model/native.py): one entry per operation.
#include <torch/extension.h>

#include "kernels.h"

using namespace specdraft;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "(h + delta, rms_norm(h + delta) * weight)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [n, 2 I]");
  m.def("rope_store", &rope_store, "RoPE of queries and keys; keys and values into the cache");
  m.def("attention", &attention, "row-invariant softmax attention over visible cached keys",
      py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("rows"), py::arg("slot"), py::arg("start"),
      py::arg("visible"), py::arg("scale"), py::arg("out"), py::arg("source") = py::none(),
      py::arg("shared") = py::none());
  m.def("top_k_rows", &top_k_rows, "each row's k largest entries, largest first, ties by index");
  m.def("top_probability", &top_probability, "a logits row's softmax's largest probability");
  m.def("quant_linear", &quant_linear, "x @ W^T (+ bias) with W packed as exact 4- or 8-bit blocks");
  m.def("bf16_linear", &bf16_linear, "x @ W^T (+ bias), bfloat16, W packed [P, K / 2, 16, 2] (AVX512-BF16)");
  m.def("wide", &has_avx512, "whether the AVX-512 variants run here");
  m.def("bf16_dot", &has_bf16_dot, "whether the bfloat16 GEMM (AVX512-BF16) runs here");
  m.def("configure", &configure, "the number of threads the fused kernels share their rows between");
  m.def("use_pool", &use_pool, "this thread's kernels share rows on the pool (or on torch's OpenMP threads)");
}
