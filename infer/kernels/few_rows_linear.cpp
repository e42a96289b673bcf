// y = x @ w.T for the few rows of a verify step, streaming each fp32 weight row once from memory.
//
// A verify step multiplies every weight matrix by the 2-16 rows of a draft tree. The weights do not fit
// in cache, so the step is bound by how fast they stream from memory; BLAS GEMMs, made for many rows,
// stream them at about half the rate of the one-row GEMV on some CPUs (infer/cpu_linear.py has the
// numbers). Here each thread walks its own contiguous block of weight rows, 4 rows at a time with a
// software prefetch 1 KB ahead of each, and multiplies them by up to 4 input rows held in registers;
// more input rows take more passes over the same 4 weight rows, which are in L1 by then.
//
// The weight stays as it is (row-major [N, K], no packed copy). Sums run in a different order than
// BLAS, so results differ from F.linear by float rounding only.
//
// `few_rows_linear_cat` runs several weights sharing an input in one pass (q/k/v, gate/up), writing their
// outputs side by side; `rms_norm` is the Llama-family RMSNorm on the rows of a block, and `rope_` the rotary
// embedding applied in place to q and k in that side-by-side output; `attention_tail` the rest of a decoder
// layer after its K/V write, from attention to the next layer's input norm, in one call. They serve the lean
// verify forward (infer/lean_forward.py).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

// Accumulators live in vector registers: kWeightRows x kInputRows of them, plus kWeightRows weight vectors
// and one input vector. AVX-512 has 32 registers of 16 floats (16 + 4 + 1 fit); AVX2 has 16 of 8 floats, so
// there the tile is 4 x 2 (8 + 4 + 1) and 4 input rows take two passes over weight rows already in L1. The
// AVX-512 tile built for AVX2 spills its accumulators: the 211 SmolLM2 linears took 62/97/175 ms at 2/4/8
// rows (Xeon, -mno-avx512f), against 23/30/42 ms for the 4 x 2 tile and 29/32/36 ms for oneDNN.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
constexpr int64_t kWeightRows = 4;   // weight rows streamed together
constexpr int64_t kInputRows = 4;    // input rows per pass
#else
constexpr int64_t kLanes = 8;
constexpr int64_t kWeightRows = 4;
constexpr int64_t kInputRows = 2;
#endif
typedef float vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));
typedef float vec8 __attribute__((vector_size(32), aligned(4)));
typedef float vec4 __attribute__((vector_size(16), aligned(4)));
constexpr int64_t kPrefetch = 256;   // floats ahead of the current load, per weight row (1 KB)

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

// y[r, n + b] = x[r, :] . w[n + b, :] for r < R, b < B. x: [R, K] (row stride K), w: [N, K], y: rows of
// stride ldy (N for one weight; the total width when several weights write side by side).
template <int B, int R>
inline void tile(const float* x, const float* w, float* y, int64_t K, int64_t ldy, int64_t n) {
  vec acc[B][R] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    vec wv[B];
    for (int b = 0; b < B; ++b) {
      const float* row = w + (n + b) * K + k;
      wv[b] = *reinterpret_cast<const vec*>(row);
      __builtin_prefetch(row + kPrefetch, 0, 3);
    }
    for (int r = 0; r < R; ++r) {
      vec xv = *reinterpret_cast<const vec*>(x + r * K + k);
      for (int b = 0; b < B; ++b) acc[b][r] += wv[b] * xv;
    }
  }
  for (int b = 0; b < B; ++b) {
    for (int r = 0; r < R; ++r) {
      float s = sum_lanes(acc[b][r]);
      for (int64_t t = k; t < K; ++t) s += w[(n + b) * K + t] * x[r * K + t];  // K not a multiple of kLanes
      y[r * ldy + n + b] = s;
    }
  }
}

