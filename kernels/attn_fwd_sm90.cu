// Block-sparse attention forward for sm_90a (Hopper): warpgroup MMA (wgmma), stage (a) of issue 27.
//
// Computes what kernels/attn_fwd.cu computes without score modifiers, for every (batch, head,
// query) row over the keys its layout allows:
//   S = Q K^T * scale,  P = softmax(S),  out = P V,  lse = log(sum(exp(S)))
// Shapes: q, out [batch, heads, n_q, HEAD_DIM] and k, v [batch, heads / kv_group, n_k, HEAD_DIM]
// of T (__half or __nv_bfloat16); q, k, v at any element strides with contiguous, 16-byte
// aligned rows, out contiguous; query head h reads kv head h / kv_group (GQA/MQA); lse float32
// [batch, heads, n_q]. The layout's CSR arrays (docs/design.md §2) name the active key blocks of
// each query block, and the element rule RULE (none, causal, window, bitmask) applies inside the
// blocks whose entry mask is >= 0, exactly as in attn_fwd (kernels/common/walk.cuh and
// mask_score_frags). Queries are the last n_q of n_k positions (q_offset = n_k - n_q). A row
// with no allowed key gets out = 0 and lse = -inf.
//
// Work decomposition: one CTA per (128 query rows, head, batch), the last rows' CTAs of every
// head started first (cta_tile_longest_first in common/types.cuh), in two warpgroups of 128
// threads; warpgroup w owns rows 64w .. 64w + 63, the M = 64 of one wgmma. With 128-blocks the
// CTA owns one layout block and walks its CSR row; with 64-blocks it owns two adjacent blocks,
// one per warpgroup, and walks the union of their rows (PairedRowTiles), each warpgroup skipping
// the key tiles its own block's row lacks (wgmma is issued by a whole warpgroup, so that is the
// grain of every skip).
//
// Per active key tile of TILE_N keys, for each warpgroup:
//   S[64 x TILE_N]  = Q K^T   HEAD_DIM / 16 wgmma m64nTILE_Nk16, A = Q and B = K from shared
//                             memory (K-major: the head dim runs along each row of both)
//   mask, online softmax      in the accumulator layout: a thread holds rows g and g + 8 of its
//                             warp's 16 (g = lane / 4), the same places as an mma.sync fragment,
//                             so attn_fwd's masking and softmax code applies unchanged
//   O[64 x HEAD_DIM] += P V   TILE_N / 16 wgmma m64nHEAD_DIMk16, A = P from registers (the S
//                             accumulators of 16 keys are the A fragment of one K-step, rounded
//                             to T), B = V from shared memory MN-major (imm-trans-b = 1: V's
//                             rows as stored, keys x head dim)
//
// Shared memory: Q (128 rows) and two stages of K and V (TILE_N rows each), every tile in
// 64-column panels of 128-byte rows with the 128-byte swizzle (16-byte chunk c of row r at chunk
// c ^ (r % 8)), each panel on a 1024-byte boundary: the canonical layout wgmma's descriptors
// read, K-major for Q and K, MN-major for V (the same bytes; only the descriptor's strides
// differ).
//
// Pipeline (K and V in two stages, bench/NOTES.md change 26): every thread copies its share of
// each tile with cp.async, which writes through the generic proxy, so each thread issues
// fence.proxy.async after its copies land and before the barrier that lets wgmma (the async
// proxy) read them. K(t) and V(t) are one commit group in stage t % 2. Per tile:
//   wait K(t) V(t), fence, sync | copy K(t+1) V(t+1) into the other stage |
//   S = QK^T, mask | softmax | O += PV
// The one barrier a tile also says that every warpgroup is done with tile t - 1, whose stage the
// copies of t + 1 overwrite; those copies have all of tile t to land in. Each wgmma batch is
// waited for at once (wgmma.wait_group 0). Stage (b) replaces the copies by a TMA producer warp
// on an mbarrier ring and overlaps the two warpgroups (bench/NOTES.md, "sm_90a forward, stage
// (a)").
//
// Template parameters: BLOCK (layout block, 64 or 128), TILE_N (keys per tile: 64, or 128 with
// 128-blocks), HEAD_DIM (64, 128, 256), T, RULE (MaskRule). Run: compiled by NVRTC for sm_90a
// only (CuPy's RawModule compiles for the device's own arch, which rejects wgmma), or on the CPU
// interpreter (cuattn/backends/interp.py; tests/backends/test_attn_fwd_sm90.py), e.g.
// `attn_fwd_sm90<128, 128, 128, __nv_bfloat16, MASK_CAUSAL>` on grid (ceil(n_q / 128), heads,
// batch), 256 threads, attn_fwd_sm90_traits::SMEM_BYTES of dynamic shared memory.
#include "common/score_tile.cuh"
#include "common/smem.cuh"
#include "common/walk.cuh"
#include "common/warp_gemm.cuh"
#include "common/wgmma.cuh"

