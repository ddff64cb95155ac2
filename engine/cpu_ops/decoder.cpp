// A whole decode step of a Llama-family decoder stack on the CPU, float32, in one call.
//
// A decode step of a few to ~100 sequences is bound by reading the weights once. Run layer by layer
// from Python, it is ~10 compiled calls per layer (norms, projections, rotary, KV store, attention,
// SwiGLU), each a ctypes call, a few tensor allocations and an OpenMP fork/join: on SmolLM2-135M that
// was a quarter of the step at batch 1, and a step of 9 sequences took twice one of 8 while only the
// one of 8 ran here. Here the step is one parallel region, for any batch up to MAX_WIDE_BATCH (the
// caller keeps to the compiled GEMV's row limit); per layer:
//
//   1. input norm (+ residual add)    every thread computes it into its own buffer (B x hidden
//                                     floats: cheaper than a barrier); thread 0 keeps the residual
//   2. qkv projection                 claimed one head (head_dim rows) at a time; the thread that
//                                     computed a head applies the bias and rotary to it and, for
//                                     K and V heads, stores it into the paged cache
//   3. attention                      plan.h's tiles over the paged cache (attention_run.h)
//   4. o projection                   32-row blocks (gemv.h's row kernel)
//   5. post-attention norm            as 1
//   6. gate/up projection + SwiGLU    32-row blocks of gate and the same rows of up, silu(g) * u
//   7. down projection                32-row blocks: the next layer's input
// and after the last layer, the final norm. Each phase ends at the barrier of its worksharing loop
// (5 or 6 per layer); the residual alternates between two buffers so that thread 0 can write the
// next one while the others still read the current one.
//
// A projection may be per-output-channel int8 instead (its float32 pointer null, its TpInt8Weight set),
// 2:4-sparse (its TpSparseWeight set: sparse24.h, claimed as the float32 rows are) or group-wise int4 (its
// TpInt4Weight set); projections.h computes each form. For int4 each thread
// prescales the projection's input into its own buffer (B x in floats, as the norms: cheaper than a
// barrier) and the rows are claimed a 16-column tile at a time (qkv: a head's tiles, so
// head_dim % 16 == 0; gate/up: gate tile t with up tile t + intermediate / 16, so intermediate % 16 == 0).
//
// Every piece is the function the per-call ops use (gemv.h, int4_tile.h, fused.h, attention_run.h) on
// the same inputs, in the same order, with the same attention plan, so the result is bit-identical to the
// layer-by-layer path with the compiled ops. Threads: the caller's count, in the OpenMP runtime
// torch loaded (build.py).
#include <algorithm>
#include <new>
#include <vector>

#include "attention_run.h"
#include "fused.h"
#include "projections.h"

#ifdef _OPENMP
#include <omp.h>
#endif

// Mirrored by ctypes Structures in decoder.py, field for field.
struct TpDecoderLayer {
  const float* input_norm;                           // [hidden]
  const float* qkv_weight;                           // [(Hq + 2 Hkv) * head_dim, hidden]
  const float* qkv_bias;                             // [(Hq + 2 Hkv) * head_dim] or null
  const float* o_weight;                             // [hidden, Hq * head_dim]
  const float* o_bias;                               // [hidden] or null
  const float* post_norm;                            // [hidden]
  const float* gate_up_weight;                       // [2 * intermediate, hidden], gate rows first
  const float* gate_up_bias;                         // [2 * intermediate] or null
  const float* down_weight;                          // [hidden, intermediate]
  const float* down_bias;                            // [hidden] or null
  float* k_cache;                                    // [num_blocks, block_size, Hkv, head_dim]
  float* v_cache;                                    // strides as in TpDecoderArgs, for every layer
  TpInt8Weight qkv_i8, o_i8, gate_up_i8, down_i8;    // per projection, exactly one of: the float32
  TpInt4Weight qkv_q4, o_q4, gate_up_q4, down_q4;    // weight above, an int8 one, an int4 one,
  TpSparseWeight qkv_sp, o_sp, gate_up_sp, down_sp;  // a 2:4-sparse one
};

