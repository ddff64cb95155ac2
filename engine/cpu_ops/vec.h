// Portable SIMD helpers and dtype conversions for Tidepool's CPU ops.
//
// The vectors are GCC/Clang vector extensions of 8 floats: with -march=native they compile to one
// AVX/AVX2 (or AVX-512VL) register, to two NEON registers on arm64 and to SSE pairs elsewhere, so
// the kernels need no intrinsics and no runtime dispatch (the build is keyed on the CPU instead).
// Loads and stores go through memcpy: any alignment, no strict-aliasing games, one vmovups each.
#pragma once

#include <cstdint>
#include <cstring>

namespace tidepool {

constexpr int W = 8;  // floats per vector

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

// Not `vf{} + x`: adding +0.0 is not an identity for -0.0, so the compiler would keep the add.
inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x}; }
static_assert(W == 8, "splat lists W elements");

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define TP_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define TP_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vi{__VA_ARGS__})
#endif

// Pairwise sums within each 128-bit half (the AVX `vhaddps` pattern): a0+a1, a2+a3, b0+b1, b2+b3, ...
inline vf hadd(vf a, vf b) {
  return TP_SHUFFLE(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + TP_SHUFFLE(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// Lane g of the result is the sum of all lanes of v[g], for g < N; the other lanes are 0.
template <int N>
inline vf lane_sums(const vf* v) {
  static_assert(N >= 1 && N <= W, "one lane per vector");
  auto at = [&](int g) { return g < N ? v[g] : vf{}; };
  const vf lo = hadd(hadd(at(0), at(1)), hadd(at(2), at(3)));
  const vf hi = N > 4 ? hadd(hadd(at(4), at(5)), hadd(at(6), at(7))) : vf{};
  return TP_SHUFFLE(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) + TP_SHUFFLE(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
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
