// The row merge of partial attentions over disjoint key sets (see kernels/merge_states.cu):
// merge_row, one warp per row, over any accessor of a row's parts; SplitMajor, the decode's
// float32 split partials. Shared by the merge kernels and by kernels/attn_decode_gqa.cu, whose
// last CTA of a (sequence, kv head) merges its rows' splits itself; and WarpPartials, the decode
// kernels' merge of their warps' partial rows in shared memory.
#pragma once

#include "types.cuh"

// What an empty part (lse = -inf) contributes to out.
enum MergeEmpty : int {
  MERGE_SKIP_EMPTY = 0,   // nothing: its out is never multiplied (it may hold garbage)
  MERGE_WEIGH_EMPTY = 1,  // its out times its weight 0, as a dense softmax's zero probabilities
};

// -0 + x is x for every x (+0 + -0 is +0): sums start here, so the sum of one term is that term
// bit for bit and the compiler drops the add.
constexpr float SUM_IDENTITY = -0.f;
// Decode merges are latency-bound (a few KB per row): the split walk keeps SPLITS_IN_FLIGHT x
// LANE_ELEMS loads outstanding.
constexpr int SPLITS_IN_FLIGHT = 2;

// The parts of one row, as merge_row reads them: count() parts, lse(s) and out(s, d) (element d
// of part s's out, as float). SPLITS: the count when it is a compile-time constant, 0 when it is
// only known at run time. The decode's splits: float32 [splits, HEAD_DIM] and [splits] of one row.
template <int HEAD_DIM>
struct SplitMajor {
  static constexpr int SPLITS = 0;
  const float* row_out;  // [splits, HEAD_DIM]
  const float* row_lse;  // [splits]
  int splits;
  __device__ __forceinline__ int count() const { return splits; }
  __device__ __forceinline__ float lse(int s) const { return row_lse[s]; }
  __device__ __forceinline__ float out(int s, int d) const {
    return row_out[size_t(s) * HEAD_DIM + d];
  }
};

// One warp merges one row's parts into out_row [HEAD_DIM] and *row_lse; lane owns out elements
// lane + 32 e. EMPTY: what an empty part contributes (MergeEmpty).
template <int HEAD_DIM, MergeEmpty EMPTY, typename T, typename Parts>
__device__ __forceinline__ void merge_row(const Parts& parts, T* __restrict__ out_row,
                                          float* __restrict__ row_lse, int lane) {
  constexpr int LANE_ELEMS = (HEAD_DIM + 31) / 32;
  // Who reads which lse for the max and the sum: with a run-time count lanes read every 32nd
  // part in parallel and reduce by shuffles (one round trip for up to 32 splits); with a
  // compile-time one (two sides) every lane reads them all, fewer instructions than the shuffles.
  constexpr bool LANES_SHARE = Parts::SPLITS == 0;
  const int first = LANES_SHARE ? lane : 0;
  const int step = LANES_SHARE ? 32 : 1;
  // fmaxf drops a NaN lse from base, but its weight below is NaN all the same
  float base = -INFINITY;
  for (int s = first; s < parts.count(); s += step) base = fmaxf(base, parts.lse(s));
  if constexpr (LANES_SHARE) {
    for (int offset = 16; offset > 0; offset /= 2)
      base = fmaxf(base, __shfl_xor_sync(FULL_WARP, base, offset));
  }
  // base = -inf: every part empty (or NaN); shifting by 0 keeps an empty weight exp(-inf) = 0
  // rather than exp(-inf - -inf) = NaN
  const float shift = base == -INFINITY ? 0.f : base;
  float total = SUM_IDENTITY;
  for (int s = first; s < parts.count(); s += step) total += expf(parts.lse(s) - shift);
  if constexpr (LANES_SHARE) {
    for (int offset = 16; offset > 0; offset /= 2)
      total += __shfl_xor_sync(FULL_WARP, total, offset);  // the same sum on every lane
  }
  // total == 0: no part holds a key (or only -inf scores): 0 and -inf, written whatever the
  // parts' outs hold; a NaN total gives NaN for both
  const bool none = total == 0.f;
  const float inv_total = 1.f / total;
  float acc[LANE_ELEMS];
#pragma unroll
  for (int e = 0; e < LANE_ELEMS; ++e) acc[e] = SUM_IDENTITY;
#pragma unroll SPLITS_IN_FLIGHT
  for (int s = 0; s < parts.count(); ++s) {
    const float part_lse = parts.lse(s);
    const float weight = expf(part_lse - shift);
    // skipping, an empty part's out is never multiplied (it may be NaN); a part that
    // contributes is, however small its weight
    const bool skipped = EMPTY == MERGE_SKIP_EMPTY && part_lse == -INFINITY;
#pragma unroll
    for (int e = 0; e < LANE_ELEMS; ++e) {
      const int d = lane + 32 * e;
      if (d < HEAD_DIM) acc[e] += skipped ? 0.f : weight * parts.out(s, d);
    }
  }
#pragma unroll
  for (int e = 0; e < LANE_ELEMS; ++e) {
    const int d = lane + 32 * e;
    if (d < HEAD_DIM) out_row[d] = from_float<T>(none ? 0.f : acc[e] * inv_total);
  }
  if (lane == 0) *row_lse = none ? -INFINITY : shift + logf(total);
}

// One query row's partials from the WARPS warps of a CTA that split its keys among them, in
// shared memory: warp w's at rows + w * warp_stride, HEAD_DIM floats of acc, then its m and l
// (m in log2 units with BASE2, natural ones otherwise). weigh() finds m_all, the largest m
// (fmaxf leaves a warp's NaN m out of it, not out of the sums: its weight is NaN), each warp's
// weight exp(m - m_all) and l_all, the weighted sum of the l. A warp that counted nothing (m
// -inf) weighs 0, which still multiplies its acc: 0, or the NaN of a 0 * NaN. l_all == 0: the
// row counts nothing here; a NaN l_all: a NaN or +inf score reached it.
template <int WARPS, int HEAD_DIM, bool BASE2>
struct WarpPartials {
  const float* rows;
  int warp_stride;
  float m_all = -INFINITY;
  float l_all = 0.f;
  float weight[WARPS];

  __device__ __forceinline__ void weigh() {
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m_all = fmaxf(m_all, rows[w * warp_stride + HEAD_DIM]);
    const float m_shift = m_all == -INFINITY ? 0.f : m_all;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float* row = rows + w * warp_stride;
      weight[w] = BASE2 ? exp2f(row[HEAD_DIM] - m_shift) : expf(row[HEAD_DIM] - m_shift);
      l_all += weight[w] * row[HEAD_DIM + 1];
    }
  }
  // Element d of the weighted sum of the warps' acc.
  __device__ __forceinline__ float column(int d) const {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) sum += weight[w] * rows[w * warp_stride + d];
    return sum;
  }
};