// The 128-byte swizzle of every tile: a shared-memory row is one 128-byte panel row, the
// pattern (and each panel) repeats every 8 rows.
constexpr int SWIZZLE_ROW_BYTES = 128;
constexpr int SWIZZLE_GROUP_ROWS = 8;
constexpr int SWIZZLE_REPEAT_BYTES = SWIZZLE_ROW_BYTES * SWIZZLE_GROUP_ROWS;
constexpr int COPY_CHUNK_BYTES = 16;  // one cp.async, the swizzle's unit
// The leading byte offset of a swizzled K-major operand is unused (the PTX ISA: "assumed 1",
// one 16-byte unit).
constexpr unsigned SWIZZLED_K_MAJOR_LEADING = 16;
// Columns of a score tile one mask pass covers: a bitmask row is read 64 bits at a time.
constexpr int MASK_PASS_COLUMNS = 64;

// Every size of the kernel, chosen here and checked.
template <int BLOCK, int TILE_N, int HEAD_DIM, typename T>
struct attn_fwd_sm90_traits {
  static constexpr int WARPGROUPS = 2;
  static constexpr int WARPGROUP_SIZE = WARPGROUP_WARPS * 32;
  static constexpr int NUM_THREADS = WARPGROUPS * WARPGROUP_SIZE;
  static constexpr int TILE_M = WARPGROUPS * WGMMA_M;  // query rows per CTA
  // Layout blocks per CTA: 1 (128-blocks: the warpgroups split it), or 2 (64-blocks: one each).
  static constexpr int ROW_BLOCKS = TILE_M / BLOCK;
  static constexpr int PANEL_COLUMNS = SWIZZLE_ROW_BYTES / int(sizeof(T));
  static constexpr int PANELS = HEAD_DIM / PANEL_COLUMNS;
  static constexpr int Q_PANEL_BYTES = TILE_M * SWIZZLE_ROW_BYTES;
  static constexpr int KV_PANEL_BYTES = TILE_N * SWIZZLE_ROW_BYTES;
  static constexpr int Q_BYTES = PANELS * Q_PANEL_BYTES;
  static constexpr int KV_BYTES = PANELS * KV_PANEL_BYTES;
  // K and V of one tile (K first); tile t's in stage t % KV_STAGES. The loop alternates the
  // two (stage ^= 1) with one commit group in flight, so the count is fixed.
  static constexpr int KV_STAGES = 2;
  static constexpr int STAGE_BYTES = 2 * KV_BYTES;
  // Q, the K/V stages, and room to start them on the swizzle's repeat wherever the block's
  // dynamic shared memory begins.
  static constexpr int SMEM_BYTES = Q_BYTES + KV_STAGES * STAGE_BYTES + SWIZZLE_REPEAT_BYTES;
  static constexpr int QK_STEPS = HEAD_DIM / WGMMA_K;  // wgmma of S = Q K^T
  static constexpr int PV_STEPS = TILE_N / WGMMA_K;    // wgmma of O += P V
  static constexpr int STEPS_PER_PANEL = PANEL_COLUMNS / WGMMA_K;
  // Bytes from one K-step of QK^T to the next inside a panel row, and of PV (16 V rows).
  static constexpr int QK_STEP_BYTES = WGMMA_K * int(sizeof(T));
  static constexpr int PV_STEP_BYTES = WGMMA_K * SWIZZLE_ROW_BYTES;
  static constexpr int MASK_PASSES = TILE_N > MASK_PASS_COLUMNS ? TILE_N / MASK_PASS_COLUMNS : 1;
  static constexpr int MASK_COLUMNS = TILE_N / MASK_PASSES;
  static_assert(is_half_type<T>::value, "wgmma takes fp16 or bf16 (fp32 keeps attn_fwd)");
  static_assert(KV_STAGES == 2, "the main loop flips between two K/V stages");
  static_assert(BLOCK == 64 || BLOCK == 128, "a warpgroup's 64 rows lie in one layout block");
  static_assert(BLOCK % TILE_N == 0 && (TILE_N == 64 || TILE_N == 128),
                "key tiles of 64 or 128 inside one block");
  static_assert(HEAD_DIM % PANEL_COLUMNS == 0 && HEAD_DIM <= 256,
                "whole 128-byte panels, and N <= 256 for O += P V");
};

