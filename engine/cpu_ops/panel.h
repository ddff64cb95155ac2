// The wide-batch projection kernel, from packed panels: y[b, o] = w[o] . x[b] for PANEL_MIN_INPUTS (24 at
// W = 8, 16 at W = 16) inputs or more.
//
// gemv.h's row kernel takes one weight row against up to 8 inputs and ends each (row, input) with a
// horizontal sum; every multiply-add needs its own input load. That suits decode at 1-8 sequences,
// where reading the weights is the cost; with more inputs the arithmetic is, and the row kernel ran
// at ~40% of the FMA peak there. Here PANEL (2 W: 16 or 32) weight rows are first transposed into a
// packed panel [k][PANEL] (float32; int8 rows widened exactly), then each pass multiplies the panel with
// PANEL_INPUTS (6, or 12 with AVX-512's 32 registers) inputs: per input column two panel vectors, a
// broadcast per input, two independent FMAs per input into register accumulators, and no horizontal
// sums at all (the classic 6x16 micro-kernel, 12x32 at W = 16).
// Packing costs about half a pass, so the gain grows with the passes (bench/panel_kernel.py).
//
// Columns go PANEL_K at a time (a 64 KB panel, 128 KB at W = 16, stays in L2 for every pass over the inputs); the
// partial sums carry over in a per-thread buffer. So the sum for one (row, input) is always the same
// sequence of FMAs: the same bits whatever the batch, the input's place in it, or the pass's width.
// int8: the sum times the row's scale, then the bias (as the row kernel and tp_gemv_i8 do).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <vector>

#include "gemv.h"

