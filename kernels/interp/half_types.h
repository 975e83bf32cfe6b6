// __half and __nv_bfloat16 for the CPU kernel interpreter: 16-bit storage types with the same
// conversions CUDA's cuda_fp16.h / cuda_bf16.h provide (float -> 16 bit rounds to nearest even,
// like __float2half_rn and __float2bfloat16_rn). Arithmetic happens in float, as in the kernels.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

struct __half {
  uint16_t bits;
};

struct __nv_bfloat16 {
  uint16_t bits;
};

namespace cuattn_interp {

inline uint16_t float_to_half_bits(float value) {
  const uint32_t x = std::bit_cast<uint32_t>(value);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t magnitude = x & 0x7fffffffu;
  constexpr uint32_t FLOAT_INF = 0x7f800000u;
  constexpr uint32_t HALF_OVERFLOW = 0x477ff000u;   // 65520: rounds to +inf under nearest-even
  constexpr uint32_t HALF_MIN_NORMAL = 0x38800000u;  // 2^-14
  constexpr uint32_t REBIAS = 112u << 23;            // (127 - 15) exponent bias difference
  if (magnitude > FLOAT_INF) return uint16_t(sign | 0x7e00u);
  if (magnitude >= HALF_OVERFLOW) return uint16_t(sign | 0x7c00u);
  if (magnitude < HALF_MIN_NORMAL) {
    // Subnormal half: count units of 2^-24 (exact scaling), rint rounds half to even.
    const float units = std::bit_cast<float>(magnitude) * 16777216.0f;
    return uint16_t(sign | uint16_t(std::lrint(units)));
  }
  const uint32_t round_bit = (magnitude >> 13) & 1u;
  return uint16_t(sign | ((magnitude - REBIAS + 0xfffu + round_bit) >> 13));
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    const float value = std::ldexp(float(mantissa), -24);
    return sign ? -value : value;
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t float_to_bfloat16_bits(float value) {
  const uint32_t x = std::bit_cast<uint32_t>(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);
  const uint32_t round_bit = (x >> 16) & 1u;
  return uint16_t((x + 0x7fffu + round_bit) >> 16);
}

inline float bfloat16_bits_to_float(uint16_t b) { return std::bit_cast<float>(uint32_t(b) << 16); }

}  // namespace cuattn_interp

inline __half __float2half_rn(float x) { return __half{cuattn_interp::float_to_half_bits(x)}; }
inline __half __float2half(float x) { return __float2half_rn(x); }
inline float __half2float(__half h) { return cuattn_interp::half_bits_to_float(h.bits); }
inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  return __nv_bfloat16{cuattn_interp::float_to_bfloat16_bits(x)};
}
inline __nv_bfloat16 __float2bfloat16(float x) { return __float2bfloat16_rn(x); }
inline float __bfloat162float(__nv_bfloat16 b) { return cuattn_interp::bfloat16_bits_to_float(b.bits); }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline __half __ushort_as_half(unsigned short bits) { return __half{bits}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.bits; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { return __nv_bfloat16{bits}; }
