// Block-sparse attention forward, FlashAttention-2 structure.
//
// Computes, for every (batch, head, query) row, over the keys its layout allows:
//   S = Q K^T * scale,  P = softmax(S),  out = P V,  lse = log(sum(exp(S)))
// with MODS = MODS_SCORE and softcap > 0, S = softcap * tanh(Q K^T * scale / softcap); with
// use_alibi, S gets -slope[batch, head] * |q + n_k - n_q - k| (ALiBi, end-aligned positions),
// with use_key_bias key_bias[batch, head, k] (a per-key bias: padding masks as -inf), and with
// use_rel_bias a relative-position table's rel_bias[batch, head, clamp(k - q_pos, -M, M) + M]
// (M = rel_max_distance, q_pos the end-aligned query position; T5's learned bias by distance),
// and with use_score_bias (SCORE_BIAS_FLOAT: float32, SCORE_BIAS_NARROW: T) a dense bias
// score_bias[batch, head, q, k] read at its four element strides (0 along a broadcast axis),
// only inside the visited tiles.
// With dropout_threshold > 0 (MODS_SCORE), P's entries are dropped or scaled by dropout_scale
// before P V (kernels/common/philox.cuh; lse stays that of every score), under the seed
// dropout_seed or, with use_seed_words, the two words at dropout_seed_words.
// Shapes: q, out [batch, heads, n_q, HEAD_DIM] and k, v [batch, heads / kv_group, n_k, HEAD_DIM]
// of T; q, k, v at any element strides with contiguous, 16-byte aligned rows, out contiguous; query head h reads kv head h / kv_group (GQA/MQA); lse float32
// [batch, heads, n_q]. The layout's CSR arrays (docs/design.md §2) name the active key blocks of
// each query block; only those are visited, so nothing of size n_q x n_k exists.
// A row with no allowed key gets out = 0 and lse = -inf.
//
// Work decomposition: one CTA per (TILE_M query rows, head, batch); grid.x walks layout query
// blocks times BLOCK / TILE_M sub-tiles, or, with TILE_M = 2 * BLOCK (paired 64-blocks), pairs
// of query blocks: the CTA walks the union of the two blocks' CSR rows (walk.cuh,
// PairedRowTiles) and each warp skips the tiles its own block's row does not hold. NUM_WARPS warps each own TILE_M / NUM_WARPS query rows
// (M_FRAGS fragments of 16). geometry.py gives warps 16 rows (M_FRAGS = 1: 64-row CTAs of 4
// warps at 64-blocks, the faster shape there on an H100), and 32 rows (M_FRAGS = 2:
// every K and V fragment read from shared memory feeds two mma) in the 128-row CTAs of fp16/bf16
// 128-blocks. Each warp keeps m_i (running max, log2 domain), l_i (running sum, this lane's
// columns only) and the output accumulator acc in registers.
//
// Pipeline (FlashAttention-2's order, single K and V buffers): per active tile,
//   wait K(t) | issue V(t) | S = Q K(t)^T, mask | wait V(t) | issue K(t+1) | softmax | acc += P V(t)
// so V's copy overlaps QK^T and the next K's copy overlaps the softmax and PV; two barriers per
// tile. The walk over the layout (kernels/common/walk.cuh) names tile t+1 before tile t's
// softmax.
//
// Template parameters: BLOCK (layout block size 16/32/64/128), TILE_M, TILE_N, NUM_WARPS (the
// tiles and warps), HEAD_DIM (16/32/48/64/80/96/128/256), T (float, __half, __nv_bfloat16), RULE
// (MaskRule, kernels/common/types.cuh), MODS (ScoreModsFlag: MODS_NONE is the plain kernel). Run: through cuattn (backend "cuda" or "interp"); every
// size comes from cuattn/backends/geometry.py, e.g. `attn_fwd<64, 64, 64, 4, 128, __half,
// MASK_CAUSAL, MODS_NONE>`.
#include "common/philox.cuh"
#include "common/smem.cuh"
#include "common/walk.cuh"
#include "common/warp_gemm.cuh"

