// Fused per-layer elementwise work of a decoder layer on the CPU, float32: what is left of a decode
// step once the projections and attention are compiled ops.
//
// At batch 1 the Llama layer's norms, residual adds, rotary and SwiGLU are ~100 tiny aten calls per
// layer (each a dispatch, an allocation or a view: ~10 ms of a ~40 ms SmolLM2-135M step, measured with
// bench/profile_decode.py), while the arithmetic is a few thousand floats. One call each here:
//   tp_add_rms_norm_f32  residual_out = x + residual (or x), out = weight * (h * rsqrt(mean(h^2) + eps))
//   tp_silu_mul_f32      out = silu(gate) * up over a fused [rows, 2 * inter] gate/up projection
//   tp_rotary_f32        rotate-half rotary, in place, heads of a token contiguous, any token stride
//   tp_store_kv_f32      copy each token's K and V rows into the paged cache at its slot
// Arithmetic follows Hugging Face's order (norm: sum of squares in float32, then x * r, then weight;
// rotary: x * cos + swap(x) * sin_signed, bit-identical; silu: g / (1 + exp(-g)) as g * sigmoid(g));
// norm and silu differ from torch's only by summation order, FMA contraction and exp's last bit.
// Rows are split across threads only when the call is big enough to pay for waking them.
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

}  // namespace
}  // namespace tidepool

#define TP_EXPORT __attribute__((visibility("default")))

extern "C" {

TP_EXPORT int tp_fused_abi_version() { return 1; }

TP_EXPORT int tp_fused_has_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

// x, residual (may be null), out, res_out: [rows, n] with row strides ldx / ldr / ldo / ldro; weight: [n].
TP_EXPORT int tp_add_rms_norm_f32(const float* x, const float* residual, const float* weight, float* out,
                                  float* res_out, int64_t rows, int64_t n, int64_t ldx, int64_t ldr, int64_t ldo,
                                  int64_t ldro, float eps, int32_t num_threads) {
  if (rows < 0 || n < 1 || ldx < n || ldo < n || ldro < n || (residual != nullptr && ldr < n)) return -1;
#pragma omp parallel for schedule(static) num_threads(tidepool::team(rows * n, num_threads))
  for (int64_t r = 0; r < rows; ++r)
    tidepool::add_rms_norm_row(x + r * ldx, residual == nullptr ? nullptr : residual + r * ldr, weight,
                               out + r * ldo, res_out + r * ldro, n, eps);
  return 0;
}

// gate_up: [rows, 2 * inter] (gate first) with row stride ld_in; out: [rows, inter] with row stride ld_out.
TP_EXPORT int tp_silu_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t inter, int64_t ld_in,
                              int64_t ld_out, int32_t num_threads) {
  using namespace tidepool;
  if (rows < 0 || inter < 1 || ld_in < 2 * inter || ld_out < inter) return -1;
#pragma omp parallel for schedule(static) num_threads(team(rows * inter, num_threads))
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * ld_in;
    const float* u = g + inter;
    float* o = out + r * ld_out;
    int64_t i = 0;
    for (; i + W <= inter; i += W) store(o + i, silu(load(g + i)) * load(u + i));
    for (; i < inter; ++i) o[i] = silu(g[i]) * u[i];
  }
  return 0;
}

// x: [tokens, heads, dim], heads contiguous (head stride dim), token stride ldx; cos, sin_signed:
// [tokens, dim] contiguous, sin_signed = cat(-sin, sin). x = x * cos + swap_halves(x) * sin_signed,
// bit-identical to Hugging Face's float32 arithmetic: each product rounded, then the sum. The
// library is built with -ffp-contract=fast, so this function alone turns contraction off (an FMA
// would round once: more accurate, no longer identical) and calls no helpers (GCC does not inline
// across different optimisation attributes).
#if defined(__clang__)
#define TP_NO_CONTRACT
#else
#define TP_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#endif
TP_EXPORT TP_NO_CONTRACT int tp_rotary_f32(float* x, const float* cos, const float* sin_signed, int64_t tokens,
                                           int64_t heads, int64_t dim, int64_t ldx, int32_t num_threads) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  using tidepool::vf;
  using tidepool::W;
  if (tokens < 0 || heads < 1 || dim < 2 || dim % 2 != 0 || ldx < heads * dim) return -1;
  const int64_t half = dim / 2;
  const int team = tokens * heads * dim >= tidepool::PARALLEL_MIN_FLOATS && num_threads > 1 ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(team)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos + t * dim;
    const float* s = sin_signed + t * dim;
    for (int64_t h = 0; h < heads; ++h) {
      float* a = x + t * ldx + h * dim;
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
  }
  return 0;
}

// k, v: [tokens, width] rows (width = kv heads * head dim, contiguous) with row strides ldk / ldv;
// k_cache, v_cache: num_slots rows of width floats. Returns -2 for a slot outside the cache
// (nothing after it is written).
TP_EXPORT int tp_store_kv_f32(const float* k, const float* v, float* k_cache, float* v_cache, const int64_t* slots,
                              int64_t tokens, int64_t width, int64_t ldk, int64_t ldv, int64_t num_slots) {
  if (tokens < 0 || width < 1 || ldk < width || ldv < width) return -1;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= num_slots) return -2;
    std::memcpy(k_cache + slot * width, k + t * ldk, width * sizeof(float));
    std::memcpy(v_cache + slot * width, v + t * ldv, width * sizeof(float));
  }
  return 0;
}

}  // extern "C"
