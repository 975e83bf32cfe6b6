// Block-sparse attention backward, FlashAttention-2 style.
//
// Given q, out, dout [batch, heads, n_q, HEAD_DIM], k, v [batch, heads / kv_group, n_k, HEAD_DIM]
// (T; HEAD_DIM 16-256; q, k, v, dout at any element strides with contiguous, 16-byte aligned
// rows, out contiguous) and lse [batch, heads, n_q] (float32, from attn_fwd), computes dq like q
// and, per query head, dk, dv [batch, heads, n_k, HEAD_DIM] (T) of sum(out * dout), visiting only
// the active blocks of the layout (with kv_group > 1 the caller sums each kv head's group):
//   P = exp(S - lse), dV = P^T dO, dP = dO V^T, dS = P * (dP - delta), dQ = dS K * scale,
//   dK = dS^T Q * scale, with delta = rowsum(dO * O) - dlse (dlse: the gradient reaching lse);
//   with MODS = MODS_SCORE and softcap > 0, S is capped as in attn_fwd and dS carries the cap's
//   slope 1 - (S / softcap)^2; with use_alibi, S carries ALiBi's bias as in attn_fwd, and with
//   use_alibi_grad attn_bwd_dq writes each query row's share of the slope's gradient,
//   -sum_k dS * |q_pos - k_pos| (the caller sums the rows); with use_key_bias S carries the key
//   bias, and with use_key_bias_grad attn_bwd_dkdv writes its gradient per query head,
//   sum_q dS [batch, heads, n_k] (dS of the biased score, before the cap's slope); with
//   use_rel_bias S carries the relative-position table's bias, and with use_rel_bias_grad
//   attn_bwd_dq writes each query row's share of the table's gradient, [batch, heads, n_q,
//   2M + 1] zeroed by the caller: dS of the one key a middle column reaches in the row, the sum
//   of dS over the keys clamped to the first and last columns (the caller sums the rows); with
//   use_score_bias S carries the dense bias as in attn_fwd, and with use_score_bias_grad
//   attn_bwd_dq writes dS of every element of its visited tiles into [batch, heads, n_q, n_k]
//   float32 zeroed by the caller (the caller sums the bias's broadcast axes; a bias broadcast
//   over queries takes the key bias's sums of attn_bwd_dkdv instead); with
//   dropout_threshold > 0, dV takes the dropped probabilities and dP is taken through the same
//   mask (kernels/common/philox.cuh regenerates the forward's), dS = P * (dP - delta).
// Kernels, in launch order:
//   attn_bwd_preprocess<HEAD_DIM, T>       delta [batch, heads, n_q] float32 (from dlse too)
//   attn_bwd_dkdv<BLOCK, TILE_K, TILE_Q, SPLITS, HEAD_DIM, T, RULE, MODS> one CTA per (TILE_K keys,
//       head dim split, head, batch) walks the CSC column of its key block
//       (kernels/common/walk.cuh) in steps of TILE_Q queries; its HEAD_DIM / SPLITS columns of
//       dK, dV accumulate in registers (each warp owns 16 keys).
//   attn_bwd_dq<BLOCK, TILE_Q, TILE_K, HEAD_DIM, T, RULE, MODS> one CTA per TILE_Q queries walks the
//       CSR row in steps of TILE_K keys and recomputes P and dS; dQ accumulates in registers,
//       so the backward is bit-identical across runs.
//   attn_bwd_sum_groups<HEAD_DIM, T>   (GQA/MQA only) dK, dV of each kv head from the per query
//       head gradients: the sum over its kv_group query heads, in float, in head order.
// Both double-buffer their steps: the next step's copy is in flight while the current one is
// computed, one barrier per step. (Adding dS K into a float32 dQ with scalar atomics inside the dK/dV kernel
//       was measured 1.2-2.5x slower on an H100, L2-bound.)
// The dK/dV kernel works on S^T (rows are keys), so masks are applied with the axes swapped.
// Rows with lse = -inf (nothing to attend) contribute nothing: their P is exactly 0.
// Run: through cuattn (backend "cuda" or "interp"); geometry from cuattn/backends/geometry.py.
#include "common/philox.cuh"
#include "common/row_kernel.cuh"
#include "common/smem.cuh"
#include "common/walk.cuh"
#include "common/warp_gemm.cuh"

// TILE_OWN (rows of the CTA's own axis: keys of a dK/dV CTA, queries of a dQ CTA; 16 per warp)
// and TILE_STEP (rows of the other axis per step: 32 for head dims 96 and 128, so the score
// tiles fit beside dK and dV in registers) are chosen by cuattn/backends/geometry.py and passed
// in; the traits only derive the rest and check it. The step tiles are double-buffered.
constexpr int BWD_STAGES = 2;

template <int BLOCK, int TILE_OWN, int TILE_STEP, int HEAD_DIM, typename T>
struct attn_bwd_traits {
  static constexpr int OWN_TILES_PER_BLOCK = BLOCK / TILE_OWN;
  static constexpr int NUM_WARPS = TILE_OWN / 16;
  static constexpr int NUM_THREADS = NUM_WARPS * 32;
  static constexpr int LD = SmemStride<T, HEAD_DIM>::value;
  static constexpr int SCRATCH_FLOATS = is_half_type<T>::value ? 0 : 16 * (TILE_STEP + 4);
  // Two own tiles (K, V or Q, dO), two step tiles per stage.
  static constexpr int TILE_BYTES = (2 * TILE_OWN + BWD_STAGES * 2 * TILE_STEP) * LD * int(sizeof(T));
  static_assert(BLOCK % TILE_OWN == 0 && BLOCK % TILE_STEP == 0 && TILE_OWN % 16 == 0 &&
                TILE_STEP % 16 == 0 && HEAD_DIM % 16 == 0);
};

