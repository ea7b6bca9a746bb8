// The GEMM over exactly quantised weights (``quant_linear``).

#include <vector>

#include "gemm.h"
#include "kernels.h"
#include "pool.h"
#include "tensors.h"
#include "vec.h"

namespace specdraft {

namespace {

// ---- GEMM over exactly quantised weights -------------------------------------------------------
//
// A weight [N, K] (output row n, inputs k) each of whose blocks of 32 inputs of a row is exactly
// scale * q + offset with q in 0..15 and a float16 scale and offset (GGUF's Q4_1), or scale * q
// with q in -128..127 (Q8_0), in panels of 16 output columns:
//   4-bit: codes [P, K, 8] uint8, byte j of input k of panel p holding column j (low nibble) and
//          column j + 8 (high nibble); scales and offsets [P, K / 32, 16] float32;
//   8-bit: codes [P, K, 16] int8; scales [P, K / 32, 16].
// The weight is rebuilt exactly: scale * q needs at most 11 + 8 significant bits, so it is exact in
// float32 and fma(scale, q, offset) rounds once, as the de-quantised float32 weight did. Each
// output is one chain y = fma(x[k], w[k], y) over k = 0 .. K - 1 from 0, whatever the number of
// rows and however they are blocked: row-invariant by construction. Reads 0.75 (4-bit) or 1.1
// (8-bit) bytes per weight instead of 4.

constexpr int64_t kPanel = 16;
constexpr int64_t kBlock = 32;


struct Codes4 {
  const uint8_t* codes;
  const float* scales;
  const float* offsets;
  // The panel's 16 weights at input k (block b = k / 32): w0 columns 0..7, w1 columns 8..15.
  inline void at(int64_t p, int64_t kb_count, int64_t k, __m256& w0, __m256& w1) const {
    const int64_t K = kb_count * kBlock;
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + (p * K + k) * 8)));
    const float* s = scales + (p * kb_count + k / kBlock) * kPanel;
    const float* o = offsets + (p * kb_count + k / kBlock) * kPanel;
    w0 = _mm256_fmadd_ps(_mm256_loadu_ps(s), _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))), _mm256_loadu_ps(o));
    w1 = _mm256_fmadd_ps(_mm256_loadu_ps(s + 8), _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), _mm256_loadu_ps(o + 8));
  }
  // A block's scales and offsets for the 16 columns of panel p (block kb), in registers.
  struct Block16 {
    __m512 s, o;
  };
  SPECDRAFT_AVX512 inline Block16 block16(int64_t p, int64_t kb_count, int64_t kb) const {
    const int64_t at = (p * kb_count + kb) * kPanel;
    return {_mm512_loadu_ps(scales + at), _mm512_loadu_ps(offsets + at)};
  }
  // The same 16 weights as ``at`` in one 16-lane vector (lanes 0..7 the low nibbles, 8..15 the
  // high ones), input k of panel p (K inputs) in block b.
  SPECDRAFT_AVX512 inline __m512 at16(const Block16& b, int64_t p, int64_t K, int64_t k) const {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + (p * K + k) * 8));
    __m512i v = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(bytes, bytes));
    v = _mm512_and_si512(_mm512_srlv_epi32(v, _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0)),
        _mm512_set1_epi32(15));
    return _mm512_fmadd_ps(b.s, _mm512_cvtepi32_ps(v), b.o);
  }
};

struct Codes8 {
  const int8_t* codes;
  const float* scales;
  inline void at(int64_t p, int64_t kb_count, int64_t k, __m256& w0, __m256& w1) const {
    const int64_t K = kb_count * kBlock;
    const int8_t* c = codes + (p * K + k) * kPanel;
    const float* s = scales + (p * kb_count + k / kBlock) * kPanel;
    w0 = _mm256_mul_ps(_mm256_loadu_ps(s), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)))));
    w1 = _mm256_mul_ps(_mm256_loadu_ps(s + 8), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8)))));
  }
  struct Block16 {
    __m512 s;
  };
  SPECDRAFT_AVX512 inline Block16 block16(int64_t p, int64_t kb_count, int64_t kb) const {
    return {_mm512_loadu_ps(scales + (p * kb_count + kb) * kPanel)};
  }
  SPECDRAFT_AVX512 inline __m512 at16(const Block16& b, int64_t p, int64_t K, int64_t k) const {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (p * K + k) * kPanel));
    return _mm512_mul_ps(b.s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
  }
};

