// The paged-attention op's argument block, its validation, and the split of a step into work items.
//
// A work item is a tile: one sequence, a range of its query tokens, the query heads [head0,
// head0 + num_heads) of each KV head in [kv0, kv0 + num_kv), and a range of its keys. Per KV head
// the tile has `num_tok * num_heads` query rows; the heads sharing a KV head (GQA) are rows of one
// pass, so each K/V row is read once for all of them.
// - Narrow tiles (at most W rows per KV head: decodes, short speculative chunks) span every KV
//   head, so a chunk of a cache block (all heads of consecutive tokens) is read contiguously.
// - Wide tiles (prefill chunks: up to MAX_ROWS rows) take one KV head each.
// When the tiles cannot keep the threads busy (small batch, long context), a tile's key range is
// split and the partial softmax states are merged afterwards (flash-decoding).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec.h"

// Mirrored field for field by a ctypes.Structure on the Python side. Strides are in elements; the
// last dimension of q, out and the caches is contiguous.
struct TpAttentionArgs {
  const void* q;        // [num_tokens, num_q_heads, head_dim]
  void* out;            // same shape and dtype as q
  const void* k_cache;  // [num_blocks, block_size, num_kv_heads, head_dim], same strides as v_cache
  const void* v_cache;
  const int32_t* block_tables;  // [num_seqs, block_table_width]
  const int32_t* seq_lens;      // [num_seqs]: context length after this step
  const int32_t* cu_seqlens_q;  // [num_seqs + 1]: the sequences' query rows in q
  int64_t q_token_stride, q_head_stride, out_token_stride, out_head_stride;
  int64_t cache_block_stride, cache_token_stride, cache_head_stride;
  int64_t block_table_stride;
  int32_t num_tokens, num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks, block_table_width;
  int32_t sliding_window;  // keys kept per query; 0 = no window
  int32_t dtype;           // 0 float32, 1 bfloat16, 2 float16 (q, out and the caches alike)
  int32_t num_threads;
  float scale;
};

