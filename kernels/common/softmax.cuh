// Score-tile helpers shared by the forward and backward kernels. Score tiles are warp tiles in
// the mma accumulator layout (ptx.cuh): element (j, e) of this lane sits at tile row
// g + 8 * (e / 2) and tile column 8 * j + 2 * t + e % 2, with g = lane / 4, t = lane % 4.
#pragma once

#include "mask.cuh"

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// Sets disallowed elements of a score tile to -inf. ROWS_ARE_QUERIES tells which axis of the
// tile is the query axis (forward and dQ: rows; dK/dV, which work on S^T: columns).
template <int RULE, int BLOCK, int N, bool ROWS_ARE_QUERIES>
__device__ __forceinline__ void mask_score_tile(float (&s)[N / 8][4], const RuleParams& p,
                                                int row_first, int col_first, int q_block,
                                                int k_block, int mask_id) {
  const int lane = int(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row_first + g + 8 * (e / 2);
      const int col = col_first + 8 * j + 2 * t + e % 2;
      const int q = ROWS_ARE_QUERIES ? row : col;
      const int k = ROWS_ARE_QUERIES ? col : row;
      if (!element_allowed<RULE, BLOCK>(p, q, k, q_block, k_block, mask_id)) s[j][e] = -INFINITY;
    }
  }
}

template <int N>
__device__ __forceinline__ void scale_tile(float (&s)[N / 8][4], float factor) {
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] *= factor;
  }
}
