// Block-sparse attention forward, FlashAttention-2 style.
//
// Computes, for every (batch, head, query) row, over the keys its layout allows:
//   S = Q K^T * scale,  P = softmax(S),  out = P V,  lse = log(sum(exp(S)))
// Shapes: q, out [batch, heads, n_q, HEAD_DIM] and k, v [batch, heads / kv_group, n_k, HEAD_DIM]
// of T; q, k, v at any element strides with contiguous, 16-byte aligned rows, out contiguous; query head h reads kv head h / kv_group (GQA/MQA); lse float32
// [batch, heads, n_q]. The layout's CSR arrays (docs/design.md §2) name the active key blocks of
// each query block; only those are visited, so nothing of size n_q x n_k exists.
// A row with no allowed key gets out = 0 and lse = -inf.
//
// Work decomposition: one CTA per (TILE_M query rows, head, batch); grid.x walks layout
// query blocks times BLOCK / TILE_M sub-tiles. Each warp owns 16 query rows and keeps
// m_i (running max, log2 domain), l_i (running sum, this lane's columns only) and the output
// accumulator acc in registers; K and V tiles of TILE_N keys stream through shared memory.
// Scores are scaled by scale * log2(e) once so the softmax uses exp2.
//
// Template parameters: BLOCK (layout block size 16/32/64/128), TILE_M and TILE_N (the tiles),
// HEAD_DIM (32/64/96/128), T (float, __half, __nv_bfloat16), RULE (MaskRule,
// kernels/common/types.cuh). Run: through cuattn (backend "cuda" or "interp"); every size comes
// from cuattn/backends/geometry.py, e.g. `attn_fwd<64, 64, 64, 128, __half, MASK_CAUSAL>`.
#include "common/smem.cuh"
#include "common/score_tile.cuh"
#include "common/warp_gemm.cuh"

// TILE_M (query rows per CTA) and TILE_N (keys per shared-memory tile) are chosen by
// cuattn/backends/geometry.py and passed in; the traits only derive the rest and check it.
template <int BLOCK, int TILE_M, int TILE_N, int HEAD_DIM, typename T>
struct attn_fwd_v1_traits {
  static constexpr int M_TILES_PER_BLOCK = BLOCK / TILE_M;
  static constexpr int N_TILES_PER_BLOCK = BLOCK / TILE_N;
  static constexpr int NUM_WARPS = TILE_M / 16;
  static constexpr int NUM_THREADS = NUM_WARPS * 32;
  static constexpr int LD = SmemStride<T, HEAD_DIM>::value;
  static constexpr int SCRATCH_FLOATS = is_half_type<T>::value ? 0 : 16 * (TILE_N + 4);
  static constexpr int SMEM_BYTES = (TILE_M + 2 * TILE_N) * LD * int(sizeof(T)) +
                                    NUM_WARPS * SCRATCH_FLOATS * int(sizeof(float));
  static_assert(BLOCK % TILE_M == 0 && BLOCK % TILE_N == 0 && TILE_M % 16 == 0 && TILE_N % 16 == 0);
  static_assert(HEAD_DIM % 16 == 0);
};

