// Merge of partial attentions over disjoint key sets: the two-way merge behind
// cuattn.merge_attention_states (ring attention, users) and the merge of the split-KV decode's
// splits (kernels/attn_decode.cu computes them).
//
// For every row: given parts s, (out_s, lse_s) the attention over keys K_s, computes
//   lse = log(sum_s exp(lse_s)),  out = sum_s exp(lse_s - lse) out_s
// exactly the attention over the union of the K_s, in float (T is only the storage type).
// Both kernels are one warp per row (ROWS_PER_CTA rows per CTA, common/row_kernel.cuh) over one
// row function, merge_row, which reads its parts through a small accessor and is told by a
// template flag what an empty part (lse = -inf: no key) contributes:
// merge_states<HEAD_DIM, T>: two parts, out_a, out_b [rows, HEAD_DIM] of T, lse_a, lse_b [rows].
//   An empty side contributes nothing, even if its out holds garbage: its out is never
//   multiplied (merge_attention_states' documented behaviour).
// attn_decode_merge<HEAD_DIM, T>: `splits` float32 parts laid out split-major, part_out
//   [rows, splits, HEAD_DIM], part_lse [rows, splits] (rows: the decode's B x H x t_q). Every
//   split is multiplied, an empty one by weight 0: its out is 0, or NaN where the split
//   multiplied a zero probability by a NaN or inf in v, which a dense computation carries too
//   (so the split count never decides whether that NaN reaches the row).
// Special values, both: no part with a key gives out = 0 and lse = -inf, never NaN, whatever the
// outs hold; a part that contributes carries NaN and inf as the formula does (a NaN or +inf lse
// makes the row NaN).
// Outputs: out [rows, HEAD_DIM] of T, lse [rows] float32; every array contiguous.
// Run: through cuattn.merge_attention_states (merge_states) and cuattn.decode_attention on a
// KVCache (attn_decode_merge), backend "cuda" or "interp"; the grid and the name expressions
// come from cuattn/backends/geometry.py, e.g. `merge_states<128, __nv_bfloat16>`.
#include "common/merge_row.cuh"
#include "common/row_kernel.cuh"
#include "common/types.cuh"

// Resident CTAs per SM the compiler is asked to allow: 16 CTAs of 4 warps fill the 64 warp slots
// of an sm_80 or sm_90 SM, which caps a thread at 32 registers (no spill at any head dim). Both
// merges wait on memory, so more resident warps are more loads in flight; uncapped, head dim 128
// took 38-40 registers, 12 CTAs.
constexpr int MERGE_MIN_CTAS_PER_SM = 16;

// merge_states' two sides (see merge_row's accessors in common/merge_row.cuh): two T arrays.
template <typename T>
struct TwoSides {
  static constexpr int SPLITS = 2;
  const T* row_out_a;  // [HEAD_DIM]
  const T* row_out_b;
  const float* row_lse_a;
  const float* row_lse_b;
  __device__ __forceinline__ int count() const { return SPLITS; }
  __device__ __forceinline__ float lse(int s) const { return *(s == 0 ? row_lse_a : row_lse_b); }
  __device__ __forceinline__ float out(int s, int d) const {
    return to_float((s == 0 ? row_out_a : row_out_b)[d]);
  }
};

// Each warp merges rows warp, warp + NUM_WARPS, ... of the CTA's ROWS_PER_CTA; parts_of(row)
// gives a row's accessor.
template <int HEAD_DIM, MergeEmpty EMPTY, typename T, typename PartsOf>
__device__ __forceinline__ void merge_rows(PartsOf parts_of, T* __restrict__ out,
                                           float* __restrict__ lse, int rows) {
  using Traits = row_kernel_traits<HEAD_DIM, T>;
  // divided unsigned, so the compiler knows 0 <= lane < 32 and folds lane + 32 e into one
  // address and immediate offsets (int(threadIdx.x) % 32 cost an address per element)
  const int warp = int(threadIdx.x / 32);
  const int lane = int(threadIdx.x % 32);
  for (int r = warp; r < Traits::ROWS_PER_CTA; r += Traits::NUM_WARPS) {
    const int row = int(blockIdx.x) * Traits::ROWS_PER_CTA + r;
    if (row >= rows) break;  // uniform across the warp
    const size_t first = size_t(row) * HEAD_DIM;
    merge_row<HEAD_DIM, EMPTY>(parts_of(size_t(row)), out + first, lse + row, lane);
  }
}

template <int HEAD_DIM, typename T>
__global__ void __launch_bounds__(row_kernel_traits<HEAD_DIM, T>::NUM_THREADS, MERGE_MIN_CTAS_PER_SM)
    merge_states(const T* __restrict__ out_a, const float* __restrict__ lse_a,
                 const T* __restrict__ out_b, const float* __restrict__ lse_b,
                 T* __restrict__ out, float* __restrict__ lse, int rows) {
  merge_rows<HEAD_DIM, MERGE_SKIP_EMPTY>(
      [=](size_t row) {
        const size_t first = row * HEAD_DIM;
        return TwoSides<T>{out_a + first, out_b + first, lse_a + row, lse_b + row};
      },
      out, lse, rows);
}

template <int HEAD_DIM, typename T>
__global__ void __launch_bounds__(row_kernel_traits<HEAD_DIM, T>::NUM_THREADS, MERGE_MIN_CTAS_PER_SM)
    attn_decode_merge(const float* __restrict__ part_out, const float* __restrict__ part_lse,
                      T* __restrict__ out, float* __restrict__ lse, int rows, int splits) {
  merge_rows<HEAD_DIM, MERGE_WEIGH_EMPTY>(
      [=](size_t row) {
        return SplitMajor<HEAD_DIM>{part_out + row * splits * HEAD_DIM, part_lse + row * splits,
                                    splits};
      },
      out, lse, rows);
}
