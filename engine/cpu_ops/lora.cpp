// Multi-LoRA apply on CPU in one call: y[t] += B[s] (A[s] x[t]) per sub-target, s = slots[t] (-1: none).
//
// Layout (the multi-LoRA contract, kernels/lora_ref.py): A [S, J*R, in], B [S, out, R], float32, contiguous;
// sub-target j's A rows are A[s, j*R : j*R + R] and it owns output columns [off[j], off[j+1]); ranks [S] (the
// largest rank of slot s) or [S, J] (per sub-target, 0: left out): rows / columns at or beyond a rank are zero
// and are never read here.
//
// Decode steps mix a few tokens per adapter, so the cost to avoid is reading an adapter once per token.
// Tokens are grouped by slot (a counting sort on the host thread), each present slot's tokens gathered
// into a contiguous scratch, then one worksharing loop over (slot, sub-target) items, each doing
//   shrink: h[n, j*R + k] = A[s, j*R + k] . x[n] for k < rank: a few A rows against up to 4 tokens per
//           pass (each A row read once per 4 tokens), the sums out of vec.h's lane_sums;
//   expand: y[t, o] += sum_k h[n, j*R + k] B[s, o, k] over sub-target j's columns, W at a time: W rows of B
//           (their first rank columns, W at a time) transposed in registers (panel.h's transpose) so the
//           product runs along the output columns with one broadcast of h per rank column and no
//           horizontal sums.
// Both stream their slot's weights once with vec.h's software prefetch ahead of the reads (as gemv.h): the
// adapters of a step do not fit in cache, and with it a 30-layer pass over 8 slots ran 1.36-1.38x faster
// (one thread, in one process against a build with TIDEPOOL_CPU_PREFETCH_BYTES=off).
// Items write disjoint parts of y (other tokens or other columns), so the loop has one barrier (its end):
// on a busy machine every barrier can wait a time slice for a descheduled thread. Each A and B element of
// a present slot is read once per call. Accumulation is float32; the sum per element is a fixed sequence of
// FMAs, independent of the thread count.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "panel.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace tidepool {
namespace {

constexpr int MAX_SUB = 8;  // sub-targets a site may fuse (the contract has at most 3)

struct Args {
  float* y;
  int64_t ldy;
  const float* x;
  int64_t ldx;
  const float* a;
  const float* b;
  const int64_t* offsets;  // J + 1 output columns
  int64_t num_sub, num_slots, rank_max, in, out;
  bool ranks_per_sub;  // ranks [S, J] (else [S]: one rank for every sub-target of a slot)
};

// One present slot: its tokens (ids into x / y), their gathered inputs and the shrink's output.
struct SlotWork {
  int64_t slot, first;  // first: index of its first token in the grouped order
  int64_t count;
};

struct Item {
  int64_t group, sub, rank;  // one present slot's one sub-target (of that rank): its shrink, then its expand
};

// A rows per pass of the shrink: ROWS x TOKENS independent accumulators (16 with AVX-512's 32 registers,
// 8 with AVX2's 16) keep the FMA units busy where gemv.h's row_dot (one row, a chain per input) waits on
// FMA latency; their sums come out of one lane_sums, not one scalar horizontal sum each.
constexpr int ROWS = W == 16 ? 4 : 2;
constexpr int TOKENS = 4;

// h[n * ldh + k] = A[k] . x[n] for k in [k0, k0 + R), n < N (x: [N, in] contiguous).
template <int R, int N>
inline void shrink_tile(const float* a, int64_t k0, const float* x, int64_t in, float* h, int64_t ldh) {
  vf acc[R * N];
  for (int i = 0; i < R * N; ++i) acc[i] = vf{};
  int64_t i = 0;
  for (; i + W <= in; i += W) {
    vf xv[N];
    for (int n = 0; n < N; ++n) xv[n] = load(x + n * in + i);
    for (int r = 0; r < R; ++r) {
      if ((i * int64_t(sizeof(float))) % 64 == 0) prefetch_ahead(a + (k0 + r) * in + i);  // once per 64 bytes
      const vf av = load(a + (k0 + r) * in + i);
      for (int n = 0; n < N; ++n) acc[r * N + n] += av * xv[n];
    }
  }
  const vf sums = lane_sums<R * N>(acc);
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) {
      float total = sums[r * N + n];
      for (int64_t j = i; j < in; ++j) total += a[(k0 + r) * in + j] * x[n * in + j];
      h[n * ldh + k0 + r] = total;
    }
}

