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
#include <cstdint>
#include <cstring>

#include "fused.h"

extern "C" {

TP_EXPORT int tp_fused_abi_version() { return 1; }

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
// [tokens, dim] contiguous, sin_signed = cat(-sin, sin). Rotated in place by rotary_head (fused.h:
// bit-identical to Hugging Face's float32 arithmetic).
TP_EXPORT int tp_rotary_f32(float* x, const float* cos, const float* sin_signed, int64_t tokens, int64_t heads,
                            int64_t dim, int64_t ldx, int32_t num_threads) {
  using namespace tidepool;
  if (tokens < 0 || heads < 1 || dim < 2 || dim % 2 != 0 || ldx < heads * dim) return -1;
#pragma omp parallel for schedule(static) num_threads(team(tokens * heads * dim, num_threads))
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) rotary_head(x + t * ldx + h * dim, cos + t * dim, sin_signed + t * dim, dim / 2);
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
