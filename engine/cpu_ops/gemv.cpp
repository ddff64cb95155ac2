// Small-batch matrix-vector products for decode: y[b, o] = sum_i x[b, i] * w[o, i], float32 weights or
// per-output-channel int8 ones (times scale[o]; a quarter of the bytes to stream).
//
// Decode at batch 1..8 is bound by reading the weights once per step; a GEMM library tuned for big
// products leaves a good part of the read bandwidth unused at these shapes. Here every weight row
// (contiguous, [out, in] row-major) is read exactly once and multiplied with each of the `batch`
// input rows while it is in registers/L1; the inputs (batch x in floats) stay in L1/L2. Threads take
// blocks of 32 output rows from a shared counter (dynamic schedule): with a busy neighbour on one
// core, a static split would make every call wait for the thread that core delays; a block is
// 32 x in floats streamed contiguously, so the counter costs one atomic per tens of KB read.
//
// Accumulation is in float32 with independent vector accumulators per input row (FMA latency hiding),
// then one horizontal sum; results differ from a BLAS GEMM only by summation order. Threads: the
// caller passes torch's intra-op count (the library shares torch's OpenMP runtime, see build.py).
//
// Above MAX_BATCH input rows (a decode batch of tens of sequences) the arithmetic is the cost, not the
// read: each claimed block of rows goes through panel.h's packed-panel kernel (16 rows transposed
// into a panel, then 6 inputs per pass, no horizontal sums). The block is still read from memory
// once; from some batch up a library GEMM wins all the same (where: bench/gemv.py, `linear.py`).
#include <algorithm>
#include <cstdint>

#include "projections.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace tidepool {
namespace {

// Threads claim BLOCK_ROWS-row blocks; each block is multiplied with all the inputs by projections.h's
// weight_rows (which the one-call decode step runs too). w: float32, else w8.
void gemv(const float* w, const TpInt8Weight& w8, const float* x, float* y, int64_t batch, int64_t rows, int64_t in,
          int64_t ldx, int64_t ldy, int num_threads) {
  const int64_t blocks = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
  for (int64_t block = 0; block < blocks; ++block)
    weight_rows(w, w8, nullptr, x, ldx, in, batch, block * BLOCK_ROWS, std::min(rows, (block + 1) * BLOCK_ROWS), y,
                ldy, 0);
}

bool args_ok(int64_t batch, int64_t rows, int64_t in, int64_t ldx, int64_t ldy) {
  return batch >= 1 && batch <= MAX_WIDE_BATCH && rows >= 1 && in >= 1 && ldx >= in && ldy >= rows;
}

}  // namespace
}  // namespace tidepool

extern "C" {

TP_EXPORT int tp_gemv_max_batch() { return tidepool::MAX_WIDE_BATCH; }  // input rows one call takes

TP_EXPORT int64_t tp_gemv_panel_min_inputs() { return tidepool::PANEL_MIN_INPUTS; }  // the built-in threshold

// Sets the fewest inputs that take the packed-panel kernel (panel.h) and returns the previous value: for
// benchmarks comparing it with the row kernel in one process (a value above tp_gemv_max_batch: never).
TP_EXPORT int64_t tp_gemv_set_panel_min_inputs(int64_t n) { return tidepool::set_panel_min_inputs(n); }

// w: [rows, in] row-major; x: [batch, in] with row stride ldx; y: [batch, rows] with row stride ldy.
// Returns 0, or -1 for arguments it does not take (the caller checks them first; this is a backstop).
TP_EXPORT int tp_gemv_f32(const float* w, const float* x, float* y, int64_t batch, int64_t rows, int64_t in,
                          int64_t ldx, int64_t ldy, int32_t num_threads) {
  if (!tidepool::args_ok(batch, rows, in, ldx, ldy)) return -1;
  tidepool::gemv(w, {nullptr, nullptr}, x, y, batch, rows, in, ldx, ldy, num_threads < 1 ? 1 : num_threads);
  return 0;
}

// The same with per-output-channel int8 weights: y[b, o] = scales[o] * sum_i x[b, i] * w[o, i].
TP_EXPORT int tp_gemv_i8(const int8_t* w, const float* scales, const float* x, float* y, int64_t batch, int64_t rows,
                         int64_t in, int64_t ldx, int64_t ldy, int32_t num_threads) {
  if (!tidepool::args_ok(batch, rows, in, ldx, ldy) || scales == nullptr) return -1;
  tidepool::gemv(nullptr, {w, scales}, x, y, batch, rows, in, ldx, ldy, num_threads < 1 ? 1 : num_threads);
  return 0;
}

}  // extern "C"
