// y = x @ w.T for the few rows of a verify step, streaming each fp32 weight row once from memory.
//
// A verify step multiplies every weight matrix by the 2-16 rows of a draft tree. The weights do not fit
// in cache, so the step is bound by how fast they stream from memory; BLAS GEMMs, made for many rows,
// stream them at about half the rate of the one-row GEMV on some CPUs (docs/benchmarks.md has the
// numbers). Here each thread walks its own contiguous block of weight rows, 4 rows at a time with
// software prefetches ahead of each (1 KB into L1, 16 KB into L2), and multiplies them by up to 4 input rows
// held in registers; more input rows take more passes over the same 4 weight rows, which are in L1 by then.
// One core keeps too few reads in flight to reach the memory's bandwidth on its own, and the more rows it
// multiplies, the fewer: the L2 prefetch far ahead is what keeps 4 rows as fast as 1 (docs/benchmarks.md,
// "Measurements behind the CPU engine's design").
//
// The weight stays as it is (row-major [N, K], no packed copy). Sums run in a different order than
// BLAS, so results differ from F.linear by float rounding only.
//
// `few_rows_linear_cat` runs several weights sharing an input in one pass (q/k/v, gate/up), writing their
// outputs side by side; `rms_norm` is the Llama-family RMSNorm on the rows of a block, and `rope_` the rotary
// embedding applied in place to q and k in that side-by-side output; `attention_tail` the rest of a decoder
// layer after its K/V write, from attention to the next layer's input norm, in one call, its attention by
// `few_rows_attention` where that takes the shapes; `write_kv` puts a block's K and V into the cache's
// buffers, and `decoder_layer` is a whole layer in one call (q/k/v, rotary, `write_kv`, `attention_tail`).
// They serve the lean verify forward (infer/cpu/lean_forward.py). Any weight may be held as int8 rows with one
// fp32 scale a row (widened to fp32 as it is loaded: a quarter of the bytes to stream), which is how the `int8`
// self-drafter's lean forward runs; `int8_rows_linear` is one such weight alone, and `argmax_logits` uses it to
// score only the tokens that could be a row's argmax (infer/cpu/argmax_head.py). Or in groups of 32 inputs with a
// scale each: int8 (GGUF's Q8_0), or 4-bit with an offset too (GGUF's Q4_1), rebuilt in registers to the bits of
// the fp32 weight they hold: how the `int4` self-drafter's lean forward runs, and how a target whose weights lie on
// such a grid (one dequantized from a GGUF file) is verified; the products and sums stay fp32 in every format. A bf16
// weight is widened exactly as it streams (half of fp32's bytes): a bf16 target's matmuls of 1..n rows run here,
// where torch's own bf16 GEMV reads its weight far below the memory's pace on some CPUs.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Accumulators live in vector registers: kWeightRows x kInputRows of them, plus kWeightRows weight vectors
// and one input vector. AVX-512 has 32 registers of 16 floats (16 + 4 + 1 fit); AVX2 has 16 of 8 floats, so
// there the tile is 4 x 2 (8 + 4 + 1) and 4 input rows take two passes over weight rows already in L1. The
// AVX-512 tile built for AVX2 spills its accumulators and ran several times slower than the 4 x 2 tile, and
// slower than oneDNN.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
constexpr int64_t kWeightRows = 4;   // weight rows streamed together
constexpr int64_t kInputRows = 4;    // input rows per pass
// 9 to 14 input rows go against two weight rows at a time, all in one pass (2 x 14 accumulators + 2 weight vectors +
// 1 input vector = 31 registers), so each weight row streams from memory once while all its products are computed,
// instead of 3-4 passes of 4 x 4 tiles over weight rows in L1: 8-12% faster at 10-13 rows; at 5-8 and 16 rows
// the 4 x 4 passes were as fast or slightly faster, so they stay there.
constexpr int64_t kWideInputRows = 14;
#else
constexpr int64_t kLanes = 8;
constexpr int64_t kWeightRows = 4;
constexpr int64_t kInputRows = 2;
#endif
typedef float vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));
typedef float vec8 __attribute__((vector_size(32), aligned(4)));
typedef float vec4 __attribute__((vector_size(16), aligned(4)));
constexpr int64_t kPrefetch = 256;   // floats ahead of the current load, per weight row, into L1 (1 KB)
constexpr int64_t kPrefetchL2 = 4096;  // and into L2 (16 KB; 8 KB gave most of the gain, 32 KB no more)

inline float sum_lanes(vec v) {
#if defined(__AVX512F__)
  vec8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  vec8 a = v;
#endif
  vec4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// The lane sums of four vectors at once: {sum(a), sum(b), sum(c), sum(d)}, halving all four together (a third
// of the shuffles and adds of four sum_lanes).
inline vec4 sum_lanes4(vec a, vec b, vec c, vec d) {
#if defined(__AVX512F__)
  const vec ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vec cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vec quarters = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                       __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const vec8 x = __builtin_shufflevector(quarters, quarters, 0, 1, 4, 5, 8, 9, 12, 13) +
                 __builtin_shufflevector(quarters, quarters, 2, 3, 6, 7, 10, 11, 14, 15);
#else
  const vec ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  const vec cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
  const vec8 x = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
                 __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
#endif
  return __builtin_shufflevector(x, x, 0, 2, 4, 6) + __builtin_shufflevector(x, x, 1, 3, 5, 7);
}

// acc + w * x in one rounding (an FMA instruction), written out: left to the compiler, `acc += w * x` is an FMA or
// a product and a sum by its tuning's heuristics, loop by loop. GCC 12 tuning for AMD (znver3, which -march=native
// can pick for a newer AMD CPU) avoids 256-bit FMA chains, and turned tile()'s one-row fp32 loop into products and sums
// while the grouped tile's stayed FMAs: the AVX2 build's two readings of one weight then differed in the last bit.
inline vec fma_lanes(vec w, vec x, vec acc) {
#if defined(__AVX512F__)
  return std::bit_cast<vec>(_mm512_fmadd_ps(std::bit_cast<__m512>(w), std::bit_cast<__m512>(x),
                                            std::bit_cast<__m512>(acc)));
#else
  return std::bit_cast<vec>(_mm256_fmadd_ps(std::bit_cast<__m256>(w), std::bit_cast<__m256>(x),
                                            std::bit_cast<__m256>(acc)));
#endif
}

// kLanes weights from w as fp32: a plain load, or int8 widened (one sign extension and one conversion; the
// generic vector conversion of an int8 vector is not compiled to those two instructions).
inline vec load_lanes(const float* w) { return *reinterpret_cast<const vec*>(w); }
inline vec load_lanes(const int8_t* w) {
#if defined(__AVX512F__)
  __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
#else
  __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
#endif
  vec v;
  std::memcpy(&v, &f, sizeof(v));
  return v;
}
// bf16 widened exactly: its 16 bits are the high half of the fp32 value it stands for (a zero extension and a shift).
inline vec load_lanes(const c10::BFloat16* w) {
#if defined(__AVX512F__)
  __m512i i = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))), 16);
#else
  __m256i i = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))), 16);
#endif
  vec v;
  std::memcpy(&v, &i, sizeof(v));
  return v;
}

// y[r, n + b] = x[r, :] . w[n + b, :] (times scale[n + b] where `scale` is given) for r < R, b < B. x: [R, K]
// (row stride K), w: [N, K] of T (fp32, or int8 converted to fp32 as it is loaded; the products and sums are
// fp32 either way), y: rows of stride ldy (N for one weight; the total width when several write side by side).
template <int B, int R, typename T>
inline void tile(const float* x, const T* w, const float* scale, float* y, int64_t K, int64_t ldy, int64_t n) {
  constexpr int64_t ahead = kPrefetch * sizeof(float) / sizeof(T);  // the same bytes ahead in any type
  constexpr int64_t far_ahead = kPrefetchL2 * sizeof(float) / sizeof(T);
  vec acc[B][R] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    vec wv[B];
    for (int b = 0; b < B; ++b) {
      const T* row = w + (n + b) * K + k;
      wv[b] = load_lanes(row);
      // fp32: every step, as measured for it; int8 (and bf16): once per 64-byte line, not at each of its steps,
      // which measured about 7% faster for int8 weights at one row
      if (sizeof(T) == sizeof(float) || k % (64 / sizeof(T)) == 0) {
        __builtin_prefetch(row + ahead, 0, 3);
        __builtin_prefetch(row + far_ahead, 0, 1);
      }
    }
    for (int r = 0; r < R; ++r) {
      vec xv = *reinterpret_cast<const vec*>(x + r * K + k);
      for (int b = 0; b < B; ++b) acc[b][r] = fma_lanes(wv[b], xv, acc[b][r]);
    }
  }
  for (int b = 0; b < B; ++b) {
    for (int r = 0; r < R; ++r) {
      float s = sum_lanes(acc[b][r]);
      for (int64_t t = k; t < K; ++t) s += static_cast<float>(w[(n + b) * K + t]) * x[r * K + t];  // K % kLanes
      y[r * ldy + n + b] = scale == nullptr ? s : s * scale[n + b];
    }
  }
}