// dK/dV CTAs may split the head dimension (SPLITS > 1, head dim 256): each computes the
// columns [split * D_OUT, (split + 1) * D_OUT) of dK and dV, recomputing S and dP over the whole
// head dim, so the two accumulators stay at 2 x D_OUT / 2 floats per thread.
template <int BLOCK, int TILE_OWN, int TILE_STEP, int SPLITS, int HEAD_DIM, typename T>
struct attn_bwd_dkdv_traits : attn_bwd_traits<BLOCK, TILE_OWN, TILE_STEP, HEAD_DIM, T> {
  using Base = attn_bwd_traits<BLOCK, TILE_OWN, TILE_STEP, HEAD_DIM, T>;
  static constexpr int D_OUT = HEAD_DIM / SPLITS;
  static_assert(HEAD_DIM % SPLITS == 0 && D_OUT % 16 == 0, "splits are whole 16-column steps");
  static constexpr int STATS_FLOATS = 2 * TILE_STEP;  // lse and delta of one step's queries
  static constexpr int SMEM_BYTES = Base::TILE_BYTES + BWD_STAGES * STATS_FLOATS * int(sizeof(float)) +
                                    Base::NUM_WARPS * Base::SCRATCH_FLOATS * int(sizeof(float));
};

template <int BLOCK, int TILE_OWN, int TILE_STEP, int HEAD_DIM, typename T>
struct attn_bwd_dq_traits : attn_bwd_traits<BLOCK, TILE_OWN, TILE_STEP, HEAD_DIM, T> {
  using Base = attn_bwd_traits<BLOCK, TILE_OWN, TILE_STEP, HEAD_DIM, T>;
  static constexpr int SMEM_BYTES =
      Base::TILE_BYTES + Base::NUM_WARPS * Base::SCRATCH_FLOATS * int(sizeof(float));
  // The score-modifier variant takes the softcap's slopes before adding biases, into a tile of
  // registers; a d = 256 warp, whose dQ accumulator alone is 128 registers, has no room for
  // them (ptxas spilled on sm_80 and sm_90) and recovers each capped score from P instead
  // (log2(P) + lse less the biases).
  static constexpr bool KEEP_SLOPES = HEAD_DIM < 256;
  // Q and dO never change across the walk: the plain half-precision kernels up to d = 128 hold
  // their A fragments in registers (2 x HEAD_DIM / 4 a thread) instead of re-reading them from
  // shared memory at every key step. The variant is at its register
  // limit, fp32 has no ldmatrix fragments, and d = 256's would be 128 registers.
  static constexpr int OWN_FRAGS_MAX_HEAD_DIM = 128;
  template <int MODS>
  static constexpr bool OWN_FRAGS =
      is_half_type<T>::value && MODS == MODS_NONE && HEAD_DIM <= OWN_FRAGS_MAX_HEAD_DIM;
};

// lse in the log2 domain as the backward uses it; a row with nothing to attend (lse = -inf) or
// past the end of the sequence becomes +inf so that exp2(s - lse) is exactly 0 for it.
__device__ __forceinline__ float lse_log2_or_inf(const float* lse, size_t index, bool valid) {
  if (!valid) return INFINITY;
  const float value = lse[index];
  return value == -INFINITY ? INFINITY : value * LOG2E;
}

// delta[row] = sum_d dout[row, d] * out[row, d] - dlse[row], one warp per row. dlse (like lse)
// is the gradient reaching the lse output: d lse / d s = P, so it enters dS = P * (dP - delta)
// through delta alone. use_dlse = 0 when nothing reached the lse (dlse is then not read).
template <int HEAD_DIM, typename T>
__global__ void __launch_bounds__(row_kernel_traits<HEAD_DIM, T>::NUM_THREADS, 1)
    attn_bwd_preprocess(const T* __restrict__ out, const T* __restrict__ dout,
                        const float* __restrict__ dlse, float* __restrict__ delta, int n_q,
                        int use_dlse, long long dout_batch_stride, long long dout_head_stride,
                        long long dout_row_stride) {
  using Traits = row_kernel_traits<HEAD_DIM, T>;
  const size_t head_offset = (size_t(blockIdx.z) * gridDim.y + blockIdx.y) * size_t(n_q);
  const int warp = int(threadIdx.x) / 32;
  const int lane = int(threadIdx.x) % 32;
  for (int r = warp; r < Traits::ROWS_PER_CTA; r += Traits::NUM_WARPS) {
    const int row = int(blockIdx.x) * Traits::ROWS_PER_CTA + r;
    if (row >= n_q) break;  // uniform across the warp
    const T* out_row = out + (head_offset + row) * HEAD_DIM;
    const T* dout_row = dout + strided_row(dout_batch_stride, dout_head_stride, dout_row_stride,
                                           blockIdx.z, blockIdx.y, row);
    float sum = 0.f;
    for (int d = lane; d < HEAD_DIM; d += 32) sum += to_float(out_row[d]) * to_float(dout_row[d]);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) delta[head_offset + row] = use_dlse ? sum - dlse[head_offset + row] : sum;
  }
}

