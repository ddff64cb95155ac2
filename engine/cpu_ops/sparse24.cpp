// 2:4-sparse projections on the CPU, one projection per call: y[b, o] = sum_i x[b, i] * W[o, i] over the kept
// values only (sparse24.h), float32 kept values or int8 ones times a per-row scale.
//
// The decode-time twin of gemv.cpp: threads claim BLOCK_ROWS-row blocks from a shared counter (dynamic
// schedule: a busy neighbour on one core delays only the blocks it claims) and run every input over each
// block with sparse24.h's sparse_rows (the row kernel up to panel_min_inputs() inputs, the packed panels
// from there), which the one-call decode step runs too, so the two give the same bits. Threads: the
// caller passes torch's intra-op count (the library shares torch's OpenMP runtime, see build.py).
#include <algorithm>
#include <cstdint>

#include "projections.h"

#ifdef _OPENMP
#include <omp.h>
#endif

extern "C" {

TP_EXPORT int tp_sparse24_max_batch() { return tidepool::MAX_WIDE_BATCH; }  // input rows one call takes

// As tp_gemv_set_panel_min_inputs, for this library (benchmarks comparing the two kernels in one process).
TP_EXPORT int64_t tp_sparse24_set_panel_min_inputs(int64_t n) { return tidepool::set_panel_min_inputs(n); }

// w: the 2:4 weight of `rows` outputs and `in` inputs; x: [batch, in] with row stride ldx; y: [batch, rows]
// with row stride ldy. Returns 0, or -1 for arguments it does not take (the caller checks them first).
TP_EXPORT int tp_sparse24_gemv(const TpSparseWeight* weight, const float* x, float* y, int64_t batch, int64_t rows,
                               int64_t in, int64_t ldx, int64_t ldy, int32_t num_threads) {
  using namespace tidepool;
  const TpSparseWeight& w = *weight;
  if (batch < 1 || batch > MAX_WIDE_BATCH || rows < 1 || in < 4 || ldx < in || ldy < rows || !sparse_ok(w, in))
    return -1;
  const int threads = num_threads < 1 ? 1 : num_threads;
  const int64_t blocks = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t block = 0; block < blocks; ++block)
    sparse_rows(w, nullptr, x, ldx, in, batch, block * BLOCK_ROWS, std::min(rows, (block + 1) * BLOCK_ROWS), y, ldy,
                0);
  return 0;
}

}  // extern "C"
