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
#include "common/row_kernel.cuh"
#include "common/types.cuh"

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
// Resident CTAs per SM the compiler is asked to allow: 16 CTAs of 4 warps fill the 64 warp slots
// of an sm_80 or sm_90 SM, which caps a thread at 32 registers (no spill at any head dim). Both
// merges wait on memory, so more resident warps are more loads in flight; uncapped, head dim 128
// took 38-40 registers, 12 CTAs.
constexpr int MERGE_MIN_CTAS_PER_SM = 16;

// The parts of one row, as merge_row reads them: count() parts, lse(s) and out(s, d) (element d
// of part s's out, as float). SPLITS: the count when it is a compile-time constant, 0 when it is
// only known at run time.
// merge_states' two sides: two T arrays.
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

// The decode's splits: float32 [splits, HEAD_DIM] and [splits] of one row.
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
