// exp2 on the FMA pipe instead of MUFU: exp2_poly<DEGREE>(x) = 2^x as 2^j x p(f), with
// j = round(x), f = x - j in [-1/2, 1/2] and p the degree-DEGREE polynomial below, all in FADD,
// FFMA and integer operations (no MUFU, no conversion: F2I and FRND run at MUFU's rate). For the
// sm_90a forward's softmax (kernels/attn_fwd_sm90.cu, EXP2_POLY), whose exp2 at d = 64 keep
// MUFU (16 an SM a cycle) as busy as wgmma keeps the tensor pipe.
//   * Arguments: at most 2^7 (the softmax's are at most RESCALE_SKIP_LOG2 plus rounding). At or
//     below EXP2_POLY_MIN, -inf (a masked score) included, the result is exactly +0; between it
//     and -126 a subnormal under 2^-126 (MUFU.EX2.FTZ gives 0 there). A NaN gives 0.
//   * Accuracy: p's relative error against 2^f is 1.01e-4 (2^-13.3) at degree 3 and 2.91e-6
//     (2^-18.4) at degree 4, and 2^j is exact: exp2_poly_degree picks 3 for bf16, 4 for fp16, so
//     that it stays a twentieth or less of T's rounding of the result (2^-8, 2^-11).
#pragma once

#include "types.cuh"

// x + 1.5 x 2^23 rounds x to the nearest integer j (float's spacing in [2^23, 2^24) is 1), held
// in the sum's low mantissa bits as two's complement: its bits are 0x4B400000 + j for |j| < 2^22.
constexpr float EXP2_POLY_ROUND = 12582912.f;
constexpr unsigned FLOAT_EXPONENT_SHIFT = 23;  // where a float's exponent field starts
// The clamp: j = -127 and f = 0 there, p(0) = 1.0 (0x3F800000), and 0x3F800000 + (-127 << 23)
// is 0: exactly +0 for every argument at or below it, -inf included.
constexpr float EXP2_POLY_MIN = -127.f;

// p(f) ~ 2^f on [-1/2, 1/2]: minimax of the relative error with p(0) = 1 exactly (a linear
// programme on 20,001 points), coefficients rounded to float; Horner's rule.
constexpr float EXP2_POLY3_C1 = 0.6932829f;
constexpr float EXP2_POLY3_C2 = 0.24221095f;
constexpr float EXP2_POLY3_C3 = 0.05500893f;
constexpr float EXP2_POLY4_C1 = 0.69312423f;
constexpr float EXP2_POLY4_C2 = 0.2402409f;
constexpr float EXP2_POLY4_C3 = 0.055906385f;
constexpr float EXP2_POLY4_C4 = 0.009583231f;

template <int DEGREE>
__device__ __forceinline__ float exp2_reduced(float f) {
  static_assert(DEGREE == 3 || DEGREE == 4, "coefficients for degrees 3 and 4");
  if constexpr (DEGREE == 3) {
    return fmaf(fmaf(fmaf(EXP2_POLY3_C3, f, EXP2_POLY3_C2), f, EXP2_POLY3_C1), f, 1.f);
  } else {
    const float high = fmaf(fmaf(EXP2_POLY4_C4, f, EXP2_POLY4_C3), f, EXP2_POLY4_C2);
    return fmaf(fmaf(high, f, EXP2_POLY4_C1), f, 1.f);
  }
}

template <int DEGREE>
__device__ __forceinline__ float exp2_poly(float x) {
  x = fmaxf(x, EXP2_POLY_MIN);
  const float rounded = x + EXP2_POLY_ROUND;
  const float f = x - (rounded - EXP2_POLY_ROUND);  // exact: both are within 2^22 of x
  // p in [2^-1/2, 2^1/2] has exponent field 126 or 127; j's shift leaves only j above bit 22
  // (0x4B400000 << 23 wraps to 0), so the add moves p's exponent by j.
  const unsigned scaled = unsigned(__float_as_int(exp2_reduced<DEGREE>(f))) +
                          (unsigned(__float_as_int(rounded)) << FLOAT_EXPONENT_SHIFT);
  return __int_as_float(int(scaled));
}

// The degree whose error is a twentieth or less of T's rounding of the result.
template <typename T>
struct exp2_poly_degree;
template <>
struct exp2_poly_degree<__nv_bfloat16> {
  static constexpr int value = 3;
};
template <>
struct exp2_poly_degree<__half> {
  static constexpr int value = 4;
};