struct TpDecoderArgs {
  const TpDecoderLayer* layers;  // [num_layers]
  const float* x;                // [batch, hidden] the embeddings (read only)
  float* out;                    // [batch, hidden] the final norm's output
  const float* final_norm;       // [hidden]
  const float* cos;              // [batch, head_dim]
  const float* sin_signed;       // [batch, head_dim], cat(-sin, sin)
  const int64_t* slots;          // [batch] flat cache slot of each new token
  const int32_t* block_tables;   // [batch, block_table_width], row stride block_table_stride
  const int32_t* seq_lens;       // [batch] context length after this step
  const int32_t* cu_seqlens_q;   // [batch + 1] = 0, 1, ..., batch (one query per sequence)
  int64_t block_table_stride, cache_block_stride, cache_token_stride, cache_head_stride;
  int32_t num_layers, batch, hidden, num_q_heads, num_kv_heads, head_dim, intermediate;
  int32_t block_size, num_blocks, block_table_width, sliding_window, num_threads;
  float eps, scale;
};

namespace tidepool {
namespace {

using Dec = TpDecoderArgs;

enum DecoderError { BAD_BATCH = 7, BAD_SLOT = 8 };

struct Buffers {
  std::vector<float> res0, res1, qkv, attn, o, act, h, parts;
  std::vector<float> xn, res_private;  // per thread, [threads][batch * hidden]
  std::vector<float> gate_up;          // per thread, [threads][2][batch * BLOCK_ROWS]: a block of gate and up
  std::vector<float> xs, sums;         // per thread, [threads][batch * max_in], [threads][batch * max_in / 8]: int4 inputs
  int64_t max_in = 0;                  // the widest projection input (hidden, Hq * head_dim, intermediate)
  std::vector<Scratch> scratch;
};

// This thread's int4 input buffers, prescaled from x [B, in].
inline Int4Input int4_input(Buffers& buf, int tid, int64_t batch, const float* x, int64_t in,
                            const TpInt4Weight& w) {
  Int4Input r{buf.xs.data() + tid * batch * buf.max_in, buf.sums.data() + tid * batch * (buf.max_in / 8)};
  prescale(x, in, batch, in, w.group, r.xs, r.sums);
  return r;
}

inline int thread_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// The norm of phases 1 and 5 for every row: into this thread's xn; the residual into res_out
// (thread 0: the shared next residual; the others: their private copy, never read).
void norm_rows(const Dec& d, const float* x, const float* residual, const float* weight, float* xn, float* res_out) {
  const int64_t n = d.hidden;
  for (int64_t b = 0; b < d.batch; ++b)
    add_rms_norm_row(x + b * n, residual == nullptr ? nullptr : residual + b * n, weight, xn + b * n,
                     res_out + b * n, n, d.eps);
}

// `q4`: the int4 input when the projection is int4 (then head_dim % TILE == 0: a head is whole tiles).
void qkv_phase(const Dec& d, const TpDecoderLayer& L, const float* xn, const Int4Input& q4, float* qkv) {
  const int64_t dim = d.head_dim, hidden = d.hidden, B = d.batch;
  const int hq = d.num_q_heads, hkv = d.num_kv_heads;
  const int64_t width = int64_t(hq + 2 * hkv) * dim;
#pragma omp for schedule(dynamic, 1)
  for (int head = 0; head < hq + 2 * hkv; ++head) {
    if (L.qkv_q4.q != nullptr) {
      for (int64_t t = head * dim / TILE; t < (head + 1) * dim / TILE; ++t)
        int4_tile(L.qkv_q4, hidden, width, q4.xs, q4.sums, B, t, qkv + t * TILE, width);
      if (L.qkv_bias != nullptr)
        for (int64_t b = 0; b < B; ++b)
          for (int64_t o = head * dim; o < (head + 1) * dim; ++o) qkv[b * width + o] += L.qkv_bias[o];
    } else {
      any_rows({L.qkv_weight, L.qkv_i8, L.qkv_sp}, L.qkv_bias, xn, hidden, hidden, B, head * dim, (head + 1) * dim, qkv,
               width, 0);
    }
    for (int64_t b = 0; b < B; ++b) {
      float* row = qkv + b * width + head * dim;
      if (head < hq + hkv) rotary_head(row, d.cos + b * dim, d.sin_signed + b * dim, dim / 2);
      if (head < hq) continue;
      const bool is_k = head < hq + hkv;
      const int kv = is_k ? head - hq : head - hq - hkv;
      const int64_t slot = d.slots[b];
      float* cache = is_k ? L.k_cache : L.v_cache;
      float* dst = cache + (slot / d.block_size) * d.cache_block_stride + (slot % d.block_size) * d.cache_token_stride +
                   kv * d.cache_head_stride;
      std::copy(row, row + dim, dst);
    }
  }
}

// gate/up rows [o0, o0 + BLOCK_ROWS) (int4: [o0, o0 + TILE), gate tile blk and up tile inter / TILE + blk,
// so intermediate % TILE == 0) and act = silu(gate) * up on them: vector silu on whole vectors of the
// row (i + W <= intermediate), scalar on the tail, as tp_silu_mul_f32 splits it.
// g and u: this thread's two [batch, BLOCK_ROWS] buffers.
void gate_up_phase(const Dec& d, const TpDecoderLayer& L, const float* xn, const Int4Input& q4, float* g, float* u,
                   float* act) {
  const int64_t inter = d.intermediate, hidden = d.hidden, B = d.batch;
  const bool int4 = L.gate_up_q4.q != nullptr;
  const int64_t rows = int4 ? TILE : BLOCK_ROWS, num_blocks = (inter + rows - 1) / rows;
  const float* bias = L.gate_up_bias;
#pragma omp for schedule(dynamic, 1)
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const int64_t o0 = blk * rows, o1 = std::min<int64_t>(o0 + rows, inter);
    if (int4) {
      int4_tile(L.gate_up_q4, hidden, 2 * inter, q4.xs, q4.sums, B, blk, g, BLOCK_ROWS);
      int4_tile(L.gate_up_q4, hidden, 2 * inter, q4.xs, q4.sums, B, inter / TILE + blk, u, BLOCK_ROWS);
      if (bias != nullptr)
        for (int64_t b = 0; b < B; ++b)
          for (int64_t o = o0; o < o1; ++o) {
            g[b * BLOCK_ROWS + o - o0] += bias[o];
            u[b * BLOCK_ROWS + o - o0] += bias[inter + o];
          }
    } else {
      const RowWeight rw{L.gate_up_weight, L.gate_up_i8, L.gate_up_sp};
      any_rows(rw, bias, xn, hidden, hidden, B, o0, o1, g, BLOCK_ROWS, o0);
      any_rows(rw, bias, xn, hidden, hidden, B, inter + o0, inter + o1, u, BLOCK_ROWS, inter + o0);
    }
    for (int64_t b = 0; b < B; ++b) {
      float* dst = act + b * inter + o0;
      const float *gb = g + b * BLOCK_ROWS, *ub = u + b * BLOCK_ROWS;
      int64_t j = 0;
      for (; j + W <= o1 - o0; j += W) store(dst + j, silu(load(gb + j)) * load(ub + j));
      for (; j < o1 - o0; ++j) dst[j] = silu(gb[j]) * ub[j];
    }
  }
}

void run_stack(const Dec& d, const TpAttentionArgs& att, const Plan& p, Buffers& buf) {
  const int64_t hidden = d.hidden, q_size = int64_t(d.num_q_heads) * d.head_dim, B = d.batch;
  const int64_t per_thread = B * hidden;
#pragma omp parallel num_threads(d.num_threads) if (d.num_threads > 1)
  {
    const int tid = thread_id();
    float* xn = buf.xn.data() + tid * per_thread;
    float* res_mine = buf.res_private.data() + tid * per_thread;
    float* gate = buf.gate_up.data() + tid * 2 * B * BLOCK_ROWS;
    Scratch& sc = buf.scratch[tid];
    float* res[2] = {buf.res0.data(), buf.res1.data()};
    int cur = 0;
    const float* x = d.x;
    const Int4Input none{nullptr, nullptr};  // a dense projection reads its input as it is
    for (int layer = 0; layer < d.num_layers; ++layer) {
      const TpDecoderLayer& L = d.layers[layer];
      norm_rows(d, x, layer == 0 ? nullptr : res[cur], L.input_norm, xn, tid == 0 ? res[cur ^ 1] : res_mine);
      cur ^= 1;
      qkv_phase(d, L, xn, L.qkv_q4.q ? int4_input(buf, tid, B, xn, hidden, L.qkv_q4) : none, buf.qkv.data());
      TpAttentionArgs a = att;
      a.k_cache = L.k_cache;
      a.v_cache = L.v_cache;
#pragma omp for schedule(dynamic, 1)
      for (size_t i = 0; i < p.items.size(); ++i) run_item<float>(a, p.items[i], sc, buf.parts.data());
      if (!p.merges.empty()) {
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < p.merges.size(); ++i) run_merge<float>(a, p.merges[i], buf.parts.data(), sc);
      }
      if (L.o_q4.q == nullptr)
        project({L.o_weight, L.o_i8, L.o_sp}, L.o_bias, buf.attn.data(), q_size, B, buf.o.data(), hidden, hidden,
                q_size);
      else
        project_int4(L.o_q4, L.o_bias, int4_input(buf, tid, B, buf.attn.data(), q_size, L.o_q4), B, q_size,
                     buf.o.data(), hidden, hidden);
      norm_rows(d, buf.o.data(), res[cur], L.post_norm, xn, tid == 0 ? res[cur ^ 1] : res_mine);
      cur ^= 1;
      gate_up_phase(d, L, xn, L.gate_up_q4.q ? int4_input(buf, tid, B, xn, hidden, L.gate_up_q4) : none, gate,
                    gate + B * BLOCK_ROWS, buf.act.data());
      if (L.down_q4.q == nullptr)
        project({L.down_weight, L.down_i8, L.down_sp}, L.down_bias, buf.act.data(), d.intermediate, B, buf.h.data(),
                hidden, hidden, d.intermediate);
      else
        project_int4(L.down_q4, L.down_bias, int4_input(buf, tid, B, buf.act.data(), d.intermediate, L.down_q4), B,
                     d.intermediate, buf.h.data(), hidden, hidden);
      x = buf.h.data();
    }
    if (tid == 0) norm_rows(d, x, d.num_layers == 0 ? nullptr : res[cur], d.final_norm, d.out, res_mine);
  }
}