// R rows x one panel from de-quantised weights w [K, 16]: acc[r] = chain over k of x[r, k] w[k].
template <int R>
inline void rows_panel(const float* x, int64_t ldx, const float* w, int64_t K, __m256* acc) {
  for (int r = 0; r < 2 * R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * kPanel), w1 = _mm256_loadu_ps(w + k * kPanel + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      acc[2 * r] = _mm256_fmadd_ps(xb, w0, acc[2 * r]);
      acc[2 * r + 1] = _mm256_fmadd_ps(xb, w1, acc[2 * r + 1]);
    }
  }
}

inline void store_panel(const __m256* acc, float* y, int64_t columns, const float* bias) {
  alignas(32) float out[kPanel];
  _mm256_store_ps(out, acc[0]);
  _mm256_store_ps(out + 8, acc[1]);
  for (int64_t j = 0; j < columns; ++j) y[j] = bias ? out[j] + bias[j] : out[j];
}

// R rows x G panels at once, weights de-quantised as they stream by (each once for the R rows;
// G panels give 2 G independent chains a row to keep the FMA units busy).
template <class Codes, int R, int G>
inline void rows_panels(const Codes& c, const float* x, int64_t ldx, int64_t p0, int64_t kb_count, __m256* acc) {
  for (int i = 0; i < 2 * R * G; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t K = kb_count * kBlock;
  for (int64_t k = 0; k < K; ++k) {
    for (int g = 0; g < G; ++g) {
      __m256 w0, w1;
      c.at(p0 + g, kb_count, k, w0, w1);
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
        acc[(r * G + g) * 2] = _mm256_fmadd_ps(xb, w0, acc[(r * G + g) * 2]);
        acc[(r * G + g) * 2 + 1] = _mm256_fmadd_ps(xb, w1, acc[(r * G + g) * 2 + 1]);
      }
    }
  }
}

// rows_panels for R rows (1..3) and the panels p0 .. p1 - 1 (at most 2), stored into y.
template <class Codes, int R>
inline void few_rows(const Codes& c, const float* x, int64_t K, int64_t p0, int64_t p1, int64_t N,
    const float* bias, float* y) {
  const int64_t kb_count = K / kBlock;
  __m256 acc[2 * R * 2];
  const int G = static_cast<int>(p1 - p0);
  if (G == 2) {
    rows_panels<Codes, R, 2>(c, x, K, p0, kb_count, acc);
  } else {
    rows_panels<Codes, R, 1>(c, x, K, p0, kb_count, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      const int64_t p = p0 + g;
      store_panel(acc + (r * G + g) * 2, y + r * N + p * kPanel, std::min(kPanel, N - p * kPanel),
          bias ? bias + p * kPanel : nullptr);
    }
}

SPECDRAFT_AVX512 inline void store_panel16(__m512 acc, float* y, int64_t columns, const float* bias) {
  alignas(64) float out[kPanel];
  _mm512_store_ps(out, acc);
  for (int64_t j = 0; j < columns; ++j) y[j] = bias ? out[j] + bias[j] : out[j];
}

template <class Codes, int R, int G>
SPECDRAFT_AVX512 inline void rows_panels16(const Codes& c, const float* x, int64_t ldx, int64_t p0, int64_t kb_count, __m512* acc) {
  for (int i = 0; i < R * G; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t K = kb_count * kBlock;
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    typename Codes::Block16 blocks[G];
    for (int g = 0; g < G; ++g) blocks[g] = c.block16(p0 + g, kb_count, kb);
    for (int64_t k = kb * kBlock; k < (kb + 1) * kBlock; ++k) {
      for (int g = 0; g < G; ++g) {
        const __m512 w = c.at16(blocks[g], p0 + g, K, k);
        for (int r = 0; r < R; ++r) acc[r * G + g] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w, acc[r * G + g]);
      }
    }
  }
}