// summed[b, kv_head, row] = sum over g < kv_group of per_head[b, kv_head * kv_group + g, row]:
// grid x over ROWS_PER_CTA rows of n_k, y the kv head, z the batch. One thread per element keeps
// the reads of consecutive threads consecutive.
template <int HEAD_DIM, typename T>
__global__ void __launch_bounds__(row_kernel_traits<HEAD_DIM, T>::NUM_THREADS, 1)
    attn_bwd_sum_groups(const T* __restrict__ per_head, T* __restrict__ summed, int n_k,
                        int kv_group) {
  using Traits = row_kernel_traits<HEAD_DIM, T>;
  const size_t kv_head = size_t(blockIdx.z) * gridDim.y + blockIdx.y;
  const int first_row = int(blockIdx.x) * Traits::ROWS_PER_CTA;
  for (int e = int(threadIdx.x); e < Traits::ROWS_PER_CTA * HEAD_DIM; e += Traits::NUM_THREADS) {
    const int row = first_row + e / HEAD_DIM;
    if (row >= n_k) break;  // rows only grow with e
    const size_t within = size_t(row) * HEAD_DIM + e % HEAD_DIM;
    float sum = 0.f;
    for (int g = 0; g < kv_group; ++g) {
      sum += to_float(per_head[(kv_head * kv_group + g) * size_t(n_k) * HEAD_DIM + within]);
    }
    summed[kv_head * size_t(n_k) * HEAD_DIM + within] = from_float<T>(sum);
  }
}

template <int BLOCK, int TILE_K, int TILE_Q, int SPLITS, int HEAD_DIM, typename T, int RULE,
          int MODS>