// Weights quantized in groups of kGroup consecutive inputs of a row, each group with its own fp32 scale (and
// offset): w = q * scale + low. Int4Groups: q in 0..15, two a byte ([N, K / 2] bytes: byte j of a group holds its
// input j in the low nibble and input j + 16 in the high one, GGUF's Q4_1 layout), scale and low [N, K / kGroup];
// Int8Groups: q in -127..127 ([N, K]), scale [N, K / kGroup], no offset (GGUF's Q8_0).
//
// Each weight is rebuilt in registers as fp32 rounds q * scale + low written out in two steps, the product and then
// the sum, never fused into one rounding (torch's `q * scale + low`, infer/cpu/linear.py: int4_weight), and then
// multiplied and summed exactly as tile() does an fp32 weight, lane by lane in the same order. So a grouped weight
// gives the same bits as the fp32 weight it rebuilds, from a fifth (4-bit) or a quarter (8-bit) of its bytes: a
// target dequantized from a GGUF file (the embedded SmolLM2) is read on its own grid, losslessly, and the `int4`
// self-drafter computes what the target's verify computes.
constexpr int64_t kGroup = 32;
constexpr int kGroupVectors = kGroup / kLanes;
// A grouped weight's q, scales (and offsets) from its first row on: the whole weight, or one row of it (row_of).
struct Int4Groups {
  const uint8_t* q;
  const float* scale;
  const float* low;
};
struct Int8Groups {
  const int8_t* q;
  const float* scale;
};
inline Int4Groups row_of(const Int4Groups& w, int64_t row, int64_t K) {
  return {w.q + row * (K / 2), w.scale + row * (K / kGroup), w.low + row * (K / kGroup)};
}
inline Int8Groups row_of(const Int8Groups& w, int64_t row, int64_t K) {
  return {w.q + row * K, w.scale + row * (K / kGroup)};
}

// Group g of a row's weights as fp32 vectors, inputs in order (v[0] holds inputs 0..kLanes-1 of the group).
struct GroupVectors {
  vec v[kGroupVectors];
};

// The products q * scale stay a rounded fp32 value: the compiler cannot see through this, so it does not fuse the
// product with the add of the offset after it (one rounding instead of two would change the weight's last bit).
inline vec unfused(vec product) {
  asm("" : "+v"(product));
  return product;
}

inline GroupVectors load_group(const Int4Groups& row, int64_t g) {
  const uint8_t* q = row.q + g * (kGroup / 2);
  const float scale = row.scale[g], low = row.low[g];
  GroupVectors out;
#if defined(__AVX512F__)
  // the group's 16 possible weights j * scale + low, j = 0..15, in one register; each byte widened to a 32-bit lane
  // then looks up its low nibble (input j) and its high nibble (input j + 16) in it (a permute reads only an index's
  // low 4 bits): two multiplications' worth of work a group for all 32 weights, and no conversion of q to floats
  const vec levels = unfused(vec{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} * scale) + low;
  const __m512 table = std::bit_cast<__m512>(levels);
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  out.v[0] = std::bit_cast<vec>(_mm512_permutexvar_ps(bytes, table));
  out.v[1] = std::bit_cast<vec>(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table));
#else
  for (int half = 0; half < 2; ++half) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * half)));
    const vec low_q = std::bit_cast<vec>(_mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0x0F))));
    const vec high_q = std::bit_cast<vec>(_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)));
    out.v[half] = unfused(low_q * scale) + low;
    out.v[2 + half] = unfused(high_q * scale) + low;
  }
#endif
  return out;
}

inline GroupVectors load_group(const Int8Groups& row, int64_t g) {
  GroupVectors out;
  for (int v = 0; v < kGroupVectors; ++v) out.v[v] = load_lanes(row.q + g * kGroup + v * kLanes) * row.scale[g];
  return out;
}

// Prefetches into L1 and into L2, as volatile asm: GCC 12's dead-code elimination dropped every __builtin_prefetch
// of the grouped tiles below (whose addresses are read nowhere else in the loop), which left their streams to the
// hardware prefetcher alone. The row tiles keep __builtin_prefetch, which GCC keeps there: through these helpers
// the same prefetch instructions made SmolLM2's fp32 linears at 13 rows 23.2 -> 30.8 ms (alternating builds,
// median of 16; the cause not traced).
inline void prefetch_l1(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }
inline void prefetch_l2(const void* p) { asm volatile("prefetcht2 %0" : : "m"(*static_cast<const char*>(p))); }

// Prefetches of what a row reads further on, issued at group g: once per 64-byte line of q, every 16 groups for
// the scales (and offsets).
inline void prefetch_group(const Int4Groups& row, int64_t g) {
  if (g % 4 == 0) {
    prefetch_l1(row.q + g * (kGroup / 2) + kPrefetch * sizeof(float));
    prefetch_l2(row.q + g * (kGroup / 2) + kPrefetchL2 * sizeof(float));
  }
  if (g % 16 == 0) {
    prefetch_l2(row.scale + g + kPrefetchL2 / 2);
    prefetch_l2(row.low + g + kPrefetchL2 / 2);
  }
}

inline void prefetch_group(const Int8Groups& row, int64_t g) {
  if (g % 2 == 0) {
    prefetch_l1(row.q + g * kGroup + kPrefetch * sizeof(float));
    prefetch_l2(row.q + g * kGroup + kPrefetchL2 * sizeof(float));
  }
  if (g % 16 == 0) prefetch_l2(row.scale + g + kPrefetchL2 / 4);
}

// tile() for grouped weights: y[r, n + b] = x[r, :] . (q * scale + low)[n + b, :], each group's weights rebuilt
// once for all R input rows, then the same products and sums as tile()'s for the fp32 weight (the same bits). K is
// a multiple of kGroup (check_weight).
template <int B, int R, typename W, typename = std::enable_if_t<!std::is_pointer_v<W>>>
inline void tile(const float* x, const W& w, const float*, float* y, int64_t K, int64_t ldy, int64_t n) {
  vec acc[B][R] = {};
  W rows[B];
  for (int b = 0; b < B; ++b) rows[b] = row_of(w, n + b, K);
  for (int64_t g = 0; g < K / kGroup; ++g) {
    GroupVectors qv[B];
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) {
      prefetch_group(rows[b], g);
      qv[b] = load_group(rows[b], g);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float* xg = x + r * K + g * kGroup;
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) {
#pragma GCC unroll 4
        for (int v = 0; v < kGroupVectors; ++v)
          acc[b][r] = fma_lanes(qv[b].v[v], load_lanes(xg + v * kLanes), acc[b][r]);
      }
    }
  }
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) y[r * ldy + n + b] = sum_lanes(acc[b][r]);
}

#if defined(__AVX512F__)
// Weight rows [n, n + B) against R input rows in one pass, 8 < R <= kWideInputRows.
template <int B, typename W>
void wide_tile(const float* x, const W& w, const float* scale, float* y, int64_t K, int64_t ldy, int64_t n,
               int64_t R) {
  switch (R) {
    case 9: tile<B, 9>(x, w, scale, y, K, ldy, n); break;
    case 10: tile<B, 10>(x, w, scale, y, K, ldy, n); break;
    case 11: tile<B, 11>(x, w, scale, y, K, ldy, n); break;
    case 12: tile<B, 12>(x, w, scale, y, K, ldy, n); break;
    case 13: tile<B, 13>(x, w, scale, y, K, ldy, n); break;
    default: tile<B, 14>(x, w, scale, y, K, ldy, n); break;
  }
}

// Grouped weight rows [n, n + B) against R input rows in one pass, kInputRows < R <= 2 * kInputRows.
template <int B, typename W>
void middle_tile(const float* x, const W& w, float* y, int64_t K, int64_t ldy, int64_t n, int64_t R) {
  switch (R) {
    case 5: tile<B, 5>(x, w, nullptr, y, K, ldy, n); break;
    case 6: tile<B, 6>(x, w, nullptr, y, K, ldy, n); break;
    case 7: tile<B, 7>(x, w, nullptr, y, K, ldy, n); break;
    default: tile<B, 8>(x, w, nullptr, y, K, ldy, n); break;
  }
}
#endif

// Weight rows [n, n + B) against all M input rows, kInputRows at a time; on AVX-512, 9 to kWideInputRows input rows
// go two weight rows at a time against all of them in one pass (see kWideInputRows). Grouped weights, whose groups
// cost as much to rebuild as several input rows' products, take 5 to 8 input rows in one pass too, with all B weight
// rows (about 8% faster for 4-bit weights at 8 and 13 rows than passes of 4 input rows, 13 with pairs of weight
// rows; at 5-8 rows pairs of weight rows were 3-9% slower than all four).
template <int B, typename W>
void weight_rows(const float* x, const W& w, float* y, int64_t M, int64_t K, int64_t ldy, int64_t n,
                 const float* scale = nullptr) {
#if defined(__AVX512F__)
  constexpr int pair = B == 1 ? 1 : 2;
  static_assert(B % pair == 0, "weight rows go in pairs");
  if constexpr (!std::is_pointer_v<W>) {
    if (kInputRows < M && M <= 2 * kInputRows) {
      middle_tile<B>(x, w, y, K, ldy, n, M);
      return;
    }
  }
  if (2 * kInputRows < M && M <= kWideInputRows) {
    for (int b = 0; b < B; b += pair) wide_tile<pair>(x, w, scale, y, K, ldy, n + b, M);
    return;
  }
#endif
  for (int64_t m = 0; m < M; m += kInputRows) {
    const float* xm = x + m * K;
    float* ym = y + m * ldy;
    switch (std::min(kInputRows, M - m)) {
      case 1: tile<B, 1>(xm, w, scale, ym, K, ldy, n); break;
      case 2: tile<B, 2>(xm, w, scale, ym, K, ldy, n); break;
      case 3: tile<B, 3>(xm, w, scale, ym, K, ldy, n); break;
      default: tile<B, 4>(xm, w, scale, ym, K, ldy, n); break;
    }
  }
}