template <int N>
inline void shrink_tokens(const float* a, int64_t rank, const float* x, int64_t in, float* h, int64_t ldh) {
  int64_t k = 0;
  for (; k + ROWS <= rank; k += ROWS) shrink_tile<ROWS, N>(a, k, x, in, h, ldh);
  for (; k < rank; ++k) shrink_tile<1, N>(a, k, x, in, h, ldh);
}

// h[n, k] = A[k] . x[n] for k < rank, n < count (x: [count, in] contiguous; h row stride ldh); each A row
// is read once per TOKENS tokens (a decode step rarely has more per adapter).
void shrink(const float* a_sub, int64_t rank, const float* xg, int64_t in, int64_t count, float* h, int64_t ldh) {
  for (int64_t n0 = 0; n0 < count; n0 += TOKENS) {
    const float* x = xg + n0 * in;
    float* hn = h + n0 * ldh;
    switch (std::min<int64_t>(TOKENS, count - n0)) {
      case 1: shrink_tokens<1>(a_sub, rank, x, in, hn, ldh); break;
      case 2: shrink_tokens<2>(a_sub, rank, x, in, hn, ldh); break;
      case 3: shrink_tokens<3>(a_sub, rank, x, in, hn, ldh); break;
      default: shrink_tokens<4>(a_sub, rank, x, in, hn, ldh); break;
    }
  }
}

// W-wide vector of p[0 .. n) (n <= W), zeros after.
inline vf load_n(const float* p, int64_t n) {
  if (n == W) return load(p);
  vf v{};
  std::memcpy(&v, p, sizeof(float) * n);
  return v;
}

// y[tok[n], c] += sum_k h[n, k] b_sub[c, k] for c in [c0, c1), k < rank (b_sub rows of R floats).
void expand(const float* b_sub, int64_t rank_max, int64_t rank, const float* h, int64_t ldh, int64_t count,
            const int64_t* tok, const Args& p, int64_t c0, int64_t c1) {
  for (int64_t o = c0; o < c1; o += W) {
    const int64_t rows = std::min<int64_t>(W, c1 - o);
    for (int64_t k0 = 0; k0 < rank; k0 += W) {
      const int64_t kw = std::min<int64_t>(W, rank - k0);
      vf cols[W];  // after the transpose: cols[k][c] = B[o + c, k0 + k]
      for (int c = 0; c < W; ++c) {
        if (k0 == 0) prefetch_ahead(b_sub + (o + c) * rank_max);  // B's rows stream in order: one line each
        cols[c] = c < rows ? load_n(b_sub + (o + c) * rank_max + k0, kw) : vf{};
      }
      transpose(cols);
      for (int64_t n = 0; n < count; ++n) {
        float* yrow = p.y + tok[n] * p.ldy + o;
        vf acc = load_n(yrow, rows);
        const float* hn = h + n * ldh + k0;
        for (int64_t k = 0; k < kw; ++k) acc += splat(hn[k]) * cols[k];
        if (rows == W)
          store(yrow, acc);
        else
          std::memcpy(yrow, &acc, sizeof(float) * rows);
      }
    }
  }
}

