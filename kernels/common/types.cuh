// Element types, conversions and the element-rule enum shared by every kernel.
// Kernels compute in float; T (float, __half, __nv_bfloat16) is only the storage type.
#pragma once

#ifndef CUATTN_INTERP
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

using u32 = unsigned int;

// Element rule applied inside blocks whose row_mask/col_mask entry is >= 0 (SPEC.md "Layout").
enum MaskRule : int {
  MASK_NONE = 0,      // every key of the block allowed (only the k < n_ctx bound applies)
  MASK_CAUSAL = 1,    // k <= q
  MASK_WINDOW = 2,    // q - k < window_left and k - q < window_right
  MASK_BITMASK = 3,   // bit lookup in mask_table[mask entry]
};

template <typename A, typename B>
struct is_same_type {
  static constexpr bool value = false;
};
template <typename A>
struct is_same_type<A, A> {
  static constexpr bool value = true;
};

template <typename T>
struct is_half_type {
  static constexpr bool value = false;
};
template <>
struct is_half_type<__half> {
  static constexpr bool value = true;
};
template <>
struct is_half_type<__nv_bfloat16> {
  static constexpr bool value = true;
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Two floats rounded to T and packed into one 32-bit register, `lo` in the low half: the
// operand format of mma.m16n8k16 (element with the smaller column index in the low bits).
template <typename T>
__device__ __forceinline__ u32 pack_pair(float lo, float hi) {
  static_assert(is_half_type<T>::value, "pack_pair packs 16-bit types");
  const T lo_t = from_float<T>(lo);
  const T hi_t = from_float<T>(hi);
  unsigned short lo_bits, hi_bits;
  __builtin_memcpy(&lo_bits, &lo_t, sizeof(lo_bits));
  __builtin_memcpy(&hi_bits, &hi_t, sizeof(hi_bits));
  return u32(lo_bits) | (u32(hi_bits) << 16);
}

// 16-bit element `index` (0 = low) of a packed register, as float.
template <typename T>
__device__ __forceinline__ float unpack_element(u32 packed, int index) {
  const unsigned short bits = (unsigned short)(index ? packed >> 16 : packed & 0xffffu);
  T value;
  __builtin_memcpy(&value, &bits, sizeof(bits));
  return to_float(value);
}