// Work item `item` of a weight with N rows, against all M input rows: its blocks of kWeightRows rows come first,
// then the rows left over, one item each (so N / kWeightRows + N % kWeightRows items in all).
template <typename W>
inline void weight_item(const float* x, const W& w, float* y, int64_t M, int64_t K, int64_t ldy, int64_t N,
                        int64_t item, const float* scale = nullptr) {
  const int64_t blocks = N / kWeightRows;
  if (item < blocks) weight_rows<kWeightRows>(x, w, y, M, K, ldy, item * kWeightRows, scale);
  else weight_rows<1>(x, w, y, M, K, ldy, blocks * kWeightRows + (item - blocks), scale);
}

#if defined(__AVX512BF16__)
// bf16 inputs against bf16 weights: each fp32 lane adds the products of two adjacent bf16 pairs in one instruction
// (vdpbf16ps; a product of two bf16 values is exact in fp32), so 32 products take one instruction where widened
// weights take two FMAs and the widening. On two cores a verify of 8 or more rows of a 1B model is bound by these
// products, not by the weights' bytes: at 16 rows the fp32 FMAs cost 2.3 times one row's step (docs/benchmarks.md).
// The sums are fp32 in another order than the widened path's (lane j adds inputs 2j and 2j + 1 of every 32), so
// results differ from it by fp32 rounding only; every row's sums are the same whatever the number of rows.
constexpr int64_t kPairLanes = 32;  // bf16 values in one 512-bit vector
inline __m512bh load_pairs(const c10::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

// y[r, n + b] = x[r, :] . w[n + b, :] for r < R, b < B; x: [R, K] bf16, w: [N, K] bf16.
template <int B, int R>
inline void tile_bf16(const c10::BFloat16* x, const c10::BFloat16* w, float* y, int64_t K, int64_t ldy, int64_t n) {
  constexpr int64_t ahead = kPrefetch * sizeof(float) / sizeof(c10::BFloat16);  // the same bytes ahead as fp32's
  constexpr int64_t far_ahead = kPrefetchL2 * sizeof(float) / sizeof(c10::BFloat16);
  __m512 acc[B][R];
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kPairLanes <= K; k += kPairLanes) {  // one 64-byte line of each weight row a step
    __m512bh wv[B];
    for (int b = 0; b < B; ++b) {
      const c10::BFloat16* row = w + (n + b) * K + k;
      wv[b] = load_pairs(row);
      __builtin_prefetch(row + ahead, 0, 3);
      __builtin_prefetch(row + far_ahead, 0, 1);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = load_pairs(x + r * K + k);
      for (int b = 0; b < B; ++b) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], wv[b], xv);
    }
  }
  for (int b = 0; b < B; ++b) {
    for (int r = 0; r < R; ++r) {
      float s = sum_lanes(std::bit_cast<vec>(acc[b][r]));
      for (int64_t t = k; t < K; ++t)  // K % kPairLanes
        s += static_cast<float>(w[(n + b) * K + t]) * static_cast<float>(x[r * K + t]);
      y[r * ldy + n + b] = s;
    }
  }
}

// One pass of tile_bf16 over `rows` input rows, 1 <= rows <= R.
template <int B, int R>
inline void pass_bf16(const c10::BFloat16* x, const c10::BFloat16* w, float* y, int64_t K, int64_t ldy, int64_t n,
                      int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return pass_bf16<B, R - 1>(x, w, y, K, ldy, n, rows);
  }
  tile_bf16<B, R>(x, w, y, K, ldy, n);
}

// Weight rows [n, n + B) against all M bf16 input rows, in passes of equal size (the weight rows are in L1 after the
// first pass): at most 4 rows a pass for 4 weight rows (16 accumulators), 9 for fewer (3 x 9: 27 accumulators + 3
// weight vectors + 1 input vector = 31 registers).
template <int B>
void weight_rows_bf16(const c10::BFloat16* x, const c10::BFloat16* w, float* y, int64_t M, int64_t K, int64_t ldy,
                      int64_t n) {
  constexpr int kRows = B == 4 ? 4 : 9;
  const int64_t passes = (M + kRows - 1) / kRows, rows = (M + passes - 1) / passes;
  for (int64_t m = 0; m < M; m += rows)
    pass_bf16<B, kRows>(x + m * K, w, y + m * ldy, K, ldy, n, std::min(rows, M - m));
}

// Weight rows a work item takes for M bf16 input rows: 3 for 5 to 9 rows, all in one pass, so each weight line is
// multiplied by every row while it is in L1 once, and the memory is read while the products run; 4 otherwise (one
// pass up to 4 rows, passes of 4 past 9). With the weights in L2 (the products' own pace, 2 threads, Zen 5, K =
// 2048) 3 x 8 and 3 x 9 ran at 92 and 82 GB/s of weights where passes of 4 x 4 ran at 78 and 60; 16 rows as two
// passes of 3 x 8 were no faster than four of 4 x 4. With the memory at ~47 GB/s both wait on it alike (a 1B verify
// of 8 or 9 nodes within 2% either way).
inline int64_t bf16_item_rows(int64_t M) { return 4 < M && M <= 9 ? 3 : 4; }

inline void weight_item_bf16(const c10::BFloat16* x, const c10::BFloat16* w, float* y, int64_t M, int64_t K,
                             int64_t ldy, int64_t N, int64_t item) {
  const int64_t B = bf16_item_rows(M), blocks = N / B;
  if (item >= blocks) weight_rows_bf16<1>(x, w, y, M, K, ldy, blocks * B + (item - blocks));
  else if (B == 4) weight_rows_bf16<4>(x, w, y, M, K, ldy, item * 4);
  else weight_rows_bf16<3>(x, w, y, M, K, ldy, item * 3);
}
// bf16 inputs against int8 rows with one fp32 scale a row (the int8 copy of a bf16 LM head, infer/cpu/argmax_head.py):
// each 64-byte line of a weight row becomes 64 bf16 values (an int8 is exact in bf16) once, and every input row then
// takes two paired products of it, where widening to fp32 takes four FMAs a row. The products are exact and the sums
// fp32, as in any fp32 evaluation. Two weight rows a tile: 2 x 9 accumulators + 4 converted vectors + 2 inputs.
inline void load_int8_pairs(const int8_t* p, __m512bh& low, __m512bh& high) {
  __m512 f[4];
  for (int i = 0; i < 4; ++i)
    f[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i))));
  low = _mm512_cvtne2ps_pbh(f[1], f[0]);  // weights 0..31 in order (the second argument fills the low half)
  high = _mm512_cvtne2ps_pbh(f[3], f[2]);
}

template <int B, int R>
inline void tile_int8_bf16(const c10::BFloat16* x, const int8_t* q, const float* scale, float* y, int64_t K,
                           int64_t ldy, int64_t n) {
  constexpr int64_t ahead = kPrefetch * sizeof(float), far_ahead = kPrefetchL2 * sizeof(float);  // bytes, as fp32's
  __m512 acc[B][R];
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 * kPairLanes <= K; k += 2 * kPairLanes) {  // one 64-byte line of each weight row a step
    __m512bh low[B], high[B];
    for (int b = 0; b < B; ++b) {
      const int8_t* row = q + (n + b) * K + k;
      load_int8_pairs(row, low[b], high[b]);
      __builtin_prefetch(row + ahead, 0, 3);
      __builtin_prefetch(row + far_ahead, 0, 1);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh x_low = load_pairs(x + r * K + k), x_high = load_pairs(x + r * K + k + kPairLanes);
      for (int b = 0; b < B; ++b) {
        acc[b][r] = _mm512_dpbf16_ps(acc[b][r], low[b], x_low);
        acc[b][r] = _mm512_dpbf16_ps(acc[b][r], high[b], x_high);
      }
    }
  }
  for (int b = 0; b < B; ++b) {
    for (int r = 0; r < R; ++r) {
      float s = sum_lanes(std::bit_cast<vec>(acc[b][r]));
      for (int64_t t = k; t < K; ++t)  // K % 64
        s += static_cast<float>(q[(n + b) * K + t]) * static_cast<float>(x[r * K + t]);
      y[r * ldy + n + b] = s * scale[n + b];
    }
  }
}

template <int B, int R>
inline void pass_int8_bf16(const c10::BFloat16* x, const int8_t* q, const float* scale, float* y, int64_t K,
                           int64_t ldy, int64_t n, int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return pass_int8_bf16<B, R - 1>(x, q, scale, y, K, ldy, n, rows);
  }
  tile_int8_bf16<B, R>(x, q, scale, y, K, ldy, n);
}

// y = (x @ q.T) * scale for bf16 x [M, K] and int8 rows q [N, K] with their scales [N]: [M, N] fp32. Passes of up to
// 9 input rows over each pair of weight rows (in L1 after the first pass).
torch::Tensor int8_rows_linear_bf16(const torch::Tensor& x_in, const torch::Tensor& q, const torch::Tensor& scale) {
  const torch::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.scalar_type() == torch::kChar && q.is_contiguous() && q.size(1) == K && scale.size(0) == N,
              "int8_rows_linear_bf16: q [N, K] int8 contiguous and scale [N] expected");
  torch::Tensor y = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t kRows = 9;
  const int64_t passes = (M + kRows - 1) / kRows, rows = (M + passes - 1) / passes;
  const int64_t items = N / 2 + N % 2, threads = at::get_num_threads();
  at::parallel_for(0, items, (items + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      for (int64_t m = 0; m < M; m += rows) {
        const int64_t count = std::min(rows, M - m);
        if (item < N / 2) pass_int8_bf16<2, kRows>(xp + m * K, qp, sp, yp + m * N, K, N, item * 2, count);
        else pass_int8_bf16<1, kRows>(xp + m * K, qp, sp, yp + m * N, K, N, N - 1, count);
      }
    }
  });
  return y;
}
constexpr bool kBFloat16Products = true;
#else
constexpr bool kBFloat16Products = false;
#endif