template <class Codes, int R>
SPECDRAFT_AVX512 inline void few_rows16(const Codes& c, const float* x, int64_t K, int64_t p0, int64_t p1,
    int64_t N, const float* bias, float* y) {
  const int64_t kb_count = K / kBlock;
  __m512 acc[R * 4];  // at most R * G of them in use
  const int G = static_cast<int>(p1 - p0);
  switch (G) {
    case 4: rows_panels16<Codes, R, 4>(c, x, K, p0, kb_count, acc); break;
    case 3: rows_panels16<Codes, R, 3>(c, x, K, p0, kb_count, acc); break;
    case 2: rows_panels16<Codes, R, 2>(c, x, K, p0, kb_count, acc); break;
    default: rows_panels16<Codes, R, 1>(c, x, K, p0, kb_count, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      const int64_t p = p0 + g;
      store_panel16(acc[r * G + g], y + r * N + p * kPanel, std::min(kPanel, N - p * kPanel), bias ? bias + p * kPanel : nullptr);
    }
}

// R rows x G panels from de-quantised weights w [K, G, 16] (the task's panels side by side):
// per input, G weight vectors and R broadcasts feed R * G FMAs (24 at R = 6, G = 4), enough to
// keep the FMA units busy where one panel at a time left them waiting on loads.
template <int R, int G>
SPECDRAFT_AVX512 inline void rows_buffered16(const float* x, int64_t K, const float* w, int64_t N, int64_t p0,
    const float* bias, float* y) {
  __m512 acc[R * G];
  for (int i = 0; i < R * G; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wk[G];
    for (int g = 0; g < G; ++g) wk[g] = _mm512_loadu_ps(w + (k * G + g) * kPanel);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      for (int g = 0; g < G; ++g) acc[r * G + g] = _mm512_fmadd_ps(xb, wk[g], acc[r * G + g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      const int64_t p = p0 + g;
      store_panel16(acc[r * G + g], y + r * N + p * kPanel, std::min(kPanel, N - p * kPanel), bias ? bias + p * kPanel : nullptr);
    }
}

template <int G>
SPECDRAFT_AVX512 inline void many_rows16(const float* x, int64_t M, int64_t K, const float* w, int64_t N,
    int64_t p0, const float* bias, float* y) {
  in_blocks_of_six(M, [&](auto rows, int64_t m) {
    rows_buffered16<decltype(rows)::value, G>(x + m * K, K, w, N, p0, bias, y + m * N);
  });
}

// One task of quant_gemm (panels p0 .. p1 - 1, every row), 16 lanes at a time.
template <class Codes>
SPECDRAFT_AVX512 void quant_task16(const Codes& c, const float* x, int64_t M, int64_t K, int64_t N,
    const float* bias, float* y, int64_t p0, int64_t p1) {
  if (M <= 16) {  // decode and drafts: weights de-quantised as they stream by, once for all rows
    const int64_t step = M <= 4 ? 4 : M <= 8 ? 2 : 1;  // panels at once: at most 16 accumulators
    for (int64_t p = p0; p < p1; p += step) {
      const int64_t q = std::min(p1, p + step);
      switch (M) {
#define SPECDRAFT_ROWS(R) \
  case R: few_rows16<Codes, R>(c, x, K, p, q, N, bias, y); break;
        SPECDRAFT_ROWS(1) SPECDRAFT_ROWS(2) SPECDRAFT_ROWS(3) SPECDRAFT_ROWS(4) SPECDRAFT_ROWS(5)
        SPECDRAFT_ROWS(6) SPECDRAFT_ROWS(7) SPECDRAFT_ROWS(8) SPECDRAFT_ROWS(9) SPECDRAFT_ROWS(10)
        SPECDRAFT_ROWS(11) SPECDRAFT_ROWS(12) SPECDRAFT_ROWS(13) SPECDRAFT_ROWS(14) SPECDRAFT_ROWS(15)
        default: few_rows16<Codes, 16>(c, x, K, p, q, N, bias, y);
#undef SPECDRAFT_ROWS
      }
    }
    return;
  }
  // many rows: the task's panels de-quantised once into a buffer [K, G, 16], then rows six at a time
  const int64_t kb_count = K / kBlock, G = p1 - p0;
  thread_local std::vector<float> buffer;
  buffer.resize(K * kPanel * G);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      const auto block = c.block16(p0 + g, kb_count, kb);
      for (int64_t k = kb * kBlock; k < (kb + 1) * kBlock; ++k)
        _mm512_storeu_ps(buffer.data() + (k * G + g) * kPanel, c.at16(block, p0 + g, K, k));
    }
  switch (G) {
    case 4: many_rows16<4>(x, M, K, buffer.data(), N, p0, bias, y); break;
    case 3: many_rows16<3>(x, M, K, buffer.data(), N, p0, bias, y); break;
    case 2: many_rows16<2>(x, M, K, buffer.data(), N, p0, bias, y); break;
    default: many_rows16<1>(x, M, K, buffer.data(), N, p0, bias, y);
  }
}

template <class Codes>
void quant_gemm(const Codes& c, const float* x, int64_t M, int64_t K, int64_t N, const float* bias, float* y) {
  const int64_t P = (N + kPanel - 1) / kPanel, kb_count = K / kBlock;
  const bool wide = has_avx512();
  const int64_t group = wide ? 4 : 2;  // panels per task
  const int64_t tasks = (P + group - 1) / group;
  for_rows(tasks, std::max<int64_t>(1, M) * K * kPanel * group, [&](int64_t task) {
    const int64_t p0 = task * group, p1 = std::min(P, p0 + group);
    if (wide) {
      quant_task16(c, x, M, K, N, bias, y, p0, p1);
      return;
    }
    auto columns = [&](int64_t p) { return std::min(kPanel, N - p * kPanel); };
    if (M < 4) {  // decode and small drafts: de-quantise as the weights stream by
      if (M == 1) few_rows<Codes, 1>(c, x, K, p0, p1, N, bias, y);
      if (M == 2) few_rows<Codes, 2>(c, x, K, p0, p1, N, bias, y);
      if (M == 3) few_rows<Codes, 3>(c, x, K, p0, p1, N, bias, y);
      return;
    }
    // many rows: each panel de-quantised once into a buffer, then rows six at a time
    thread_local std::vector<float> buffer;
    buffer.resize(K * kPanel);
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t k = 0; k < K; ++k) {
        __m256 w0, w1;
        c.at(p, kb_count, k, w0, w1);
        _mm256_storeu_ps(buffer.data() + k * kPanel, w0);
        _mm256_storeu_ps(buffer.data() + k * kPanel + 8, w1);
      }
      const float* b = bias ? bias + p * kPanel : nullptr;
      __m256 acc[12];
      for (int64_t m = 0; m < M; m += 6) {
        const int64_t rows = std::min<int64_t>(6, M - m);
        switch (rows) {  // the same chain per output whichever: only the rows in flight differ
          case 6: rows_panel<6>(x + m * K, K, buffer.data(), K, acc); break;
          case 5: rows_panel<5>(x + m * K, K, buffer.data(), K, acc); break;
          case 4: rows_panel<4>(x + m * K, K, buffer.data(), K, acc); break;
          case 3: rows_panel<3>(x + m * K, K, buffer.data(), K, acc); break;
          case 2: rows_panel<2>(x + m * K, K, buffer.data(), K, acc); break;
          default: rows_panel<1>(x + m * K, K, buffer.data(), K, acc);
        }
        for (int64_t r = 0; r < rows; ++r) store_panel(acc + 2 * r, y + (m + r) * N + p * kPanel, columns(p), b);
      }
    }
  });
}

}  // namespace