template <int BLOCK, int TILE_M, int TILE_N, int HEAD_DIM, typename T, int RULE>
__global__ void __launch_bounds__(attn_fwd_v1_traits<BLOCK, TILE_M, TILE_N, HEAD_DIM, T>::NUM_THREADS, 1)
    attn_fwd_v1(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
             T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ row_ptr,
             const int* __restrict__ col_idx, const int* __restrict__ row_mask,
             const u32* __restrict__ mask_table, int n_q, int n_k, int q_offset,
             int kv_group, int num_blocks, float scale, int window_left, int window_right,
             long long q_batch_stride, long long q_head_stride, long long q_row_stride,
             long long k_batch_stride, long long k_head_stride, long long k_row_stride,
             long long v_batch_stride, long long v_head_stride, long long v_row_stride) {
  using Traits = attn_fwd_v1_traits<BLOCK, TILE_M, TILE_N, HEAD_DIM, T>;
  constexpr int LD = Traits::LD;
  constexpr int NUM_THREADS = Traits::NUM_THREADS;

  const int q_block = int(blockIdx.x) / Traits::M_TILES_PER_BLOCK;
  const int q_start = q_block * BLOCK + (int(blockIdx.x) % Traits::M_TILES_PER_BLOCK) * TILE_M;
  if (q_start >= n_q) return;  // ragged last block: this sub-tile holds no query at all
  const int head = int(blockIdx.y);
  const size_t head_offset = (size_t(blockIdx.z) * gridDim.y + head) * size_t(n_q);
  const int warp = int(threadIdx.x) / 32;
  const int lane = int(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
  const RuleParams rule{n_q, n_k, q_offset, window_left, window_right, mask_table};

  T* q_smem = dynamic_smem<T>();
  T* k_smem = q_smem + TILE_M * LD;
  T* v_smem = k_smem + TILE_N * LD;
  float* scratch = reinterpret_cast<float*>(v_smem + TILE_N * LD) + warp * Traits::SCRATCH_FLOATS;

  load_tile_async<TILE_M, HEAD_DIM, NUM_THREADS>(
      q_smem, LD, q + strided_row(q_batch_stride, q_head_stride, q_row_stride, blockIdx.z, head, q_start),
      int(q_row_stride), n_q - q_start);
  cp_async_commit();

  float acc[HEAD_DIM / 8][4] = {};
  float m_i[2] = {-INFINITY, -INFINITY};  // rows g and g + 8 of this warp, log2 domain
  float l_i[2] = {0.f, 0.f};
  const float scale_log2 = scale * LOG2E;
  const int q_warp = q_start + warp * 16;

  const int* row = row_ptr + head * (num_blocks + 1) + q_block;
  for (int entry = row[0]; entry < row[1]; ++entry) {
    const int k_block = col_idx[entry];
    const int mask_id = row_mask[entry];
    for (int sub = 0; sub < Traits::N_TILES_PER_BLOCK; ++sub) {
      const int k_start = k_block * BLOCK + sub * TILE_N;
      const int coverage = tile_coverage<RULE>(rule, q_start, q_start + TILE_M - 1, k_start,
                                               k_start + TILE_N - 1, mask_id);
      if (coverage == TILE_EMPTY) continue;  // uniform across the CTA

      __syncthreads();  // every warp is done reading the previous K/V tile
      // K and V travel in separate commit groups: S = Q K^T and the softmax start as soon as
      // K has landed, while V is still in flight.
      const int kv_head = head / kv_group;
      load_tile_async<TILE_N, HEAD_DIM, NUM_THREADS>(
          k_smem, LD,
          k + strided_row(k_batch_stride, k_head_stride, k_row_stride, blockIdx.z, kv_head, k_start),
          int(k_row_stride), n_k - k_start);
      cp_async_commit();
      load_tile_async<TILE_N, HEAD_DIM, NUM_THREADS>(
          v_smem, LD,
          v + strided_row(v_batch_stride, v_head_stride, v_row_stride, blockIdx.z, kv_head, k_start),
          int(v_row_stride), n_k - k_start);
      cp_async_commit();
      cp_async_wait_group<1>();  // Q and K
      __syncthreads();

      float s_frag[TILE_N / 8][4] = {};
      warp_gemm_rs_nk<TILE_N, HEAD_DIM>(s_frag, q_smem + warp * 16 * LD, LD, k_smem, LD);
      scale_tile<TILE_N>(s_frag, scale_log2);
      if (coverage == TILE_PARTIAL) {
        mask_score_tile<RULE, BLOCK, TILE_N, true>(s_frag, rule, q_warp, k_start, q_block, k_block,
                                                    mask_id);
      }

      // Online softmax: rescale what was accumulated so far to the new running max.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < TILE_N / 8; ++j) {
          tile_max = fmaxf(tile_max, fmaxf(s_frag[j][2 * r], s_frag[j][2 * r + 1]));
        }
        const float m_new = fmaxf(m_i[r], quad_max(tile_max));
        // A row that has seen no allowed key yet keeps max -inf; subtracting 0 instead keeps
        // exp2 away from (-inf) - (-inf) = NaN and still yields p = 0.
        const float m_base = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = exp2f(m_i[r] - m_base);
        float row_sum = 0.f;
#pragma unroll
        for (int j = 0; j < TILE_N / 8; ++j) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            s_frag[j][2 * r + c] = exp2f(s_frag[j][2 * r + c] - m_base);
            row_sum += s_frag[j][2 * r + c];
          }
        }
        l_i[r] = l_i[r] * alpha + row_sum;
        m_i[r] = m_new;
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 8; ++j) {
          acc[j][2 * r] *= alpha;
          acc[j][2 * r + 1] *= alpha;
        }
      }
      cp_async_wait_group<0>();  // V
      __syncthreads();
      warp_gemm_regs_kn<HEAD_DIM, TILE_N>(acc, s_frag, v_smem, LD, scratch);
    }
  }
  cp_async_wait_all();  // a row with no active tile still retires its Q copy

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(l_i[r]);
    const int q_row = q_warp + g + 8 * r;
    if (q_row >= n_q) continue;
    // l == 0: no allowed key (or only -inf scores): 0 and -inf, written (acc may hold 0 * NaN
    // from a masked key's v); a NaN or +inf allowed score left l NaN: the row is NaN.
    const bool empty = l == 0.f;
    const float inv_l = 1.f / l;
    T* out_row = out + (head_offset + q_row) * HEAD_DIM;
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 8; ++j) {
      out_row[8 * j + 2 * t] = from_float<T>(empty ? 0.f : acc[j][2 * r] * inv_l);
      out_row[8 * j + 2 * t + 1] = from_float<T>(empty ? 0.f : acc[j][2 * r + 1] * inv_l);
    }
    if (t == 0) lse[head_offset + q_row] = empty ? -INFINITY : (m_i[r] + log2f(l)) * LN2;
  }
}