// A weight [N, K] as few_rows_linear_cat reads it, and how: fp32 rows (no scale, no low); int8 rows with one fp32
// scale a row [N]; int8 groups, a scale [N, K / kGroup]; 4-bit groups, uint8 [N, K / 2] with a scale and a low
// [N, K / kGroup] each. Everything contiguous.
enum class Format { kFloat, kBFloat16, kInt8Rows, kInt8Groups, kInt4Groups };

Format check_weight(const torch::Tensor& weight, const c10::optional<torch::Tensor>& scale,
                    const c10::optional<torch::Tensor>& low, int64_t K, const char* name) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), name, ": a contiguous 2-D weight expected");
  const int64_t N = weight.size(0);
  const bool scaled = scale.has_value() && scale->defined(), offset = low.has_value() && low->defined();
  const auto fp32 = [&](const torch::Tensor& t, std::vector<int64_t> shape) {
    return t.scalar_type() == torch::kFloat && t.is_contiguous() && t.sizes() == c10::IntArrayRef(shape);
  };
  const int64_t groups = K / kGroup;
  switch (weight.scalar_type()) {
    case torch::kFloat:
      TORCH_CHECK(weight.size(1) == K, name, ": weight [N, K] expected, with K = ", K);
      TORCH_CHECK(!scaled && !offset, name, ": a scale or low is given for a float32 weight (they are for int rows)");
      return Format::kFloat;
    case torch::kBFloat16:
      TORCH_CHECK(weight.size(1) == K, name, ": weight [N, K] expected, with K = ", K);
      TORCH_CHECK(!scaled && !offset, name, ": a scale or low is given for a bfloat16 weight (they are for int rows)");
      return Format::kBFloat16;
    case torch::kChar:
      TORCH_CHECK(weight.size(1) == K, name, ": int8 weight [N, K] expected, with K = ", K);
      TORCH_CHECK(!offset, name, ": a low is given for int8 rows (it is for 4-bit groups)");
      if (scaled && scale->dim() == 1) {
        TORCH_CHECK(fp32(*scale, {N}), name, ": an int8 weight of ", N, " rows needs a scale [", N,
                    "] float32 contiguous, one a row, or [", N, ", K / ", kGroup, "], one a group");
        return Format::kInt8Rows;
      }
      TORCH_CHECK(scaled && K % kGroup == 0 && fp32(*scale, {N, groups}), name, ": an int8 weight of ", N,
                  " rows needs a scale [", N, "] float32 contiguous, one a row, or [", N, ", ", K, " / ", kGroup,
                  "], one a group of ", kGroup, " inputs (K a multiple of ", kGroup, ")");
      return Format::kInt8Groups;
    case torch::kByte:
      TORCH_CHECK(K % kGroup == 0 && weight.size(1) == K / 2, name, ": a 4-bit weight [N, K / 2] of uint8 with K = ",
                  K, " a multiple of ", kGroup, " expected");
      TORCH_CHECK(scaled && offset && fp32(*scale, {N, groups}) && fp32(*low, {N, groups}), name,
                  ": a 4-bit weight of ", N, " rows needs a scale and a low [", N, ", ", groups,
                  "] float32 contiguous, one each a group of ", kGroup, " inputs");
      return Format::kInt4Groups;
    default:
      TORCH_CHECK(false, name, ": float32, bfloat16, int8 or 4-bit (uint8) weights only, got ", weight.scalar_type());
  }
  return Format::kFloat;
}

}  // namespace

// x: [M, K] fp32, or bf16 against bf16 weights only (then on a CPU with AVX512-BF16 the products are of bf16 pairs,
// tile_bf16; elsewhere x is widened exactly and takes the fp32 path); weights: [N_i, K] contiguous, each fp32, bf16
// (widened exactly as it is loaded: half of fp32's
// bytes to stream), int8 rows with its scale [N_i], or grouped (int8 with a
// scale [N_i, K / 32], 4-bit with a scale and a low: check_weight); fp32 products and sums either way, the weight
// dequantized as it is loaded (a quarter of fp32's bytes to stream for int8, about a fifth for 4-bit groups);
// biases, scales, lows: one (or None) per weight, or empty. Returns [M, sum N_i]: the weights' outputs side by side,
// as if they were one concatenated weight (the q/k/v or gate/up projections of a layer in one pass, without a
// concatenated copy).
torch::Tensor few_rows_linear_cat(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights,
                                  const std::vector<c10::optional<torch::Tensor>>& biases,
                                  const std::vector<c10::optional<torch::Tensor>>& scales,
                                  const std::vector<c10::optional<torch::Tensor>>& lows) {
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == torch::kFloat || x_in.scalar_type() == torch::kBFloat16),
              "few_rows_linear: x [M, K] float32 (or bfloat16, against bfloat16 weights) expected");
  TORCH_CHECK(!weights.empty(), "few_rows_linear: no weight given");
  if (x_in.scalar_type() == torch::kBFloat16) {
    for (const auto& w : weights)
      TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "few_rows_linear: a bfloat16 x goes with bfloat16 weights "
                  "only (pass x as float32 for ", w.scalar_type(), " weights)");
    if (!kBFloat16Products)  // no bf16 products on this CPU: x widened exactly, the fp32 path
      return few_rows_linear_cat(x_in.to(torch::kFloat), weights, biases, scales, lows);
  }
  TORCH_CHECK(biases.empty() || biases.size() == weights.size(), "few_rows_linear: one bias (or None) per weight");
  TORCH_CHECK(scales.empty() || scales.size() == weights.size(), "few_rows_linear: one scale (or None) per weight");
  TORCH_CHECK(lows.empty() || lows.size() == weights.size(), "few_rows_linear: one low (or None) per weight");
  const torch::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  // Work items, numbered across the weights: each weight's blocks of item_rows rows, then its tail rows one
  // by one. first[i] is the number of weight i's first item, column[i] its first output column.
  const size_t count = weights.size();
  std::vector<int64_t> first(count + 1, 0), column(count, 0);
  std::vector<Format> format(count);
  int64_t width = 0;
#if defined(__AVX512BF16__)
  const int64_t item_rows = x.scalar_type() == torch::kBFloat16 ? bf16_item_rows(M) : kWeightRows;
#else
  const int64_t item_rows = kWeightRows;
#endif
  for (size_t i = 0; i < count; ++i) {
    const c10::optional<torch::Tensor> none;
    format[i] = check_weight(weights[i], scales.empty() ? none : scales[i], lows.empty() ? none : lows[i], K,
                             "few_rows_linear");
    const int64_t N = weights[i].size(0);
    first[i + 1] = first[i] + N / item_rows + N % item_rows;
    column[i] = width;
    width += N;
  }
  torch::Tensor y = torch::empty({M, width}, x.options().dtype(torch::kFloat));
#if defined(__AVX512BF16__)
  if (x.scalar_type() == torch::kBFloat16) {
    const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>();
    float* yp = y.data_ptr<float>();
    const int64_t items = first[count], threads = at::get_num_threads();
    at::parallel_for(0, items, (items + threads - 1) / threads, [&](int64_t begin, int64_t end) {
      size_t i = 0;
      for (int64_t j = begin; j < end; ++j) {
        while (j >= first[i + 1]) ++i;
        weight_item_bf16(xb, weights[i].data_ptr<c10::BFloat16>(), yp + column[i], M, K, width, weights[i].size(0),
                         j - first[i]);
      }
    });
    for (size_t i = 0; i < biases.size(); ++i) {
      if (biases[i].has_value() && biases[i]->defined())
        y.narrow(1, column[i], weights[i].size(0)).add_(*biases[i]);
    }
    return y;
  }
#endif
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t items = first[count];
  const int64_t threads = at::get_num_threads();
  // one contiguous run of items per thread: each thread's stream of weight rows is sequential
  at::parallel_for(0, items, (items + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    size_t i = 0;
    for (int64_t j = begin; j < end; ++j) {
      while (j >= first[i + 1]) ++i;
      const int64_t N = weights[i].size(0), item = j - first[i];
      float* out = yp + column[i];
      switch (format[i]) {
        case Format::kFloat:
          weight_item(xp, weights[i].data_ptr<float>(), out, M, K, width, N, item);
          break;
        case Format::kBFloat16:
          weight_item(xp, weights[i].data_ptr<c10::BFloat16>(), out, M, K, width, N, item);
          break;
        case Format::kInt8Rows:
          weight_item(xp, weights[i].data_ptr<int8_t>(), out, M, K, width, N, item, scales[i]->data_ptr<float>());
          break;
        case Format::kInt8Groups:
          weight_item(xp, Int8Groups{weights[i].data_ptr<int8_t>(), scales[i]->data_ptr<float>()}, out, M, K, width,
                      N, item);
          break;
        case Format::kInt4Groups:
          weight_item(xp, Int4Groups{weights[i].data_ptr<uint8_t>(), scales[i]->data_ptr<float>(),
                                     lows[i]->data_ptr<float>()}, out, M, K, width, N, item);
          break;
      }
    }
  });
  for (size_t i = 0; i < biases.size(); ++i) {
    if (biases[i].has_value() && biases[i]->defined())
      y.narrow(1, column[i], weights[i].size(0)).add_(*biases[i]);
  }
  return y;
}

// x: [M, K] fp32 (or bf16 against a bf16 weight), weight: [N, K] contiguous, bias: [N] or None -> [M, N] fp32
torch::Tensor few_rows_linear(const torch::Tensor& x_in, const torch::Tensor& weight,
                              const c10::optional<torch::Tensor>& bias) {
  return few_rows_linear_cat(x_in, {weight}, {bias}, {}, {});
}

