// How the one-call decode step (decoder.cpp) computes a projection in each of its three forms: float32
// rows and int8 rows (gemv.h's row kernel; int8: the sum times the row's scale, as gemv.cpp's
// tp_gemv_i8) in BLOCK_ROWS-row claims, and int4 tiles (int4_tile.h) claimed a 16-column tile at a
// time from inputs each thread prescaled into its own buffer. Each worksharing loop ends at its barrier.
#pragma once

#include <algorithm>
#include <cstdint>

#include "gemv.h"
#include "int4_tile.h"

// Per-output-channel int8 weights: W[o, i] = w[o, i] * scales[o] (w: [rows, in] row-major). w == nullptr: none.
struct TpInt8Weight {
  const int8_t* w;
  const float* scales;
};

namespace tidepool {
namespace {

constexpr int BLOCK_ROWS = 32;  // rows of a projection per claim (as gemv.cpp's dynamic schedule)

// A thread's prescaled int4 input (int4_tile.h's `prescale`): xs [B, in], sums [B, in / group].
struct Int4Input {
  float* xs;
  float* sums;
};

// y[b, o] = W x[b] (+ bias[o]) for an int4 W of `rows` outputs, 16-column tiles claimed one at a time.
template <int B>
void project_int4(const TpInt4Weight& w, const float* bias, const Int4Input& in, int64_t k, float* y, int64_t ldy,
                  int64_t rows) {
  const int64_t tiles = (rows + TILE - 1) / TILE;
#pragma omp for schedule(dynamic, 1)
  for (int64_t t = 0; t < tiles; ++t) {
    int4_tile(w, k, rows, in.xs, in.sums, B, t, y + t * TILE, ldy);
    if (bias != nullptr)
      for (int b = 0; b < B; ++b)
        for (int64_t o = t * TILE; o < std::min<int64_t>(rows, (t + 1) * TILE); ++o) y[b * ldy + o] += bias[o];
  }
}

// Row o of a float32 or int8 projection times B inputs (int8: the sum times the row's scale, as tp_gemv_i8).
template <int B>
inline void weight_row(const float* w, const TpInt8Weight& w8, int64_t o, const float* x, int64_t ldx, int64_t in,
                       float* r) {
  if (w != nullptr) {
    row_dot<B>(w + o * in, x, ldx, in, r);
    return;
  }
  row_dot<B>(w8.w + o * in, x, ldx, in, r);
  for (int b = 0; b < B; ++b) r[b] *= w8.scales[o];
}

// y[b, o] = w[o] . x[b] (+ bias[o]) for every row (float32 w, else int8 w8), in BLOCK_ROWS-row claims.
template <int B>
void project(const float* w, const TpInt8Weight& w8, const float* bias, const float* x, int64_t ldx, float* y,
             int64_t ldy, int64_t rows, int64_t in) {
#pragma omp for schedule(dynamic, BLOCK_ROWS)
  for (int64_t o = 0; o < rows; ++o) {
    float r[B];
    weight_row<B>(w, w8, o, x, ldx, in, r);
    for (int b = 0; b < B; ++b) y[b * ldy + o] = bias != nullptr ? r[b] + bias[o] : r[b];
  }
}

// Exactly one of the three forms; an int4 one of the shapes int4_tile.h takes, in whole tiles where
// its phase claims them (`whole_tiles`).
inline bool projection_ok(const float* w, const TpInt8Weight& w8, const TpInt4Weight& w4, int64_t in, int64_t rows,
                   bool whole_tiles) {
  const int forms = (w != nullptr) + (w8.w != nullptr) + (w4.q != nullptr);
  if (forms != 1) return false;
  if (w8.w != nullptr) return w8.scales != nullptr;
  return w4.q == nullptr || (int4_shape_ok(w4, in, rows) && whole_tiles);
}

}  // namespace
}  // namespace tidepool