// The first byte at or after `p` on the swizzle's repeat in the shared-memory window (where
// the pattern anchors, so the descriptors' base offset is 0).
__device__ __forceinline__ unsigned char* align_to_swizzle_repeat(unsigned char* p) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(p));
  return p + (SWIZZLE_REPEAT_BYTES - address % SWIZZLE_REPEAT_BYTES) % SWIZZLE_REPEAT_BYTES;
}

// Starts the cp.async copies of a ROWS x HEAD_DIM tile (gmem rows `gmem_ld` elements apart)
// into `tile` in the swizzled panel layout of the header; rows >= valid_rows are zero-filled
// (a masked key's V must be 0, not stale data: its P is 0, and 0 * NaN is NaN). Each thread
// copies one 16-byte column chunk of rows ROW_STEP apart; ROW_STEP is a multiple of the
// swizzle's 8 rows, so all of a thread's copies land in the same swizzled chunk and only the
// row offset changes.
template <int ROWS, int HEAD_DIM, int NUM_THREADS, typename T>
__device__ __forceinline__ void load_tile_swizzled(unsigned char* tile, const T* gmem,
                                                   int gmem_ld, int valid_rows) {
  constexpr int CHUNK_ELEMENTS = COPY_CHUNK_BYTES / int(sizeof(T));
  constexpr int CHUNKS_PER_ROW = HEAD_DIM / CHUNK_ELEMENTS;
  constexpr int CHUNKS_PER_PANEL_ROW = SWIZZLE_ROW_BYTES / COPY_CHUNK_BYTES;
  constexpr int ROW_STEP = NUM_THREADS / CHUNKS_PER_ROW;
  constexpr int COPIES = ROWS / ROW_STEP;
  static_assert(NUM_THREADS % CHUNKS_PER_ROW == 0 && ROW_STEP % SWIZZLE_GROUP_ROWS == 0 &&
                ROWS % ROW_STEP == 0);
  const int tid = int(threadIdx.x);
  const int row = tid / CHUNKS_PER_ROW;
  const int chunk = tid % CHUNKS_PER_ROW;
  const int panel = chunk / CHUNKS_PER_PANEL_ROW;
  const int swizzled = (chunk % CHUNKS_PER_PANEL_ROW) ^ (row % SWIZZLE_GROUP_ROWS);
  unsigned char* dst = tile + panel * ROWS * SWIZZLE_ROW_BYTES + row * SWIZZLE_ROW_BYTES +
                       swizzled * COPY_CHUNK_BYTES;
  const T* src = gmem + row * gmem_ld + chunk * CHUNK_ELEMENTS;
#pragma unroll
  for (int i = 0; i < COPIES; ++i) {
    const bool valid = row + i * ROW_STEP < valid_rows;
    cp_async_16(dst + i * ROW_STEP * SWIZZLE_ROW_BYTES, valid ? src + i * ROW_STEP * gmem_ld : gmem,
                valid);
  }
}

