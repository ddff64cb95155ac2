// Group-wise int4 projections on the CPU: the tile kernel shared by int4_gemv.cpp (one projection per
// call) and decoder.cpp (every projection of a decode step inside one parallel region).
//
// Weight (kernels/int4_packing.py): W[k, n] = q * s + m (mins) or (q - z) * s (zeros), groups of g
// along K. y[b, n] = sum_g (s[g, n] * sum_{k in g} x[b, k] q[k, n] + c[g, n] * sum_{k in g} x[b, k])
// with c = m or c = -s * z: the scale and offset are applied once per group, not per weight.
//
// Layout read here: int4_packing's words (8 nibbles along K) re-laid in tiles of TILE = 16 output
// columns (int4_gemv.py's `tile_weight`, once at load): q [T, K/8, 16], scales and offsets
// [T, K/g, 16], the last tile zero-padded. In the [K/8, N] layout a tile's K/8 lines lie N * 4 bytes
// apart, and streaming 72-192 such lines at once left the loads waiting on memory (a decode step
// read 1.8 GB/s of it); tiled, a tile is one contiguous run.
//
// The kernel broadcasts x[b, k] against the column vector unpacked from a word (outer-product
// form); each packed word is read once per MAX_INPUTS inputs (from L1 after the first pass). Nibble i
// is taken out with one AND (i < 7; i = 7 with a logical shift) without shifting it down: the float
// of (word & 15 << 4i) is q * 16^i exactly, and `prescale` multiplies the input by 16^-i (a power of
// two, so x * q is the same float). Accumulation in float32; any caller gets the same bits for the
// same inputs (same tiles, same order).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// One int4 weight as the ops take it (mirrored by ctypes in decoder.py; int4_gemv.cpp takes the fields
// as arguments). q == nullptr: no int4 weight here.
struct TpInt4Weight {
  const int32_t* q;     // [T, K/8, TILE]
  const void* scales;   // [T, K/g, TILE], dtype as scale_dtype
  const void* offsets;  // the same shape and dtype: mins or zero points
  int32_t scale_dtype;  // 0 float32, 1 bfloat16, 2 float16
  int32_t mins;         // 1: offsets are mins (W = q * s + m); 0: zero points (W = (q - z) * s)
  int64_t group;        // group size along K
};

namespace tidepool {
namespace {

constexpr int TILE = 16;       // output columns per tile: one cache line of a packed row
constexpr int H = TILE / W;    // vectors per tile row: 2 (W = 8) or 1 (W = 16)
constexpr int MAX_INPUTS = 4;  // inputs per pass over a tile: 2 x 4 accumulators + operands fit AVX2's 16 registers
static_assert(TILE % W == 0, "a tile row is whole vectors");

typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));
typedef uint16_t vu16 __attribute__((vector_size(W * sizeof(uint16_t))));

inline vf as_float(vi v) { return __builtin_convertvector(v, vf); }

// Nibble i of each word as a float, times 16^i for i < 7 (masked in place); the top nibble is shifted
// down instead (its mask would set the sign bit). One integer op and one conversion per nibble.
inline vf nibble(vi word, int i) {
  if (i < 7) return as_float(word & int32_t(15u << (4 * i)));
  return as_float(vi(vu(word) >> 28));
}

// What x[k] is multiplied by so that its product with nibble(k % 8) is x * q.
inline float input_scale(int64_t k) { return k % 8 == 7 ? 1.0f : 1.0f / float(1 << (4 * (k % 8))); }

// W scales (or offsets) as floats.
inline vf load_scales(const float* p) { return load(p); }