namespace tidepool {

constexpr int KEY_CHUNK = 16;        // keys per softmax update (never crossing a cache block)
constexpr int MAX_ROWS = 32;         // query rows per KV head in a wide tile (a multiple of W)
constexpr int MIN_SPLIT_KEYS = 256;  // a split of a long context never scores fewer keys than this

enum Error {
  OK = 0,
  BAD_SHAPE = 1,
  BAD_QUERY_OFFSETS = 2,
  SHORT_BLOCK_TABLE = 3,
  BAD_BLOCK_ID = 4,
  BAD_DTYPE = 5,
  OUT_OF_MEMORY = 6,
};

struct Item {
  int32_t seq, kv0, num_kv, head0, num_heads, tok0, num_tok, key0, key1;
  int64_t part;  // offset of this item's partial state in the split buffer; -1: it writes `out`
  int64_t cost;
  int rows() const { return num_tok * num_heads; }  // per KV head
  int64_t part_size(int dim) const { return int64_t(num_kv) * rows() * (dim + 2); }  // o, then m, then l
};

struct Merge {  // the splits of one tile: num_parts partial states from tile.part on
  Item tile;
  int32_t num_parts;
};

struct Plan {
  std::vector<Item> items;  // largest first
  std::vector<Merge> merges;
  int64_t parts_size = 0;   // floats of partial state
  int state_rows = 0;       // max over items of num_kv * rows padded to W: the scratch a thread needs
};

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

inline int validate(const TpAttentionArgs& a) {
  if (a.num_seqs < 0 || a.num_q_heads <= 0 || a.num_kv_heads <= 0 || a.num_q_heads % a.num_kv_heads != 0 ||
      a.head_dim <= 0 || a.block_size <= 0 || a.sliding_window < 0 || a.num_tokens < 0)
    return BAD_SHAPE;
  if (a.num_seqs > 0 && a.cu_seqlens_q[0] < 0) return BAD_QUERY_OFFSETS;
  for (int32_t s = 0; s < a.num_seqs; ++s) {
    const int32_t num_q = a.cu_seqlens_q[s + 1] - a.cu_seqlens_q[s];
    const int32_t len = a.seq_lens[s];
    if (num_q < 0 || num_q > len || a.cu_seqlens_q[s + 1] > a.num_tokens) return BAD_QUERY_OFFSETS;
    if (num_q == 0) continue;
    const int32_t num_blocks = (len + a.block_size - 1) / a.block_size;
    if (num_blocks > a.block_table_width) return SHORT_BLOCK_TABLE;
    const int32_t* table = a.block_tables + s * a.block_table_stride;
    for (int32_t b = 0; b < num_blocks; ++b)
      if (table[b] < 0 || table[b] >= a.num_blocks) return BAD_BLOCK_ID;
  }
  return OK;
}

inline std::vector<Item> tiles_of(const TpAttentionArgs& a) {
  const int group = a.num_q_heads / a.num_kv_heads;
  const int heads_per_tile = std::min(group, MAX_ROWS);
  const int toks_per_tile = std::max(1, MAX_ROWS / heads_per_tile);
  std::vector<Item> tiles;
  for (int32_t s = 0; s < a.num_seqs; ++s) {
    const int32_t num_q = a.cu_seqlens_q[s + 1] - a.cu_seqlens_q[s];
    const int32_t first = a.seq_lens[s] - num_q;  // position of the sequence's first query
    for (int32_t t0 = 0; t0 < num_q; t0 += toks_per_tile) {
      const int32_t nt = std::min(toks_per_tile, num_q - t0);
      const int32_t key0 = a.sliding_window > 0 ? std::max(0, first + t0 - a.sliding_window + 1) : 0;
      const int32_t key1 = first + t0 + nt;
      for (int32_t h0 = 0; h0 < group; h0 += heads_per_tile) {
        const int32_t nh = std::min(heads_per_tile, group - h0);
        const bool narrow = nt * nh <= W;
        for (int32_t kv0 = 0; kv0 < a.num_kv_heads; kv0 += narrow ? a.num_kv_heads : 1) {
          const int32_t num_kv = narrow ? a.num_kv_heads : 1;
          const int64_t cost = int64_t(key1 - key0) * num_kv * round_up(nt * nh, W);
          tiles.push_back(Item{s, kv0, num_kv, h0, nh, t0, nt, key0, key1, -1, cost});
        }
      }
    }
  }
  return tiles;
}

// Tiles of every sequence, split along the keys when the tiles alone cannot keep the threads busy.
inline Plan plan(const TpAttentionArgs& a) {
  Plan p;
  const std::vector<Item> tiles = tiles_of(a);
  int64_t total = 0;
  for (const Item& t : tiles) total += t.cost;
  const int64_t target = a.num_threads > 1 ? std::max<int64_t>(1, total / (4 * int64_t(a.num_threads))) : total;
  for (const Item& tile : tiles) {
    p.state_rows = std::max(p.state_rows, tile.num_kv * round_up(tile.rows(), W));
    const int32_t keys = tile.key1 - tile.key0;
    const int64_t wanted = std::min<int64_t>((tile.cost + target - 1) / target, keys / MIN_SPLIT_KEYS);
    if (wanted < 2) {
      p.items.push_back(tile);
      continue;
    }
    const int32_t piece = round_up(int((keys + wanted - 1) / wanted), KEY_CHUNK);
    Merge merge{tile, 0};
    merge.tile.part = p.parts_size;
    for (int32_t k0 = tile.key0; k0 < tile.key1; k0 += piece) {
      Item item = tile;
      item.key0 = k0;
      item.key1 = std::min(tile.key1, k0 + piece);
      item.cost = tile.cost / keys * (item.key1 - item.key0);
      item.part = p.parts_size;
      p.parts_size += tile.part_size(a.head_dim);
      p.items.push_back(item);
      ++merge.num_parts;
    }
    p.merges.push_back(merge);
  }
  std::sort(p.items.begin(), p.items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  return p;
}

}  // namespace tidepool
