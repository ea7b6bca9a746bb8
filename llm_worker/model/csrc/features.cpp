// What the processor can run: the AVX-512 and AVX512-BF16 variants (and the variables that turn
// them off for tests and comparisons).
#include <cstdlib>
#include <string>

#include "kernels.h"
#include "vec.h"

namespace specdraft {

namespace {

// Whether the environment variable ``name`` is "0" (a variant turned off, for tests and comparisons).
bool turned_off(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && std::string(value) == "0";
}

}  // namespace

// Whether the AVX-512 variants run (SPECDRAFT_NATIVE_AVX512=0 keeps AVX2: tests compare the two).
bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
      && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
      && !turned_off("SPECDRAFT_NATIVE_AVX512");
  return yes;
}

// Whether the bfloat16 GEMM runs (AVX512-BF16; SPECDRAFT_NATIVE_BF16=0 turns it off).
bool has_bf16_dot() {
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512bf16")
      && !turned_off("SPECDRAFT_NATIVE_BF16");
  return yes;
}

}  // namespace specdraft