inline vf load_scales(const bf16* p) {  // a bfloat16 is the top half of a float32
  vu16 bits;
  std::memcpy(&bits, p, sizeof bits);
  const vu wide = __builtin_convertvector(bits, vu) << 16;
  vf v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

#if TIDEPOOL_HAS_F16
// With F16C one vcvtph2ps; GCC's generic vector conversion of _Float16 calls a library routine per lane
// (measured: float16 scales made the whole op 1.6x slower than float32 ones).
inline vf load_scales(const f16* p) {
#if defined(__AVX512F__)
  if constexpr (W == 16) return from_native(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#endif
#ifdef __F16C__
  if constexpr (W == 8) return from_native(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#endif
  vf out;
  for (int l = 0; l < W; ++l) out[l] = to_float(p[l]);
  return out;
}
#endif

// xs[b, k] = x[b, k] * input_scale(k) and sums[b, g] = the sum of group g of x[b] (unscaled), for
// `batch` rows of k inputs (k % group == 0, group % 8 == 0). xs has row stride k, sums `groups`.
inline void prescale(const float* x, int64_t ldx, int64_t batch, int64_t k, int64_t group, float* xs, float* sums) {
  const int64_t groups = k / group;
  vf scale;  // a packed row of the weight is 8 consecutive k
  for (int l = 0; l < W; ++l) scale[l] = input_scale(l);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t g = 0; g < groups; ++g) {
      vf s{};
      int64_t j = g * group;
      for (; j + W <= (g + 1) * group; j += W) {  // W is a multiple of 8: lane l is k % 8 == l % 8
        const vf v = load(x + b * ldx + j);
        s += v;
        store(xs + b * k + j, v * scale);
      }
      float total = 0.0f;
      for (int l = 0; l < W; ++l) total += s[l];
      for (; j < (g + 1) * group; ++j) {  // a group of 8 when W is 16
        total += x[b * ldx + j];
        xs[b * k + j] = x[b * ldx + j] * input_scale(j);
      }
      sums[b * groups + g] = total;
    }
}

// Columns 16t .. 16t + width for inputs b0 .. b0 + B (prescaled: xs, sums), every group, into
// y[b, 0 .. width) (y: column 16t of the output); P accumulator sets hide FMA latency when B is small.
template <int B, typename S>
void tile(const TpInt4Weight& w, int64_t k, const float* xs, const float* sums, int64_t t, int width, int64_t b0,
          float* y, int64_t ldy) {
  constexpr int P = B == 1 ? 4 : (B == 2 ? 2 : 1);
  const int64_t groups = k / w.group, rows_per_group = w.group / 8;
  const int32_t* q = w.q + t * (k / 8) * TILE;
  const S* scales = static_cast<const S*>(w.scales) + t * groups * TILE;
  const S* offsets = static_cast<const S*>(w.offsets) + t * groups * TILE;
  vf total[B][H];
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) total[b][h] = vf{};
  for (int64_t g = 0; g < groups; ++g) {
    vf acc[B][H][P];
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int p = 0; p < P; ++p) acc[b][h][p] = vf{};
    for (int64_t r = g * rows_per_group; r < (g + 1) * rows_per_group; ++r) {
      prefetch_ahead(q + r * TILE);  // a tile row is one 64-byte line
      vi words[H];
      for (int h = 0; h < H; ++h) words[h] = load(q + r * TILE + h * W);
      const float* x = xs + b0 * k + 8 * r;
      for (int i = 0; i < 8; ++i) {
        vf qv[H];
        for (int h = 0; h < H; ++h) qv[h] = nibble(words[h], i);
        for (int b = 0; b < B; ++b) {
          const vf xb = splat(x[b * k + i]);
          for (int h = 0; h < H; ++h) acc[b][h][i % P] += xb * qv[h];
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      const vf s = load_scales(scales + g * TILE + h * W), off = load_scales(offsets + g * TILE + h * W);
      const vf c = w.mins ? off : -off * s;
      for (int b = 0; b < B; ++b) {
        vf d = acc[b][h][0];
        for (int p = 1; p < P; ++p) d += acc[b][h][p];
        total[b][h] += s * d + c * splat(sums[(b0 + b) * groups + g]);
      }
    }
  }
  for (int b = 0; b < B; ++b) {
    float out[TILE];
    for (int h = 0; h < H; ++h) store(out + h * W, total[b][h]);
    std::memcpy(y + (b0 + b) * ldy, out, sizeof(float) * width);
  }
}

template <typename S>
void tile_all_inputs(const TpInt4Weight& w, int64_t k, const float* xs, const float* sums, int64_t batch, int64_t t,
                     int width, float* y, int64_t ldy) {
  using Fn = void (*)(const TpInt4Weight&, int64_t, const float*, const float*, int64_t, int, int64_t, float*,
                      int64_t);
  constexpr Fn TILES[MAX_INPUTS + 1] = {nullptr, tile<1, S>, tile<2, S>, tile<3, S>, tile<4, S>};
  for (int64_t b0 = 0; b0 < batch; b0 += MAX_INPUTS)
    TILES[std::min<int64_t>(MAX_INPUTS, batch - b0)](w, k, xs, sums, t, width, b0, y, ldy);
}

// Tile t's columns (of n in all) of x @ W for `batch` prescaled inputs of k, into y[b, 0 .. 16) (y
// points at the tile's first column, row stride ldy). False (nothing written) for a scale dtype this
// build does not read.
inline bool int4_tile(const TpInt4Weight& w, int64_t k, int64_t n, const float* xs, const float* sums, int64_t batch,
                      int64_t t, float* y, int64_t ldy) {
  const int width = int(std::min<int64_t>(TILE, n - t * TILE));
  switch (w.scale_dtype) {
    case 0:
      tile_all_inputs<float>(w, k, xs, sums, batch, t, width, y, ldy);
      return true;
    case 1:
      tile_all_inputs<bf16>(w, k, xs, sums, batch, t, width, y, ldy);
      return true;
#if TIDEPOOL_HAS_F16
    case 2:
      tile_all_inputs<f16>(w, k, xs, sums, batch, t, width, y, ldy);
      return true;
#endif
    default:
      return false;
  }
}

// The argument checks every caller makes (the scale dtype is checked by int4_tile).
inline bool int4_shape_ok(const TpInt4Weight& w, int64_t k, int64_t n) {
  return w.q != nullptr && w.scales != nullptr && w.offsets != nullptr && n >= 1 && k >= 8 && k % 8 == 0 &&
         w.group >= 8 && w.group % 8 == 0 && k % w.group == 0 &&
         (w.scale_dtype == 0 || w.scale_dtype == 1 || (w.scale_dtype == 2 && TIDEPOOL_HAS_F16));
}

}  // namespace
}  // namespace tidepool
