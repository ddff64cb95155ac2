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
// Above MAX_BATCH input rows (a decode batch of tens of sequences) the same row kernel runs on the
// inputs MAX_BATCH at a time inside each claimed block of rows: the block (32 x in floats, tens of
// KB) is read from memory once and from L2 for the later groups, and each group of inputs stays in
// L1 across the block's rows. Bandwidth stays one read of the weights; the arithmetic grows with
// the batch, so from some batch up a blocked GEMM wins (where: bench/gemv.py, `linear.py`).
#include <algorithm>
#include <cstdint>

#include "gemv.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace tidepool {
namespace {

// Rows [lo, hi) of the weights times B input rows (a whole batch of 1..MAX_BATCH, or one group of a wider
// one); `scales` (int8 weights): each row's sum times its scale.
template <int B, typename T>
void group_rows(const T* w, const float* scales, const float* x, float* y, int64_t lo, int64_t hi, int64_t in,
                int64_t ldx, int64_t ldy) {
  for (int64_t o = lo; o < hi; ++o) {
    float out[B];
    row_dot<B>(w + o * in, x, ldx, in, out);
    for (int b = 0; b < B; ++b) y[b * ldy + o] = scales != nullptr ? out[b] * scales[o] : out[b];
  }
}

constexpr int64_t BLOCK_ROWS = 32;

// Threads claim BLOCK_ROWS-row blocks; each block is multiplied with the inputs MAX_BATCH at a time.
template <typename T>
void gemv(const T* w, const float* scales, const float* x, float* y, int64_t batch, int64_t rows, int64_t in,
          int64_t ldx, int64_t ldy, int num_threads) {
  using GroupFn = void (*)(const T*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                           int64_t);
  constexpr GroupFn GROUPS[MAX_BATCH + 1] = {
      nullptr,           group_rows<1, T>, group_rows<2, T>, group_rows<3, T>, group_rows<4, T>,
      group_rows<5, T>,  group_rows<6, T>, group_rows<7, T>, group_rows<8, T>,
  };
  const int64_t blocks = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t lo = block * BLOCK_ROWS, hi = std::min(rows, lo + BLOCK_ROWS);
    for (int64_t b = 0; b < batch; b += MAX_BATCH) {
      const int64_t group = std::min<int64_t>(MAX_BATCH, batch - b);
      GROUPS[group](w, scales, x + b * ldx, y + b * ldy, lo, hi, in, ldx, ldy);
    }
  }
}

bool args_ok(int64_t batch, int64_t rows, int64_t in, int64_t ldx, int64_t ldy) {
  return batch >= 1 && batch <= MAX_WIDE_BATCH && rows >= 1 && in >= 1 && ldx >= in && ldy >= rows;
}

}  // namespace
}  // namespace tidepool

#define TP_EXPORT __attribute__((visibility("default")))

extern "C" {

TP_EXPORT int tp_gemv_max_batch() { return tidepool::MAX_WIDE_BATCH; }  // input rows one call takes

TP_EXPORT int tp_gemv_has_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

// w: [rows, in] row-major; x: [batch, in] with row stride ldx; y: [batch, rows] with row stride ldy.
// Returns 0, or -1 for arguments it does not take (the caller checks them first; this is a backstop).
TP_EXPORT int tp_gemv_f32(const float* w, const float* x, float* y, int64_t batch, int64_t rows, int64_t in,
                          int64_t ldx, int64_t ldy, int32_t num_threads) {
  if (!tidepool::args_ok(batch, rows, in, ldx, ldy)) return -1;
  tidepool::gemv<float>(w, nullptr, x, y, batch, rows, in, ldx, ldy, num_threads < 1 ? 1 : num_threads);
  return 0;
}

// The same with per-output-channel int8 weights: y[b, o] = scales[o] * sum_i x[b, i] * w[o, i].
TP_EXPORT int tp_gemv_i8(const int8_t* w, const float* scales, const float* x, float* y, int64_t batch, int64_t rows,
                         int64_t in, int64_t ldx, int64_t ldy, int32_t num_threads) {
  if (!tidepool::args_ok(batch, rows, in, ldx, ldy) || scales == nullptr) return -1;
  tidepool::gemv<int8_t>(w, scales, x, y, batch, rows, in, ldx, ldy, num_threads < 1 ? 1 : num_threads);
  return 0;
}

}  // extern "C"
