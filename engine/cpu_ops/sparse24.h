// 2:4-sparse projection rows (engine/sparsity/format.py's tidepool-2:4 layout), shared by sparse24.cpp
// (one projection per call) and decoder.cpp (the one-call decode step, through projections.h).
//
// A row of W [out, in] is read as its kept values [in / 2] (float32, or int8 times a per-row scale) and
// one mask byte per 8 input columns: bit c of byte b set = column 8b + c kept, two bits per group of 4.
// That is the file's metadata (a nibble i0 | i1 << 2 per group) re-laid once at load, byte for byte
// (sparse24.py's `masks_from_meta`), so the kernel needs no lookup to build a vector mask. Only those bytes
// are read: half the float32 weight bytes plus 1/16, which is what a memory-bound decode step pays for.
//
// sparse_load expands W dense columns of a row in registers from W / 2 kept values and W / 8 mask
// bytes: with AVX-512 (W = 16) one masked expand (vexpandps) whose mask is the two bytes as they are
// (measured single-threaded on an AMD EPYC with AVX-512, a 3072 x 576 projection in L3: a nibble -> mask
// table lookup in the loop was 1.3x slower; a vpermps over indices from two 8-lane tables was even at
// 1 input, faster at 4, slower at 8; dense float32 from L3 took 0.94x the time of this at 1 input, for twice
// the bytes: from DRAM this reads at the memory's speed with cycles to spare); with AVX2 (W = 8)
// one lane permute (vpermps) of the 4 values with a zero lane, its indices from a 256-entry table
// keyed by the mask byte (8 KB, stays in L1); elsewhere lane by lane. The expanded vector then goes
// through the same arithmetic as gemv.h's row kernel (independent accumulators per input, one
// horizontal sum), so the sum is a dense dot product over the pruned row in which the dropped terms are
// exact zeros: it equals F.linear over the unpacked weight up to summation order.
//
// From panel_min_inputs() inputs (panel.h) the rows go through panel.h's packed-panel kernel instead:
// `pack_panel`'s overload for a SparseSource expands each block of W rows x W columns with sparse_load
// and transposes it into the panel, so the compressed bytes are still read once and the arithmetic is
// the dense kernel's. int8 values are widened exactly; the row's scale multiplies the sum.
#pragma once

#include <array>
#include <cstdint>

#include "panel.h"

// One 2:4 projection: values [rows, in / 2] (float32, or int8 with scales), masks [rows, ceil(in / 8)] (the
// kept-column bitmasks above, not the file's nibbles).
// values == nullptr: none. Mirrored by sparse24.py's SparseStruct.
struct TpSparseWeight {
  const void* values;
  const uint8_t* masks;
  const float* scales;  // [rows] float32 when int8 != 0, else null
  int32_t int8;         // 1: int8 values
  int32_t reserved;
};

namespace tidepool {
namespace {

// Mask byte -> for each of its 8 dense columns the index (0..3) of its kept value among the byte's 4 (in
// column order), or 4 (a zero lane) for a dropped column (AVX2's permute). Any byte maps somewhere.
constexpr std::array<std::array<int32_t, 8>, 256> permute_indices() {
  std::array<std::array<int32_t, 8>, 256> t{};
  for (int b = 0; b < 256; ++b) {
    int kept = 0;
    for (int l = 0; l < 8; ++l) t[b][l] = ((b >> l) & 1) && kept < 4 ? kept++ : 4;
  }
  return t;
}

inline constexpr std::array<std::array<int32_t, 8>, 256> PERMUTE_INDEX = permute_indices();

// The 4-bit mask of group g of a row (bits i0 and i1).
inline int group_mask(const uint8_t* masks, int64_t g) { return (masks[g >> 1] >> (4 * (g & 1))) & 15; }

// Dense column `col` of a row (values unscaled): the kept value of its group with as many kept columns
// before it in the group, or 0.
template <typename T>
inline float sparse_at(const T* values, const uint8_t* masks, int64_t col) {
  const int64_t g = col >> 2;
  const int n = group_mask(masks, g), i = int(col & 3);
  if (!((n >> i) & 1)) return 0.0f;
  return float(values[2 * g + __builtin_popcount(unsigned(n) & ((1u << i) - 1))]);
}

// W / 2 kept values of a row from `v`, widened to floats in the low lanes.
#if defined(__AVX512F__)
inline __m256 low_values(const float* v) { return _mm256_loadu_ps(v); }
inline __m256 low_values(const int8_t* v) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v))));
}
#endif
#if defined(__AVX2__)
inline __m128 quad_values(const float* v) { return _mm_loadu_ps(v); }
inline __m128 quad_values(const int8_t* v) {
  int32_t four;
  std::memcpy(&four, v, sizeof four);
  return _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(four)));
}
#endif

