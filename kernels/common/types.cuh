// Element types, conversions and the element-rule enum shared by every kernel.
// Kernels compute in float; T (float, __half, __nv_bfloat16) is only the storage type.
#pragma once

#ifndef CUATTN_INTERP
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

using u32 = unsigned int;
using u64 = unsigned long long;

// The member mask of a shuffle or vote that the whole warp takes part in.
constexpr unsigned FULL_WARP = 0xffffffffu;

// NVRTC has no <cmath>: the float infinity every kernel's empty rows (-inf lse) need.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// Element rule applied inside blocks whose row_mask/col_mask entry is >= 0 (docs/design.md §2).
enum MaskRule : int {
  MASK_NONE = 0,      // every key of the block allowed (only the k < n_k bound applies)
  MASK_CAUSAL = 1,    // k <= q
  MASK_WINDOW = 2,    // q - k < window_left and k - q < window_right
  MASK_BITMASK = 3,   // bit lookup in mask_table[mask entry]
};

// Score modifiers between scale * q.k and the mask (docs/design.md §2). MODS_NONE compiles the
// plain kernels, so a call without modifiers pays nothing for them; MODS_SCORE reads their
// runtime values (softcap > 0: s = softcap * tanh(s / softcap)).
enum ScoreModsFlag : int {
  MODS_NONE = 0,
  MODS_SCORE = 1,
};

template <typename A, typename B>
struct is_same_type {
  static constexpr bool value = false;
};
template <typename A>
struct is_same_type<A, A> {
  static constexpr bool value = true;
};

