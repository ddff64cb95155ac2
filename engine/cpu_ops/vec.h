// Portable SIMD helpers and dtype conversions for Tidepool's CPU ops.
//
// The vectors are GCC/Clang vector extensions of W floats, W = TIDEPOOL_VEC_WIDTH: 16 where the build
// targets AVX-512 (one zmm register: twice the FMA width of AVX2 on CPUs with full-width units), else 8
// (one AVX/AVX2 register, two NEON registers on arm64, SSE pairs elsewhere). build.py sets it from
// TIDEPOOL_CPU_VECTOR_WIDTH when asked (tests build both widths on any CPU: a width the CPU lacks is
// lowered to narrower instructions, correct but slower). The kernels need no intrinsics and no runtime
// dispatch (the build is keyed on the CPU and the flags instead); every reduction and shuffle below is
// written for any power-of-two W. Loads and stores go through memcpy: any alignment, no
// strict-aliasing games, one vmovups each.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#ifndef TIDEPOOL_VEC_WIDTH
#if defined(__AVX512F__)
#define TIDEPOOL_VEC_WIDTH 16
#else
#define TIDEPOOL_VEC_WIDTH 8
#endif
#endif

// Bytes ahead of a streaming weight read that the kernels prefetch (-1: none); build.py sets it from
// TIDEPOOL_CPU_PREFETCH_BYTES when asked. See prefetch_ahead.
#ifndef TIDEPOOL_PREFETCH_BYTES
#define TIDEPOOL_PREFETCH_BYTES 4096
#endif

// The cache level software prefetches fill (prefetch_line): 2 = L2 (prefetcht1), 3 = L1 as well
// (prefetcht0). build.py sets it from TIDEPOOL_CPU_PREFETCH_CACHE when asked. L2 by default: on an AMD
// EPYC (Zen 4) VM, decode attention over a KV cache larger than L3 ran at 12 GB/s with L1 prefetches,
// the same as with none, and at 26-30 GB/s with L2 prefetches (bench/README.md, "Prefetching into L2").
#ifndef TIDEPOOL_PREFETCH_LOCALITY
#define TIDEPOOL_PREFETCH_LOCALITY 2
#endif

namespace tidepool {

constexpr int W = TIDEPOOL_VEC_WIDTH;  // floats per vector
static_assert(W == 8 || W == 16, "TIDEPOOL_VEC_WIDTH is 8 or 16");

typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vi load(const int32_t* p) {
  vi v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// A software prefetch of the line PREFETCH_BYTES past p, for the row kernels that stream weights once
// (gemv.h, int4_tile.h; call it once per 64 bytes read). Rows are short (SmolLM2: 2.3 KB) and threads
// claim 32-row blocks at unrelated addresses, so the hardware prefetchers keep restarting; with this, on
// an Intel AVX-512 VM (bench/build_variants.py --variable prefetch; bench/README.md, "Prefetching the
// weights") a float32 decode step was 1.08x faster at bs=1 and 1.35x at 4 sequences on two threads,
// 1.20x and 1.28x on one, int4 1.13x and 1.28x (2 KB ahead, into L1: 256 B-1 KB gained less, 4-8 KB no
// more). Into L2 (PREFETCH_LOCALITY) on an AMD EPYC (Zen 4) VM, 4 KB ahead beat 2 KB at 4 sequences
// (17.6-18.9 against 24.5-25.4 ms per step), matched it at 1, 8, 16 and 64, and 3 KB-6 KB formed a
// plateau, so 4 KB. The packed-panel kernel (compute-bound) has no prefetch. It changes no arithmetic,
// so no result's bits.
constexpr int PREFETCH_BYTES = TIDEPOOL_PREFETCH_BYTES;
constexpr int PREFETCH_LOCALITY = TIDEPOOL_PREFETCH_LOCALITY;
static_assert(PREFETCH_LOCALITY == 2 || PREFETCH_LOCALITY == 3, "TIDEPOOL_PREFETCH_LOCALITY is 2 (L2) or 3 (L1)");

// A software prefetch of the 64-byte line at p into the level PREFETCH_LOCALITY names.
inline void prefetch_line(const void* p) { __builtin_prefetch(p, 0, PREFETCH_LOCALITY); }

inline void prefetch_ahead(const void* p) {
  if constexpr (PREFETCH_BYTES >= 0) prefetch_line(static_cast<const char*>(p) + PREFETCH_BYTES);
}

// The floats of an intrinsic's register (__m256 for W = 8, __m512 for W = 16) as a vf.
template <typename Native>
inline vf from_native(const Native& v) {
  vf out;
  std::memcpy(&out, &v, sizeof out);
  return out;
}

// An initialiser list, not `vf{} + x` (adding +0.0 is not an identity for -0.0, so the compiler would
// keep the add) nor a loop over lanes (GCC then inserts lane by lane): one broadcast, or an embedded
// {1toW} broadcast operand of the FMA that uses it.
inline vf splat(float x) {
#if TIDEPOOL_VEC_WIDTH == 16
  return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
  return vf{x, x, x, x, x, x, x, x};
#endif
}

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define TP_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define TP_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vi{__VA_ARGS__})
#endif

// shuffle<F>(a, b): lane c of the result is lane F::at(c) of the concatenation a ++ b (constant indices,
// so each is one permute instruction).
template <typename F, int... C>
inline vf shuffle_seq(vf a, vf b, std::integer_sequence<int, C...>) {
  return TP_SHUFFLE(a, b, F::at(C)...);
}

template <typename F>
inline vf shuffle(vf a, vf b) {
  return shuffle_seq<F>(a, b, std::make_integer_sequence<int, W>{});
}

// One level of lane_sums: a and b each hold W / G groups of G partial sums; the result holds a's groups
// then b's, each halved (lanes i and i + G / 2 of a group added), so 2W / G groups of G / 2.
template <int G, bool UPPER>
struct HalfGroups {
  static constexpr int at(int c) {
    const int half = G / 2, q = c / half, o = c % half, per_input = W / G;
    const int base = q < per_input ? q * G : W + (q - per_input) * G;
    return base + o + (UPPER ? half : 0);
  }
};

template <int G>
inline vf half_groups(vf a, vf b) {
  return shuffle<HalfGroups<G, false>>(a, b) + shuffle<HalfGroups<G, true>>(a, b);
}

// cur[0 .. COUNT) each hold W / G groups of G partial sums; pairs merge (two permutes and an add per
// pair) until one vector is left, its groups in the order of the original vectors.
template <int COUNT, int G>
inline void merge_vectors(vf* cur) {
  if constexpr (COUNT > 1) {
    for (int i = 0; i < COUNT / 2; ++i) cur[i] = half_groups<G>(cur[2 * i], cur[2 * i + 1]);
    merge_vectors<COUNT / 2, G / 2>(cur);
  }
}

// One vector of groups of G partial sums (the groups of zero vectors after it): halve them until each is one lane.
template <int G>
inline vf finish_groups(vf x) {
  if constexpr (G > 1) {
    return finish_groups<G / 2>(half_groups<G>(x, vf{}));
  } else {
    return x;
  }
}

constexpr int pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2); }

