// The float32 elementwise pieces of a decoder layer, shared by fused.cpp (one op per call) and
// decoder.cpp (a whole decode step in one call), so both give the same bits.
//
//   add_rms_norm_row  res_out = x + residual (or x), out = weight * (h * rsqrt(mean(h^2) + eps))
//   silu              g * sigmoid(g) (vector: through exp2v; scalar: g / (1 + exp(-g)))
//   rotary_head       rotate-half rotary of one head in place: x * cos + swap_halves(x) * sin_signed,
//                     bit-identical to Hugging Face's float32 arithmetic (each product rounded, then
//                     the sum): the libraries are built with -ffp-contract=fast, so this function alone
//                     turns contraction off (an FMA would round once) and calls no helpers (GCC does
//                     not inline across different optimisation attributes).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace tidepool {
namespace {

constexpr int64_t PARALLEL_MIN_FLOATS = 1 << 15;  // below this, one thread: waking a team costs more

inline int team(int64_t floats, int num_threads) {
  return floats >= PARALLEL_MIN_FLOATS && num_threads > 1 ? num_threads : 1;
}

inline float sum_squares(const float* h, int64_t n) {
  vf acc[4] = {};
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W)
    for (int u = 0; u < 4; ++u) {
      const vf v = load(h + i + u * W);
      acc[u] += v * v;
    }
  for (; i + W <= n; i += W) {
    const vf v = load(h + i);
    acc[0] += v * v;
  }
  const vf s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  float total = 0.0f;
  for (int l = 0; l < W; ++l) total += s[l];
  for (; i < n; ++i) total += h[i] * h[i];
  return total;
}

void add_rms_norm_row(const float* x, const float* residual, const float* weight, float* out, float* res_out,
                      int64_t n, float eps) {
  const float* h = x;
  if (residual != nullptr) {
    int64_t i = 0;
    for (; i + W <= n; i += W) store(res_out + i, load(x + i) + load(residual + i));
    for (; i < n; ++i) res_out[i] = x[i] + residual[i];
    h = res_out;
  } else if (res_out != x) {
    std::memcpy(res_out, x, n * sizeof(float));
  }
  const float r = 1.0f / std::sqrt(sum_squares(h, n) / static_cast<float>(n) + eps);
  const vf rv = splat(r);
  int64_t i = 0;
  for (; i + W <= n; i += W) store(out + i, (load(h + i) * rv) * load(weight + i));
  for (; i < n; ++i) out[i] = (h[i] * r) * weight[i];
}

// silu(g) = g * sigmoid(g); sigmoid through e = exp(-|g|) <= 1, so exp2v only sees arguments <= 0.
inline vf silu(vf g) {
  const vf neg_abs = g < vf{} ? g : -g;
  const vf e = exp2v(neg_abs * 1.4426950408889634f);
  const vf one = splat(1.0f);
  const vf sig = g < vf{} ? e / (one + e) : one / (one + e);
  return g * sig;
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

#if defined(__clang__)
#define TP_NO_CONTRACT
#else
#define TP_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#endif

// a: one head's dim = 2 * half floats; c, s: that token's cos and sin_signed rows (dim floats each).
TP_NO_CONTRACT void rotary_head(float* a, const float* c, const float* s, int64_t half) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  float* b = a + half;
  int64_t i = 0;
  for (; i + W <= half; i += W) {
    vf av, bv, ca, cb, sa, sb;
    std::memcpy(&av, a + i, sizeof av);
    std::memcpy(&bv, b + i, sizeof bv);
    std::memcpy(&ca, c + i, sizeof ca);
    std::memcpy(&cb, c + half + i, sizeof cb);
    std::memcpy(&sa, s + i, sizeof sa);
    std::memcpy(&sb, s + half + i, sizeof sb);
    const vf ra = av * ca + bv * sa, rb = bv * cb + av * sb;
    std::memcpy(a + i, &ra, sizeof ra);
    std::memcpy(b + i, &rb, sizeof rb);
  }
  for (; i < half; ++i) {
    const float av = a[i], bv = b[i];
    a[i] = av * c[i] + bv * s[i];
    b[i] = bv * c[half + i] + av * s[half + i];
  }
}

}  // namespace
}  // namespace tidepool