// TILE_M (query rows per CTA), TILE_N (keys per shared-memory tile) and NUM_WARPS are chosen by
// cuattn/backends/geometry.py and passed in; the traits only derive the rest and check it.
template <int BLOCK, int TILE_M, int TILE_N, int NUM_WARPS_, int HEAD_DIM, typename T>
struct attn_fwd_traits {
  // Query layout blocks per CTA: 1, or 2 when TILE_M = 2 * BLOCK (geometry.py pairs adjacent
  // 64-blocks: each K/V tile read through L2 then feeds 128 rows; the walk merges both rows).
  static constexpr int ROW_BLOCKS = TILE_M > BLOCK ? TILE_M / BLOCK : 1;
  static constexpr int M_TILES_PER_BLOCK = TILE_M > BLOCK ? 1 : BLOCK / TILE_M;
  static constexpr int NUM_WARPS = NUM_WARPS_;
  static constexpr int WARPS_PER_ROW_BLOCK = NUM_WARPS_ / ROW_BLOCKS;
  static constexpr int NUM_THREADS = NUM_WARPS * 32;
  static constexpr int WARP_M = TILE_M / NUM_WARPS;  // query rows per warp
  static constexpr int M_FRAGS = WARP_M / 16;
  // At 16 rows per warp and d <= 128 the forward holds <= 182 registers, room for every tile
  // copy's address at once: the copies unroll (~3 instructions per cp.async instead of ~12).
  // At 32 rows per warp, or d = 256 (a 128-float accumulator per thread), it is at the
  // 255-register limit, where unrolled copies spill.
  static constexpr bool UNROLL_COPIES = M_FRAGS == 1 && HEAD_DIM <= 128;
  static constexpr int LD = SmemStride<T, HEAD_DIM>::value;
  static constexpr int SCRATCH_FLOATS = is_half_type<T>::value ? 0 : 16 * (TILE_N + 4);
  static constexpr int SMEM_BYTES = (TILE_M + 2 * TILE_N) * LD * int(sizeof(T)) +
                                    NUM_WARPS * SCRATCH_FLOATS * int(sizeof(float));
  static_assert((BLOCK % TILE_M == 0 || TILE_M == 2 * BLOCK) && BLOCK % TILE_N == 0 &&
                TILE_N % 16 == 0);
  static_assert(BLOCK % WARP_M == 0, "a warp's rows lie in one layout block");
  static_assert(TILE_M % NUM_WARPS == 0 && WARP_M % 16 == 0, "whole 16-row fragments per warp");
  static_assert(HEAD_DIM % 16 == 0);
};