// The descriptor of a swizzled operand at `at` (K-major: 8-row groups one repeat apart; MN-major:
// the same, and the next 64 columns `panel_bytes` on).
__device__ __forceinline__ u64 swizzled_descriptor(const unsigned char* at, unsigned panel_bytes) {
  return wgmma_descriptor(at, panel_bytes, SWIZZLE_REPEAT_BYTES, WGMMA_SWIZZLE_128B);
}

template <int BLOCK, int TILE_N, int HEAD_DIM, typename T, int RULE>
__global__ void __launch_bounds__(attn_fwd_sm90_traits<BLOCK, TILE_N, HEAD_DIM, T>::NUM_THREADS, 1)
    attn_fwd_sm90(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                  T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ row_ptr,
                  const int* __restrict__ col_idx, const int* __restrict__ row_mask,
                  const u32* __restrict__ mask_table, int n_q, int n_k, int q_offset,
                  int kv_group, int num_blocks, float scale, int window_left, int window_right,
                  long long q_batch_stride, long long q_head_stride, long long q_row_stride,
                  long long k_batch_stride, long long k_head_stride, long long k_row_stride,
                  long long v_batch_stride, long long v_head_stride, long long v_row_stride) {
  using Traits = attn_fwd_sm90_traits<BLOCK, TILE_N, HEAD_DIM, T>;
  constexpr int NUM_THREADS = Traits::NUM_THREADS;

  const CtaTile cta = cta_tile_longest_first();
  const int head = cta.head;
  const int batch = cta.batch;
  const int q_start = cta.tile * Traits::TILE_M;
  if (q_start >= n_q) return;  // (a grid rounded up past the queries)
  const int q_block = q_start / BLOCK;
  const size_t head_offset = (size_t(batch) * gridDim.y + head) * size_t(n_q);
  const int warpgroup = int(threadIdx.x) / Traits::WARPGROUP_SIZE;
  const int warp_in_group = int(threadIdx.x) / 32 % WARPGROUP_WARPS;
  const int row_block = Traits::ROW_BLOCKS == 2 ? warpgroup : 0;  // the warpgroup's own block
  const int group_first = q_start + warpgroup * WGMMA_M;
  const int warp_first = group_first + warp_in_group * 16;
  const RuleParams rule{n_q, n_k, q_offset, window_left, window_right, mask_table};

  unsigned char* q_tile = align_to_swizzle_repeat(dynamic_smem<unsigned char>());
  unsigned char* kv_stages = q_tile + Traits::Q_BYTES;
  const int kv_head = head / kv_group;
  // The keys k_start .. k_start + TILE_N - 1 of `from` (k or v) into `tile`.
  auto load_keys = [&](unsigned char* tile, const T* from, long long batch_stride,
                       long long head_stride, long long row_stride, int k_start) {
    load_tile_swizzled<TILE_N, HEAD_DIM, NUM_THREADS>(
        tile, from + strided_row(batch_stride, head_stride, row_stride, batch, kv_head, k_start),
        int(row_stride), n_k - k_start);
  };
  // K and V of the tile at k_start into `stage`, one commit group.
  auto load_kv = [&](unsigned char* stage, int k_start) {
    load_keys(stage, k, k_batch_stride, k_head_stride, k_row_stride, k_start);
    load_keys(stage + Traits::KV_BYTES, v, v_batch_stride, v_head_stride, v_row_stride, k_start);
    cp_async_commit();
  };
  // Copies that landed, made visible to the async proxy (wgmma) and to every thread.
  auto land_copies = [] {
    cp_async_wait_group<0>();
    fence_proxy_async();
    __syncthreads();
  };

  auto walk = forward_walk<Traits::ROW_BLOCKS, RULE, BLOCK, TILE_N>(
      row_ptr, col_idx, row_mask, head, num_blocks, q_block, row_block);
  using Walk = decltype(walk);
  // The rows the walk tests: the CTA's, or in a paired CTA the warpgroup's own.
  const int walk_first = Traits::ROW_BLOCKS == 2 ? group_first : q_start;
  const int walk_last = walk_first + (Traits::ROW_BLOCKS == 2 ? WGMMA_M : Traits::TILE_M) - 1;
  typename Walk::Tile tile;
  bool active = walk.next(tile, rule, walk_first, walk_last);
  load_tile_swizzled<Traits::TILE_M, HEAD_DIM, NUM_THREADS>(
      q_tile,
      q + strided_row(q_batch_stride, q_head_stride, q_row_stride, batch, head, q_start),
      int(q_row_stride), n_q - q_start);
  cp_async_commit();
  int stage = 0;
  if (active) load_kv(kv_stages, tile.start);

  // The warpgroup's accumulators in the wgmma D layout, seen as mma.sync fragments (header).
  float o[HEAD_DIM / 8][4] = {};
  float(&o_acc)[HEAD_DIM / 2] = reinterpret_cast<float(&)[HEAD_DIM / 2]>(o);
  float m_i[2] = {-INFINITY, -INFINITY};  // rows g and g + 8, log2 domain
  float l_i[2] = {};                      // this thread's columns only
  const ScoreScale score_scale = ScoreScale::make<MODS_NONE>(scale, 0.f, nullptr, 0, 0, 0);
  const unsigned char* q_group = q_tile + warpgroup * WGMMA_M * SWIZZLE_ROW_BYTES;

  // The inner loop: one active K/V tile per iteration.
  while (active) {
    land_copies();  // Q, K(t) and V(t); every warpgroup is done with tile t - 1 and its stage
    const unsigned char* k_tile = kv_stages + stage * Traits::STAGE_BYTES;
    const unsigned char* v_tile = k_tile + Traits::KV_BYTES;
    typename Walk::Tile next_tile;
    const bool has_next = walk.next(next_tile, rule, walk_first, walk_last);
    stage ^= 1;
    if (has_next) load_kv(kv_stages + stage * Traits::STAGE_BYTES, next_tile.start);

    // A warpgroup whose rows the tile does not reach (the other block's tile in a paired CTA,
    // or above the diagonal) skips it; the coverage is the warpgroup's, uniform across it.
    const WarpTile mine = warp_view<RULE, TILE_N>(tile, row_block, rule, group_first,
                                                   group_first + WGMMA_M - 1);
    const bool computes = mine.coverage != TILE_EMPTY;
    float s[TILE_N / 8][4];
    float(&s_acc)[TILE_N / 2] = reinterpret_cast<float(&)[TILE_N / 2]>(s);
    if (computes) {
      wgmma_fence_operands(s_acc);
      wgmma_fence();
#pragma unroll
      for (int step = 0; step < Traits::QK_STEPS; ++step) {
        const int panel = step / Traits::STEPS_PER_PANEL;
        const int within = (step % Traits::STEPS_PER_PANEL) * Traits::QK_STEP_BYTES;
        const u64 desc_q = swizzled_descriptor(q_group + panel * Traits::Q_PANEL_BYTES + within,
                                               SWIZZLED_K_MAJOR_LEADING);
        const u64 desc_k = swizzled_descriptor(k_tile + panel * Traits::KV_PANEL_BYTES + within,
                                               SWIZZLED_K_MAJOR_LEADING);
        wgmma_m64k16<T, TILE_N>(s_acc, desc_q, desc_k, step > 0);
      }
      wgmma_commit_group();
      wgmma_wait_group<0>();
      wgmma_fence_operands(s_acc);
      if (mine.coverage != TILE_FULL) {
#pragma unroll
        for (int pass = 0; pass < Traits::MASK_PASSES; ++pass) {
          constexpr int COLUMNS = Traits::MASK_COLUMNS;
          auto& columns = *reinterpret_cast<float(*)[1][COLUMNS / 8][4]>(&s[pass * COLUMNS / 8]);
          mask_score_frags<RULE, BLOCK, 1, COLUMNS, true>(columns, rule, warp_first,
                                                          tile.start + pass * COLUMNS,
                                                          q_block + row_block, tile.block,
                                                          mine.mask_id);
        }
      }
    }

    if (computes) {
      // Online softmax: rescale what was accumulated so far to the new running max.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < TILE_N / 8; ++j) {
          tile_max = fmaxf(tile_max, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
        }
        const float m_new =
            fmaxf(m_i[r], scaled_max<MODS_NONE>(quad_max(tile_max), score_scale));
        // A row that has seen no allowed key yet keeps max -inf; subtracting 0 instead keeps
        // exp2 away from (-inf) - (-inf) = NaN and still yields p = 0.
        const float m_base = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = exp2f(m_i[r] - m_base);
        const float row_sum = row_probs<MODS_NONE, TILE_N>(s, r, score_scale, m_base);
        l_i[r] = l_i[r] * alpha + row_sum;
        m_i[r] = m_new;
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 8; ++j) {
          o[j][2 * r] *= alpha;
          o[j][2 * r + 1] *= alpha;
        }
      }
      // P as T: the accumulators of keys 16 step .. 16 step + 15 are the A fragment of K-step
      // `step` (kernels/common/wgmma.cuh).
      u32 p[Traits::PV_STEPS][WGMMA_A_REGISTERS];
#pragma unroll
      for (int step = 0; step < Traits::PV_STEPS; ++step) {
#pragma unroll
        for (int reg = 0; reg < WGMMA_A_REGISTERS; ++reg) {
          const int element = step * 2 * WGMMA_A_REGISTERS + 2 * reg;
          p[step][reg] = pack_pair<T>(s_acc[element], s_acc[element + 1]);
        }
      }
      wgmma_fence_operands(o_acc);
      wgmma_fence();
#pragma unroll
      for (int step = 0; step < Traits::PV_STEPS; ++step) {
        const u64 desc_v = swizzled_descriptor(v_tile + step * Traits::PV_STEP_BYTES,
                                               unsigned(Traits::KV_PANEL_BYTES));
        wgmma_m64k16_rs<T, HEAD_DIM, WGMMA_MN_MAJOR>(o_acc, p[step], desc_v, true);
      }
      wgmma_commit_group();
      wgmma_wait_group<0>();
      wgmma_fence_operands(o_acc);
    }
    tile = next_tile;
    active = has_next;
  }
  cp_async_wait_all();  // a row with no active tile still retires its Q copy

  const AccLayout frag;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(l_i[r]);
    const int q_row = warp_first + frag.row(2 * r);
    if (q_row >= n_q) continue;
    // l == 0: no allowed key (or only -inf scores): out 0 and lse -inf, written, since o may
    // hold 0 * NaN from a masked key's v.
    const bool empty = l == 0.f;
    const float inv_l = 1.f / l;
    T* out_row = out + (head_offset + q_row) * HEAD_DIM;
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 8; ++j) {
      store_pair(out_row + frag.pair_col(j), empty ? 0.f : o[j][2 * r] * inv_l,
                 empty ? 0.f : o[j][2 * r + 1] * inv_l);
    }
    if (frag.t == 0) lse[head_offset + q_row] = empty ? -INFINITY : (m_i[r] + log2f(l)) * LN2;
  }
}