__global__ void __launch_bounds__(
    attn_bwd_dkdv_traits<BLOCK, TILE_K, TILE_Q, SPLITS, HEAD_DIM, T>::NUM_THREADS, 1)
    attn_bwd_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                  const T* __restrict__ dout, const float* __restrict__ lse,
                  const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
                  const int* __restrict__ col_ptr, const int* __restrict__ row_idx,
                  const int* __restrict__ col_mask, const u32* __restrict__ mask_table, int n_q,
                  int n_k, int q_offset, int kv_group, int num_blocks, float scale,
                  int window_left, int window_right, float softcap,
                  const float* __restrict__ alibi_slopes, int use_alibi, int alibi_batch_stride,
                  const float* __restrict__ key_bias, int use_key_bias,
                  long long key_bias_batch_stride, long long key_bias_head_stride,
                  const float* __restrict__ rel_bias, int use_rel_bias,
                  int rel_bias_batch_stride, int rel_max_distance,
                  const void* __restrict__ score_bias, int use_score_bias,
                  long long score_bias_batch_stride, long long score_bias_head_stride,
                  long long score_bias_q_stride, long long score_bias_k_stride,
                  long long dropout_threshold,
                  long long dropout_seed, float dropout_scale,
                  const u32* __restrict__ dropout_seed_words, int use_seed_words,
                  float* __restrict__ key_bias_grad, int use_key_bias_grad,
                  long long q_batch_stride, long long q_head_stride, long long q_row_stride,
                  long long k_batch_stride, long long k_head_stride, long long k_row_stride,
                  long long v_batch_stride, long long v_head_stride, long long v_row_stride,
                  long long dout_batch_stride, long long dout_head_stride, long long dout_row_stride) {
  using Traits = attn_bwd_dkdv_traits<BLOCK, TILE_K, TILE_Q, SPLITS, HEAD_DIM, T>;
  constexpr int LD = Traits::LD;
  constexpr int NUM_THREADS = Traits::NUM_THREADS;
  constexpr int D_OUT = Traits::D_OUT;

  const int d_first = (int(blockIdx.x) % SPLITS) * D_OUT;  // the dK/dV columns of this CTA
  const int key_tile = int(blockIdx.x) / SPLITS;
  const int k_block = key_tile / Traits::OWN_TILES_PER_BLOCK;
  const int k_start = k_block * BLOCK + (key_tile % Traits::OWN_TILES_PER_BLOCK) * TILE_K;
  if (k_start >= n_k) return;  // ragged last block: this sub-tile holds no key
  const int head = int(blockIdx.y);
  const size_t batch_head = size_t(blockIdx.z) * gridDim.y + head;
  const size_t head_offset = batch_head * size_t(n_q);  // rows of q, dout, lse, delta
  const int tid = int(threadIdx.x);
  const int warp = tid / 32;
  const AccLayout frag;
  const RuleParams rule{n_q, n_k, q_offset, window_left, window_right, mask_table};

  // Shared memory: K, V (this CTA's keys), then per stage Q, dO and the queries' lse, delta.
  T* k_smem = dynamic_smem<T>();
  T* v_smem = k_smem + TILE_K * LD;
  T* step_smem = v_smem + TILE_K * LD;  // stage s: Q at s * 2 * TILE_Q * LD, dO after it
  float* stats_smem = reinterpret_cast<float*>(step_smem + BWD_STAGES * 2 * TILE_Q * LD);
  float* scratch = stats_smem + BWD_STAGES * Traits::STATS_FLOATS + warp * Traits::SCRATCH_FLOATS;

  const int kv_head = head / kv_group;
  load_tile_async<TILE_K, HEAD_DIM, NUM_THREADS>(
      k_smem, LD, k + strided_row(k_batch_stride, k_head_stride, k_row_stride, blockIdx.z, kv_head, k_start),
      int(k_row_stride), n_k - k_start);
  load_tile_async<TILE_K, HEAD_DIM, NUM_THREADS>(
      v_smem, LD, v + strided_row(v_batch_stride, v_head_stride, v_row_stride, blockIdx.z, kv_head, k_start),
      int(v_row_stride), n_k - k_start);
  cp_async_commit();

  // Starts the copy of one step's queries into `stage`: Q and dO asynchronously, lse (log2
  // domain) and delta by plain stores, all visible after the next barrier.
  auto load_step = [&](int stage, int q_start) {
    T* q_stage = step_smem + stage * 2 * TILE_Q * LD;
    load_tile_async<TILE_Q, HEAD_DIM, NUM_THREADS>(
        q_stage, LD,
        q + strided_row(q_batch_stride, q_head_stride, q_row_stride, blockIdx.z, head, q_start),
        int(q_row_stride), n_q - q_start);
    load_tile_async<TILE_Q, HEAD_DIM, NUM_THREADS>(
        q_stage + TILE_Q * LD, LD,
        dout + strided_row(dout_batch_stride, dout_head_stride, dout_row_stride, blockIdx.z, head,
                           q_start),
        int(dout_row_stride), n_q - q_start);
    cp_async_commit();
    float* stats = stats_smem + stage * Traits::STATS_FLOATS;
    for (int i = tid; i < TILE_Q; i += NUM_THREADS) {
      const bool valid = q_start + i < n_q;
      stats[i] = lse_log2_or_inf(lse, head_offset + q_start + i, valid);
      stats[TILE_Q + i] = valid ? delta[head_offset + q_start + i] : 0.f;
    }
  };

  float dk_acc[D_OUT / 8][4] = {};
  float dv_acc[D_OUT / 8][4] = {};
  const ScoreScale score_scale = ScoreScale::make<MODS>(
      scale, softcap, use_alibi ? alibi_slopes : nullptr, alibi_batch_stride, int(blockIdx.z), head);
  const int k_warp = k_start + warp * 16;
  const int k_last = k_start + TILE_K - 1;
  // The key bias of this lane's two keys (rows g and g + 8 of S^T), log2 domain, for every
  // step; and the sums over queries of their dS (the bias's gradient).
  float key_bias_log2[2] = {}, key_ds[2] = {};
  // The table's row and dropout's key are rebuilt from the parameters where used (constant
  // bank): held across the loop they cost registers the fp32 d = 256 kernels do not have.
  auto rel_bias_of = [&] {
    return RelBias::make(rel_bias, use_rel_bias, rel_bias_batch_stride, rel_max_distance,
                         int(blockIdx.z), head);
  };
  auto dropout_of = [&] {
    return Dropout::make(dropout_threshold, dropout_seed, dropout_seed_words, use_seed_words,
                         dropout_scale);
  };
  auto score_bias_of = [&] {
    return ScoreBias<T>::make(score_bias, use_score_bias, score_bias_batch_stride,
                              score_bias_head_stride, score_bias_q_stride, score_bias_k_stride,
                              n_q, n_k, int(blockIdx.z), head);
  };
  if constexpr (MODS == MODS_SCORE) {
    if (use_key_bias) {
      const KeyBias kb{key_bias + blockIdx.z * key_bias_batch_stride + head * key_bias_head_stride,
                       n_k};
#pragma unroll
      for (int r = 0; r < 2; ++r) key_bias_log2[r] = kb.log2_at(k_warp + frag.row(2 * r));
    }
  }

  ActiveTiles<RULE, BLOCK, TILE_Q, false> walk(col_ptr + head * (num_blocks + 1) + k_block, row_idx,
                                               col_mask);
  // The inner loop: one active query tile per step, the next one's copy in flight.
  walk_double_buffered(walk, rule, k_start, k_last, load_step, [&](const ActiveTile& tile, int stage) {
    const int q_start = tile.start;
    const T* q_smem = step_smem + stage * 2 * TILE_Q * LD;
    const T* do_smem = q_smem + TILE_Q * LD;
    const float* lse_smem = stats_smem + stage * Traits::STATS_FLOATS;
    const float* delta_smem = lse_smem + TILE_Q;

    // S^T for this warp's 16 keys against the TILE_Q queries, then P^T = exp2(S^T - lse).
    float p_t[TILE_Q / 8][4] = {};
    warp_gemm_rs_nk<TILE_Q, HEAD_DIM>(p_t, k_smem + warp * 16 * LD, LD, q_smem, LD);
    score_tile<MODS, TILE_Q>(p_t, score_scale);
    if constexpr (MODS == MODS_SCORE) {
      if (score_scale.alibi_log2 != 0.f) {
        alibi_tile<TILE_Q, false>(p_t, score_scale, q_offset, k_warp, q_start);
      }
#pragma unroll
      for (int j = 0; j < TILE_Q / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) p_t[j][e] += key_bias_log2[e / 2];  // 0 without one
      }
      if (use_rel_bias) rel_bias_tile<TILE_Q, false>(p_t, rel_bias_of(), q_offset, k_warp, q_start);
      if (use_score_bias) score_bias_tile<TILE_Q, false>(p_t, score_bias_of(), k_warp, q_start, LOG2E);
    }
    if (tile.coverage == TILE_PARTIAL) {
      mask_score_tile<RULE, BLOCK, TILE_Q, false>(p_t, rule, k_warp, q_start, tile.block, k_block,
                                                  tile.mask_id);
    }
#pragma unroll
    for (int j = 0; j < TILE_Q / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) p_t[j][e] = exp2f(p_t[j][e] - lse_smem[frag.col(j, e)]);
    }
    // The last step of a ragged sequence holds rows past n_q (zero-filled q and dO, lse +inf):
    // their P and dS are 0, except that an infinite key or value makes 0 * inf = NaN there.
    // They are no rows of the problem, so they are zeroed (a uniform branch, rarely taken).
    const bool ragged = q_start + TILE_Q > n_q;
    if (ragged) zero_columns_past<TILE_Q>(p_t, frag, n_q - q_start);
    if constexpr (MODS == MODS_SCORE) {
      // dV takes the dropped probabilities (dS below needs every P: a copy, dead after dV)
      float p_kept[TILE_Q / 8][4];
#pragma unroll
      for (int j = 0; j < TILE_Q / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) p_kept[j][e] = p_t[j][e];
      }
      const Dropout dropout = dropout_of();
      if (dropout.on()) dropout_tile<TILE_Q, false>(p_kept, dropout, k_warp, q_start);
      warp_gemm_regs_kn<D_OUT, TILE_Q>(dv_acc, p_kept, do_smem + d_first, LD, scratch);
    } else {
      warp_gemm_regs_kn<D_OUT, TILE_Q>(dv_acc, p_t, do_smem + d_first, LD, scratch);
    }

    // dP^T = V dO^T, then dS^T = P^T * (dP^T - delta) in place.
    float ds_t[TILE_Q / 8][4] = {};
    warp_gemm_rs_nk<TILE_Q, HEAD_DIM>(ds_t, v_smem + warp * 16 * LD, LD, do_smem, LD);
    if constexpr (MODS == MODS_SCORE) {  // dP of the probabilities before dropout
      const Dropout dropout = dropout_of();
      if (dropout.on()) dropout_tile<TILE_Q, false>(ds_t, dropout, k_warp, q_start);
    }
