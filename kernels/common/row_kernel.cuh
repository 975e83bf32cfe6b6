// The geometry every one-warp-per-row kernel shares (attn_bwd_preprocess, attn_bwd_sum_groups,
// merge_states, attn_decode_merge): ROWS_PER_CTA rows per CTA, NUM_WARPS warps each taking every NUM_WARPS-th row,
// no shared memory. cuattn/backends/geometry.py (ROWS_PER_CTA_ELEMENTWISE, ELEMENTWISE_WARPS)
// launches with the same numbers, and the interpreter checks both agree.
#pragma once

template <int HEAD_DIM, typename T>
struct row_kernel_traits {
  static constexpr int ROWS_PER_CTA = 16;
  static constexpr int NUM_WARPS = 4;
  static constexpr int NUM_THREADS = NUM_WARPS * 32;
  static constexpr int SMEM_BYTES = 0;
};
