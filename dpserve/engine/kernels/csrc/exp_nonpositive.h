// exp(x) for x <= 0, shared by cpu_kernels.cpp (the attention's softmax) and decode_matmul.cpp
// (SiLU): to ~1 ulp (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6 polynomial in r
// scaled by 2^n), written so that a simd loop vectorizes it: libm's expf is a call per element.
// Results below 2^-126 flush to that bound (a softmax weight of ~1e-38).
//
// In an unnamed namespace: the two files are compiled for different targets (cpu_kernels.py),
// so each keeps its own copy rather than the linker choosing one for both.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace {

inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

}  // namespace
