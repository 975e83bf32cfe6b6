// Warp-level tile products C[16 M x N] += A[16 M x K] * B[K x N] with C in the mma accumulator
// layout, M fragments of 16 rows stacked (float acc[M][N / 8][4], see ptx.cuh): the one register
// layout every kernel's softmax and masking code works on, whichever path computed it. Each B
// fragment read from shared memory feeds all M fragments, so M = 2 halves the shared-memory
// traffic per mma of M = 1 (what FlashAttention-2 gets from 32+ query rows per warp). The
// one-fragment forms (float acc[N / 8][4]) are the same code with M = 1.
//   * __half / __nv_bfloat16: ldmatrix + mma.sync m16n8k16 (tensor cores, fp32 accumulate).
//   * float: SIMT FMA in fp32 straight from shared memory (exact enough for 1e-5 vs float64;
//     TF32 tensor cores would not be).
// Operand forms (names: where A comes from, how B is stored):
//   rs_nk:   A row-major in smem [16][K];       B stored as rows of N: [N][K]  (B = that^T)
//   ts_kn:   A stored transposed in smem [K][16]; B stored [K][N]
//   regs_kn: A in registers, accumulator layout float[K / 8][4]; B stored [K][N]
//   fs_nk:   A's ldmatrix fragments held in registers (load_a_frags, half types only): a tile
//            that stays put across a loop is read from shared memory once; B as rs_nk
#pragma once

#include "ptx.cuh"

namespace warp_gemm_detail {

// SIMT fallback: this lane computes its own accumulator elements from any operand accessors,
// as outer products over k (two A values and two B values per n-tile per step), so only the
// accumulators stay live; each element still sums over k in order, in fp32.
template <int N, int K, typename AAt, typename BAt>
__device__ __forceinline__ void simt_gemm(float (&acc)[N / 8][4], AAt a_at, BAt b_at) {
  const AccLayout frag;
#pragma unroll 2
  for (int kk = 0; kk < K; ++kk) {
    const float a_lo = a_at(frag.row(0), kk);
    const float a_hi = a_at(frag.row(2), kk);
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
      const float b0 = b_at(kk, frag.col(j, 0));
      const float b1 = b_at(kk, frag.col(j, 1));
      acc[j][0] = fmaf(a_lo, b0, acc[j][0]);
      acc[j][1] = fmaf(a_lo, b1, acc[j][1]);
      acc[j][2] = fmaf(a_hi, b0, acc[j][2]);
      acc[j][3] = fmaf(a_hi, b1, acc[j][3]);
    }
  }
}

}  // namespace warp_gemm_detail

// A fragment and one B 16-column slab into acc[n0 / 8] and acc[n0 / 8 + 1].
template <typename T, int NT>
__device__ __forceinline__ void mma_pair(float (&acc)[NT][4], int n0, const u32 (&a_frag)[4],
                                         const u32 (&b_frag)[4]) {
  const u32 b_lo[2] = {b_frag[0], b_frag[1]};
  const u32 b_hi[2] = {b_frag[2], b_frag[3]};
  mma_m16n8k16<T>(acc[n0 / 8], a_frag, b_lo, acc[n0 / 8]);
  mma_m16n8k16<T>(acc[n0 / 8 + 1], a_frag, b_hi, acc[n0 / 8 + 1]);
}

template <int M, int N, int K, typename T>
__device__ __forceinline__ void warp_gemm_rs_nk(float (&acc)[M][N / 8][4], const T* a, int lda,
                                                const T* b, int ldb) {
  static_assert(N % 16 == 0 && K % 16 == 0, "warp tiles are whole 16x16 mma steps");
  if constexpr (is_half_type<T>::value) {
    const int lane = int(threadIdx.x) % 32;
    // With M = 2, two k-steps unrolled, not all: a fully unrolled loop lets the compiler hoist
    // every A fragment of the row (8 registers per k-step) and spill the accumulators.
    constexpr int K_UNROLL = M > 1 ? 2 : K / 16;
#pragma unroll K_UNROLL
    for (int k0 = 0; k0 < K; k0 += 16) {
      u32 a_frag[M][4];
#pragma unroll
      for (int m = 0; m < M; ++m) {
        ldmatrix_x4(a_frag[m], a + (16 * m + lane % 16) * lda + k0 + (lane / 16) * 8);
      }
#pragma unroll
      for (int n0 = 0; n0 < N; n0 += 16) {
        u32 b_frag[4];
        ldmatrix_x4(b_frag, b + (n0 + lane % 8 + (lane / 16) * 8) * ldb + k0 + ((lane / 8) % 2) * 8);
#pragma unroll
        for (int m = 0; m < M; ++m) mma_pair<T>(acc[m], n0, a_frag[m], b_frag);
      }
    }
  } else {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const T* a_m = a + 16 * m * lda;
      warp_gemm_detail::simt_gemm<N, K>(
          acc[m], [&](int r, int c) { return a_m[r * lda + c]; },
          [&](int r, int c) { return b[c * ldb + r]; });
    }
  }
}

