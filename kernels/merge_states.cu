// Merge of two partial attentions over disjoint key sets (split-KV decoding, ring attention).
//
// For every row r: given (out_a, lse_a) over keys A and (out_b, lse_b) over keys B, computes
//   lse = log(exp(lse_a) + exp(lse_b)),  out = (exp(lse_a - lse) out_a + exp(lse_b - lse) out_b)
// exactly the attention over A u B. A side with lse = -inf (no key) contributes nothing, even if
// its out holds garbage; both sides empty give out = 0 and lse = -inf, never NaN. A side that
// contributes carries NaN and inf as the formula does (a NaN or +inf lse makes the row NaN).
// Shapes: out_a, out_b, out [rows, HEAD_DIM] of T (contiguous); lse_a, lse_b, lse [rows] float32.
// One warp per row (ROWS_PER_CTA rows per CTA), weights in float.
// Run: through cuattn.merge_attention_states (backend "cuda" or "interp"); the grid comes from
// cuattn/backends/geometry.py, e.g. `merge_states<128, __nv_bfloat16>`.
#include "common/row_kernel.cuh"
#include "common/types.cuh"

// exp(lse - base) of one side, 0 for a side with no key (lse = -inf). A NaN lse gives NaN
// (fmaxf drops NaN from base, so base may be -inf then: expf(NaN) is still NaN), a +inf one
// inf - inf = NaN: a side that contributes carries NaN as the dense formula does.
__device__ __forceinline__ float side_weight(float lse, float base) {
  return lse == -INFINITY ? 0.f : expf(lse - base);
}

template <int HEAD_DIM, typename T>
__global__ void __launch_bounds__(row_kernel_traits<HEAD_DIM, T>::NUM_THREADS, 1)
    merge_states(const T* __restrict__ out_a, const float* __restrict__ lse_a,
                 const T* __restrict__ out_b, const float* __restrict__ lse_b,
                 T* __restrict__ out, float* __restrict__ lse, int rows) {
  using Traits = row_kernel_traits<HEAD_DIM, T>;
  const int warp = int(threadIdx.x) / 32;
  const int lane = int(threadIdx.x) % 32;
  for (int r = warp; r < Traits::ROWS_PER_CTA; r += Traits::NUM_WARPS) {
    const int row = int(blockIdx.x) * Traits::ROWS_PER_CTA + r;
    if (row >= rows) break;  // uniform across the warp
    const float a = lse_a[row], b = lse_b[row];
    const float base = fmaxf(a, b);
    const float w_a = side_weight(a, base), w_b = side_weight(b, base);
    const float total = w_a + w_b;  // NaN if a side's is; 0 only when both sides are empty
    const bool none = total == 0.f;
    const float inv_total = 1.f / total;
    for (int d = lane; d < HEAD_DIM; d += 32) {
      const size_t i = size_t(row) * HEAD_DIM + d;
      // an empty side's out must not be multiplied (it may be NaN); a side that contributes is,
      // however small its weight
      const float from_a = a == -INFINITY ? 0.f : w_a * to_float(out_a[i]);
      const float from_b = b == -INFINITY ? 0.f : w_b * to_float(out_b[i]);
      out[i] = from_float<T>(none ? 0.f : (from_a + from_b) * inv_total);
    }
    if (lane == 0) lse[row] = none ? -INFINITY : base + logf(total);
  }
}