// Lane g of the result is the sum of all lanes of v[g], for g < N; the other lanes are 0.
// log2(W) levels of pairwise group sums, no scalar horizontal sum: N vectors (rounded up to a power of
// two, P) merge into one holding P groups of W / P partial sums, which then halve in place.
template <int N>
inline vf lane_sums(const vf* v) {
  static_assert(N >= 1 && N <= W, "one lane per vector");
  constexpr int P = pow2_at_least(N);
  vf cur[P];
  for (int g = 0; g < P; ++g) cur[g] = g < N ? v[g] : vf{};
  merge_vectors<P, W>(cur);
  return finish_groups<W / P>(cur[0]);
}

// 2^x for x <= 0 (softmax arguments after subtracting the running max), exact 0 below 2^-126.
// x = n + f with n = round(x), |f| <= 1/2; 2^f by its Taylor series to degree 7 (truncation error
// < 6e-9 relative, below float rounding), 2^n by building the exponent bits.
inline vf exp2v(vf x) {
  const vf lo = splat(-126.0f);
  const vf xc = x < lo ? lo : x;
  const vf t = xc + 0.5f;
  vi n = __builtin_convertvector(t, vi);    // truncates toward zero
  n += (__builtin_convertvector(n, vf) > t);  // comparisons are -1 where true: floor(t)
  const vf f = xc - __builtin_convertvector(n, vf);
  vf p = splat(1.525273380405984e-05f);
  p = p * f + 1.5403530393381606e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.618129107628477e-03f;
  p = p * f + 5.550410866482158e-02f;
  p = p * f + 2.402265069591007e-01f;
  p = p * f + 6.931471805599453e-01f;
  p = p * f + 1.0f;
  const vi bits = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < lo ? vf{} : p * scale;
}

// Storage types of the tensors the ops read and write (torch.float32 / bfloat16 / float16).
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

#if defined(__FLT16_MANT_DIG__)
#define TIDEPOOL_HAS_F16 1
#else
#define TIDEPOOL_HAS_F16 0
#endif

inline float to_float(float x) { return x; }

inline float to_float(bf16 x) {
  const uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

#if TIDEPOOL_HAS_F16
inline float to_float(f16 x) {
  _Float16 h;
  std::memcpy(&h, &x.bits, sizeof h);
  return static_cast<float>(h);
}
#endif

template <typename T>
T from_float(float x);

template <>
inline float from_float<float>(float x) {
  return x;
}

// Round to nearest even, as torch does; NaN stays a (quiet) NaN.
template <>
inline bf16 from_float<bf16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t(u >> 16)};
}

#if TIDEPOOL_HAS_F16
template <>
inline f16 from_float<f16>(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  f16 out;
  std::memcpy(&out.bits, &h, sizeof h);
  return out;
}
#endif

}  // namespace tidepool

// The build hides every symbol (-fvisibility=hidden: helpers inline, no PLT calls); TP_EXPORT marks the exports.
#define TP_EXPORT __attribute__((visibility("default")))

// The vector width, prefetch distance and prefetch level this library was built with (logged by cpu_ops, checked by the
// tests that build several), and whether it runs OpenMP (the build links torch's runtime where torch has one). Each
// library is one translation unit, so these definitions are the only ones.
extern "C" TP_EXPORT int tp_vector_width() { return tidepool::W; }
extern "C" TP_EXPORT int tp_prefetch_bytes() { return tidepool::PREFETCH_BYTES; }
extern "C" TP_EXPORT int tp_prefetch_locality() { return tidepool::PREFETCH_LOCALITY; }
extern "C" TP_EXPORT int tp_has_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}
