// Register-blocked tiles of one attention pass: a tile of query rows against a chunk of keys.
//
// Layouts (all float32, in a thread's scratch unless noted):
//   qt [dim][rp]    the tile's queries transposed (rows are token x head pairs, padded to rp, a
//                   multiple of W, with zeros) and pre-scaled by softmax_scale * log2(e);
//   k, v            rows of `dim` floats, `stride` floats apart (in place in the KV cache for float32);
//   s  [nk][rp]     scores of each key for every row, turned into probabilities in place;
//   o  [rows][dim]  the unnormalised output; m, l, alpha [rp]: running max (log2 domain), running
//                   sum and this chunk's rescale factor per row.
// Rows are vectorised (W at a time) in the score and softmax steps and the head dimension in the
// value step, so a key is broadcast from the cache once per W rows and no horizontal sums occur.
#pragma once

#include <cmath>

#include "vec.h"

namespace tidepool {

// Software prefetch of the next chunk's K and V rows, spread over the current chunk's score loop
// (a row or a few per key): one burst of a whole chunk would fill the miss buffers and stall the
// core, and the hardware prefetchers restart at every block (blocks sit at unrelated addresses).
// Into L2 by default (vec.h's prefetch_line): L1 prefetches bought nothing over none on Zen 4.
struct Prefetch {
  const char* k = nullptr;  // the next chunk's row 0 for this KV head; null: nothing to fetch
  const char* v = nullptr;
  int64_t stride = 0;  // bytes between rows
  int num_rows = 0;
  int row_bytes = 0;
  void rows(int j0, int j1) const {
    for (int j = j0; j < j1 && j < num_rows; ++j)
      for (int b = 0; b < row_bytes; b += 64) {
        prefetch_line(k + j * stride + b);
        prefetch_line(v + j * stride + b);
      }
  }
};

// s[j][r] = sum_d qt[d][r] * k[j][d] for JB keys and NV vectors of rows.
template <int JB, int NV>
inline void score_tile(const float* qt, int rp, const float* k, int64_t stride, int dim, float* s) {
  vf acc[JB][NV];
  for (int j = 0; j < JB; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v] = vf{};
  for (int d = 0; d < dim; ++d) {
    vf q[NV];
    for (int v = 0; v < NV; ++v) q[v] = load(qt + d * rp + v * W);
    for (int j = 0; j < JB; ++j) {
      const vf key = splat(k[j * stride + d]);
      for (int v = 0; v < NV; ++v) acc[j][v] += key * q[v];
    }
  }
  for (int j = 0; j < JB; ++j)
    for (int v = 0; v < NV; ++v) store(s + j * rp + v * W, acc[j][v]);
}

// score_tile<J, NV> for the runtime key count n < JB (the end of a chunk).
template <int NV, int J>
inline void score_rest(int n, const float* qt, int rp, const float* k, int64_t stride, int dim, float* s) {
  if constexpr (J > 0) {
    if (n == J)
      score_tile<J, NV>(qt, rp, k, stride, dim, s);
    else
      score_rest<NV, J - 1>(n, qt, rp, k, stride, dim, s);
  }
}

template <int NV>
inline void score_rows(const float* qt, int rp, const float* k, int64_t stride, int nk, int dim, float* s,
                       const Prefetch* pf) {
  constexpr int JB = NV == 2 ? 6 : 8;  // JB * NV accumulators + NV query vectors + a broadcast: <= 16 registers
  int j = 0;
  for (; j + JB <= nk; j += JB) {
    if (pf) pf->rows(j, j + JB);
    score_tile<JB, NV>(qt, rp, k + j * stride, stride, dim, s + j * rp);
  }
  if (pf) pf->rows(j, pf->num_rows);
  score_rest<NV, JB - 1>(nk - j, qt, rp, k + j * stride, stride, dim, s + j * rp);
}

inline void scores(const float* qt, int rp, const float* k, int64_t stride, int nk, int dim, float* s,
                   const Prefetch& pf) {
  int r = 0;
  for (; r + 2 * W <= rp; r += 2 * W) score_rows<2>(qt + r, rp, k, stride, nk, dim, s + r, r == 0 ? &pf : nullptr);
  if (r < rp) score_rows<1>(qt + r, rp, k, stride, nk, dim, s + r, r == 0 ? &pf : nullptr);
}

// The same scores for a tile of at most W rows (decode: one token, the query heads of a KV head):
// dot products along d with q rows in natural layout qr [NR][dim], reduced across lanes once per
// key, so the work per key is NR * dim / W FMAs instead of dim broadcasts and FMAs with idle lanes.
// s has rp = W columns; lanes >= NR get 0.
template <int NR, int JB>
inline void dot_tile(const float* qr, const float* k, int64_t stride, int dim, float* s) {
  vf acc[JB][NR];
  for (int j = 0; j < JB; ++j)
    for (int g = 0; g < NR; ++g) acc[j][g] = vf{};
  int d = 0;
  for (; d + W <= dim; d += W) {
    vf key[JB];
    for (int j = 0; j < JB; ++j) key[j] = load(k + j * stride + d);
    for (int g = 0; g < NR; ++g) {
      const vf q = load(qr + g * dim + d);
      for (int j = 0; j < JB; ++j) acc[j][g] += q * key[j];
    }
  }
  for (int j = 0; j < JB; ++j) {
    vf sums = lane_sums<NR>(acc[j]);
    for (int t = d; t < dim; ++t)  // head dims that are not a multiple of W
      for (int g = 0; g < NR; ++g) sums[g] += qr[g * dim + t] * k[j * stride + t];
    store(s + j * W, sums);
  }
}

template <int NR>
inline void dot_rows(const float* qr, const float* k, int64_t stride, int nk, int dim, float* s, const Prefetch& pf) {
  constexpr int JB = NR <= 2 ? 4 : NR <= 4 ? 2 : 1;  // JB * NR accumulators + JB keys fit 16 registers (32: NR <= 16)
  int j = 0;
  for (; j + JB <= nk; j += JB) {
    pf.rows(j, j + JB);
    dot_tile<NR, JB>(qr, k + j * stride, stride, dim, s + j * W);
  }
  pf.rows(j, pf.num_rows);
  for (; j < nk; ++j) dot_tile<NR, 1>(qr, k + j * stride, stride, dim, s + j * W);
}

// dot_rows<rows> for 1 <= rows <= W (a narrow tile).
template <int NR = 1>
inline void dot_scores(const float* qr, int rows, const float* k, int64_t stride, int nk, int dim, float* s,
                       const Prefetch& pf) {
  if constexpr (NR < W) {
    if (rows != NR) return dot_scores<NR + 1>(qr, rows, k, stride, nk, dim, s, pf);
  }
  dot_rows<NR>(qr, k, stride, nk, dim, s, pf);
}

// Online softmax over one chunk: s becomes exp2(s - m_new); l and m move on; alpha = exp2(m_old - m_new).
// A row that has seen only masked keys keeps m = -inf; its probabilities and alpha are exactly 0.
inline void softmax_update(float* s, int nk, int rp, float* m, float* l, float* alpha) {
  const vf neg_inf = splat(-INFINITY);
  for (int r = 0; r < rp; r += W) {
    vf chunk_max = load(s + r);
    for (int j = 1; j < nk; ++j) chunk_max = vmax(chunk_max, load(s + j * rp + r));
    const vf m_old = load(m + r);
    const vf m_new = vmax(m_old, chunk_max);
    const vf base = m_new == neg_inf ? vf{} : m_new;
    vf sum = vf{};
    for (int j = 0; j < nk; ++j) {
      const vf p = exp2v(load(s + j * rp + r) - base);
      store(s + j * rp + r, p);
      sum += p;
    }
    const vf a = exp2v(m_old - base);
    store(alpha + r, a);
    store(l + r, load(l + r) * a + sum);
    store(m + r, m_new);
  }
}

// o[i][d] = o[i][d] * alpha[i] + sum_j p[j][i] * v[j][d] for NR rows and NV vectors of d.
template <int NR, int NV>
inline void value_tile(float* o, int dim, const float* alpha, const float* p, int rp, const float* v, int64_t stride,
                       int nk) {
  vf acc[NR][NV];
  for (int i = 0; i < NR; ++i) {
    const vf a = splat(alpha[i]);
    for (int n = 0; n < NV; ++n) acc[i][n] = load(o + i * dim + n * W) * a;
  }
  for (int j = 0; j < nk; ++j) {
    vf val[NV];
    for (int n = 0; n < NV; ++n) val[n] = load(v + j * stride + n * W);
    for (int i = 0; i < NR; ++i) {
      const vf pb = splat(p[j * rp + i]);
      for (int n = 0; n < NV; ++n) acc[i][n] += pb * val[n];
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int n = 0; n < NV; ++n) store(o + i * dim + n * W, acc[i][n]);
}

template <int NR>
inline void value_rows(float* o, int dim, const float* alpha, const float* p, int rp, const float* v, int64_t stride,
                       int nk) {
  int d = 0;
  for (; d + 2 * W <= dim; d += 2 * W) value_tile<NR, 2>(o + d, dim, alpha, p, rp, v + d, stride, nk);
  if (d + W <= dim) {
    value_tile<NR, 1>(o + d, dim, alpha, p, rp, v + d, stride, nk);
    d += W;
  }
  for (; d < dim; ++d) {  // head dims that are not a multiple of W
    for (int i = 0; i < NR; ++i) {
      float acc = o[i * dim + d] * alpha[i];
      for (int j = 0; j < nk; ++j) acc += p[j * rp + i] * v[j * stride + d];
      o[i * dim + d] = acc;
    }
  }
}

// value_rows<R> for the runtime row count n < RB (the last rows of a tile).
template <int R>
inline void value_rest(int n, float* o, int dim, const float* alpha, const float* p, int rp, const float* v,
                       int64_t stride, int nk) {
  if constexpr (R > 0) {
    if (n == R)
      value_rows<R>(o, dim, alpha, p, rp, v, stride, nk);
    else
      value_rest<R - 1>(n, o, dim, alpha, p, rp, v, stride, nk);
  }
}

inline void accumulate(float* o, int dim, const float* alpha, const float* p, int rp, const float* v, int64_t stride,
                       int nk, int rows) {
  constexpr int RB = 6;  // 6 rows x 2 vectors of accumulators + 2 value vectors + a broadcast: 15 registers
  int r = 0;
  for (; r + RB <= rows; r += RB) value_rows<RB>(o + r * dim, dim, alpha + r, p + r, rp, v, stride, nk);
  value_rest<RB - 1>(rows - r, o + r * dim, dim, alpha + r, p + r, rp, v, stride, nk);
}

}  // namespace tidepool
