// Group-wise int4 projections on the CPU, one projection per call: y = x @ W for any number of input
// rows (a decode batch or a prefill chunk), reading the tiled layout of int4_tile.h in place.
//
// The inputs are prescaled once per call (int4_tile.h's `prescale`), then threads claim tiles of 16
// output columns from a shared counter (dynamic schedule, as gemv.cpp: a busy neighbour on one core
// delays only the tiles it claims) and run every input over each tile. Threads: the caller passes
// torch's intra-op count (the library shares torch's OpenMP runtime, see build.py).
#include <vector>

#include "int4_tile.h"

#ifdef _OPENMP
#include <omp.h>
#endif

extern "C" {

TP_EXPORT int tp_int4_tile() { return tidepool::TILE; }

TP_EXPORT int tp_int4_has_float16() { return TIDEPOOL_HAS_F16; }

// x [batch, k] (row stride ldx) times the tiled int4 weight of n columns -> y [batch, n] (row stride ldy).
// Returns 0, or -1 for arguments it does not take (the caller checks them first; this is a backstop).
TP_EXPORT int tp_int4_gemv(const float* x, int64_t ldx, const TpInt4Weight* weight, float* y, int64_t ldy,
                           int64_t batch, int64_t n, int64_t k, int32_t num_threads) {
  using namespace tidepool;
  const TpInt4Weight& w = *weight;
  if (batch < 1 || ldx < k || ldy < n || !int4_shape_ok(w, k, n)) return -1;
  std::vector<float> xs(batch * k), sums(batch * (k / w.group));
  prescale(x, ldx, batch, k, w.group, xs.data(), sums.data());
  const int64_t tiles = (n + TILE - 1) / TILE;
  const int threads = num_threads < 1 ? 1 : num_threads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < tiles; ++t) int4_tile(w, k, n, xs.data(), sums.data(), batch, t, y + t * TILE, ldy);
  return 0;
}

}  // extern "C"