// x [M, K] float32 @ the packed weight^T (+ bias) -> [M, N] float32.
torch::Tensor quant_linear(
    torch::Tensor x, torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> offsets,
    c10::optional<torch::Tensor> bias, int64_t n) {
  for (auto* t : {&x, &codes, &scales}) check_cpu(*t, "quant_linear argument");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1), P = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(K % kBlock == 0 && scales.scalar_type() == at::kFloat && scales.numel() == P * (K / kBlock) * kPanel,
      "scales [P, K / 32, 16] for x's K");
  const float* b = bias_data(bias, n);
  torch::Tensor y = torch::empty({M, n}, x.options());
  if (offsets.has_value()) {
    check_cpu(*offsets, "offsets");
    TORCH_CHECK(codes.scalar_type() == at::kByte && codes.numel() == P * K * 8, "4-bit codes [P, K, 8] uint8");
    TORCH_CHECK(offsets->scalar_type() == at::kFloat && offsets->numel() == scales.numel(), "offsets like scales");
    Codes4 c{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), offsets->data_ptr<float>()};
    quant_gemm(c, x.data_ptr<float>(), M, K, n, b, y.data_ptr<float>());
  } else {
    TORCH_CHECK(codes.scalar_type() == at::kChar && codes.numel() == P * K * kPanel, "8-bit codes [P, K, 16] int8");
    Codes8 c{codes.data_ptr<int8_t>(), scales.data_ptr<float>()};
    quant_gemm(c, x.data_ptr<float>(), M, K, n, b, y.data_ptr<float>());
  }
  return y;
}

}  // namespace specdraft