TpAttentionArgs attention_args(const Dec& d, Buffers& buf) {
  const int64_t q_size = int64_t(d.num_q_heads) * d.head_dim;
  TpAttentionArgs a{};
  a.q = buf.qkv.data();
  a.out = buf.attn.data();
  a.k_cache = d.num_layers > 0 ? d.layers[0].k_cache : nullptr;
  a.v_cache = d.num_layers > 0 ? d.layers[0].v_cache : nullptr;
  a.block_tables = d.block_tables;
  a.seq_lens = d.seq_lens;
  a.cu_seqlens_q = d.cu_seqlens_q;
  a.q_token_stride = q_size + 2 * int64_t(d.num_kv_heads) * d.head_dim;
  a.q_head_stride = d.head_dim;
  a.out_token_stride = q_size;
  a.out_head_stride = d.head_dim;
  a.cache_block_stride = d.cache_block_stride;
  a.cache_token_stride = d.cache_token_stride;
  a.cache_head_stride = d.cache_head_stride;
  a.block_table_stride = d.block_table_stride;
  a.num_tokens = d.batch;
  a.num_seqs = d.batch;
  a.num_q_heads = d.num_q_heads;
  a.num_kv_heads = d.num_kv_heads;
  a.head_dim = d.head_dim;
  a.block_size = d.block_size;
  a.num_blocks = d.num_blocks;
  a.block_table_width = d.block_table_width;
  a.sliding_window = d.sliding_window;
  a.dtype = 0;
  a.num_threads = d.num_threads;
  a.scale = d.scale;
  return a;
}