namespace tidepool {
namespace {

constexpr int PANEL = 2 * W;           // weight rows per panel: two vectors of accumulators per input
// Inputs per pass: 2 * PANEL_INPUTS accumulators + 2 panel vectors + 1 broadcast in the vector registers,
// 16 with AVX2 (6 inputs: 15), 32 with AVX-512 (12 inputs: 27). At W = 16 twelve measured 1.10-1.18x six
// (bench/panel_kernel.py's harness, SmolLM2's shapes, 32-128 inputs, 2 threads): half the panel loads per FMA.
constexpr int PANEL_INPUTS = W == 16 ? 12 : 6;
constexpr int64_t PANEL_K = 1024;      // input columns per packed panel: 4 KB per row
// Fewest inputs worth packing for. With one projection's weights warm in cache (bench/panel_kernel.py,
// 2 threads, SmolLM2's shapes) the panel wins from 10 inputs (1.13-1.33x; at 9 0.84-1.11x). In the
// engine's step, whose weights stream from memory (decode_batches.py, medians of two 3-round runs), it
// is even or behind to 16 (0.92x at 10, 0.93-1.02x at 16) and ahead from 24 (1.07-1.09x; 1.21-1.26x
// at 32, 1.36-1.39x at 64, 1.32-1.46x at 128). Those were 8-float vectors on an AVX2 VM. At W = 16 (an
// Intel AVX-512 VM, 12 inputs a pass) it is even at 16 and ahead from 18 (decode_batches.py, 3 rounds:
// 1.01x at 16, 1.08x at 18, 1.17x at 20, 1.19x at 22, 1.14x at 24; the row kernel takes 17-24 inputs in
// three groups); with the threshold at 12 it was behind at 14 (0.96x, a sweep by hand).
constexpr int64_t PANEL_MIN_INPUTS = W == 16 ? 16 : 24;

// The threshold weight_rows uses: PANEL_MIN_INPUTS unless a benchmark moved it to compare the two
// kernels in one process (tp_gemv_set_panel_min_inputs, tp_decoder_set_panel_min_inputs). One per library.
inline std::atomic<int64_t>& panel_min_inputs() {
  static std::atomic<int64_t> value{PANEL_MIN_INPUTS};
  return value;
}

// Moves the threshold (at least 1 input) and returns the previous one: both libraries' exports.
inline int64_t set_panel_min_inputs(int64_t n) { return panel_min_inputs().exchange(n < 1 ? 1 : n); }
// One butterfly stage of a W x W transpose: rows i and i + D (i & D == 0) swap their off-diagonal
// D x D blocks. Lane c of the new row i is a[c] where c & D == 0, else b[c - D]; of row i + D,
// a[c + D] where c & D == 0, else b[c].
template <int D, bool SECOND>
struct SwapBlocks {
  static constexpr int at(int c) {
    if (!SECOND) return (c & D) == 0 ? c : W + c - D;
    return (c & D) == 0 ? c + D : W + c;
  }
};

template <int D>
inline void transpose_stage(vf* r) {
  if constexpr (D < W) {
    for (int i = 0; i < W; ++i)
      if ((i & D) == 0) {
        const vf a = r[i], b = r[i + D];
        r[i] = shuffle<SwapBlocks<D, false>>(a, b);
        r[i + D] = shuffle<SwapBlocks<D, true>>(a, b);
      }
    transpose_stage<2 * D>(r);
  }
}

// Rows of r become columns: r[k][j] <- r[j][k] (log2(W) stages of two-register permutes).
inline void transpose(vf* r) { transpose_stage<1>(r); }

// panel[k * PANEL + j] = w[r0 + j, k0 + k] for k < kc, j < nrows; 0 for the rows past nrows.
template <typename T>
inline void pack_panel(const T* w, int64_t in, int64_t r0, int64_t nrows, int64_t k0, int64_t kc, float* panel) {
  int64_t j0 = 0;
  for (; j0 + W <= nrows; j0 += W) {
    const T* src = w + (r0 + j0) * in + k0;
    int64_t k = 0;
    for (; k + W <= kc; k += W) {
      vf r[W];
      for (int j = 0; j < W; ++j) r[j] = load_weights(src + j * in + k);
      transpose(r);
      for (int kk = 0; kk < W; ++kk) store(panel + (k + kk) * PANEL + j0, r[kk]);
    }
    for (; k < kc; ++k)
      for (int j = 0; j < W; ++j) panel[k * PANEL + j0 + j] = float(src[j * in + k]);
  }
  for (int64_t j = j0; j < PANEL; ++j)
    for (int64_t k = 0; k < kc; ++k) panel[k * PANEL + j] = j < nrows ? float(w[(r0 + j) * in + k0 + k]) : 0.0f;
}

// acc[b][0..PANEL) (+)= panel . x[b] over kc columns for NB inputs (first: start from 0, else from acc).
template <int NB>
void panel_pass(const float* panel, int64_t kc, const float* x, int64_t ldx, float* acc, bool first) {
  vf a[NB][2];
  for (int b = 0; b < NB; ++b)
    for (int h = 0; h < 2; ++h) a[b][h] = first ? vf{} : load(acc + b * PANEL + h * W);
  for (int64_t k = 0; k < kc; ++k) {
    const vf w0 = load(panel + k * PANEL), w1 = load(panel + k * PANEL + W);
    for (int b = 0; b < NB; ++b) {
      const vf xb = splat(x[b * ldx + k]);
      a[b][0] += w0 * xb;
      a[b][1] += w1 * xb;
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int h = 0; h < 2; ++h) store(acc + b * PANEL + h * W, a[b][h]);
}

using PassFn = void (*)(const float*, int64_t, const float*, int64_t, float*, bool);

// PASSES[n] = panel_pass<n> for 1 <= n <= PANEL_INPUTS (entry 0 unused).
template <int... N>
constexpr std::array<PassFn, sizeof...(N)> pass_table(std::integer_sequence<int, N...>) {
  return {(N == 0 ? nullptr : &panel_pass<N == 0 ? 1 : N>)...};
}

// Rows [lo, hi) times `batch` inputs x [batch, in]:
// y[b * ldy + o - col0] = (w[o] . x[b]) (* scales[o]) (+ bias[o]).
// T: float, or int8_t with per-row scales.
template <typename T>
void panel_rows(const T* w, const float* scales, const float* bias, const float* x, int64_t ldx, int64_t in,
                int64_t batch, int64_t lo, int64_t hi, float* y, int64_t ldy, int64_t col0) {
  constexpr auto PASSES = pass_table(std::make_integer_sequence<int, PANEL_INPUTS + 1>{});
  thread_local std::vector<float> panel, acc;  // per OpenMP thread; sized once per shape
  panel.resize(PANEL * std::min(in, PANEL_K));
  acc.resize(batch * PANEL);
  // As few passes as PANEL_INPUTS a pass allows, their widths as even as possible (16 = 6 + 5 + 5, not
  // 6 + 6 + 4: a narrow pass has fewer FMAs per panel load).
  const int64_t passes = (batch + PANEL_INPUTS - 1) / PANEL_INPUTS;
  for (int64_t r0 = lo; r0 < hi; r0 += PANEL) {
    const int64_t nrows = std::min<int64_t>(PANEL, hi - r0);
    for (int64_t k0 = 0; k0 < in; k0 += PANEL_K) {
      const int64_t kc = std::min(PANEL_K, in - k0);
      pack_panel(w, in, r0, nrows, k0, kc, panel.data());
      for (int64_t p = 0, b = 0; p < passes; ++p) {
        const int64_t width = batch / passes + (p < batch % passes);
        PASSES[width](panel.data(), kc, x + b * ldx + k0, ldx, acc.data() + b * PANEL, k0 == 0);
        b += width;
      }
    }
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t j = 0; j < nrows; ++j) {
        const int64_t o = r0 + j;
        float r = acc[b * PANEL + j];
        if (scales != nullptr) r *= scales[o];
        y[b * ldy + o - col0] = bias != nullptr ? r + bias[o] : r;
      }
  }
}

}  // namespace
}  // namespace tidepool