// y = (x @ q.T) * scale for a weight held as int8 rows q [N, K] with one fp32 scale a row [N]; x: [M, K] fp32.
// Each product and sum in fp32, so y differs from x @ (q * scale).T by float rounding only. infer/cpu/argmax_head.py
// uses it to find the candidates for the target's greedy token.
torch::Tensor int8_rows_linear(const torch::Tensor& x_in, const torch::Tensor& q, const torch::Tensor& scale) {
  TORCH_CHECK(q.scalar_type() == torch::kChar, "int8_rows_linear: q [N, K] int8 contiguous expected");
  return few_rows_linear_cat(x_in, {q}, {}, {scale}, {});
}

// An LM head [V, K] (fp32, or bf16 widened exactly) as ArgmaxHead holds it, in one pass over its rows: int8 rows with
// one fp32 scale each, as infer/cpu/linear.py's int8_rows makes them (scale = max(max|w| / 127, the smallest normal
// float), q = w / scale rounded half to even, clamped to +-127), and each row's radius rho = (||w - q * scale|| +
// gamma * (||w|| + ||q * scale||)) * (1 + rel_slack), the norms in float64 (infer/cpu/argmax_head.py derives it).
// Torch's float64 ops over the whole head took 4.2 s for a 1B model's (128,256 x 2,048, 2 threads); this pass 0.3 s.
std::vector<torch::Tensor> int8_rows_radius(const torch::Tensor& weight_in, double gamma, double rel_slack) {
  TORCH_CHECK(weight_in.dim() == 2 && (weight_in.scalar_type() == torch::kFloat ||
                                       weight_in.scalar_type() == torch::kBFloat16),
              "int8_rows_radius: an fp32 or bf16 weight [V, K] expected");
  const torch::Tensor weight = weight_in.contiguous();
  const int64_t V = weight.size(0), K = weight.size(1);
  torch::Tensor q = torch::empty({V, K}, weight.options().dtype(torch::kChar));
  torch::Tensor scale = torch::empty({V}, weight.options().dtype(torch::kFloat));
  torch::Tensor rho = torch::empty({V}, weight.options().dtype(torch::kFloat));
  const bool bf16 = weight.scalar_type() == torch::kBFloat16;
  const float* wf = bf16 ? nullptr : weight.data_ptr<float>();
  const c10::BFloat16* wb = bf16 ? weight.data_ptr<c10::BFloat16>() : nullptr;
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  float* rp = rho.data_ptr<float>();
  at::parallel_for(0, V, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t v = begin; v < end; ++v) {
      float amax = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        row[k] = bf16 ? static_cast<float>(wb[v * K + k]) : wf[v * K + k];
        amax = std::max(amax, std::fabs(row[k]));
      }
      const float s = std::max(amax / 127.0f, std::numeric_limits<float>::min());
      double residual = 0.0, norm = 0.0, approx_norm = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const float level = std::min(127.0f, std::max(-127.0f, std::nearbyint(row[k] / s)));  // half to even
        qp[v * K + k] = static_cast<int8_t>(level);
        const double w = row[k], a = static_cast<double>(level) * s;  // exact: an int8 times a float fits a double
        residual += (w - a) * (w - a);
        norm += w * w;
        approx_norm += a * a;
      }
      sp[v] = s;
      rp[v] = static_cast<float>((std::sqrt(residual) + gamma * (std::sqrt(norm) + std::sqrt(approx_norm))) *
                                 (1.0 + rel_slack));
    }
  });
  return {q, scale, rho};
}

// The logits x @ w.T + bias where a token could be the argmax of its row, -inf elsewhere, from the int8 copy
// (q, scale) of w and a per-token radius rho with |(x @ (q * scale).T)_j - (x @ w.T)_j| <= ||x|| * rho_j for
// any fp32 evaluation (infer/cpu/argmax_head.py derives it). Per row r: approx = x_r @ (q * scale).T + bias,
// bound_j = ||x_r|| * (1 + rel_slack) * rho_j, floor = max_j (approx_j - bound_j) - abs_slack * (max |approx|
// + max bound); token j is a candidate where approx_j + bound_j >= floor in any row, and its logit is then
// computed from w's row in every row. x: [R, K] fp32 with w [V, K] fp32 contiguous, or both bf16: then a
// candidate's logit is the one the streamed kernel's bf16 head computes (the same tile, so the same bits) rounded to
// bf16, held in the fp32 output (the caller sets abs_slack to cover that rounding: a token may tie the winner once
// rounded). Returns [R, V] fp32, or an empty tensor where x is not finite or more than max_candidates tokens are
// candidates (then the caller computes the full head).
torch::Tensor argmax_logits(const torch::Tensor& x_in, const torch::Tensor& weight, const torch::Tensor& q,
                            const torch::Tensor& scale, const torch::Tensor& rho_in,
                            const c10::optional<torch::Tensor>& bias_in, double rel_slack, double abs_slack,
                            int64_t max_candidates) {
  const bool bf16 = x_in.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(weight.scalar_type() == (bf16 ? torch::kBFloat16 : torch::kFloat),
              "argmax_logits: x and the weight must both be float32 or both bfloat16");
  const torch::Tensor xb = x_in.contiguous(), x = bf16 ? xb.to(torch::kFloat) : xb, rho = rho_in.contiguous();
  const int64_t R = x.size(0), V = q.size(0), K = x.size(1);
  check_weight(weight, c10::nullopt, c10::nullopt, K, "argmax_logits");
  TORCH_CHECK(weight.size(0) == V && rho.dim() == 1 && rho.size(0) == V && rho.scalar_type() == torch::kFloat,
              "argmax_logits: weight [V, K] and rho [V] float32 expected, V = ", V);
  const bool has_bias = bias_in.has_value() && bias_in->defined();
  const torch::Tensor bias = has_bias ? bias_in->to(torch::kFloat).contiguous() : torch::Tensor();
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < R * K; ++i)
    if (!std::isfinite(xp[i])) return torch::empty({0}, x.options());
  // [R, V]: approx, then the logits in place
#if defined(__AVX512BF16__)
  torch::Tensor out = bf16 ? int8_rows_linear_bf16(xb, q, scale) : int8_rows_linear(x, q, scale);
#else
  torch::Tensor out = int8_rows_linear(x, q, scale);
#endif
  if (has_bias) out.add_(bias);
  float* op = out.data_ptr<float>();
  const float* rp = rho.data_ptr<float>();
  float rho_max = 0.0f;
  for (int64_t j = 0; j < V; ++j) rho_max = std::max(rho_max, rp[j]);
  std::vector<float> norms(R), floors(R);
  for (int64_t r = 0; r < R; ++r) {
    double sq = 0.0;
    for (int64_t k = 0; k < K; ++k) sq += static_cast<double>(xp[r * K + k]) * xp[r * K + k];
    const float norm = norms[r] = static_cast<float>(std::sqrt(sq) * (1.0 + rel_slack));
    const float* a = op + r * V;
    // max_j (a_j - norm * rho_j) and max_j |a_j|, kLanes at a time (std::max on floats does not vectorize)
    const vec normv = vec{} + norm;
    vec lowv = vec{} - std::numeric_limits<float>::infinity(), magv = vec{};
    int64_t j = 0;
    for (; j + kLanes <= V; j += kLanes) {
      const vec av = *reinterpret_cast<const vec*>(a + j), rv = *reinterpret_cast<const vec*>(rp + j);
      const vec lv = av - normv * rv, mv = av < 0 ? -av : av;
      lowv = lv > lowv ? lv : lowv;
      magv = mv > magv ? mv : magv;
    }
    float low = -std::numeric_limits<float>::infinity(), magnitude = 0.0f;
    for (int64_t l = 0; l < kLanes; ++l) {
      low = std::max(low, lowv[l]);
      magnitude = std::max(magnitude, magv[l]);
    }
    for (; j < V; ++j) {
      low = std::max(low, a[j] - norm * rp[j]);
      magnitude = std::max(magnitude, std::fabs(a[j]));
    }
    if (!std::isfinite(low) || !std::isfinite(magnitude)) return torch::empty({0}, x.options());
    floors[r] = low - static_cast<float>(abs_slack) * (magnitude + norm * rho_max);
  }
  // margin_j = max_r (approx_rj + bound_rj - floor_r): token j is a candidate where it is >= 0
  std::vector<float> margin(V, -std::numeric_limits<float>::infinity());
  float* mp = margin.data();
  for (int64_t r = 0; r < R; ++r) {
    const float* a = op + r * V;
    const float norm = norms[r], floor = floors[r];
    const vec normv = vec{} + norm, floorv = vec{} + floor;
    int64_t j = 0;
    for (; j + kLanes <= V; j += kLanes) {
      vec& m = *reinterpret_cast<vec*>(mp + j);
      const vec c = *reinterpret_cast<const vec*>(a + j) + normv * *reinterpret_cast<const vec*>(rp + j) - floorv;
      m = c > m ? c : m;
    }
    for (; j < V; ++j) mp[j] = std::max(mp[j], a[j] + norm * rp[j] - floor);
  }
  std::vector<int64_t> ids;
  for (int64_t j = 0; j < V; ++j) {
    if (mp[j] >= 0) {
      ids.push_back(j);
      if (static_cast<int64_t>(ids.size()) > max_candidates) return torch::empty({0}, x.options());
    }
  }
  for (int64_t r = 0; r < R; ++r) std::fill(op + r * V, op + (r + 1) * V, -std::numeric_limits<float>::infinity());
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  if (bf16) {
    const c10::BFloat16* wp = weight.data_ptr<c10::BFloat16>();
    for (const int64_t j : ids) {
#if defined(__AVX512BF16__)
      weight_rows_bf16<1>(xb.data_ptr<c10::BFloat16>(), wp, op, R, K, V, j);  // the head's own tile: the same bits
#else
      weight_rows<1>(xp, wp, op, R, K, V, j);  // x widened exactly, as few_rows_linear_cat widens it here
#endif
      for (int64_t r = 0; r < R; ++r) {
        const float logit = bp == nullptr ? op[r * V + j] : op[r * V + j] + bp[j];
        op[r * V + j] = static_cast<float>(c10::BFloat16(logit));  // rounded to nearest even, as torch's .to()
      }
    }
    return out;
  }
  const float* wp = weight.data_ptr<float>();
  for (const int64_t j : ids) {
    for (int64_t r = 0; r < R; ++r) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += xp[r * K + k] * wp[j * K + k];
      op[r * V + j] = bp == nullptr ? sum : sum + bp[j];
    }
  }
  return out;
}

