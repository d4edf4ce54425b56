// exp for the CPU kernels (framework/execution/cpp_extension.py puts this folder on their include path).
#pragma once

#include <cstdint>

namespace servelab {

// Branch-free so that loops calling it vectorise (std::exp does not without -ffast-math):
// 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], Cephes' degree-6 polynomial (relative error about
// 2e-7, as std::exp's float rounding); x clamped to [-87, 88]. n is rounded through an int, shifted
// positive so that truncation rounds down: std::floor keeps GCC from vectorising the loop.
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const int32_t k = static_cast<int32_t>(x * 1.44269504088896341f + 128.5f) - 128;
  const float n = static_cast<float>(k);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * __builtin_bit_cast(float, (k + 127) << 23);
}

}  // namespace servelab
