// The paged-attention work items (plan.h's tiles and their merges), shared by paged_attention.cpp
// (one call per layer) and decoder.cpp (every layer of a decode step in one call).
//
// run_item walks a tile's keys in chunks (at most KEY_CHUNK keys, never crossing a cache block),
// prefetching the next chunk, and per KV head: scores (attention_tiles.h), mask where the chunk
// touches the causal diagonal or the window's edge, online-softmax update, value accumulation. It
// writes `out` directly, or its partial softmax state when the tile's keys were split; run_merge
// combines the parts of one split tile. No K/V is copied for float32; bfloat16/float16 chunks are
// widened into the thread's Scratch. Accumulation is float32 throughout; queries are pre-scaled by
// scale * log2(e) so the softmax uses exp2.
#pragma once

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "attention_tiles.h"
#include "plan.h"
#include "vec.h"

namespace tidepool {
namespace {

using Args = TpAttentionArgs;
constexpr float LOG2E = 1.4426950408889634f;

struct Scratch {  // one thread's working set; state arrays hold every KV head of a tile
  std::vector<float> q, s, o, m, l, alpha, kbuf, vbuf;
  std::vector<int32_t> pos;
  Scratch(int dim, int state_rows)
      : q(size_t(dim) * state_rows),
        s(size_t(KEY_CHUNK) * std::max(state_rows, W)),
        o(size_t(dim) * state_rows),
        m(state_rows),
        l(state_rows),
        alpha(state_rows),
        kbuf(size_t(KEY_CHUNK) * dim),
        vbuf(size_t(KEY_CHUNK) * dim),
        pos(MAX_ROWS) {}
};

// Row r of KV head kv in a tile: token tok0 + r / num_heads, query head kv * group + head0 + r % num_heads.
template <typename P>
P* row_ptr(P* base, const Args& a, const Item& it, int kv, int r, int64_t token_stride, int64_t head_stride) {
  const int group = a.num_q_heads / a.num_kv_heads;
  const int64_t token = a.cu_seqlens_q[it.seq] + it.tok0 + r / it.num_heads;
  const int64_t head = int64_t(kv) * group + it.head0 + r % it.num_heads;
  return base + token * token_stride + head * head_stride;
}

template <typename T>
void widen(float* dst, const T* src, int64_t stride, int nk, int dim) {
  for (int j = 0; j < nk; ++j)
    for (int d = 0; d < dim; ++d) dst[j * dim + d] = to_float(src[j * stride + d]);
}

template <typename T>
void run_item(const Args& a, const Item& it, Scratch& sc, float* parts) {
  const int dim = a.head_dim;
  const int rows = it.rows();
  const int rp = round_up(rows, W);
  const bool narrow = rows <= W;  // dot-product scores; q holds rows untransposed ([rows][dim])
  const int32_t first = a.seq_lens[it.seq] - (a.cu_seqlens_q[it.seq + 1] - a.cu_seqlens_q[it.seq]);
  const float qscale = a.scale * LOG2E;
  int32_t* pos = sc.pos.data();
  for (int r = 0; r < rows; ++r) pos[r] = first + it.tok0 + r / it.num_heads;
  for (int h = 0; h < it.num_kv; ++h) {
    float* q = sc.q.data() + size_t(h) * rp * dim;
    if (!narrow) std::fill(q, q + size_t(dim) * rp, 0.0f);  // padded rows score 0 and are never read
    for (int r = 0; r < rows; ++r) {
      const T* src = row_ptr(static_cast<const T*>(a.q), a, it, it.kv0 + h, r, a.q_token_stride, a.q_head_stride);
      for (int d = 0; d < dim; ++d) (narrow ? q[r * dim + d] : q[d * rp + r]) = to_float(src[d]) * qscale;
    }
  }
  std::fill(sc.m.begin(), sc.m.begin() + it.num_kv * rp, -INFINITY);
  std::fill(sc.l.begin(), sc.l.begin() + it.num_kv * rp, 0.0f);
  std::fill(sc.o.begin(), sc.o.begin() + size_t(it.num_kv) * rows * dim, 0.0f);
  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  const int32_t* table = a.block_tables + it.seq * a.block_table_stride;
  const int32_t window = a.sliding_window;
  auto chunk_at = [&](int32_t key, int& nk) {  // offset of the chunk starting at `key` (KV head 0)
    const int32_t offset = key % a.block_size;
    nk = std::min({KEY_CHUNK, a.block_size - offset, it.key1 - key});
    return table[key / a.block_size] * a.cache_block_stride + offset * a.cache_token_stride;
  };
  int nk = 0;
  int64_t at = chunk_at(it.key0, nk);
  float* s = sc.s.data();
  for (int32_t key = it.key0; key < it.key1;) {
    int next_nk = 0;
    const int64_t next_at = key + nk < it.key1 ? chunk_at(key + nk, next_nk) : 0;
    const bool masked = key + nk - 1 > pos[0] || (window > 0 && key <= pos[rows - 1] - window);
    for (int h = 0; h < it.num_kv; ++h) {
      const int64_t head_at = at + int64_t(it.kv0 + h) * a.cache_head_stride;
      const float *k, *v;
      int64_t stride;
      if constexpr (std::is_same_v<T, float>) {
        k = k_cache + head_at;
        v = v_cache + head_at;
        stride = a.cache_token_stride;
      } else {
        widen(sc.kbuf.data(), k_cache + head_at, a.cache_token_stride, nk, dim);
        widen(sc.vbuf.data(), v_cache + head_at, a.cache_token_stride, nk, dim);
        k = sc.kbuf.data();
        v = sc.vbuf.data();
        stride = dim;
      }
      const int64_t next_head_at = next_at + int64_t(it.kv0 + h) * a.cache_head_stride;
      const Prefetch pf{reinterpret_cast<const char*>(k_cache + next_head_at),
                        reinterpret_cast<const char*>(v_cache + next_head_at),
                        a.cache_token_stride * int64_t(sizeof(T)), next_nk, dim * int(sizeof(T))};
      const float* q = sc.q.data() + size_t(h) * rp * dim;
      if (narrow)
        dot_scores(q, rows, k, stride, nk, dim, s, pf);
      else
        scores(q, rp, k, stride, nk, dim, s, pf);
      if (masked) {  // only chunks on the causal diagonal or at the window's edge
        for (int j = 0; j < nk; ++j)
          for (int r = 0; r < rows; ++r)
            if (key + j > pos[r] || (window > 0 && key + j <= pos[r] - window)) s[j * rp + r] = -INFINITY;
      }
      float *m = sc.m.data() + h * rp, *l = sc.l.data() + h * rp, *alpha = sc.alpha.data() + h * rp;
      softmax_update(s, nk, rp, m, l, alpha);
      accumulate(sc.o.data() + size_t(h) * rows * dim, dim, alpha, s, rp, v, stride, nk, rows);
    }
    key += nk;
    nk = next_nk;
    at = next_at;
  }
  for (int h = 0; h < it.num_kv; ++h) {
    const float* o = sc.o.data() + size_t(h) * rows * dim;
    const float *m = sc.m.data() + h * rp, *l = sc.l.data() + h * rp;
    if (it.part < 0) {
      for (int r = 0; r < rows; ++r) {
        T* dst = row_ptr(static_cast<T*>(a.out), a, it, it.kv0 + h, r, a.out_token_stride, a.out_head_stride);
        const float inv = 1.0f / l[r];
        for (int d = 0; d < dim; ++d) dst[d] = from_float<T>(o[r * dim + d] * inv);
      }
      continue;
    }
    const int total = it.num_kv * rows;  // partial layout: o [total][dim], m [total], l [total]
    float* part = parts + it.part;
    std::copy(o, o + size_t(rows) * dim, part + size_t(h) * rows * dim);
    std::copy(m, m + rows, part + size_t(total) * dim + h * rows);
    std::copy(l, l + rows, part + size_t(total) * dim + total + h * rows);
  }
}

template <typename T>
void run_merge(const Args& a, const Merge& mg, const float* parts, Scratch& sc) {
  const Item& it = mg.tile;
  const int dim = a.head_dim;
  const int rows = it.rows();
  const int total = it.num_kv * rows;
  const int64_t part_size = it.part_size(dim);
  float* acc = sc.kbuf.data();
  for (int row = 0; row < total; ++row) {
    float top = -INFINITY;
    for (int p = 0; p < mg.num_parts; ++p) top = std::max(top, parts[it.part + p * part_size + total * dim + row]);
    std::fill(acc, acc + dim, 0.0f);
    float sum = 0.0f;
    for (int p = 0; p < mg.num_parts; ++p) {
      const float* part = parts + it.part + p * part_size;
      const float weight = std::exp2(part[total * dim + row] - top);  // 0 for a split with no visible key
      sum += weight * part[total * dim + total + row];
      for (int d = 0; d < dim; ++d) acc[d] += weight * part[row * dim + d];
    }
    const int h = row / rows, r = row % rows;
    T* dst = row_ptr(static_cast<T*>(a.out), a, it, it.kv0 + h, r, a.out_token_stride, a.out_head_stride);
    const float inv = 1.0f / sum;
    for (int d = 0; d < dim; ++d) dst[d] = from_float<T>(acc[d] * inv);
  }
}

}  // namespace
}  // namespace tidepool