template <int N, int K, typename T>
__device__ __forceinline__ void warp_gemm_rs_nk(float (&acc)[N / 8][4], const T* a, int lda,
                                                const T* b, int ldb) {
  warp_gemm_rs_nk<1, N, K>(*reinterpret_cast<float (*)[1][N / 8][4]>(&acc), a, lda, b, ldb);
}

// The A fragments of a warp's row-major 16 x K tile at `a` (lda elements a row), one
// ldmatrix.x4 per 16-column k-step, for warp_gemm_fs_nk: 2 K / 16 registers a thread.
template <int K, typename T>
__device__ __forceinline__ void load_a_frags(u32 (&frags)[K / 16][4], const T* a, int lda) {
  static_assert(is_half_type<T>::value && K % 16 == 0, "ldmatrix fragments of 16-bit types");
  const int lane = int(threadIdx.x) % 32;
#pragma unroll
  for (int step = 0; step < K / 16; ++step) {
    ldmatrix_x4(frags[step], a + (lane % 16) * lda + 16 * step + (lane / 16) * 8);
  }
}

// acc[16 x N] += A B^T, A from load_a_frags, B stored as rows of N ([N][K], as rs_nk).
template <int N, int K, typename T>
__device__ __forceinline__ void warp_gemm_fs_nk(float (&acc)[N / 8][4], const u32 (&a_frags)[K / 16][4],
                                                const T* b, int ldb) {
  static_assert(is_half_type<T>::value && N % 16 == 0 && K % 16 == 0);
  const int lane = int(threadIdx.x) % 32;
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += 16) {
#pragma unroll
    for (int n0 = 0; n0 < N; n0 += 16) {
      u32 b_frag[4];
      ldmatrix_x4(b_frag, b + (n0 + lane % 8 + (lane / 16) * 8) * ldb + k0 + ((lane / 8) % 2) * 8);
      mma_pair<T>(acc, n0, a_frags[k0 / 16], b_frag);
    }
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
        mma_pair<T>(acc, n0, a_frag, b_frag);
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
// warp's private [16][K + 4] floats of shared memory, one fragment at a time.
template <int M, int N, int K, typename T>
__device__ __forceinline__ void warp_gemm_regs_kn(float (&acc)[M][N / 8][4],
                                                  const float (&a)[M][K / 8][4], const T* b,
                                                  int ldb, float* scratch) {
  static_assert(N % 16 == 0 && K % 16 == 0, "warp tiles are whole 16x16 mma steps");
  const int lane = int(threadIdx.x) % 32;
  if constexpr (is_half_type<T>::value) {
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 16) {
      const int j = k0 / 8;
      u32 a_frag[M][4];
#pragma unroll
      for (int m = 0; m < M; ++m) {
        a_frag[m][0] = pack_pair<T>(a[m][j][0], a[m][j][1]);
        a_frag[m][1] = pack_pair<T>(a[m][j][2], a[m][j][3]);
        a_frag[m][2] = pack_pair<T>(a[m][j + 1][0], a[m][j + 1][1]);
        a_frag[m][3] = pack_pair<T>(a[m][j + 1][2], a[m][j + 1][3]);
      }
#pragma unroll
      for (int n0 = 0; n0 < N; n0 += 16) {
        u32 b_frag[4];
        ldmatrix_x4_trans(b_frag,
                          b + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * ldb + n0 + (lane / 16) * 8);
#pragma unroll
        for (int m = 0; m < M; ++m) mma_pair<T>(acc[m], n0, a_frag[m], b_frag);
      }
    }
  } else {
    constexpr int LD = K + 4;
    const AccLayout frag;
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
      for (int j = 0; j < K / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) scratch[frag.row(e) * LD + frag.col(j, e)] = a[m][j][e];
      }
      __syncwarp();
      warp_gemm_detail::simt_gemm<N, K>(
          acc[m], [&](int r, int c) { return scratch[r * LD + c]; },
          [&](int r, int c) { return b[r * ldb + c]; });
      __syncwarp();
    }
  }
}

template <int N, int K, typename T>
__device__ __forceinline__ void warp_gemm_regs_kn(float (&acc)[N / 8][4], const float (&a)[K / 8][4],
                                                  const T* b, int ldb, float* scratch) {
  warp_gemm_regs_kn<1, N, K>(*reinterpret_cast<float (*)[1][N / 8][4]>(&acc),
                             *reinterpret_cast<const float (*)[1][K / 8][4]>(&a), b, ldb, scratch);
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
