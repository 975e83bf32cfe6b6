// Every inline PTX instruction of cuattn, each behind one small named device function
// (destination first). Under the CPU interpreter (CUATTN_INTERP) each function has a C++ version
// that follows the PTX ISA's per-lane fragment layouts exactly, gathering the other lanes'
// registers through the per-warp exchange of kernels/interp/cuda_shim.h, so the fragment layout
// the kernels rely on is really exercised on the CPU.
//
// Fragment layouts used below (PTX ISA, "Matrix Fragments for mma.m16n8k16" and "ldmatrix"),
// with g = lane / 4 (groupID) and t = lane % 4 (threadID_in_group):
//   A (16x16, row-major, 4 regs of 2 x 16 bit): reg r holds row g + 8*(r % 2),
//       columns 2t + 8*(r / 2) + {0, 1}
//   B (16x8, "col", 2 regs): reg r holds rows (k) 2t + 8*r + {0, 1}, column (n) g
//   C/D (16x8, 4 floats): element e holds row g + 8*(e / 2), column 2t + (e % 2)
//   ldmatrix .x4: lanes 8m..8m+7 give the row addresses of 8x8 matrix m; reg m of a lane holds
//       row g, columns 2t, 2t+1 of matrix m (with .trans: rows 2t, 2t+1 of column g).
#pragma once

#include "types.cuh"

#ifdef CUATTN_INTERP
#include <cstring>
#include <vector>
#endif

// `value` opaque to the compiler from here on (an empty asm that reads and writes it): what
// depends on it is computed after this point, never hoisted out of an enclosing loop (where
// ptxas would otherwise hold it across the loop, and spill it in a producer's few registers).
// The interpreter has nothing to hide it from.
__device__ __forceinline__ void opaque_to_compiler(int& value) {
#ifndef CUATTN_INTERP
  asm volatile("" : "+r"(value));
#endif
}

// Two fp8 codes (KV fp8_e4m3 or fp8_e5m2; code 0 in the low byte of `pair`) widened to an fp16
// pair (code 0 in the low half), exactly: every e4m3 and e5m2 value is an fp16. One cvt from
// sm_89 on (the order as cvt's packing direction keeps it: low byte to low half); sm_80 and the
// interpreter decode the codes' bits (kernels/common/types.cuh), with the same result.
template <typename KV>
__device__ __forceinline__ u32 fp8x2_to_half2(unsigned short pair) {
  static_assert(is_fp8_type<KV>::value, "fp8x2_to_half2 widens fp8 codes");
#if !defined(CUATTN_INTERP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  u32 out;
  if constexpr (is_same_type<KV, fp8_e4m3>::value) {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"(pair));
  } else {
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(out) : "h"(pair));
  }
  return out;
#else
  const KV lo{(unsigned char)(pair & 0xffu)};
  const KV hi{(unsigned char)(pair >> 8)};
  return pack_pair<__half>(to_float(lo), to_float(hi));
#endif
}

// D = A * B + C on tensor cores, fp32 accumulate; T is __half or __nv_bfloat16.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2],
                                             const float (&c)[4]) {
  static_assert(is_half_type<T>::value, "mma_m16n8k16 takes fp16 or bf16 operands");
#ifdef CUATTN_INTERP
  u32 mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  const u32* all = cuattn_interp::warp_exchange(mine, sizeof(mine));
  auto a_at = [&](int row, int col) {
    const int lane = (row % 8) * 4 + (col % 8) / 2;
    const int reg = (row / 8) + 2 * (col / 8);
    return unpack_element<T>(all[lane * cuattn_interp::EXCHANGE_WORDS + reg], col % 2);
  };
  auto b_at = [&](int row, int col) {
    const int lane = col * 4 + (row % 8) / 2;
    const int reg = 4 + row / 8;
    return unpack_element<T>(all[lane * cuattn_interp::EXCHANGE_WORDS + reg], row % 2);
  };
  const int lane = cuattn_interp::lane_id();
  const int g = lane / 4, t = lane % 4;
  float result[4];
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * t + (e % 2);
    float sum = c[e];
    for (int k = 0; k < 16; ++k) sum = std::fma(a_at(row, k), b_at(k, col), sum);
    result[e] = sum;
  }
  for (int e = 0; e < 4; ++e) d[e] = result[e];
#else
  if constexpr (is_same_type<T, __half>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
          "f"(c[2]), "f"(c[3]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
          "f"(c[2]), "f"(c[3]));
  }
#endif
}

// This lane's positions in an accumulator fragment.
struct AccLayout {
  int g;  // row group: rows g and g + 8
  int t;  // column pair: columns 2t and 2t + 1 of every 8-column n-tile
  __device__ __forceinline__ AccLayout() : g(int(threadIdx.x) % 32 / 4), t(int(threadIdx.x) % 4) {}
  // Row of element e (0..3) inside its 16-row fragment; r = e / 2 picks the half.
  __device__ __forceinline__ int row(int e) const { return g + 8 * (e / 2); }
  // Column of element e of n-tile j.
  __device__ __forceinline__ int col(int j, int e) const { return 8 * j + 2 * t + e % 2; }
  // First of the two adjacent columns this lane holds in n-tile j.
  __device__ __forceinline__ int pair_col(int j) const { return 8 * j + 2 * t; }
};