bool has_int4(const Dec& d) {
  for (int32_t l = 0; l < d.num_layers; ++l) {
    const TpDecoderLayer& L = d.layers[l];
    if (L.qkv_q4.q || L.o_q4.q || L.gate_up_q4.q || L.down_q4.q) return true;
  }
  return false;
}

bool layer_ok(const Dec& d, const TpDecoderLayer& L) {
  const int64_t hidden = d.hidden, inter = d.intermediate, q_size = int64_t(d.num_q_heads) * d.head_dim;
  const int64_t qkv_rows = int64_t(d.num_q_heads + 2 * d.num_kv_heads) * d.head_dim;
  return projection_ok(L.qkv_weight, L.qkv_i8, L.qkv_sp, L.qkv_q4, hidden, qkv_rows, d.head_dim % TILE == 0) &&
         projection_ok(L.o_weight, L.o_i8, L.o_sp, L.o_q4, q_size, hidden, true) &&
         projection_ok(L.gate_up_weight, L.gate_up_i8, L.gate_up_sp, L.gate_up_q4, hidden, 2 * inter,
                       inter % TILE == 0) &&
         projection_ok(L.down_weight, L.down_i8, L.down_sp, L.down_q4, inter, hidden, true);
}

int validate_decoder(const Dec& d) {
  if (d.batch < 1 || d.batch > MAX_WIDE_BATCH) return BAD_BATCH;
  if (d.num_layers < 0 || d.hidden < 1 || d.intermediate < 1 || d.head_dim < 2 || d.head_dim % 2 != 0 ||
      d.num_threads < 1 || d.block_size < 1 || d.num_blocks < 1)
    return BAD_SHAPE;
  for (int32_t l = 0; l < d.num_layers; ++l)
    if (!layer_ok(d, d.layers[l])) return BAD_SHAPE;
  for (int32_t s = 0; s <= d.batch; ++s)
    if (d.cu_seqlens_q[s] != s) return BAD_QUERY_OFFSETS;  // one query (the decode) per sequence
  const int64_t num_slots = int64_t(d.num_blocks) * d.block_size;
  for (int32_t b = 0; b < d.batch; ++b)
    if (d.slots[b] < 0 || d.slots[b] >= num_slots) return BAD_SLOT;
  return OK;
}

}  // namespace
}  // namespace tidepool

