// Conversions between a tensor's dtype and the float32 the CPU kernels compute in (framework/execution/
// cpp_extension.py puts this folder on their include path). bfloat16 goes by bit operations, so that loops
// over it vectorise: c10's rounding branches on NaN, which kept qkv_rotary's bfloat16 loop scalar (8x
// float32's time). Other dtypes convert as c10 converts them.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace servelab {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <>
inline float to_float(c10::BFloat16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x.x) << 16); }

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

// Nearest, ties to even, and NaN to 0x7FC0: c10's result, bit for bit.
template <>
inline c10::BFloat16 round_to(float x) {
  const uint32_t u = __builtin_bit_cast(uint32_t, x);
  const auto rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return c10::BFloat16(x != x ? uint16_t{0x7FC0} : rounded, c10::BFloat16::from_bits());
}

}  // namespace servelab
