// Wide-batch projections: the packed-panel kernel (engine/cpu_ops/panel.h, what weight_rows runs above 8
// inputs) against the row kernel it replaced there (gemv.h's row_dot, inputs in groups of 8), in one process.
//
// Both run as the engine runs them: OpenMP threads claim 32-row blocks of the weight (dynamic schedule),
// all inputs per block. Per (shape, batch) the two alternate for `rounds` rounds; the best time of each
// is kept. Prints one JSON object per line: shape, batch, threads, ms and GFLOP/s of each, the ratio,
// and the largest difference between their results (summation order only).
//
//   bench/panel_kernel.py compiles and runs this (g++ with the engine's flags); see its docstring.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "projections.h"

using namespace tidepool;

namespace {

using Clock = std::chrono::steady_clock;

// The pre-panel weight_rows: the row kernel on the inputs MAX_BATCH at a time.
void rows_in_groups(const float* w, const float* x, int64_t in, int64_t batch, int64_t lo, int64_t hi, float* y,
                    int64_t ldy) {
  using GroupFn = void (*)(const float*, const TpInt8Weight&, const float*, const float*, int64_t, int64_t, int64_t,
                           int64_t, float*, int64_t, int64_t);
  constexpr GroupFn GROUPS[MAX_BATCH + 1] = {nullptr,       group_rows<1>, group_rows<2>, group_rows<3>, group_rows<4>,
                                             group_rows<5>, group_rows<6>, group_rows<7>, group_rows<8>};
  const TpInt8Weight none{nullptr, nullptr};
  for (int64_t b = 0; b < batch; b += MAX_BATCH)
    GROUPS[std::min<int64_t>(MAX_BATCH, batch - b)](w, none, nullptr, x + b * in, in, in, lo, hi, y + b * ldy, ldy, 0);
}

template <typename Fn>
double timed(int64_t rows, int threads, Fn&& fn) {
  const auto t0 = Clock::now();
  const int64_t blocks = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t blk = 0; blk < blocks; ++blk) fn(blk * BLOCK_ROWS, std::min(rows, (blk + 1) * BLOCK_ROWS));
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s NAME ROWS IN BATCH,... THREADS,ROUNDS\n", argv[0]);
    return 2;
  }
  const char* name = argv[1];
  const int64_t rows = std::atoll(argv[2]), in = std::atoll(argv[3]);
  int threads = 1, rounds = 5;
  std::sscanf(argv[5], "%d,%d", &threads, &rounds);
  std::vector<int64_t> batches;
  for (char* p = argv[4]; *p;) {
    batches.push_back(std::strtoll(p, &p, 10));
    if (*p == ',') ++p;
  }
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  std::vector<float> w(rows * in);
  for (float& v : w) v = normal(gen);
  for (const int64_t batch : batches) {
    std::vector<float> x(batch * in), y_rows(batch * rows), y_panel(batch * rows);
    for (float& v : x) v = normal(gen);
    double best_rows = 1e30, best_panel = 1e30;
    for (int r = 0; r < rounds; ++r) {
      best_rows = std::min(best_rows, timed(rows, threads, [&](int64_t lo, int64_t hi) {
                             rows_in_groups(w.data(), x.data(), in, batch, lo, hi, y_rows.data(), rows);
                           }));
      best_panel = std::min(best_panel, timed(rows, threads, [&](int64_t lo, int64_t hi) {
                              panel_rows(w.data(), nullptr, nullptr, x.data(), in, in, batch, lo, hi, y_panel.data(),
                                         rows, 0);
                            }));
    }
    double diff = 0.0;
    for (size_t i = 0; i < y_rows.size(); ++i) diff = std::max(diff, double(std::fabs(y_rows[i] - y_panel[i])));
    const double gflop = 2.0 * double(rows) * double(in) * double(batch) / 1e9;
    std::printf(
        "{\"shape\": \"%s\", \"rows\": %lld, \"in\": %lld, \"batch\": %lld, \"threads\": %d, \"rows_ms\": %.4f, "
        "\"panel_ms\": %.4f, \"rows_gflop_s\": %.1f, \"panel_gflop_s\": %.1f, \"panel_speedup\": %.3f, "
        "\"max_abs_diff\": %.3g}\n",
        name, (long long)rows, (long long)in, (long long)batch, threads, best_rows * 1e3, best_panel * 1e3,
        gflop / best_rows, gflop / best_panel, best_rows / best_panel, diff);
  }
  return 0;
}