#pragma unroll
    for (int j = 0; j < TILE_Q / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        ds_t[j][e] = p_t[j][e] * (ds_t[j][e] - delta_smem[frag.col(j, e)]);
      }
    }
    if (ragged) zero_columns_past<TILE_Q>(ds_t, frag, n_q - q_start);
    if constexpr (MODS == MODS_SCORE) {
      // The biased score's gradient first (the key bias's), then, with a cap, the cap's slope
      // from the capped score, which comes back from P as log2(P) + lse less the biases: no
      // tile of scores is kept (at head dim 128 this kernel is at the register limit).
#pragma unroll
      for (int j = 0; j < TILE_Q / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) key_ds[e / 2] += ds_t[j][e];
      }
      if (score_scale.cap_log2 > 0.f) {  // P is dead after dS: the capped score in its place
#pragma unroll
        for (int j = 0; j < TILE_Q / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int q_minus_k = q_offset + q_start + frag.col(j, e) - k_warp - frag.row(e);
            p_t[j][e] = log2f(p_t[j][e]) + lse_smem[frag.col(j, e)] -
                        alibi_bias(score_scale, q_minus_k) - key_bias_log2[e / 2];
          }
        }
        if (use_rel_bias) {
          const RelBias rb = rel_bias_of();
          position_bias_frags<1, TILE_Q, false>(as_frags<TILE_Q>(p_t), q_offset, k_warp, q_start,
                                                [&](int q_minus_k) { return -rb.log2_at(q_minus_k); });
        }
        if (use_score_bias) {
          score_bias_tile<TILE_Q, false>(p_t, score_bias_of(), k_warp, q_start, -LOG2E);
        }
#pragma unroll
        for (int j = 0; j < TILE_Q / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) ds_t[j][e] *= softcap_slope<MODS>(p_t[j][e], score_scale);
        }
      }
    }
    warp_gemm_regs_kn<D_OUT, TILE_Q>(dk_acc, ds_t, q_smem + d_first, LD, scratch);
  });

  if constexpr (MODS == MODS_SCORE) {
#pragma unroll
    for (int r = 0; r < 2; ++r) key_ds[r] = quad_sum(key_ds[r]);  // whole warp
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int k_row = k_warp + frag.row(2 * r);
    if (k_row >= n_k) continue;
    if constexpr (MODS == MODS_SCORE) {
      // one head-dim split writes it (every split computes the whole of dS)
      if (use_key_bias_grad && frag.t == 0 && d_first == 0) {
        key_bias_grad[batch_head * size_t(n_k) + k_row] = key_ds[r];
      }
    }
    const size_t row = (batch_head * size_t(n_k) + k_row) * HEAD_DIM + d_first;  // per query head
    T* dk_row = dk + row;
    T* dv_row = dv + row;
#pragma unroll
    for (int j = 0; j < D_OUT / 8; ++j) {
      store_pair(dk_row + frag.pair_col(j), dk_acc[j][2 * r] * scale,
                 dk_acc[j][2 * r + 1] * scale);
      store_pair(dv_row + frag.pair_col(j), dv_acc[j][2 * r], dv_acc[j][2 * r + 1]);
    }
  }
}