// Dense columns [col, col + W) of a row (col % W == 0): values from v + col / 2, masks from m + col / 8.
template <typename T>
inline vf sparse_load(const T* v, const uint8_t* m, int64_t col) {
  const T* vals = v + col / 2;
  const uint8_t* masks = m + col / 8;
#if defined(__AVX512F__)
  if constexpr (W == 16) {
    uint16_t mask;
    std::memcpy(&mask, masks, sizeof mask);  // little-endian: byte col / 8 holds the low 8 columns
    return from_native(_mm512_maskz_expand_ps(__mmask16(mask), _mm512_castps256_ps512(low_values(vals))));
  }
#endif
#if defined(__AVX2__)
  if constexpr (W == 8) {
    const __m256i idx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(PERMUTE_INDEX[masks[0]].data()));
    return from_native(_mm256_permutevar8x32_ps(_mm256_zextps128_ps256(quad_values(vals)), idx));
  }
#endif
  vf out;
  for (int l = 0; l < W; ++l) out[l] = sparse_at(vals, masks, l);
  return out;
}

// One output row for `B` inputs (gemv.h's row_dot over the expanded row): U accumulators per input over
// U * W-column chunks, then W, then group by group. v: the row's kept values, m: its masks.
template <int B, typename T>
inline void sparse_row_dot(const T* v, const uint8_t* m, const float* x, int64_t ldx, int64_t in, float* out) {
  constexpr int U = accumulators<B>();
  constexpr int CHUNK = U * W / 2 * int(sizeof(T));  // bytes of kept values one step of the main loop reads
  vf acc[B][U];
  for (int b = 0; b < B; ++b)
    for (int u = 0; u < U; ++u) acc[b][u] = vf{};
  int64_t i = 0;
  for (; i + U * W <= in; i += U * W) {
    const char* vb = reinterpret_cast<const char*>(v + i / 2);
    if constexpr (CHUNK >= 64) {
      for (int c = 0; c < CHUNK; c += 64) prefetch_ahead(vb + c);
    } else if ((i / 2 * int64_t(sizeof(T))) % 64 == 0) {
      prefetch_ahead(vb);
    }
    if ((i / 8) % 64 < U * W / 8) prefetch_ahead(m + i / 8);  // once per 64 bytes of masks
    vf wv[U];
    for (int u = 0; u < U; ++u) wv[u] = sparse_load(v, m, i + u * W);
    for (int b = 0; b < B; ++b)
      for (int u = 0; u < U; ++u) acc[b][u] += wv[u] * load(x + b * ldx + i + u * W);
  }
  for (; i + W <= in; i += W) {
    const vf wv = sparse_load(v, m, i);
    for (int b = 0; b < B; ++b) acc[b][0] += wv * load(x + b * ldx + i);
  }
  for (int b = 0; b < B; ++b) {
    vf s = acc[b][0];
    for (int u = 1; u < U; ++u) s += acc[b][u];
    float total = 0.0f;
    for (int l = 0; l < W; ++l) total += s[l];
    for (int64_t g = i / 4; g < in / 4; ++g) {  // in % 4 == 0: whole groups
      const unsigned n = unsigned(group_mask(m, g));
      const float* xb = x + b * ldx + 4 * g;
      total += float(v[2 * g]) * xb[__builtin_ctz(n)] + float(v[2 * g + 1]) * xb[31 - __builtin_clz(n)];
    }
    out[b] = total;
  }
}

// A sparse projection as panel_rows' weight: its `pack_panel` overload below expands it.
struct SparseSource {
  TpSparseWeight w;
};

template <typename T>
void pack_sparse_panel(const T* values, const uint8_t* masks, int64_t in, int64_t r0, int64_t nrows, int64_t k0,
                       int64_t kc, float* panel) {
  const int64_t vs = in / 2, ms = (in + 7) / 8;
  int64_t j0 = 0;
  for (; j0 + W <= nrows; j0 += W) {
    int64_t k = 0;
    for (; k + W <= kc; k += W) {  // k0 is a multiple of PANEL_K, so k0 + k of W
      vf r[W];
      for (int j = 0; j < W; ++j) r[j] = sparse_load(values + (r0 + j0 + j) * vs, masks + (r0 + j0 + j) * ms, k0 + k);
      transpose(r);
      for (int kk = 0; kk < W; ++kk) store(panel + (k + kk) * PANEL + j0, r[kk]);
    }
    for (; k < kc; ++k)
      for (int j = 0; j < W; ++j)
        panel[k * PANEL + j0 + j] = sparse_at(values + (r0 + j0 + j) * vs, masks + (r0 + j0 + j) * ms, k0 + k);
  }
  for (int64_t j = j0; j < PANEL; ++j)
    for (int64_t k = 0; k < kc; ++k)
      panel[k * PANEL + j] = j < nrows ? sparse_at(values + (r0 + j) * vs, masks + (r0 + j) * ms, k0 + k) : 0.0f;
}

