// The small-batch GEMV's row kernel, shared by gemv.cpp (one projection per call) and decoder.cpp
// (every projection of a decode step inside one parallel region).
//
// row_dot<B> reads one weight row (contiguous, [out, in] row-major) once and multiplies it with
// each of B input rows while it is in registers/L1; accumulation is float32 with independent vector
// accumulators per input row (FMA latency hiding), then one horizontal sum, so any caller that uses
// it gets the same bits for the same row. The weights are float32, or int8 (per-output-channel
// int8: each 8 weights widened to floats exactly, |w| <= 127; the caller applies the row's scale to
// the sum, which commutes with it).
#pragma once

#include <cstdint>
#include <cstring>

#include "vec.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tidepool {
namespace {

constexpr int MAX_BATCH = 8;         // inputs one pass of row_dot takes
constexpr int MAX_WIDE_BATCH = 256;  // gemv.cpp's grouped kernel: a bound on the arguments, not a tuning

// Independent accumulators per input row: enough to hide FMA latency, few enough that B x U of them
// plus the weight vectors fit the 16 vector registers of AVX2 (no spills at B = 8; AVX-512 has 32).
template <int B>
constexpr int accumulators() {
  return B == 1 ? 4 : (B == 2 ? 2 : 1);
}

inline vf load_weights(const float* p) { return load(p); }

// One vpmovsxbd and one vcvtdq2ps (AVX2 for 8 lanes, AVX-512 for 16). GCC turns the generic conversion
// of a byte vector into one scalar conversion per lane: measured, that made an int8 step 1.6x slower
// than the float32 one.
inline vf load_weights(const int8_t* p) {
#if defined(__AVX512F__)
  if constexpr (W == 16)
    return from_native(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#endif
#if defined(__AVX2__)
  if constexpr (W == 8)
    return from_native(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#endif
  vf out;
  for (int l = 0; l < W; ++l) out[l] = float(p[l]);
  return out;
}

// One output row for `B` inputs: U accumulators per input over U*W-float chunks, then W, then scalars.
template <int B, typename T = float>
inline void row_dot(const T* w, const float* x, int64_t ldx, int64_t in, float* out) {
  constexpr int U = accumulators<B>();
  constexpr int CHUNK = U * W * int(sizeof(T));  // bytes of weights one step of the main loop reads
  vf acc[B][U];
  for (int b = 0; b < B; ++b)
    for (int u = 0; u < U; ++u) acc[b][u] = vf{};
  int64_t i = 0;
  for (; i + U * W <= in; i += U * W) {
    if constexpr (CHUNK >= 64) {
      for (int c = 0; c < CHUNK; c += 64) prefetch_ahead(reinterpret_cast<const char*>(w + i) + c);
    } else if ((i * int64_t(sizeof(T))) % 64 == 0) {  // CHUNK divides 64: once per 64 bytes of the row
      prefetch_ahead(w + i);
    }
    vf wv[U];
    for (int u = 0; u < U; ++u) wv[u] = load_weights(w + i + u * W);
    for (int b = 0; b < B; ++b)
      for (int u = 0; u < U; ++u) acc[b][u] += wv[u] * load(x + b * ldx + i + u * W);
  }
  for (; i + W <= in; i += W) {
    const vf wv = load_weights(w + i);
    for (int b = 0; b < B; ++b) acc[b][0] += wv * load(x + b * ldx + i);
  }
  for (int b = 0; b < B; ++b) {
    vf s = acc[b][0];
    for (int u = 1; u < U; ++u) s += acc[b][u];
    float total = 0.0f;
    for (int l = 0; l < W; ++l) total += s[l];
    for (int64_t j = i; j < in; ++j) total += float(w[j]) * x[b * ldx + j];
    out[b] = total;
  }
}

}  // namespace
}  // namespace tidepool