template <int BLOCK, int TILE_Q, int TILE_K, int HEAD_DIM, typename T, int RULE, int MODS>
__global__ void __launch_bounds__(attn_bwd_dq_traits<BLOCK, TILE_Q, TILE_K, HEAD_DIM, T>::NUM_THREADS, 1)
    attn_bwd_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                const T* __restrict__ dout, const float* __restrict__ lse,
                const float* __restrict__ delta, T* __restrict__ dq, const int* __restrict__ row_ptr,
                const int* __restrict__ col_idx, const int* __restrict__ row_mask,
                const u32* __restrict__ mask_table, int n_q, int n_k, int q_offset, int kv_group,
                int num_blocks, float scale, int window_left, int window_right, float softcap,
                const float* __restrict__ alibi_slopes, int use_alibi, int alibi_batch_stride,
                const float* __restrict__ key_bias, int use_key_bias,
                long long key_bias_batch_stride, long long key_bias_head_stride,
                const float* __restrict__ rel_bias, int use_rel_bias, int rel_bias_batch_stride,
                int rel_max_distance, const void* __restrict__ score_bias, int use_score_bias,
                long long score_bias_batch_stride, long long score_bias_head_stride,
                long long score_bias_q_stride, long long score_bias_k_stride,
                long long dropout_threshold, long long dropout_seed,
                float dropout_scale, const u32* __restrict__ dropout_seed_words, int use_seed_words,
                float* __restrict__ alibi_grad, int use_alibi_grad,
                float* __restrict__ rel_bias_grad, int use_rel_bias_grad,
                float* __restrict__ score_bias_grad, int use_score_bias_grad,
                long long q_batch_stride, long long q_head_stride, long long q_row_stride,
                long long k_batch_stride, long long k_head_stride, long long k_row_stride,
                long long v_batch_stride, long long v_head_stride, long long v_row_stride,
                long long dout_batch_stride, long long dout_head_stride, long long dout_row_stride) {
  using Traits = attn_bwd_dq_traits<BLOCK, TILE_Q, TILE_K, HEAD_DIM, T>;
  constexpr int LD = Traits::LD;
  constexpr int NUM_THREADS = Traits::NUM_THREADS;

  const int q_block = int(blockIdx.x) / Traits::OWN_TILES_PER_BLOCK;
  const int q_start = q_block * BLOCK + (int(blockIdx.x) % Traits::OWN_TILES_PER_BLOCK) * TILE_Q;
  if (q_start >= n_q) return;
  const int head = int(blockIdx.y);
  const size_t head_offset = (size_t(blockIdx.z) * gridDim.y + head) * size_t(n_q);
  const int warp = int(threadIdx.x) / 32;
  const AccLayout frag;
  const RuleParams rule{n_q, n_k, q_offset, window_left, window_right, mask_table};

  // Shared memory: Q, dO (this CTA's queries), then per stage K and V.
  T* q_smem = dynamic_smem<T>();
  T* do_smem = q_smem + TILE_Q * LD;
  T* step_smem = do_smem + TILE_Q * LD;  // stage s: K at s * 2 * TILE_K * LD, V after it
  float* scratch = reinterpret_cast<float*>(step_smem + BWD_STAGES * 2 * TILE_K * LD) +
                   warp * Traits::SCRATCH_FLOATS;

  load_tile_async<TILE_Q, HEAD_DIM, NUM_THREADS>(
      q_smem, LD,
      q + strided_row(q_batch_stride, q_head_stride, q_row_stride, blockIdx.z, head, q_start),
      int(q_row_stride), n_q - q_start);
  load_tile_async<TILE_Q, HEAD_DIM, NUM_THREADS>(
      do_smem, LD,
      dout + strided_row(dout_batch_stride, dout_head_stride, dout_row_stride, blockIdx.z, head,
                         q_start),
      int(dout_row_stride), n_q - q_start);
  cp_async_commit();

  auto load_step = [&](int stage, int k_start) {
    T* k_stage = step_smem + stage * 2 * TILE_K * LD;
    const int kv_head = head / kv_group;
    load_tile_async<TILE_K, HEAD_DIM, NUM_THREADS>(
        k_stage, LD,
        k + strided_row(k_batch_stride, k_head_stride, k_row_stride, blockIdx.z, kv_head, k_start),
        int(k_row_stride), n_k - k_start);
    load_tile_async<TILE_K, HEAD_DIM, NUM_THREADS>(
        k_stage + TILE_K * LD, LD,
        v + strided_row(v_batch_stride, v_head_stride, v_row_stride, blockIdx.z, kv_head, k_start),
        int(v_row_stride), n_k - k_start);
    cp_async_commit();
  };

  const int q_warp = q_start + warp * 16;
  const int q_last = q_start + TILE_Q - 1;
  float lse_row[2], delta_row[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int q_row = q_warp + frag.row(2 * r);
    lse_row[r] = lse_log2_or_inf(lse, head_offset + q_row, q_row < n_q);
    delta_row[r] = q_row < n_q ? delta[head_offset + q_row] : 0.f;
  }
  // The table's row and dropout's key are rebuilt from the parameters where used (constant
  // bank): held across the loop they cost registers the fp32 d = 256 kernels do not have.
  auto rel_bias_of = [&] {
    return RelBias::make(rel_bias, use_rel_bias, rel_bias_batch_stride, rel_max_distance,
                         int(blockIdx.z), head);
  };
  const int rel_width = 2 * rel_max_distance + 1;
  auto dropout_of = [&] {
    return Dropout::make(dropout_threshold, dropout_seed, dropout_seed_words, use_seed_words,
                         dropout_scale);
  };
  auto score_bias_of = [&] {
    return ScoreBias<T>::make(score_bias, use_score_bias, score_bias_batch_stride,
                              score_bias_head_stride, score_bias_q_stride, score_bias_k_stride,
                              n_q, n_k, int(blockIdx.z), head);
  };
  const KeyBias kb{key_bias + blockIdx.z * key_bias_batch_stride + head * key_bias_head_stride, n_k};
  const ScoreScale score_scale = ScoreScale::make<MODS>(
      scale, softcap, use_alibi ? alibi_slopes : nullptr, alibi_batch_stride, int(blockIdx.z), head);

  // The score-modifier variant at head dim 256 computes dQ's columns in DQ_PASSES passes of
  // D_OUT over the row, S and dP again in each: its state beside a 256-column accumulator
  // spilled (sm_80 and sm_90). The operands' gradients come from the first pass.
  constexpr int DQ_PASSES_FROM_HEAD_DIM = 256;
  constexpr int DQ_PASSES = MODS == MODS_SCORE && HEAD_DIM >= DQ_PASSES_FROM_HEAD_DIM ? 2 : 1;
  constexpr int D_OUT = HEAD_DIM / DQ_PASSES;
#pragma unroll 1
  for (int pass = 0; pass < DQ_PASSES; ++pass) {
    const int d_first = pass * D_OUT;
    const bool operand_grads = pass == 0;
    float dq_acc[D_OUT / 8][4] = {};
    // sum over this lane's keys of dS * |q_pos - k_pos| per row (ALiBi's slope gradient)
    float alibi_dist_ds[2] = {};
    // with a relative-position table: the sums of dS over this lane's keys that clamp to its
    // first and last columns (the columns between hold one key per row: stored as they come)
    float rel_first_ds[2] = {}, rel_last_ds[2] = {};
    ActiveTiles<RULE, BLOCK, TILE_K, true> walk(row_ptr + head * (num_blocks + 1) + q_block, col_idx,
                                                row_mask);
    constexpr bool OWN_FRAGS = Traits::template OWN_FRAGS<MODS>;
    constexpr int FRAG_STEPS = OWN_FRAGS ? HEAD_DIM / 16 : 1;
    u32 q_frags[FRAG_STEPS][4], do_frags[FRAG_STEPS][4];
    if constexpr (OWN_FRAGS) {
      // The own tiles land first (the walk's first step then waits for nothing of theirs).
      cp_async_wait_group<0>();
      __syncthreads();
      load_a_frags<HEAD_DIM>(q_frags, q_smem + warp * 16 * LD, LD);
      load_a_frags<HEAD_DIM>(do_frags, do_smem + warp * 16 * LD, LD);
    }
    // The inner loop: one active key tile per step, the next one's copy in flight.
    walk_double_buffered(walk, rule, q_start, q_last, load_step, [&](const ActiveTile& tile, int stage) {
      const int k_start = tile.start;
      const T* k_smem = step_smem + stage * 2 * TILE_K * LD;
      const T* v_smem = k_smem + TILE_K * LD;

      float p[TILE_K / 8][4] = {};
      if constexpr (OWN_FRAGS) {
        warp_gemm_fs_nk<TILE_K, HEAD_DIM>(p, q_frags, k_smem, LD);
      } else {
        warp_gemm_rs_nk<TILE_K, HEAD_DIM>(p, q_smem + warp * 16 * LD, LD, k_smem, LD);
      }
      score_tile<MODS, TILE_K>(p, score_scale);
      // the softcap's slope of each score, from the capped score before any bias is added (a
      // masked score's slope multiplies its dS, which is 0)
      float slope[TILE_K / 8][4];
      if constexpr (MODS == MODS_SCORE && Traits::KEEP_SLOPES) {
#pragma unroll
        for (int j = 0; j < TILE_K / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) slope[j][e] = softcap_slope<MODS>(p[j][e], score_scale);
        }
      }
      if constexpr (MODS == MODS_SCORE) {  // before the mask, which replaces what it masks
        if (use_score_bias) score_bias_tile<TILE_K, true>(p, score_bias_of(), q_warp, k_start, LOG2E);
      }
      if (tile.coverage == TILE_PARTIAL) {
        mask_score_tile<RULE, BLOCK, TILE_K, true>(p, rule, q_warp, k_start, q_block, tile.block,
                                                   tile.mask_id);
      }
      // this lane's two keys per n-tile: their key bias (log2 domain; 0 without one)
      float key_bias_log2[TILE_K / 8][2] = {};
      if constexpr (MODS == MODS_SCORE) {
        if (use_key_bias) {
#pragma unroll
          for (int j = 0; j < TILE_K / 8; ++j) {
#pragma unroll
            for (int c = 0; c < 2; ++c) key_bias_log2[j][c] = kb.log2_at(k_start + frag.col(j, c));
          }
        }
      }
      // q_pos - k_pos of this lane's element (0, 0), in float (exact below 2^24): the others
      // differ by constants, so each element's distance is one add.
      const float q_minus_k_first =
          float(q_offset + q_warp - k_start) + float(frag.row(0) - frag.col(0, 0));
      if constexpr (MODS == MODS_SCORE) {
        if (use_rel_bias) rel_bias_tile<TILE_K, true>(p, rel_bias_of(), q_offset, q_warp, k_start);
      }
      float ds[TILE_K / 8][4] = {};
      if constexpr (OWN_FRAGS) {
        warp_gemm_fs_nk<TILE_K, HEAD_DIM>(ds, do_frags, v_smem, LD);
      } else {
        warp_gemm_rs_nk<TILE_K, HEAD_DIM>(ds, do_smem + warp * 16 * LD, LD, v_smem, LD);
      }
      if constexpr (MODS == MODS_SCORE) {  // dP of the probabilities before dropout
        const Dropout dropout = dropout_of();
        if (dropout.on()) dropout_tile<TILE_K, true>(ds, dropout, q_warp, k_start);
      }
#pragma unroll
      for (int j = 0; j < TILE_K / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float distance = 0.f;  // |q_pos - k_pos|, ALiBi's factor
          if constexpr (MODS == MODS_SCORE) {
            distance = fabsf(q_minus_k_first + float(8 * (e / 2) - 8 * j - e % 2));
            p[j][e] += score_scale.alibi_log2 * distance + key_bias_log2[j][e % 2];  // 0: none
          }
          p[j][e] = exp2f(p[j][e] - lse_row[e / 2]);
          ds[j][e] = p[j][e] * (ds[j][e] - delta_row[e / 2]);
          if constexpr (MODS == MODS_SCORE) {
            alibi_dist_ds[e / 2] += ds[j][e] * distance;  // before the cap's slope: d/d bias
          }
        }
      }
      if constexpr (MODS == MODS_SCORE) {
        // the table's gradient from dS of the biased scores, before the cap's slope
        if (use_rel_bias_grad && operand_grads) {
          rel_grad_tile<TILE_K>(ds, rel_bias_of(), q_offset, q_warp, k_start, n_q,
                                rel_bias_grad + head_offset * rel_width, rel_first_ds, rel_last_ds);
        }
        if (use_score_bias_grad && operand_grads) {
          score_bias_grad_tile<TILE_K>(ds, score_bias_grad + head_offset * size_t(n_k), n_q, n_k,
                                       q_warp, k_start);
        }
        // With a cap, its slope: kept, or (KEEP_SLOPES false) from the capped score, which comes
        // back from P as log2(P) + lse less the biases (P is dead after dS).
        if constexpr (Traits::KEEP_SLOPES) {
#pragma unroll
          for (int j = 0; j < TILE_K / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) ds[j][e] *= slope[j][e];
          }
        } else if (score_scale.cap_log2 > 0.f) {
#pragma unroll
          for (int j = 0; j < TILE_K / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float distance = fabsf(q_minus_k_first + float(8 * (e / 2) - 8 * j - e % 2));
              p[j][e] = log2f(p[j][e]) + lse_row[e / 2] - score_scale.alibi_log2 * distance -
                        key_bias_log2[j][e % 2];
            }
          }
          if (use_rel_bias) {
            const RelBias rb = rel_bias_of();
            position_bias_frags<1, TILE_K, true>(as_frags<TILE_K>(p), q_offset, q_warp, k_start,
                                                 [&](int q_minus_k) { return -rb.log2_at(q_minus_k); });
          }
          if (use_score_bias) {
            score_bias_tile<TILE_K, true>(p, score_bias_of(), q_warp, k_start, -LOG2E);
          }
#pragma unroll
          for (int j = 0; j < TILE_K / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) ds[j][e] *= softcap_slope<MODS>(p[j][e], score_scale);
          }
        }
      }
      warp_gemm_regs_kn<D_OUT, TILE_K>(dq_acc, ds, k_smem + d_first, LD, scratch);
    });

    if constexpr (MODS == MODS_SCORE) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {  // whole warp
        alibi_dist_ds[r] = quad_sum(alibi_dist_ds[r]);
        rel_first_ds[r] = quad_sum(rel_first_ds[r]);
        rel_last_ds[r] = quad_sum(rel_last_ds[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int q_row = q_warp + frag.row(2 * r);
      if (q_row >= n_q) continue;
      T* dq_row = dq + (head_offset + q_row) * HEAD_DIM + d_first;
#pragma unroll
      for (int j = 0; j < D_OUT / 8; ++j) {
        store_pair(dq_row + frag.pair_col(j), dq_acc[j][2 * r] * scale, dq_acc[j][2 * r + 1] * scale);
      }
      if constexpr (MODS == MODS_SCORE) {
        // d bias / d slope = -|q_pos - k_pos|: the row's share of the slope's gradient
        if (use_alibi_grad && operand_grads && frag.t == 0) {
          alibi_grad[head_offset + q_row] = -alibi_dist_ds[r];
        }
        // the table's clamped columns: this row's sums (one column when the table has one)
        if (use_rel_bias_grad && operand_grads && frag.t == 0) {
          float* rel_row = rel_bias_grad + (head_offset + q_row) * rel_width;
          if (rel_width > 1) {
            rel_row[0] = rel_first_ds[r];
            rel_row[rel_width - 1] = rel_last_ds[r];
          } else {  // one column: every key reads it (rel_grad_tile splits them at distance 0)
            rel_row[0] = rel_first_ds[r] + rel_last_ds[r];
          }
        }
      }
    }
    __syncthreads();  // every warp is done with the step buffers the next pass refills
  }
}