// Weight rows [n, n + B) against all M input rows, kInputRows at a time.
template <int B>
void weight_rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t ldy, int64_t n) {
  for (int64_t m = 0; m < M; m += kInputRows) {
    const float* xm = x + m * K;
    float* ym = y + m * ldy;
    switch (std::min(kInputRows, M - m)) {
      case 1: tile<B, 1>(xm, w, ym, K, ldy, n); break;
      case 2: tile<B, 2>(xm, w, ym, K, ldy, n); break;
      case 3: tile<B, 3>(xm, w, ym, K, ldy, n); break;
      default: tile<B, 4>(xm, w, ym, K, ldy, n); break;
    }
  }
}

void check_weight(const torch::Tensor& weight, int64_t K, const char* name) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == K, name, ": weight [N, K] expected, with K = ", K);
  TORCH_CHECK(weight.scalar_type() == torch::kFloat, name, ": float32 only");
  TORCH_CHECK(weight.is_contiguous(), name, ": the weight must be contiguous");
}

}  // namespace

// x: [M, K] fp32; weights: [N_i, K] fp32 contiguous; biases: one [N_i] (or None) per weight, or empty.
// Returns [M, sum N_i]: the weights' outputs side by side, as if they were one concatenated weight (the
// q/k/v or gate/up projections of a layer in one pass, without a concatenated copy of them in memory).
torch::Tensor few_rows_linear_cat(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights,
                                  const std::vector<c10::optional<torch::Tensor>>& biases) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat, "few_rows_linear: x [M, K] float32 expected");
  TORCH_CHECK(!weights.empty(), "few_rows_linear: no weight given");
  TORCH_CHECK(biases.empty() || biases.size() == weights.size(), "few_rows_linear: one bias (or None) per weight");
  const torch::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  // Work items, numbered across the weights: each weight's blocks of kWeightRows rows, then its tail rows one
  // by one. first[i] is the number of weight i's first item, column[i] its first output column.
  const size_t count = weights.size();
  std::vector<int64_t> first(count + 1, 0), column(count, 0);
  int64_t width = 0;
  for (size_t i = 0; i < count; ++i) {
    check_weight(weights[i], K, "few_rows_linear");
    const int64_t N = weights[i].size(0);
    first[i + 1] = first[i] + N / kWeightRows + N % kWeightRows;
    column[i] = width;
    width += N;
  }
  torch::Tensor y = torch::empty({M, width}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t items = first[count];
  const int64_t threads = at::get_num_threads();
  // one contiguous run of items per thread: each thread's stream of weight rows is sequential
  at::parallel_for(0, items, (items + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    size_t i = 0;
    for (int64_t j = begin; j < end; ++j) {
      while (j >= first[i + 1]) ++i;
      const float* wp = weights[i].data_ptr<float>();
      const int64_t blocks = weights[i].size(0) / kWeightRows, local = j - first[i];
      if (local < blocks) weight_rows<kWeightRows>(xp, wp, yp + column[i], M, K, width, local * kWeightRows);
      else weight_rows<1>(xp, wp, yp + column[i], M, K, width, blocks * kWeightRows + (local - blocks));
    }
  });
  for (size_t i = 0; i < biases.size(); ++i) {
    if (biases[i].has_value() && biases[i]->defined())
      y.narrow(1, column[i], weights[i].size(0)).add_(*biases[i]);
  }
  return y;
}

// x: [M, K] fp32, weight: [N, K] fp32 contiguous, bias: [N] or None -> [M, N]
torch::Tensor few_rows_linear(const torch::Tensor& x_in, const torch::Tensor& weight,
                              const c10::optional<torch::Tensor>& bias) {
  return few_rows_linear_cat(x_in, {weight}, {bias});
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

// x through weights side by side, as the lean forward's `_linear` runs a block: the streamed kernel, or
// ATen's linear (one row: the GEMV at the memory floor).
torch::Tensor linear_rows(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                          const std::vector<c10::optional<torch::Tensor>>& biases, bool stream) {
  if (stream) return few_rows_linear_cat(x, weights, biases);
  std::vector<torch::Tensor> parts;
  for (size_t i = 0; i < weights.size(); ++i)
    parts.push_back(at::linear(x, weights[i], biases.empty() ? c10::nullopt : biases[i]));
  return parts.size() == 1 ? parts[0] : at::cat(parts, 1);
}

}  // namespace