// RMSNorm over the last dimension, as Llama-family models compute it in fp32:
// y = weight * x / sqrt(mean(x^2) + eps). x: [M, K] fp32, weight: [K] fp32.
torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat, "rms_norm: x [M, K] float32 expected");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x_in.size(1) && weight.scalar_type() == torch::kFloat,
              "rms_norm: weight [K] float32 expected");
  const torch::Tensor x = x_in.contiguous();
  const torch::Tensor w = weight.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  torch::Tensor y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xp + m * K;
    float sum = 0.0f;
    for (int64_t k = 0; k < K; ++k) sum += row[k] * row[k];
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(K) + static_cast<float>(eps));
    for (int64_t k = 0; k < K; ++k) yp[m * K + k] = wp[k] * (row[k] * scale);
  }
  return y;
}

// Rotary position embedding, in place, on the first `heads` heads of each row of a fused q/k/v projection,
// as Llama-family models apply it: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1).
// qkv: [M, (any) * D] fp32 contiguous, cos/sin: [M, D] fp32 (the model's rotary module's output).
void rope_(torch::Tensor& qkv, const torch::Tensor& cos_in, const torch::Tensor& sin_in, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat && qkv.is_contiguous(),
              "rope_: qkv [M, width] float32 contiguous expected");
  TORCH_CHECK(cos_in.dim() == 2 && cos_in.sizes() == sin_in.sizes() && cos_in.size(0) == qkv.size(0) &&
              cos_in.scalar_type() == torch::kFloat && sin_in.scalar_type() == torch::kFloat,
              "rope_: cos and sin [M, D] float32 expected");
  const torch::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const int64_t M = qkv.size(0), width = qkv.size(1), D = cos.size(1), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && heads * D <= width, "rope_: ", heads, " heads of ", D, " do not fit in ", width);
  float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* c = cp + m * D;
    const float* s = sp + m * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* x = xp + m * width + h * D;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i + half] + x1 * s[i + half];
      }
    }
  }
}

namespace {

typedef int32_t ivec __attribute__((vector_size(kLanes * sizeof(int32_t))));

// e^x lane by lane, for a softmax (x <= 0 there): 2^n * e^f with n = round(x / ln 2) and |f| <= ln 2 / 2, e^f
// by its Taylor polynomial to f^7 (truncation under 6e-9 relative, below float's rounding); 0 below -87, where
// e^x leaves float's normal range (a masked slot's -inf), and NaN where x is NaN.
inline vec exp_lanes(vec x) {
  const vec magic = vec{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds a float to an integer
  const vec low = vec{} - 87.0f;
  const vec xc = x < low ? low : x;
  const vec n = (xc * 1.44269504f + magic) - magic;
  const vec f = (xc - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n ln 2, ln 2 in two parts (Cody-Waite)
  vec e = vec{} + (1.0f / 5040);
  e = e * f + (1.0f / 720);
  e = e * f + (1.0f / 120);
  e = e * f + (1.0f / 24);
  e = e * f + (1.0f / 6);
  e = e * f + 0.5f;
  e = e * f + 1.0f;
  e = e * f + 1.0f;
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;  // 2^n, for -126 <= n <= 0
  vec two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  e *= two_n;
  e = x < low ? vec{} : e;
  return x != x ? x : e;
}

// Whether few_rows_attention takes these inputs (else SDPA runs them).
bool few_rows_attention_fits(const torch::Tensor& qkv, const torch::Tensor& keys, const torch::Tensor& values,
                             const torch::Tensor& mask, int64_t heads) {
  if (qkv.dim() != 2 || keys.dim() != 4 || !mask.defined() || mask.dim() != 4) return false;
  const int64_t B = keys.size(0), KVH = keys.size(1), S = keys.size(2), D = keys.size(3);
  return B > 0 && KVH > 0 && S > 0 && heads > 0 && heads % KVH == 0 && qkv.size(0) % B == 0 &&
         heads * D <= qkv.size(1) &&
         (D == kLanes || D == 2 * kLanes || D == 4 * kLanes || D == 8 * kLanes) && qkv.is_contiguous() &&
         qkv.scalar_type() == torch::kFloat && keys.scalar_type() == torch::kFloat &&
         values.scalar_type() == torch::kFloat && values.sizes() == keys.sizes() && keys.stride(3) == 1 &&
         values.stride(3) == 1 && mask.scalar_type() == torch::kFloat && mask.size(0) == B && mask.size(1) == 1 &&
         mask.size(2) == qkv.size(0) / B && mask.size(3) == S;
}

constexpr int64_t kSlotBlock = 32;  // K (or V) rows that stay in L1 while every query of a group reads them

// The queries of one K/V head (its query heads' rows of a block) against it: out_i = softmax(q_i . K * scale +
// mask_i) V for i < Q, with C vectors of kLanes floats a head (a compile-time count, so q and the sums stay in
// registers). Slots go in blocks of kSlotBlock, each block read by every query while it is in L1: a K/V head of
// 300 slots is 150 KB, so a query at a time would read it from L2 once per query.
// q, out, mask: Q row pointers; K, V: S rows of stride key_step / value_step; w: scratch for Q * (S + kLanes)
// floats; inverse: scratch for Q floats.
template <int C>
void attend_group(const float* const* q, float* const* out, const float* const* mask, int64_t Q, const float* K,
                  int64_t key_step, const float* V, int64_t value_step, int64_t S, float scale, float* w,
                  float* inverse) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  const int64_t ld = S + kLanes;
  for (int64_t s0 = 0; s0 < S; s0 += kSlotBlock) {  // 1. scores
    const int64_t s1 = std::min(S, s0 + kSlotBlock);
    for (int64_t i = 0; i < Q; ++i) {
      vec qv[C];
      for (int c = 0; c < C; ++c) qv[c] = load_lanes(q[i] + c * kLanes);
      float* wi = w + i * ld;
      int64_t s = s0;
      for (; s + 4 <= s1; s += 4) {  // four slots a step, their lane sums taken together
        const float* k = K + s * key_step;
        vec acc[4];
        for (int j = 0; j < 4; ++j) acc[j] = qv[0] * load_lanes(k + j * key_step);
        for (int c = 1; c < C; ++c)
          for (int j = 0; j < 4; ++j) acc[j] += qv[c] * load_lanes(k + j * key_step + c * kLanes);
        vec4 sums = sum_lanes4(acc[0], acc[1], acc[2], acc[3]) * scale;
        for (int j = 0; j < 4; ++j) wi[s + j] = sums[j] + mask[i][s + j];
      }
      for (; s < s1; ++s) {
        const float* k = K + s * key_step;
        vec acc = qv[0] * load_lanes(k);
        for (int c = 1; c < C; ++c) acc += qv[c] * load_lanes(k + c * kLanes);
        wi[s] = sum_lanes(acc) * scale + mask[i][s];
      }
    }
  }
  for (int64_t i = 0; i < Q; ++i) {  // 2. e^(score - max) and 1 / their sum; 0 for a row that sees no slot
    float* wi = w + i * ld;
    std::fill(wi + S, wi + ld, minus_inf);  // the lanes past S weigh nothing
    vec tops = vec{} + minus_inf;
    for (int64_t s = 0; s < S; s += kLanes) {
      const vec x = load_lanes(wi + s);
      tops = x > tops || x != x ? x : tops;  // a NaN score makes the row NaN, as in SDPA
    }
    float top = minus_inf;
    for (int64_t l = 0; l < kLanes; ++l) top = tops[l] > top || tops[l] != tops[l] ? tops[l] : top;
    if (top == minus_inf) {
      inverse[i] = 0.0f;
      std::fill(wi, wi + S, 0.0f);
      continue;
    }
    vec total = {};
    for (int64_t s = 0; s < S; s += kLanes) {
      const vec e = exp_lanes(load_lanes(wi + s) - top);
      std::memcpy(wi + s, &e, sizeof(e));
      total += e;
    }
    inverse[i] = 1.0f / sum_lanes(total);
  }
  for (int64_t s0 = 0; s0 < S; s0 += kSlotBlock) {  // 3. the weighted values, summed into out block by block
    const int64_t s1 = std::min(S, s0 + kSlotBlock);
    for (int64_t i = 0; i < Q; ++i) {
      const float* wi = w + i * ld;
      vec even[C] = {}, odd[C] = {};  // two sums, so consecutive slots do not wait on each other
      if (s0 > 0) for (int c = 0; c < C; ++c) even[c] = load_lanes(out[i] + c * kLanes);
      int64_t s = s0;
      for (; s + 1 < s1; s += 2) {
        const vec w0 = vec{} + wi[s], w1 = vec{} + wi[s + 1];
        const float* v0 = V + s * value_step;
        const float* v1 = v0 + value_step;
        for (int c = 0; c < C; ++c) {
          even[c] += w0 * load_lanes(v0 + c * kLanes);
          odd[c] += w1 * load_lanes(v1 + c * kLanes);
        }
      }
      if (s < s1) {
        const vec w0 = vec{} + wi[s];
        for (int c = 0; c < C; ++c) even[c] += w0 * load_lanes(V + s * value_step + c * kLanes);
      }
      const vec last = vec{} + (s1 == S ? inverse[i] : 1.0f);  // 1 / the sum of weights, after the last block
      for (int c = 0; c < C; ++c) {
        const vec r = (even[c] + odd[c]) * last;
        std::memcpy(out[i] + c * kLanes, &r, sizeof(r));
      }
    }
  }
}

}  // namespace

// The work of `few_rows_attention` (below) on inputs `few_rows_attention_fits` has taken: `attention_tail`
// checks them once and calls this.
torch::Tensor few_rows_attention_fitting(const torch::Tensor& qkv, const torch::Tensor& keys,
                                         const torch::Tensor& values, const torch::Tensor& mask_in, int64_t heads,
                                         double scale) {
  const int64_t B = keys.size(0), KVH = keys.size(1), S = keys.size(2), D = keys.size(3);
  const int64_t N = qkv.size(0) / B, width = qkv.size(1), group = heads / KVH;
  const torch::Tensor mask = mask_in.contiguous();
  torch::Tensor out = torch::empty({B * N, heads * D}, qkv.options());
  const float* qp = qkv.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const float* mp = mask.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t key_step = keys.stride(2), value_step = values.stride(2);
  const float sc = static_cast<float>(scale);
  auto attend = &attend_group<1>;
  switch (D / kLanes) {
    case 1: break;
    case 2: attend = &attend_group<2>; break;
    case 4: attend = &attend_group<4>; break;
    case 8: attend = &attend_group<8>; break;
    default: TORCH_CHECK(false, "few_rows_attention: heads of ", D, " are not taken (", kLanes, " x 1, 2, 4 or 8)");
  }
  // Work items: a K/V head of a batch row, with its queries (group heads x N rows) in `parts` shares, so that
  // SmolLM2's 3 K/V heads make 6 items for 2 threads, each reading its K/V head once.
  const int64_t queries = group * N, parts = std::min<int64_t>(queries, 2);
  at::parallel_for(0, B * KVH * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(((queries + parts - 1) / parts) * (S + kLanes)), inverse(queries);
    std::vector<const float*> q_rows, mask_rows;
    std::vector<float*> out_rows;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (KVH * parts), g = item / parts % KVH, part = item % parts;
      q_rows.clear();
      mask_rows.clear();
      out_rows.clear();
      for (int64_t i = part; i < queries; i += parts) {  // query i: head g * group + i / N, row i % N
        const int64_t h = g * group + i / N, n = i % N;
        q_rows.push_back(qp + (b * N + n) * width + h * D);
        mask_rows.push_back(mp + (b * N + n) * S);
        out_rows.push_back(op + (b * N + n) * heads * D + h * D);
      }
      attend(q_rows.data(), out_rows.data(), mask_rows.data(), static_cast<int64_t>(q_rows.size()),
             kp + b * keys.stride(0) + g * keys.stride(1), key_step, vp + b * values.stride(0) + g * values.stride(1),
             value_step, S, sc, w.data(), inverse.data());
    }
  });
  return out;
}