// panel.h's panel_rows calls pack_panel(w, ...) with its weight; for a SparseSource this overload is found
// by argument-dependent lookup and is preferred to the dense template.
inline void pack_panel(const SparseSource* s, int64_t in, int64_t r0, int64_t nrows, int64_t k0, int64_t kc,
                       float* panel) {
  if (s->w.int8)
    pack_sparse_panel(static_cast<const int8_t*>(s->w.values), s->w.masks, in, r0, nrows, k0, kc, panel);
  else
    pack_sparse_panel(static_cast<const float*>(s->w.values), s->w.masks, in, r0, nrows, k0, kc, panel);
}

// Rows [lo, hi) for G inputs: y[b * ldy + o - col0] = w[o] . x[b] (int8: times scales[o]) (+ bias[o]).
template <int G, typename T>
void sparse_group_rows(const TpSparseWeight& s, const float* bias, const float* x, int64_t ldx, int64_t in,
                       int64_t lo, int64_t hi, float* y, int64_t ldy, int64_t col0) {
  const T* values = static_cast<const T*>(s.values);
  const int64_t vs = in / 2, ms = (in + 7) / 8;
  for (int64_t o = lo; o < hi; ++o) {
    float r[G];
    sparse_row_dot<G>(values + o * vs, s.masks + o * ms, x, ldx, in, r);
    if (s.scales != nullptr)
      for (int b = 0; b < G; ++b) r[b] *= s.scales[o];
    for (int b = 0; b < G; ++b) y[b * ldy + o - col0] = bias != nullptr ? r[b] + bias[o] : r[b];
  }
}

template <typename T>
void sparse_groups(const TpSparseWeight& s, const float* bias, const float* x, int64_t ldx, int64_t in,
                   int64_t batch, int64_t lo, int64_t hi, float* y, int64_t ldy, int64_t col0) {
  using GroupFn = void (*)(const TpSparseWeight&, const float*, const float*, int64_t, int64_t, int64_t, int64_t,
                           float*, int64_t, int64_t);
  constexpr GroupFn GROUPS[MAX_BATCH + 1] = {
      nullptr,
      sparse_group_rows<1, T>,
      sparse_group_rows<2, T>,
      sparse_group_rows<3, T>,
      sparse_group_rows<4, T>,
      sparse_group_rows<5, T>,
      sparse_group_rows<6, T>,
      sparse_group_rows<7, T>,
      sparse_group_rows<8, T>,
  };
  for (int64_t b = 0; b < batch; b += MAX_BATCH)
    GROUPS[std::min<int64_t>(MAX_BATCH, batch - b)](s, bias, x + b * ldx, ldx, in, lo, hi, y + b * ldy, ldy, col0);
}

// Rows [lo, hi) of a 2:4 projection times `batch` inputs x [batch, in] (in % 4 == 0), as gemv.h/projections.h's
// weight_rows: the row kernel MAX_BATCH inputs at a time below panel_min_inputs(), the packed panels from there.
inline void sparse_rows(const TpSparseWeight& s, const float* bias, const float* x, int64_t ldx, int64_t in,
                        int64_t batch, int64_t lo, int64_t hi, float* y, int64_t ldy, int64_t col0) {
  if (batch >= panel_min_inputs().load(std::memory_order_relaxed)) {
    const SparseSource src{s};
    panel_rows(&src, s.scales, bias, x, ldx, in, batch, lo, hi, y, ldy, col0);
  } else if (s.int8) {
    sparse_groups<int8_t>(s, bias, x, ldx, in, batch, lo, hi, y, ldy, col0);
  } else {
    sparse_groups<float>(s, bias, x, ldx, in, batch, lo, hi, y, ldy, col0);
  }
}

// The arguments a 2:4 projection of `in` inputs needs: values and masks, scales exactly for int8.
inline bool sparse_ok(const TpSparseWeight& s, int64_t in) {
  return s.values != nullptr && s.masks != nullptr && in % 4 == 0 && (s.int8 != 0) == (s.scales != nullptr);
}

}  // namespace
}  // namespace tidepool