extern "C" {

// Bumped whenever TpDecoderArgs, TpDecoderLayer or the meaning of a field changes; the loader checks it.
TP_EXPORT int tp_decoder_abi_version() { return 4; }
TP_EXPORT int tp_decoder_args_size() { return int(sizeof(TpDecoderArgs)); }
TP_EXPORT int tp_decoder_layer_size() { return int(sizeof(TpDecoderLayer)); }
TP_EXPORT int tp_decoder_max_batch() { return tidepool::MAX_WIDE_BATCH; }  // a bound on the arguments

// As tp_gemv_set_panel_min_inputs, for this library's projections (benchmarks only).
TP_EXPORT int64_t tp_decoder_set_panel_min_inputs(int64_t n) { return tidepool::set_panel_min_inputs(n); }

// Returns 0, or an error code (plan.h's Error, BAD_BATCH, BAD_SLOT) with nothing written.
TP_EXPORT int tp_decode_step_f32(const TpDecoderArgs* args) {
  using namespace tidepool;
  const Dec& d = *args;
  if (const int err = validate_decoder(d)) return err;
  try {  // no C++ exception may cross the C boundary; nothing inside the region allocates
    Buffers buf;
    const int64_t B = d.batch, hidden = d.hidden, threads = d.num_threads;
    const int64_t q_size = int64_t(d.num_q_heads) * d.head_dim;
    buf.qkv.resize(B * (q_size + 2 * int64_t(d.num_kv_heads) * d.head_dim));
    buf.attn.resize(B * q_size);
    buf.res0.resize(B * hidden);
    buf.res1.resize(B * hidden);
    buf.o.resize(B * hidden);
    buf.h.resize(B * hidden);
    buf.act.resize(B * int64_t(d.intermediate));
    buf.xn.resize(threads * B * hidden);
    buf.res_private.resize(threads * B * hidden);
    buf.gate_up.resize(threads * 2 * B * BLOCK_ROWS);
    buf.max_in = std::max<int64_t>({hidden, q_size, int64_t(d.intermediate)});
    if (has_int4(d)) {
      buf.xs.resize(threads * B * buf.max_in);
      buf.sums.resize(threads * B * (buf.max_in / 8));
    }
    const TpAttentionArgs att = attention_args(d, buf);  // points into qkv and attn: sized above
    if (const int err = validate(att)) return err;
    const Plan p = plan(att);
    buf.parts.resize(size_t(p.parts_size));
    buf.scratch.reserve(threads);
    for (int t = 0; t < threads; ++t) buf.scratch.emplace_back(d.head_dim, p.state_rows);
    run_stack(d, att, p, buf);
  } catch (const std::bad_alloc&) {
    return OUT_OF_MEMORY;
  }
  return OK;
}

}  // extern "C"