// softmax(q . k * scale + mask) v for each query row of a few-row block, head by head, as SDPA computes it.
// Faster than SDPA's flash kernel for CPU at the few rows of a verify block, slower at one row or past about
// eight (docs/benchmarks.md, "Measurements behind the CPU engine's design"); the lean forward calls it where it wins.
// qkv: [B*N, width] with q's heads first, each D wide; keys, values: [B, KVH, S, D] with D contiguous; mask:
// [B, 1, N, S] additive fp32. Query head h reads K/V head h / (heads / KVH). Returns
// [B*N, heads*D], the layout the o projection reads. A row whose every slot is masked gets zeros.
torch::Tensor few_rows_attention(const torch::Tensor& qkv, const torch::Tensor& keys, const torch::Tensor& values,
                                 const torch::Tensor& mask, int64_t heads, double scale) {
  TORCH_CHECK(few_rows_attention_fits(qkv, keys, values, mask, heads),
              "few_rows_attention: qkv [B*N, width] contiguous, keys and values [B, KVH, S, D] float32 with D "
              "contiguous and ", kLanes, " x 1, 2, 4 or 8, and mask [B, 1, N, S] float32 expected");
  return few_rows_attention_fitting(qkv, keys, values, mask, heads, scale);
}

// Weights that share an input and write side by side (q/k/v, gate/up) or one alone, as few_rows_linear_cat takes
// them: fp32, or int8 rows with their scales; biases and scales one (or None) per weight, or empty. Made once per
// layer by the lean forward (infer/cpu/lean_forward.py), so a layer's call passes four of these, not twelve lists.
struct Linears {
  std::vector<torch::Tensor> weights;
  std::vector<c10::optional<torch::Tensor>> biases, scales, lows;
  bool quantized = false;  // some weight is int8 or 4-bit: only this kernel runs it

  Linears(std::vector<torch::Tensor> weights_, std::vector<c10::optional<torch::Tensor>> biases_,
          std::vector<c10::optional<torch::Tensor>> scales_, std::vector<c10::optional<torch::Tensor>> lows_)
      : weights(std::move(weights_)), biases(std::move(biases_)), scales(std::move(scales_)), lows(std::move(lows_)) {
    TORCH_CHECK(!weights.empty(), "Linears: no weight given");
    for (const torch::Tensor& w : weights) quantized = quantized || w.scalar_type() != torch::kFloat;
  }
  int64_t out_features(size_t i) const { return weights[i].size(0); }
};

namespace {

// x through `linears` side by side, as the lean forward's `_linear` runs a block: the streamed kernel (always
// for int8 weights), or ATen's linear (one row: the GEMV at the memory floor).
torch::Tensor linear_rows(const torch::Tensor& x, const Linears& linears, bool stream) {
  if (stream || linears.quantized)
    return few_rows_linear_cat(x, linears.weights, linears.biases, linears.scales, linears.lows);
  std::vector<torch::Tensor> parts;
  for (size_t i = 0; i < linears.weights.size(); ++i)
    parts.push_back(at::linear(x, linears.weights[i], linears.biases.empty() ? c10::nullopt : linears.biases[i]));
  return parts.size() == 1 ? parts[0] : at::cat(parts, 1);
}

// silu(gate) * up on the rows of gate_up [M, 2I], gate's I columns first: [M, I]. silu(g) = g * sigmoid(g), the
// sigmoid from t = e^-|g| (exp_lanes' domain, no overflow either way): 1 / (1 + t) for g >= 0, t / (1 + t) below.
// One pass where ATen's silu and mul took 17 us a layer at 4 rows (SmolLM2, inside a verify forward).
torch::Tensor silu_mul(const torch::Tensor& gate_up_in, int64_t I) {
  const torch::Tensor gate_up = gate_up_in.contiguous();
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) == 2 * I && gate_up.scalar_type() == torch::kFloat,
              "silu_mul: gate_up [M, 2 x ", I, "] float32 expected");
  const int64_t M = gate_up.size(0);
  torch::Tensor out = torch::empty({M, I}, gate_up.options());
  for (int64_t m = 0; m < M; ++m) {
    const float* gate = gate_up.data_ptr<float>() + m * 2 * I;
    const float* up = gate + I;
    float* o = out.data_ptr<float>() + m * I;
    int64_t i = 0;
    for (; i + kLanes <= I; i += kLanes) {
      const vec g = load_lanes(gate + i);
      const vec t = exp_lanes(g < 0 ? g : -g);
      const vec sigmoid = g < 0 ? t / (1.0f + t) : 1.0f / (1.0f + t);
      *reinterpret_cast<vec*>(o + i) = g * sigmoid * load_lanes(up + i);
    }
    for (; i < I; ++i) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  }
  return out;
}

}  // namespace

// A Llama decoder layer from attention on, and the next layer's input norm, in one call for a block's rows:
// att = SDPA(q, keys, values, mask); x += o(att); x += down(silu(gate(n)) * up(n)) with n = post_norm(x);
// y = next_norm(x). x: [B, N, D] the residual stream; qkv: [B*N, width] the rotated projection, q's `heads`
// heads of D first; keys, values: [B, KVH, S, D] the cache after this block's write; mask: [B, 1, N, S]
// additive. o, gate_up (gate first), down: `Linears`; `stream`: the streamed kernel for fp32 linears, else
// ATen's. Returns {x, y}.
std::vector<torch::Tensor> attention_tail(const torch::Tensor& x_in, const torch::Tensor& qkv, const torch::Tensor& keys,
                                          const torch::Tensor& values, const torch::Tensor& mask, int64_t heads,
                                          double scale, const Linears& o, const torch::Tensor& post_norm,
                                          double post_eps, const Linears& gate_up, const Linears& down,
                                          const torch::Tensor& next_norm, double next_eps, bool stream) {
  TORCH_CHECK(x_in.dim() == 3 && keys.dim() == 4 && gate_up.weights.size() == 2,
              "attention_tail: x [B, N, D], keys [B, KVH, S, D] and the gate and up weights expected");
  const int64_t B = x_in.size(0), N = x_in.size(1), D = x_in.size(2), head_dim = keys.size(3);
  torch::Tensor att;
  if (few_rows_attention_fits(qkv, keys, values, mask, heads)) {
    att = few_rows_attention_fitting(qkv, keys, values, mask, heads, scale);
  } else {
    const torch::Tensor q = qkv.view({B, N, -1, head_dim}).narrow(2, 0, heads).transpose(1, 2);
    att = at::scaled_dot_product_attention(q, keys, values, mask, 0.0, false, scale, keys.size(1) != heads)
              .transpose(1, 2).reshape({B * N, heads * head_dim});
  }
  torch::Tensor x = x_in.reshape({B * N, D}) + linear_rows(att, o, stream);
  const torch::Tensor gu = linear_rows(rms_norm(x, post_norm, post_eps), gate_up, stream);
  x.add_(linear_rows(silu_mul(gu, gate_up.out_features(0)), down, stream));
  return {x.view({B, N, D}), rms_norm(x, next_norm, next_eps).view({B, N, D})};
}

