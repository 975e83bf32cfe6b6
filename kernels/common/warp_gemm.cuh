// Warp-level tile products C[16 x N] += A[16 x K] * B[K x N] with C in the mma accumulator layout
// (float acc[N / 8][4], see ptx.cuh): the one register layout every kernel's softmax and masking
// code works on, whichever path computed it.
//   * __half / __nv_bfloat16: ldmatrix + mma.sync m16n8k16 (tensor cores, fp32 accumulate).
//   * float: SIMT FMA in fp32 straight from shared memory (exact enough for 1e-5 vs float64;
//     TF32 tensor cores would not be).
// Operand forms (names: where A comes from, how B is stored):
//   rs_nk:   A row-major in smem [16][K];       B stored as rows of N: [N][K]  (B = that^T)
//   ts_kn:   A stored transposed in smem [K][16]; B stored [K][N]
//   regs_kn: A in registers, accumulator layout float[K / 8][4]; B stored [K][N]
#pragma once

#include "ptx.cuh"

namespace warp_gemm_detail {

// SIMT fallback: this lane computes its own accumulator elements from any operand accessors,
// as outer products over k (two A values and two B values per n-tile per step), so only the
// accumulators stay live; each element still sums over k in order, in fp32.
template <int N, int K, typename AAt, typename BAt>
__device__ __forceinline__ void simt_gemm(float (&acc)[N / 8][4], AAt a_at, BAt b_at) {
  const int lane = int(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
#pragma unroll 2
  for (int kk = 0; kk < K; ++kk) {
    const float a_lo = a_at(g, kk);
    const float a_hi = a_at(g + 8, kk);
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
      const float b0 = b_at(kk, 8 * j + 2 * t);
      const float b1 = b_at(kk, 8 * j + 2 * t + 1);
      acc[j][0] = fmaf(a_lo, b0, acc[j][0]);
      acc[j][1] = fmaf(a_lo, b1, acc[j][1]);
      acc[j][2] = fmaf(a_hi, b0, acc[j][2]);
      acc[j][3] = fmaf(a_hi, b1, acc[j][3]);
    }
  }
}

}  // namespace warp_gemm_detail

template <int N, int K, typename T>
__device__ __forceinline__ void warp_gemm_rs_nk(float (&acc)[N / 8][4], const T* a, int lda,
                                                const T* b, int ldb) {
  static_assert(N % 16 == 0 && K % 16 == 0, "warp tiles are whole 16x16 mma steps");
  if constexpr (is_half_type<T>::value) {
    const int lane = int(threadIdx.x) % 32;
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 16) {
      u32 a_frag[4];
      ldmatrix_x4(a_frag, a + (lane % 16) * lda + k0 + (lane / 16) * 8);
#pragma unroll
      for (int n0 = 0; n0 < N; n0 += 16) {
        u32 b_frag[4];
        ldmatrix_x4(b_frag, b + (n0 + lane % 8 + (lane / 16) * 8) * ldb + k0 + ((lane / 8) % 2) * 8);
        const u32 b_lo[2] = {b_frag[0], b_frag[1]};
        const u32 b_hi[2] = {b_frag[2], b_frag[3]};
        mma_m16n8k16<T>(acc[n0 / 8], a_frag, b_lo, acc[n0 / 8]);
        mma_m16n8k16<T>(acc[n0 / 8 + 1], a_frag, b_hi, acc[n0 / 8 + 1]);
      }
    }
  } else {
    warp_gemm_detail::simt_gemm<N, K>(
        acc, [&](int r, int c) { return a[r * lda + c]; },
        [&](int r, int c) { return b[c * ldb + r]; });
  }
}

template <int N, int K, typename T>
__device__ __forceinline__ void warp_gemm_ts_kn(float (&acc)[N / 8][4], const T* a, int lda,
                                                const T* b, int ldb) {
  static_assert(N % 16 == 0 && K % 16 == 0, "warp tiles are whole 16x16 mma steps");
  if constexpr (is_half_type<T>::value) {
    const int lane = int(threadIdx.x) % 32;
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 16) {
      u32 a_frag[4];
      ldmatrix_x4_trans(a_frag, a + (k0 + lane % 8 + (lane / 16) * 8) * lda + ((lane / 8) % 2) * 8);
#pragma unroll
      for (int n0 = 0; n0 < N; n0 += 16) {
        u32 b_frag[4];
        ldmatrix_x4_trans(b_frag,
                          b + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * ldb + n0 + (lane / 16) * 8);
        const u32 b_lo[2] = {b_frag[0], b_frag[1]};
        const u32 b_hi[2] = {b_frag[2], b_frag[3]};
        mma_m16n8k16<T>(acc[n0 / 8], a_frag, b_lo, acc[n0 / 8]);
        mma_m16n8k16<T>(acc[n0 / 8 + 1], a_frag, b_hi, acc[n0 / 8 + 1]);
      }
    }
  } else {
    warp_gemm_detail::simt_gemm<N, K>(
        acc, [&](int r, int c) { return a[c * lda + r]; },
        [&](int r, int c) { return b[r * ldb + c]; });
  }
}

// A from registers (e.g. the probabilities P just computed in accumulator layout). Half types
// use the accumulator -> A-operand identity of m16n8k16 (two adjacent n-tiles of C are one
// k-step of A), so P never leaves registers. The float path stages A through `scratch`, this
// warp's private [16][K + 4] floats of shared memory.
template <int N, int K, typename T>
__device__ __forceinline__ void warp_gemm_regs_kn(float (&acc)[N / 8][4], const float (&a)[K / 8][4],
                                                  const T* b, int ldb, float* scratch) {
  static_assert(N % 16 == 0 && K % 16 == 0, "warp tiles are whole 16x16 mma steps");
  const int lane = int(threadIdx.x) % 32;
  if constexpr (is_half_type<T>::value) {
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 16) {
      const int j = k0 / 8;
      const u32 a_frag[4] = {pack_pair<T>(a[j][0], a[j][1]), pack_pair<T>(a[j][2], a[j][3]),
                             pack_pair<T>(a[j + 1][0], a[j + 1][1]),
                             pack_pair<T>(a[j + 1][2], a[j + 1][3])};
#pragma unroll
      for (int n0 = 0; n0 < N; n0 += 16) {
        u32 b_frag[4];
        ldmatrix_x4_trans(b_frag,
                          b + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * ldb + n0 + (lane / 16) * 8);
        const u32 b_lo[2] = {b_frag[0], b_frag[1]};
        const u32 b_hi[2] = {b_frag[2], b_frag[3]};
        mma_m16n8k16<T>(acc[n0 / 8], a_frag, b_lo, acc[n0 / 8]);
        mma_m16n8k16<T>(acc[n0 / 8 + 1], a_frag, b_hi, acc[n0 / 8 + 1]);
      }
    }
  } else {
    constexpr int LD = K + 4;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < K / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) scratch[(g + 8 * (e / 2)) * LD + 8 * j + 2 * t + e % 2] = a[j][e];
    }
    __syncwarp();
    warp_gemm_detail::simt_gemm<N, K>(
        acc, [&](int r, int c) { return scratch[r * LD + c]; },
        [&](int r, int c) { return b[r * ldb + c]; });
    __syncwarp();
  }
}

// Row reductions over the accumulator layout: the four lanes of a quad (same g) share a row.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