// A Llama decoder layer from attention on, and the next layer's input norm, in one call for a block's rows:
// att = SDPA(q, keys, values, mask); x += o(att); x += down(silu(gate(n)) * up(n)) with n = post_norm(x);
// y = next_norm(x). x: [B, N, D] the residual stream; qkv: [B*N, width] the rotated projection, q's `heads`
// heads of D first; keys, values: [B, KVH, S, D] the cache after this block's write; mask: [B, 1, N, S]
// additive. Weights [N, K] fp32 contiguous, one bias (or None) per weight or none; `stream`: the streamed
// kernel for the linears, else ATen's. Returns {x, y}.
std::vector<torch::Tensor> attention_tail(const torch::Tensor& x_in, const torch::Tensor& qkv, const torch::Tensor& keys,
                                          const torch::Tensor& values, const torch::Tensor& mask, int64_t heads,
                                          double scale, const torch::Tensor& o_weight,
                                          const std::vector<c10::optional<torch::Tensor>>& o_bias,
                                          const torch::Tensor& post_norm, double post_eps,
                                          const std::vector<torch::Tensor>& gate_up,
                                          const std::vector<c10::optional<torch::Tensor>>& gate_up_bias,
                                          const torch::Tensor& down_weight,
                                          const std::vector<c10::optional<torch::Tensor>>& down_bias,
                                          const torch::Tensor& next_norm, double next_eps, bool stream) {
  TORCH_CHECK(x_in.dim() == 3 && keys.dim() == 4 && gate_up.size() == 2,
              "attention_tail: x [B, N, D], keys [B, KVH, S, D] and the gate and up weights expected");
  const int64_t B = x_in.size(0), N = x_in.size(1), D = x_in.size(2), head_dim = keys.size(3);
  const torch::Tensor q = qkv.view({B, N, -1, head_dim}).narrow(2, 0, heads).transpose(1, 2);
  const torch::Tensor att = at::scaled_dot_product_attention(q, keys, values, mask, 0.0, false, scale,
                                                             keys.size(1) != heads)
                                .transpose(1, 2).reshape({B * N, heads * head_dim});
  torch::Tensor x = x_in.reshape({B * N, D}) + linear_rows(att, {o_weight}, o_bias, stream);
  const torch::Tensor gu = linear_rows(rms_norm(x, post_norm, post_eps), gate_up, gate_up_bias, stream);
  const int64_t I = gate_up[0].size(0);
  x.add_(linear_rows(at::silu(gu.narrow(1, 0, I)).mul_(gu.narrow(1, I, I)), {down_weight}, down_bias, stream));
  return {x.view({B, N, D}), rms_norm(x, next_norm, next_eps).view({B, N, D})};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("few_rows_linear", &few_rows_linear, "x [M, K] @ weight [N, K].T + bias for a few rows, fp32",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"));
  m.def("few_rows_linear_cat", &few_rows_linear_cat,
        "x [M, K] against several weights [N_i, K] (+ biases) at once -> [M, sum N_i], fp32",
        pybind11::arg("x"), pybind11::arg("weights"), pybind11::arg("biases"));
  m.def("rms_norm", &rms_norm, "weight * x / sqrt(mean(x^2, -1) + eps) over the rows of x [M, K], fp32",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("rope_", &rope_, "rotary embedding in place on the first `heads` heads of qkv [M, width], fp32",
        pybind11::arg("qkv"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("heads"));
  m.def("attention_tail", &attention_tail,
        "a Llama decoder layer from attention on (attention, o, residual, MLP, residual) and next_norm(x)",
        pybind11::arg("x"), pybind11::arg("qkv"), pybind11::arg("keys"), pybind11::arg("values"),
        pybind11::arg("mask"), pybind11::arg("heads"), pybind11::arg("scale"), pybind11::arg("o_weight"),
        pybind11::arg("o_bias"),
        pybind11::arg("post_norm"), pybind11::arg("post_eps"), pybind11::arg("gate_up"),
        pybind11::arg("gate_up_bias"), pybind11::arg("down_weight"), pybind11::arg("down_bias"),
        pybind11::arg("next_norm"), pybind11::arg("next_eps"), pybind11::arg("stream"));
}