// Columns >= valid of a warp's [16 x COLS] accumulator tile set to 0 (the queries or keys past
// a ragged tile's end).
template <int COLS>
__device__ __forceinline__ void zero_columns_past(float (&tile)[COLS / 8][4],
                                                  const AccLayout& frag, int valid) {
#pragma unroll
  for (int j = 0; j < COLS / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (frag.col(j, e) >= valid) tile[j][e] = 0.f;
    }
  }
}

#ifdef CUATTN_INTERP
namespace cuattn_interp {
// Shared body of ldmatrix .x4 with and without .trans: every lane publishes its row address.
inline void ldmatrix_x4_cpu(u32 (&dst)[4], const void* row_address, bool transpose) {
  require_aligned(row_address, 16);  // each lane's row is one 16-byte shared-memory access
  const u32* all = warp_exchange(&row_address, sizeof(row_address));
  const int lane = lane_id();
  const int g = lane / 4, t = lane % 4;
  auto element = [&](int matrix, int row, int col) {
    const auto* row_ptr = exchanged_value<const unsigned short*>(all, matrix * 8 + row);
    return u32(row_ptr[col]);
  };
  for (int m = 0; m < 4; ++m) {
    const u32 lo = transpose ? element(m, 2 * t, g) : element(m, g, 2 * t);
    const u32 hi = transpose ? element(m, 2 * t + 1, g) : element(m, g, 2 * t + 1);
    dst[m] = lo | (hi << 16);
  }
}
}  // namespace cuattn_interp
#endif

// Four 8x8 matrices of 16-bit elements from shared memory; this lane gives one row address.
__device__ __forceinline__ void ldmatrix_x4(u32 (&dst)[4], const void* smem_row) {
#ifdef CUATTN_INTERP
  cuattn_interp::ldmatrix_x4_cpu(dst, smem_row, false);
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(dst[0]), "=r"(dst[1]), "=r"(dst[2]), "=r"(dst[3])
               : "r"(address));
#endif
}

// Same, each 8x8 matrix transposed on the way into registers.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&dst)[4], const void* smem_row) {
#ifdef CUATTN_INTERP
  cuattn_interp::ldmatrix_x4_cpu(dst, smem_row, true);
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(dst[0]), "=r"(dst[1]), "=r"(dst[2]), "=r"(dst[3])
               : "r"(address));
#endif
}

#ifdef CUATTN_INTERP
namespace cuattn_interp {
// cp.async copies are only guaranteed visible after the wait, and the destination's old contents
// are gone from the moment of issue. The CPU version poisons the destination (0xFF = NaN) at
// issue and lands the data at the wait, so a kernel that reads before waiting, or another warp
// that still reads the old contents without a barrier, sees NaN here too.
// The copies in flight are per thread: ThreadState::pending_copies in kernels/interp/cuda_shim.h.

// Completes every committed copy of this thread except those of the `keep` most recent groups.
inline void complete_copies(int keep) {
  ThreadState& me = self();
  std::vector<PendingCopy> still_pending;
  for (const auto& copy : me.pending_copies) {
    if (copy.group >= 0 && copy.group < me.committed_groups - keep) {
      if (copy.valid) {
        std::memcpy(copy.dst, copy.src, 16);
      } else {
        std::memset(copy.dst, 0, 16);
      }
    } else {
      still_pending.push_back(copy);
    }
  }
  me.pending_copies.swap(still_pending);
}
}  // namespace cuattn_interp
#endif

// 16-byte global -> shared copy that does not block; `valid == false` writes 16 zero bytes
// instead (cp.async's src-size 0 form), which is how ragged tiles get zero rows.
__device__ __forceinline__ void cp_async_16(void* dst_smem, const void* src_gmem, bool valid) {
#ifdef CUATTN_INTERP
  cuattn_interp::require_aligned(dst_smem, 16);
  if (valid) cuattn_interp::require_aligned(src_gmem, 16);
  std::memset(dst_smem, 0xFF, 16);
  cuattn_interp::self().pending_copies.push_back({dst_smem, src_gmem, valid, -1});
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst_smem));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(src_gmem),
               "r"(src_bytes));
#endif
}

// Closes the current group of cp_async_16 copies (the unit cp_async_wait_group counts).
__device__ __forceinline__ void cp_async_commit() {
#ifdef CUATTN_INTERP
  cuattn_interp::commit_group(cuattn_interp::self().pending_copies,
                              cuattn_interp::self().committed_groups);
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most PENDING of this thread's most recent commit groups are still in flight
// (a __syncthreads must follow before other threads read the data). The "memory" clobbers here
// and on commit: the copies write shared memory behind the compiler's back, so it must not keep
// shared-memory values in registers across a wait, nor move this thread's own reads of the
// landed data above it (a __syncthreads, also a compiler barrier, always follows today; the wait
// must be right without one).
template <int PENDING>
__device__ __forceinline__ void cp_async_wait_group() {
#ifdef CUATTN_INTERP
  cuattn_interp::complete_copies(PENDING);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
#endif
}

// Waits for all of this thread's copies, committed or not (a __syncthreads must follow before
// other threads read them).
__device__ __forceinline__ void cp_async_wait_all() {
#ifdef CUATTN_INTERP
  cp_async_commit();
  cuattn_interp::complete_copies(0);
#else
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}
