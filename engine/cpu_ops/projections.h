// How the one-call decode step (decoder.cpp) computes a projection in each of its four forms: float32
// rows and int8 rows (gemv.h's row kernel below PANEL_MIN_INPUTS inputs, panel.h's packed panels from
// there; int8: the sum times the row's scale) in BLOCK_ROWS-row claims, 2:4-sparse rows (sparse24.h:
// the same two kernels over rows expanded from their kept values) claimed the same way, and int4 tiles
// (int4_tile.h) claimed a 16-column tile at a time from inputs each thread prescaled into its own
// buffer. Each worksharing loop ends at its barrier.
// gemv.cpp's and sparse24.cpp's per-call ops run the same weight_rows / sparse_rows, so the paths give the same
// bits.
#pragma once

#include <algorithm>
#include <cstdint>

#include "gemv.h"
#include "int4_tile.h"
#include "panel.h"
#include "sparse24.h"

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

// y[b, o] = W x[b] (+ bias[o]) for an int4 W of `rows` outputs, 16-column tiles claimed one at a time
// (int4_tile takes the inputs MAX_INPUTS at a time).
inline void project_int4(const TpInt4Weight& w, const float* bias, const Int4Input& in, int64_t batch, int64_t k,
                         float* y, int64_t ldy, int64_t rows) {
  const int64_t tiles = (rows + TILE - 1) / TILE;
#pragma omp for schedule(dynamic, 1)
  for (int64_t t = 0; t < tiles; ++t) {
    int4_tile(w, k, rows, in.xs, in.sums, batch, t, y + t * TILE, ldy);
    if (bias != nullptr)
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t o = t * TILE; o < std::min<int64_t>(rows, (t + 1) * TILE); ++o) y[b * ldy + o] += bias[o];
  }
}

// Rows [lo, hi) of a float32 (w) or int8 (w8) projection times G inputs x [G, in]:
// y[b * ldy + o - col0] = w[o] . x[b] (int8: times the row's scale, as tp_gemv_i8) (+ bias[o]).
template <int G>
void group_rows(const float* w, const TpInt8Weight& w8, const float* bias, const float* x, int64_t ldx, int64_t in,
                int64_t lo, int64_t hi, float* y, int64_t ldy, int64_t col0) {
  for (int64_t o = lo; o < hi; ++o) {
    float r[G];
    if (w != nullptr) {
      row_dot<G>(w + o * in, x, ldx, in, r);
    } else {
      row_dot<G>(w8.w + o * in, x, ldx, in, r);
      for (int b = 0; b < G; ++b) r[b] *= w8.scales[o];
    }
    for (int b = 0; b < G; ++b) y[b * ldy + o - col0] = bias != nullptr ? r[b] + bias[o] : r[b];
  }
}

// The same for `batch` inputs. From PANEL_MIN_INPUTS: panel.h's packed-panel kernel, whose sums do not
// depend on how the inputs are grouped. Below: the row kernel on the inputs MAX_BATCH at a time from
// the first (row_dot's accumulators depend on the group's size). gemv.cpp runs this same function, so
// both paths give every input the same bits. Rows [lo, hi) are few (a block, a head).
inline void weight_rows(const float* w, const TpInt8Weight& w8, const float* bias, const float* x, int64_t ldx,
                        int64_t in, int64_t batch, int64_t lo, int64_t hi, float* y, int64_t ldy, int64_t col0) {
  if (batch >= panel_min_inputs().load(std::memory_order_relaxed)) {
    if (w != nullptr)
      panel_rows(w, nullptr, bias, x, ldx, in, batch, lo, hi, y, ldy, col0);
    else
      panel_rows(w8.w, w8.scales, bias, x, ldx, in, batch, lo, hi, y, ldy, col0);
    return;
  }
  using GroupFn = void (*)(const float*, const TpInt8Weight&, const float*, const float*, int64_t, int64_t, int64_t,
                           int64_t, float*, int64_t, int64_t);
  constexpr GroupFn GROUPS[MAX_BATCH + 1] = {
      nullptr,        group_rows<1>, group_rows<2>, group_rows<3>, group_rows<4>,
      group_rows<5>,  group_rows<6>, group_rows<7>, group_rows<8>,
  };
  for (int64_t b = 0; b < batch; b += MAX_BATCH)
    GROUPS[std::min<int64_t>(MAX_BATCH, batch - b)](w, w8, bias, x + b * ldx, ldx, in, lo, hi, y + b * ldy, ldy, col0);
}

// A float32 (w), int8 (w8) or 2:4-sparse (ws) projection's rows [lo, hi), as weight_rows / sparse_rows.
struct RowWeight {
  const float* w;
  const TpInt8Weight& w8;
  const TpSparseWeight& ws;
};

inline void any_rows(const RowWeight& rw, const float* bias, const float* x, int64_t ldx, int64_t in, int64_t batch,
                     int64_t lo, int64_t hi, float* y, int64_t ldy, int64_t col0) {
  if (rw.ws.values != nullptr)
    sparse_rows(rw.ws, bias, x, ldx, in, batch, lo, hi, y, ldy, col0);
  else
    weight_rows(rw.w, rw.w8, bias, x, ldx, in, batch, lo, hi, y, ldy, col0);
}

// y[b, o] = w[o] . x[b] (+ bias[o]) for every row (float32, int8 or 2:4 sparse), in BLOCK_ROWS-row claims.
inline void project(const RowWeight& rw, const float* bias, const float* x, int64_t ldx, int64_t batch, float* y,
                    int64_t ldy, int64_t rows, int64_t in) {
  const int64_t blocks = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
#pragma omp for schedule(dynamic, 1)
  for (int64_t blk = 0; blk < blocks; ++blk)
    any_rows(rw, bias, x, ldx, in, batch, blk * BLOCK_ROWS, std::min(rows, (blk + 1) * BLOCK_ROWS), y, ldy, 0);
}

// Exactly one of the four forms; an int4 one of the shapes int4_tile.h takes, in whole tiles where
// its phase claims them (`whole_tiles`); a 2:4 one as sparse_ok.
inline bool projection_ok(const float* w, const TpInt8Weight& w8, const TpSparseWeight& ws, const TpInt4Weight& w4,
                          int64_t in, int64_t rows, bool whole_tiles) {
  const int forms = (w != nullptr) + (w8.w != nullptr) + (ws.values != nullptr) + (w4.q != nullptr);
  if (forms != 1) return false;
  if (w8.w != nullptr) return w8.scales != nullptr;
  if (ws.values != nullptr) return sparse_ok(ws, in);
  return w4.q == nullptr || (int4_shape_ok(w4, in, rows) && whole_tiles);
}

}  // namespace
}  // namespace tidepool