template <int BLOCK, int TILE_M, int TILE_N, int NUM_WARPS, int HEAD_DIM, typename T, int RULE,
          int MODS>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
    attn_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
             T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ row_ptr,
             const int* __restrict__ col_idx, const int* __restrict__ row_mask,
             const u32* __restrict__ mask_table, int n_q, int n_k, int q_offset,
             int kv_group, int num_blocks, float scale, int window_left, int window_right,
             float softcap, const float* __restrict__ alibi_slopes, int use_alibi,
             int alibi_batch_stride, const float* __restrict__ key_bias, int use_key_bias,
             long long key_bias_batch_stride, long long key_bias_head_stride,
             const float* __restrict__ rel_bias, int use_rel_bias, int rel_bias_batch_stride,
             int rel_max_distance, const void* __restrict__ score_bias, int use_score_bias,
             long long score_bias_batch_stride, long long score_bias_head_stride,
             long long score_bias_q_stride, long long score_bias_k_stride,
             long long dropout_threshold, long long dropout_seed,
             float dropout_scale, const u32* __restrict__ dropout_seed_words, int use_seed_words,
             long long q_batch_stride, long long q_head_stride, long long q_row_stride,
             long long k_batch_stride, long long k_head_stride, long long k_row_stride,
             long long v_batch_stride, long long v_head_stride, long long v_row_stride) {
  using Traits = attn_fwd_traits<BLOCK, TILE_M, TILE_N, NUM_WARPS, HEAD_DIM, T>;
  constexpr int LD = Traits::LD;
  constexpr int NUM_THREADS = Traits::NUM_THREADS;
  constexpr int M_FRAGS = Traits::M_FRAGS;

  // The CTA's first query block, and where its rows start in it.
  const int q_block = int(blockIdx.x) * Traits::ROW_BLOCKS / Traits::M_TILES_PER_BLOCK;
  const int q_start = q_block * BLOCK + (int(blockIdx.x) % Traits::M_TILES_PER_BLOCK) * TILE_M;
  if (q_start >= n_q) return;  // ragged last block: this sub-tile holds no query at all
  const int head = int(blockIdx.y);
  const size_t head_offset = (size_t(blockIdx.z) * gridDim.y + head) * size_t(n_q);
  const int warp = int(threadIdx.x) / 32;
  // 0, or 1 for a pair's second block (a constant 0 where the CTA owns one block)
  const int row_block = Traits::ROW_BLOCKS == 2 ? warp / Traits::WARPS_PER_ROW_BLOCK : 0;
  const RuleParams rule{n_q, n_k, q_offset, window_left, window_right, mask_table};

  T* q_smem = dynamic_smem<T>();
  T* k_smem = q_smem + TILE_M * LD;
  T* v_smem = k_smem + TILE_N * LD;
  float* scratch = reinterpret_cast<float*>(v_smem + TILE_N * LD) + warp * Traits::SCRATCH_FLOATS;
  // Addresses are rebuilt from the kernel parameters at each copy rather than kept: the loop
  // runs near the register limit, and parameters live in the constant bank, not in registers.
  // The kv head is computed once: an integer division at every copy costs ~20 instructions.
  const int kv_head = head / kv_group;
  auto load_k = [&](int k_start) {
    load_tile_async<TILE_N, HEAD_DIM, NUM_THREADS, Traits::UNROLL_COPIES>(
        k_smem, LD,
        k + strided_row(k_batch_stride, k_head_stride, k_row_stride, blockIdx.z, kv_head, k_start),
        int(k_row_stride), n_k - k_start);
    cp_async_commit();
  };
  auto load_v = [&](int k_start) {
    load_tile_async<TILE_N, HEAD_DIM, NUM_THREADS, Traits::UNROLL_COPIES>(
        v_smem, LD,
        v + strided_row(v_batch_stride, v_head_stride, v_row_stride, blockIdx.z, kv_head, k_start),
        int(v_row_stride), n_k - k_start);
    cp_async_commit();
  };

  load_tile_async<TILE_M, HEAD_DIM, NUM_THREADS, Traits::UNROLL_COPIES>(
      q_smem, LD, q + strided_row(q_batch_stride, q_head_stride, q_row_stride, blockIdx.z, head, q_start),
      int(q_row_stride), n_q - q_start);
  cp_async_commit();
  // The score-modifier variant in fp32 at head dim 256 computes out's columns in FWD_PASSES
  // passes of D_OUT over the row, S and the softmax again in each (the lse from the first): its
  // state beside a 256-column fp32 accumulator spilled on sm_80 once dropout's generator was in.
  constexpr int FWD_PASSES_FROM_HEAD_DIM = 256;
  constexpr int FWD_PASSES =
      MODS == MODS_SCORE && HEAD_DIM >= FWD_PASSES_FROM_HEAD_DIM && sizeof(T) == sizeof(float) ? 2
                                                                                               : 1;
  constexpr int D_OUT = HEAD_DIM / FWD_PASSES;
#pragma unroll 1
  for (int pass = 0; pass < FWD_PASSES; ++pass) {
    const int d_first = pass * D_OUT;
    auto walk = [&] {
      const int* entries = row_ptr + head * (num_blocks + 1) + q_block;
      if constexpr (Traits::ROW_BLOCKS == 2) {
        return PairedRowTiles<RULE, BLOCK, TILE_N>(entries, q_block + 1 < num_blocks, col_idx,
                                                   row_mask, row_block);
      } else {
        return ActiveTiles<RULE, BLOCK, TILE_N, true>(entries, col_idx, row_mask);
      }
    }();
    using Walk = decltype(walk);
    // The rows the walk tests: the CTA's, or in a paired CTA the warp's own (PairedRowTiles).
    const int walk_first = q_start + (Traits::ROW_BLOCKS == 2 ? warp * Traits::WARP_M : 0);
    const int walk_last = walk_first + (Traits::ROW_BLOCKS == 2 ? Traits::WARP_M : TILE_M) - 1;
    typename Walk::Tile tile;
    bool active = walk.next(tile, rule, walk_first, walk_last);
    if (active) load_k(tile.start);

    float acc[M_FRAGS][D_OUT / 8][4] = {};
    float m_i[M_FRAGS][2];  // rows g and g + 8 of each fragment, log2 domain
    float l_i[M_FRAGS][2] = {};
#pragma unroll
    for (int m = 0; m < M_FRAGS; ++m) m_i[m][0] = m_i[m][1] = -INFINITY;
    const ScoreScale score_scale = ScoreScale::make<MODS>(
        scale, softcap, use_alibi ? alibi_slopes : nullptr, alibi_batch_stride, int(blockIdx.z), head);
    const int q_warp = q_start + warp * Traits::WARP_M;
    const T* q_warp_smem = q_smem + warp * Traits::WARP_M * LD;

    // The inner loop: one active K/V tile per iteration.
    while (active) {
      cp_async_wait_group<0>();  // Q and K(t)
      __syncthreads();           // ... visible to all; every warp is done reading V(t - 1)
      load_v(tile.start);

      // Only the warps this tile's diagonal or window edge crosses test elements. In a paired
      // CTA a warp whose rows the tile does not reach (the other block's tile, or above the
      // diagonal) skips it; one-block CTAs compute such a tile as all -inf (adding nothing):
      // the branch cost them ~35 instructions per tile (and 72 bytes of spill at d128 b128) for
      // a tile they rarely meet (static model).
      const WarpTile mine =
          warp_view<RULE, TILE_N>(tile, row_block, rule, q_warp, q_warp + Traits::WARP_M - 1);
      const bool computes = Traits::ROW_BLOCKS == 1 || mine.coverage != TILE_EMPTY;
      float s_frag[M_FRAGS][TILE_N / 8][4] = {};
      if (computes) {
        warp_gemm_rs_nk<M_FRAGS, TILE_N, HEAD_DIM>(s_frag, q_warp_smem, LD, k_smem, LD);
        // the plain kernels keep q.k as it is: their scale rides in the softmax (row_probs)
        if constexpr (MODS == MODS_SCORE) {
#pragma unroll
          for (int m = 0; m < M_FRAGS; ++m) score_tile<MODS, TILE_N>(s_frag[m], score_scale);
          if (score_scale.alibi_log2 != 0.f) {
            alibi_frags<M_FRAGS, TILE_N, true>(s_frag, score_scale, q_offset, q_warp, tile.start);
          }
          if (use_key_bias) {
            const KeyBias kb{key_bias + blockIdx.z * key_bias_batch_stride +
                                 head * key_bias_head_stride,
                             n_k};
            key_bias_frags<M_FRAGS, TILE_N>(s_frag, kb, tile.start);
          }
          if (use_rel_bias) {
            const RelBias rb = RelBias::make(rel_bias, use_rel_bias, rel_bias_batch_stride,
                                             rel_max_distance, int(blockIdx.z), head);
            rel_bias_frags<M_FRAGS, TILE_N, true>(s_frag, rb, q_offset, q_warp, tile.start);
          }
          if (use_score_bias) {
            const auto sb = ScoreBias<T>::make(score_bias, use_score_bias, score_bias_batch_stride,
                                               score_bias_head_stride, score_bias_q_stride,
                                               score_bias_k_stride, n_q, n_k, int(blockIdx.z), head);
            score_bias_frags<M_FRAGS, TILE_N, true>(s_frag, sb, q_warp, tile.start, LOG2E);
          }
        }
        if (mine.coverage != TILE_FULL) {
          mask_score_frags<RULE, BLOCK, M_FRAGS, TILE_N, true>(
              s_frag, rule, q_warp, tile.start, q_block + row_block, tile.block, mine.mask_id);
        }
      }

      typename Walk::Tile next_tile;
      const bool has_next = walk.next(next_tile, rule, walk_first, walk_last);
      cp_async_wait_group<0>();  // V(t)
      __syncthreads();           // ... visible to all; every warp is done reading K(t)
      if (has_next) load_k(next_tile.start);

      if (computes) {
        // Online softmax: rescale what was accumulated so far to the new running max.
#pragma unroll
        for (int m = 0; m < M_FRAGS; ++m) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            float tile_max = -INFINITY;
#pragma unroll
            for (int j = 0; j < TILE_N / 8; ++j) {
              tile_max = fmaxf(tile_max, fmaxf(s_frag[m][j][2 * r], s_frag[m][j][2 * r + 1]));
            }
            const float m_new = fmaxf(m_i[m][r], scaled_max<MODS>(quad_max(tile_max), score_scale));
            // A row that has seen no allowed key yet keeps max -inf; subtracting 0 instead keeps
            // exp2 away from (-inf) - (-inf) = NaN and still yields p = 0.
            const float m_base = m_new == -INFINITY ? 0.f : m_new;
            const float alpha = exp2f(m_i[m][r] - m_base);
            const float row_sum = row_probs<MODS, TILE_N>(s_frag[m], r, score_scale, m_base);
            l_i[m][r] = l_i[m][r] * alpha + row_sum;
            m_i[m][r] = m_new;
#pragma unroll
            for (int j = 0; j < D_OUT / 8; ++j) {
              acc[m][j][2 * r] *= alpha;
              acc[m][j][2 * r + 1] *= alpha;
            }
          }
        }
        if constexpr (MODS == MODS_SCORE) {  // the row sums above are of every probability
          const Dropout dropout =
              Dropout::make(dropout_threshold, dropout_seed, dropout_seed_words, use_seed_words,
                         dropout_scale);
          if (dropout.on()) dropout_frags<M_FRAGS, TILE_N, true>(s_frag, dropout, q_warp, tile.start);
        }
        warp_gemm_regs_kn<M_FRAGS, D_OUT, TILE_N>(acc, s_frag, v_smem + d_first, LD, scratch);
      }
      tile = next_tile;
      active = has_next;
    }
    cp_async_wait_all();  // a row with no active tile still retires its Q copy

    const AccLayout frag;
#pragma unroll
    for (int m = 0; m < M_FRAGS; ++m) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float l = quad_sum(l_i[m][r]);
        const int q_row = q_warp + 16 * m + frag.row(2 * r);
        if (q_row >= n_q) continue;
        // l == 0: no allowed key (or only -inf scores): out 0 and lse -inf, written, since acc
        // may hold 0 * NaN from a masked key's v. A NaN or +inf allowed score left l NaN: the row
        // is NaN, as in a dense computation (fmaxf drops NaN from the max, exp2f does not).
        const bool empty = l == 0.f;
        const float inv_l = 1.f / l;
        T* out_row = out + (head_offset + q_row) * HEAD_DIM + d_first;
#pragma unroll
        for (int j = 0; j < D_OUT / 8; ++j) {
          store_pair(out_row + frag.pair_col(j), empty ? 0.f : acc[m][j][2 * r] * inv_l,
                     empty ? 0.f : acc[m][j][2 * r + 1] * inv_l);
        }
        if (frag.t == 0 && pass == 0) {
          lse[head_offset + q_row] = empty ? -INFINITY : (m_i[m][r] + log2f(l)) * LN2;
        }
      }
    }
    __syncthreads();  // every warp is done with the K/V buffers the next pass refills
  }
}