template <typename RankT>
int apply(const Args& p, const int32_t* slots, const RankT* ranks, int64_t num_tokens, int num_threads) {
  // Scratch kept between calls (the engine makes four per layer per step): no allocation once warm.
  thread_local std::vector<int64_t> counts, order;
  thread_local std::vector<SlotWork> groups;
  thread_local std::vector<float> xg, h;
  thread_local std::vector<Item> items;
  counts.assign(p.num_slots + 1, 0);  // a counting sort of the tokens by slot
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t s = slots[t];
    if (s >= p.num_slots || s < -1) return -2;
    if (s >= 0) ++counts[s + 1];
  }
  groups.clear();
  items.clear();
  for (int64_t s = 0; s < p.num_slots; ++s) {
    if (counts[s + 1] > 0) {
      const int64_t group = int64_t(groups.size());
      for (int64_t j = 0; j < p.num_sub; ++j) {
        const int64_t rank = std::min<int64_t>(p.ranks_per_sub ? ranks[s * p.num_sub + j] : ranks[s], p.rank_max);
        if (rank > 0 && p.offsets[j] < p.offsets[j + 1]) items.push_back({group, j, rank});
      }
      if (!items.empty() && items.back().group == group) groups.push_back({s, counts[s], counts[s + 1]});
    }
    counts[s + 1] += counts[s];
  }
  if (items.empty()) return 0;
  order.resize(counts[p.num_slots]);
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slots[t] >= 0) order[counts[slots[t]]++] = t;

  const int64_t ldh = p.num_sub * p.rank_max;
  xg.resize(order.size() * p.in);
  h.resize(order.size() * ldh);
  for (size_t n = 0; n < order.size(); ++n) std::memcpy(&xg[n * p.in], p.x + order[n] * p.ldx, sizeof(float) * p.in);
  // Plain pointers into the scratch: inside the parallel region a thread_local name would be each thread's own.
  const int64_t num_items = int64_t(items.size());
  const Item* item_list = items.data();
  const SlotWork* group_list = groups.data();
  const int64_t* token_ids = order.data();
  const float* inputs = xg.data();
  float* shrunk = h.data();
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
  for (int64_t i = 0; i < num_items; ++i) {
    const SlotWork& g = group_list[item_list[i].group];
    const int64_t j = item_list[i].sub, rank = item_list[i].rank;
    float* h_sub = shrunk + g.first * ldh + j * p.rank_max;
    const float* a_sub = p.a + (g.slot * p.num_sub + j) * p.rank_max * p.in;
    shrink(a_sub, rank, inputs + g.first * p.in, p.in, g.count, h_sub, ldh);
    expand(p.b + g.slot * p.out * p.rank_max, p.rank_max, rank, h_sub, ldh, g.count, token_ids + g.first, p,
           p.offsets[j], p.offsets[j + 1]);
  }
  return 0;
}

}  // namespace
}  // namespace tidepool

extern "C" {

// One projection site's fixed tensors (the binding fills it once per site, lora.py's _SiteArgs): a [S, J*R, in]
// and b [S, out, R] contiguous float32; offsets: J + 1 int64 output columns; ranks: [S] or, with ranks_per_sub,
// [S, J] (contiguous), int64 (ranks_int64) or int32.
struct TpLoraSite {
  const float* a;
  const float* b;
  const int64_t* offsets;
  const void* ranks;
  int64_t ranks_int64, ranks_per_sub, num_sub, num_slots, rank_max, in, out;
};

// y [T, out] (row stride ldy) += the LoRA deltas of x [T, in] (row stride ldx); slots: T int32 (-1: none).
// Returns 0, -1 for arguments it does not take, -2 for a slot outside [-1, S) (the binding checks the rest
// first; this is a backstop).
TP_EXPORT int tp_lora_apply_f32(const TpLoraSite* site, float* y, int64_t ldy, const float* x, int64_t ldx,
                                const int32_t* slots, int64_t num_tokens, int32_t num_threads) {
  const TpLoraSite& s = *site;
  const int64_t* offsets = s.offsets;
  if (s.num_sub < 1 || s.num_sub > tidepool::MAX_SUB || num_tokens < 0 || s.num_slots < 1 || s.rank_max < 1 ||
      s.in < 1 || s.out < 1 || ldy < s.out || ldx < s.in || offsets[0] != 0 || offsets[s.num_sub] != s.out)
    return -1;
  for (int64_t j = 0; j < s.num_sub; ++j)
    if (offsets[j] > offsets[j + 1]) return -1;
  const tidepool::Args args{y, ldy, x, ldx, s.a, s.b, offsets, s.num_sub, s.num_slots, s.rank_max, s.in, s.out,
                            s.ranks_per_sub != 0};
  const int threads = num_threads < 1 ? 1 : num_threads;
  if (s.ranks_int64) return tidepool::apply(args, slots, static_cast<const int64_t*>(s.ranks), num_tokens, threads);
  return tidepool::apply(args, slots, static_cast<const int32_t*>(s.ranks), num_tokens, threads);
}

}  // extern "C"