// A or B by a compile-time condition (std::conditional, which NVRTC's headers lack).
template <bool C, typename A, typename B>
struct type_if {
  using type = A;
};
template <typename A, typename B>
struct type_if<false, A, B> {
  using type = B;
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

// FP8 KV-cache codes (cuattn/serving/fp8.py): one byte each, stored by the cache as uint8 and
// decoded here by integer arithmetic, so that the interpreter and NVRTC read them alike with no
// cuda_fp8.h. Every code is exactly a float; the page's scale multiplies it outside.
struct fp8_e4m3 {  // e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, no inf, 0x7f NaN
  unsigned char bits;
};
struct fp8_e5m2 {  // 5 exponent bits (bias 15), 2 mantissa bits: the top byte of an fp16
  unsigned char bits;
};

template <typename T>
struct is_fp8_type {
  static constexpr bool value = false;
};
template <>
struct is_fp8_type<fp8_e4m3> {
  static constexpr bool value = true;
};
template <>
struct is_fp8_type<fp8_e5m2> {
  static constexpr bool value = true;
};

// A code's exponent and mantissa bits placed at the top of a float's and multiplied by
// 2^(127 - bias): a normal code gets its exponent rebiased, a subnormal one (exponent 0) is a
// float denormal that the product scales exactly.
constexpr float FP8_E4M3_REBIAS = 1.329227995784916e36f;  // 2^120 = 2^(127 - 7)
constexpr float FP8_E5M2_REBIAS = 5.192296858534828e33f;  // 2^112 = 2^(127 - 15)
constexpr u32 FP8_E4M3_NAN = 0x7fu;                        // S.1111.111
constexpr u32 FP8_E5M2_SPECIAL = 0x7cu;                    // exponent 11111: inf (0x7c) or NaN

__device__ __forceinline__ float to_float(fp8_e4m3 x) {
  const u32 magnitude = x.bits & 0x7fu;
  float value = __int_as_float(int(magnitude << 20)) * FP8_E4M3_REBIAS;
  if (magnitude == FP8_E4M3_NAN) value = __int_as_float(0x7fc00000);
  return (x.bits & 0x80u) ? -value : value;
}
__device__ __forceinline__ float to_float(fp8_e5m2 x) {
  const u32 magnitude = x.bits & 0x7fu;
  float value = __int_as_float(int(magnitude << 21)) * FP8_E5M2_REBIAS;
  if (magnitude >= FP8_E5M2_SPECIAL) {
    value = magnitude == FP8_E5M2_SPECIAL ? INFINITY : __int_as_float(0x7fc00000);
  }
  return (x.bits & 0x80u) ? -value : value;
}

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

__device__ __forceinline__ unsigned short bits_of(__half x) { return __half_as_ushort(x); }
__device__ __forceinline__ unsigned short bits_of(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }

template <typename T>
__device__ __forceinline__ T from_bits(unsigned short bits);
template <>
__device__ __forceinline__ __half from_bits<__half>(unsigned short bits) {
  return __ushort_as_half(bits);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_bits<__nv_bfloat16>(unsigned short bits) {
  return __ushort_as_bfloat16(bits);
}

// Two floats rounded to T and packed into one 32-bit register, `lo` in the low half: the
// operand format of mma.m16n8k16 (element with the smaller column index in the low bits).
template <typename T>
__device__ __forceinline__ u32 pack_pair(float lo, float hi) {
  static_assert(is_half_type<T>::value, "pack_pair packs 16-bit types");
  return u32(bits_of(from_float<T>(lo))) | (u32(bits_of(from_float<T>(hi))) << 16);
}

// 16-bit element `index` (0 = low) of a packed register, as float.
template <typename T>
__device__ __forceinline__ float unpack_element(u32 packed, int index) {
  return to_float(from_bits<T>((unsigned short)(index ? packed >> 16 : packed & 0xffffu)));
}

// The CTA of attn_fwd_sm90's grid (query tiles, heads, batch): its tile, head and batch,
// numbered in the order CTAs start (x fastest). The (head, batch) pairs (head fastest, so a
// group of query heads shares its kv heads under GQA) are cut into `groups` groups of
// pairs / groups or one more pair, started one group after another; within a group, every
// pair's last query tile starts first, then the one before it. Launched head by head, the
// longest rows of a causal layout's last head would start last and the SMs done early would
// idle while they run; started over every head at once, the resident CTAs would each stream a
// different head's K and V through the L2 and miss it (the H200 read them 8 (d = 128) to 15
// (d = 64) times over). The host sizes the groups
// so one group's K and V fit the L2 (geometry.sm90_cta_groups).
struct CtaTile {
  int tile;
  int head;
  int batch;
};

// Work item `started` (0, 1, ... in the order items start) of `positions` x `pairs`, the pairs
// cut into `groups` groups of pairs / groups or one more pair (1 <= groups <= pairs), one
// group after another, and within a group position-major: every pair's position 0, then every
// pair's position 1, ... 32-bit: the backends refuse a grid of 2^32 CTAs or more
// (geometry.CTA_COUNT_LIMIT).
struct GroupedItem {
  int position;
  int pair;
};

__device__ __forceinline__ GroupedItem grouped_item(unsigned started, unsigned positions,
                                                    unsigned pairs, unsigned groups) {
  const unsigned narrow = pairs / groups;  // pairs of a group
  const unsigned wide_groups = pairs % groups;  // the first ones have one more
  const unsigned wide_items = wide_groups * (narrow + 1) * positions;
  const bool in_wide = started < wide_items;
  const unsigned size = in_wide ? narrow + 1 : narrow;
  const unsigned later = in_wide ? started : started - wide_items;
  const unsigned group = later / (size * positions);
  const unsigned in_group = later % (size * positions);
  const unsigned first_pair = (in_wide ? 0u : wide_items / positions) + group * size;
  return {int(in_group / size), int(first_pair + in_group % size)};
}

__device__ __forceinline__ CtaTile cta_tile_longest_first(unsigned groups) {
  const unsigned tiles = gridDim.x;
  const unsigned heads = gridDim.y;
  const unsigned started = blockIdx.x + tiles * (blockIdx.y + heads * blockIdx.z);
  const GroupedItem item = grouped_item(started, tiles, heads * gridDim.z, groups);
  return {int(tiles) - 1 - item.position, item.pair % int(heads), item.pair / int(heads)};
}

// Element offset of row `row` of head `head` in batch `batch` of a [batch, heads, rows, HEAD_DIM]
// input whose last axis is contiguous and whose other axes have the given element strides: q, k,
// v and dout may be views (a [B, T, H, d] projection seen as [B, H, T, d]) with 16-byte aligned
// rows; the kernels' outputs and lse, delta are contiguous. Recomputed at each copy from the
// kernel parameters (constant bank): a few integer ops, no register held across the main loops.
__device__ __forceinline__ size_t strided_row(long long batch_stride, long long head_stride,
                                              long long row_stride, int batch, int head, int row) {
  return size_t(batch) * size_t(batch_stride) + size_t(head) * size_t(head_stride) +
         size_t(row) * size_t(row_stride);
}