// The block's K and V heads, from a rotated q/k/v projection qkv [B*N, width] (q's `heads` heads, then the
// buffers' KVH heads of K, then KVH of V, each D wide), into key_buffer and value_buffer [B, KVH, capacity, D]
// at slots [size, size + N). Returns the buffers' leading [B, KVH, size + N, D] slices: the keys and values
// the block attends to. One call for what transformers' cache update does in a dozen ops from Python.
std::vector<torch::Tensor> write_kv(const torch::Tensor& qkv, torch::Tensor& key_buffer, torch::Tensor& value_buffer,
                                    int64_t size, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat && qkv.is_contiguous(),
              "write_kv: qkv [B*N, width] float32 contiguous expected");
  TORCH_CHECK(key_buffer.dim() == 4 && key_buffer.sizes() == value_buffer.sizes() &&
              key_buffer.scalar_type() == torch::kFloat && value_buffer.scalar_type() == torch::kFloat &&
              key_buffer.is_contiguous() && value_buffer.is_contiguous(),
              "write_kv: key and value buffers [B, KVH, capacity, D] float32 contiguous, of one shape, expected");
  const int64_t B = key_buffer.size(0), KVH = key_buffer.size(1), capacity = key_buffer.size(2);
  const int64_t D = key_buffer.size(3), width = qkv.size(1);
  TORCH_CHECK(B > 0 && qkv.size(0) % B == 0, "write_kv: ", qkv.size(0), " rows of qkv for a batch of ", B);
  const int64_t N = qkv.size(0) / B;
  TORCH_CHECK(heads >= 0 && (heads + 2 * KVH) * D <= width, "write_kv: ", heads, " + 2 x ", KVH, " heads of ", D,
              " do not fit in qkv rows of ", width);
  TORCH_CHECK(size >= 0 && size + N <= capacity, "write_kv: slots [", size, ", ", size + N,
              ") do not fit buffers of ", capacity);
  const float* src = qkv.data_ptr<float>();
  float* kp = key_buffer.data_ptr<float>();
  float* vp = value_buffer.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < KVH; ++g) {
      const int64_t slot = (b * KVH + g) * capacity + size;
      for (int64_t n = 0; n < N; ++n) {
        const float* row = src + (b * N + n) * width;
        std::memcpy(kp + (slot + n) * D, row + (heads + g) * D, D * sizeof(float));
        std::memcpy(vp + (slot + n) * D, row + (heads + KVH + g) * D, D * sizeof(float));
      }
    }
  }
  return {key_buffer.narrow(2, 0, size + N), value_buffer.narrow(2, 0, size + N)};
}

// A whole Llama decoder layer for a block's rows, its K/V written into buffers with room for them: qkv =
// [q|k|v](y), rotary on q and k (`rope_`), K and V into the buffers at slots [size, size + N) (`write_kv`), then
// `attention_tail`. y: [B, N, K] the layer's normed input; cos, sin: [B*N, D]; the rest as attention_tail's.
// Returns {x, y, keys, values}: the next residual stream, its next norm, and the buffers' leading slices.
std::vector<torch::Tensor> decoder_layer(const torch::Tensor& x, const torch::Tensor& y, const Linears& qkv_linears,
                                         const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& key_buffer,
                                         torch::Tensor& value_buffer, int64_t size, const torch::Tensor& mask,
                                         int64_t heads, double scale, const Linears& o, const torch::Tensor& post_norm,
                                         double post_eps, const Linears& gate_up, const Linears& down,
                                         const torch::Tensor& next_norm, double next_eps, bool stream) {
  TORCH_CHECK(x.dim() == 3 && y.dim() == 3 && y.size(0) == x.size(0) && y.size(1) == x.size(1),
              "decoder_layer: x and y [B, N, *] of one block expected");
  torch::Tensor qkv = linear_rows(y.reshape({y.size(0) * y.size(1), y.size(2)}), qkv_linears, stream);
  rope_(qkv, cos, sin, heads + key_buffer.size(1));
  const std::vector<torch::Tensor> kv = write_kv(qkv, key_buffer, value_buffer, size, heads);
  std::vector<torch::Tensor> out = attention_tail(x, qkv, kv[0], kv[1], mask, heads, scale, o, post_norm, post_eps,
                                                  gate_up, down, next_norm, next_eps, stream);
  out.push_back(kv[0]);
  out.push_back(kv[1]);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("few_rows_linear", &few_rows_linear, "x [M, K] @ weight [N, K].T + bias for a few rows, fp32",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"));
  m.def("few_rows_linear_cat", &few_rows_linear_cat,
        "x [M, K] against several weights [N_i, K] (fp32, int8 rows or groups with scales, 4-bit groups with "
        "scales and lows; + biases) at once -> [M, sum N_i], fp32",
        pybind11::arg("x"), pybind11::arg("weights"), pybind11::arg("biases"),
        pybind11::arg("scales") = std::vector<c10::optional<torch::Tensor>>(),
        pybind11::arg("lows") = std::vector<c10::optional<torch::Tensor>>());
  // module_local: each build (native, AVX2) registers its own type, so both load in one process
  pybind11::class_<Linears>(m, "Linears", pybind11::module_local(),
                            "weights sharing an input (fp32, int8 or 4-bit), biases, scales, lows")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<c10::optional<torch::Tensor>>,
                          std::vector<c10::optional<torch::Tensor>>, std::vector<c10::optional<torch::Tensor>>>(),
           pybind11::arg("weights"), pybind11::arg("biases"), pybind11::arg("scales"), pybind11::arg("lows"))
      .def_readonly("quantized", &Linears::quantized);
  m.def("int8_rows_linear", &int8_rows_linear, "x [M, K] fp32 @ (q [N, K] int8 * scale [N, 1]).T, fp32 sums",
        pybind11::arg("x"), pybind11::arg("q"), pybind11::arg("scale"));
  m.def("int8_rows_radius", &int8_rows_radius,
        "an LM head [V, K] as int8 rows, their scales and the radius rho of each row's int8 and rounding error",
        pybind11::arg("weight"), pybind11::arg("gamma"), pybind11::arg("rel_slack"));
  m.def("argmax_logits", &argmax_logits,
        "x @ w.T + bias where a token could be its row's argmax (from w's int8 copy q, scale), -inf elsewhere",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("q"), pybind11::arg("scale"),
        pybind11::arg("rho"), pybind11::arg("bias"), pybind11::arg("rel_slack"), pybind11::arg("abs_slack"),
        pybind11::arg("max_candidates"));
  m.def("few_rows_attention", &few_rows_attention,
        "softmax(q k^T * scale + mask) v for a few query rows, q's heads first in qkv [B*N, width] -> [B*N, heads*D]",
        pybind11::arg("qkv"), pybind11::arg("keys"), pybind11::arg("values"), pybind11::arg("mask"),
        pybind11::arg("heads"), pybind11::arg("scale"));
  m.def("rms_norm", &rms_norm, "weight * x / sqrt(mean(x^2, -1) + eps) over the rows of x [M, K], fp32",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("rope_", &rope_, "rotary embedding in place on the first `heads` heads of qkv [M, width], fp32",
        pybind11::arg("qkv"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("heads"));
  m.def("attention_tail", &attention_tail,
        "a Llama decoder layer from attention on (attention, o, residual, MLP, residual) and next_norm(x)",
        pybind11::arg("x"), pybind11::arg("qkv"), pybind11::arg("keys"), pybind11::arg("values"),
        pybind11::arg("mask"), pybind11::arg("heads"), pybind11::arg("scale"), pybind11::arg("o"),
        pybind11::arg("post_norm"), pybind11::arg("post_eps"), pybind11::arg("gate_up"), pybind11::arg("down"),
        pybind11::arg("next_norm"), pybind11::arg("next_eps"), pybind11::arg("stream"));
  m.def("silu_mul", &silu_mul, "silu(gate) * up for gate_up [M, 2I], gate's I columns first -> [M, I], fp32",
        pybind11::arg("gate_up"), pybind11::arg("intermediate"));
  m.def("write_kv", &write_kv,
        "a block's K and V heads from qkv [B*N, width] into buffers [B, KVH, capacity, D] at slots [size, size + N)",
        pybind11::arg("qkv"), pybind11::arg("key_buffer"), pybind11::arg("value_buffer"), pybind11::arg("size"),
        pybind11::arg("heads"));
  m.def("decoder_layer", &decoder_layer,
        "a Llama decoder layer for a block: q/k/v, rotary, the K/V write into buffers with room, attention_tail",
        pybind11::arg("x"), pybind11::arg("y"), pybind11::arg("qkv"), pybind11::arg("cos"), pybind11::arg("sin"),
        pybind11::arg("key_buffer"), pybind11::arg("value_buffer"), pybind11::arg("size"), pybind11::arg("mask"),
        pybind11::arg("heads"), pybind11::arg("scale"), pybind11::arg("o"), pybind11::arg("post_norm"),
        pybind11::arg("post_eps"), pybind11::arg("gate_up"), pybind11::arg("down"), pybind11::arg("next_norm"),
        pybind11::arg("next_eps"), pybind11::arg("stream"));
}
