// Block-sparse attention backward for sm_90a (Hopper): warpgroup MMA (wgmma) fed by TMA from a
// producer warpgroup, with dQ reduced into an fp32 accumulator inside the same kernel in a fixed
// order (FlashAttention-3's backward on cuattn's layouts).
//
// Computes what kernels/attn_bwd.cu computes without score modifiers: for every (batch, query
// head, query) row and the keys its layout allows,
//   P = exp(S - lse) with S = Q K^T * scale,  dV = P^T dO,  dP = dO V^T,
//   dS = P * (dP - delta),  dK = dS^T Q * scale,  dQ = dS K * scale
// (delta = rowsum(dO * out) - dlse, from attn_bwd_preprocess in kernels/attn_bwd.cu).
// Shapes: q, dout [batch, heads, n_q, HEAD_DIM] and k, v [batch, heads / kv_group, n_k,
// HEAD_DIM] of T (__half or __nv_bfloat16), all read through rank-4 TMA tensor maps (columns,
// rows, heads, batch: any strides the maps can describe; q_col .. dout_col as in
// attn_fwd_sm90.cu); stats float32 [batch, heads, 2, n_q_padded] (n_q rounded up to TILE_Q),
// read through a fifth rank-4 map (box TILE_Q x 2 x 1 x 1, no swizzle): lse in the log2 domain
// (+inf for a row with nothing to attend and past n_q, so its P is exactly 0), then delta (0
// past n_q); dk, dv [batch, heads / kv_group, n_k, HEAD_DIM] of T, written whole (dK = dV = 0
// for a key no query sees); dq_accum float32 [batch, heads, n_q_padded, HEAD_DIM] and the int
// semaphores [batch, heads, n_q_padded / TILE_Q] plus one work counter, all zeroed before the
// launch; attn_bwd_sm90_dq then writes dq = dq_accum * scale as T. The layout's CSC arrays
// (col_ptr, row_idx, col_mask) name the query blocks of each key block, dq_ranks (one int per
// CSC entry, cuattn/backends/kernels.py) the order in which dQ's contributions are added, and
// tile_order [kv heads, key tiles] the order in which each kv head's key tiles are claimed; the
// element rule RULE applies inside entries whose mask is >= 0 (kernels/common/walk.cuh,
// mask.cuh).
//
// Work decomposition: one CTA per (TILE_K = 128 keys: one 128-block or two 64-blocks, kv head,
// batch), 384 threads in three warpgroups (common/warpgroup.cuh):
//   warpgroup 0 gives its registers up (setmaxnreg.dec). Its thread 0 walks the CSC column (with
//     64-blocks the union of the two columns, PairedRowTiles) of every query head of the kv head
//     in turn (GQA: the kv head's CTA loops over its heads, dK and dV stay in registers) and
//     issues every copy: K and V once, then each step of TILE_Q = 64 queries' Q, dO and
//     lse/delta (TMA) into a ring of STEP_STAGES stages. Its thread 32 issues the dQ reduces.
//   warpgroups 1 and 2, the consumers, take the registers (setmaxnreg.inc); consumer c owns keys
//     64c .. 64c + 63 of the CTA (with 64-blocks, block c of the pair), the M = 64 of one wgmma.
//     A consumer whose keys a step does not reach (its block's column lacks the query block, or
//     the rule empties it) skips its GEMMs and stores nothing. Per step:
//       S^T[64 x 64]  = K Q^T    HEAD_DIM / 16 wgmma m64n64k16, A = K, B = Q (both K-major)
//       dP^T[64 x 64] = V dO^T   the same with V and dO
//       P^T = exp2(S^T * scale * log2 e - lse_log2), masked; dS^T = P^T (dP^T - delta)
//       dV[64 x d] += P^T dO     4 wgmma m64n{d}k16, A = P^T from registers (the S^T
//                                accumulators of 16 queries are one K-step's A fragment), B =
//                                dO MN-major (its rows as stored: queries x head dim)
//       dK[64 x d] += dS^T Q     the same with dS^T and Q
//       dQ_part[64 x d / 2] = dS K  the consumer's half of the head dim, over the keys of the
//                                consumers that computed the step: 8 wgmma m64n{d/2}k16 for
//                                both, 4 for one (also run by the consumer that skipped), none
//                                for neither (dQ_part = 0); A = dS read MN-major from dS^T,
//                                which the computing consumers store to shared memory, B = K
//                                MN-major
//     and the consumers store dQ_part into an fp32 tile that thread 32 adds into dq_accum with
//     one bulk reduce (cp.reduce.async.bulk .add.f32), 5 GEMMs in all.
// Determinism: the adds into one (TILE_Q queries, head, batch) tile happen in one order. Its
// semaphore counts the CTAs that added into it; the CTA adds when the semaphore holds its rank
// (the CTAs of the query block's row claimed before it), waits for its reduce to complete, then
// releases the next rank. Every step of every entry of the walk is reduced, zeros where the
// rule empties it. CTAs claim their work from a counter in the order they start (claim_work,
// common/semaphore.cuh), so a CTA only waits for CTAs that are running or done: no deadlock at
// any occupancy. The claim order (grouped_item, common/types.cuh): the (kv head, batch) pairs in
// cta_groups groups, one after another, so that a group's query side (Q, dO and the dQ
// accumulator, which every CTA of a pair re-reads) stays in the L2 (the host sizes them:
// geometry.sm90_backward_cta_groups); within a group every pair's first tile in tile_order,
// then every pair's second, ... tile_order puts the columns that walk the fewest steps first:
// walking down its column, such a CTA reaches each of its query blocks before the longer
// columns that share it, so in a causal layout no CTA waits on the one ranked before it. The
// longest-first order of the forward would make every CTA wait for the longer columns beside it.
// DQ_ORDER = DQ_UNORDERED (opt-in: CUATTN_BWD_DQ=unordered) skips the semaphores: each reduce
// goes as soon as its step's dQ tile is stored, so the adds into a tile land in whatever order
// the CTAs reach it and dQ may differ run to run in its last bits (dK and dV do not); dq_ranks
// and the semaphores are then not read.
//
// attn_bwd_sm90_persistent (opt-in: CUATTN_BWD_SM90=persistent) runs the same CTA code on a grid
// of one CTA an SM, each claiming item after item from the same counter in the same order (so
// the same ranks, and still no deadlock: a CTA waits only on items claimed before its own); the
// producer copies an item's K and V once the consumers are done with the previous item's, under
// its dK/dV epilogue and last reduces. kv_heads and batch_size are then arguments, not the grid.
//
// Shared memory (every tile in 64-column panels of 128-byte rows with the 128-byte swizzle, each
// panel on a 1024-byte boundary, as attn_fwd_sm90.cu lays them out): K and V (TILE_K rows), the
// STEP_STAGES stages of Q and of dO (TILE_Q rows), two stages of dS^T (TILE_K rows of TILE_Q
// queries: one panel), the fp32 dQ tile [TILE_Q][HEAD_DIM] (plain rows: the bulk reduce reads it
// as one range), each stage's lse_log2 and delta, then the mbarriers.
// Pipeline: kv_full completes with K and V; the step ring (StageRing) with each step's Q, dO,
// lse and delta; dq_full when the 256 consumer threads have written the dQ tile, dq_empty when
// the reduce has read it. The two consumers meet on a named barrier once a step, between their
// dS^T stores (and a flag each: computed or skipped) and the dQ GEMM that reads the computed
// halves (dS^T and the flags alternate between two stages, so the next step's stores cannot
// reach a stage the other consumer still reads).
//
// Template parameters: BLOCK (64 or 128), TILE_Q (64), HEAD_DIM (64, 128), T, RULE (MaskRule),
// DQ_ORDER (DqOrder, DQ_ORDERED unless named).
// Run: compiled by NVRTC for sm_90a only, or on the CPU interpreter
// (tests/backends/test_attn_bwd_sm90.py), e.g. `attn_bwd_sm90<128, 64, 128, __nv_bfloat16,
// MASK_CAUSAL>` on grid (ceil(n_k / 128), kv heads, batch), 384 threads,
// attn_bwd_sm90_traits::SMEM_BYTES of dynamic shared memory, the tensor maps' boxes 64 x TILE_Q
// (q, dout) and 64 x 128 (k, v) x 1 x 1; cuattn/backends/kernels.py launches it (opt-in:
// CUATTN_KERNELS=sm90a).
#include "common/row_kernel.cuh"
#include "common/score_tile.cuh"
#include "common/semaphore.cuh"
#include "common/smem.cuh"
#include "common/walk.cuh"
#include "common/warpgroup.cuh"
#include "common/wgmma.cuh"

// The 128-byte swizzle of every tile (attn_fwd_sm90.cu): a row is one 128-byte panel row.
constexpr int SWIZZLE_ROW_BYTES = 128;
constexpr int SWIZZLE_GROUP_ROWS = 8;
constexpr int SWIZZLE_REPEAT_BYTES = SWIZZLE_ROW_BYTES * SWIZZLE_GROUP_ROWS;
constexpr int SWIZZLE_CHUNK_BYTES = 16;
constexpr unsigned SWIZZLED_K_MAJOR_LEADING = 16;  // unused by a swizzled K-major operand

template <int BLOCK, int TILE_Q, int HEAD_DIM, typename T>
struct attn_bwd_sm90_traits {
  static constexpr int WARPGROUP_SIZE = WARPGROUP_WARPS * 32;
  static constexpr int CONSUMERS = 2;
  static constexpr int NUM_THREADS = (1 + CONSUMERS) * WARPGROUP_SIZE;
  static constexpr int CONSUMER_THREADS = CONSUMERS * WARPGROUP_SIZE;
  // Registers per thread after setmaxnreg, 128 x (producer + 2 x consumer) = 64512 of the
  // 65536 one CTA holds: at d = 128 a consumer needs 240 (dK and dV are 128 of them; at 232
  // ptxas spills and serialises the wgmma), at d = 64 232 leave the producer 40.
  static constexpr int CONSUMER_REGISTERS = HEAD_DIM == 128 ? 240 : 232;
  static constexpr int PRODUCER_REGISTERS = HEAD_DIM == 128 ? 24 : 40;
  static constexpr int TILE_K = CONSUMERS * WGMMA_M;  // keys per CTA
  static constexpr int KEY_BLOCKS = TILE_K / BLOCK;     // 1, or 2 paired 64-blocks
  static constexpr int PANEL_COLUMNS = SWIZZLE_ROW_BYTES / int(sizeof(T));
  static constexpr int PANELS = HEAD_DIM / PANEL_COLUMNS;
  static constexpr int KV_PANEL_BYTES = TILE_K * SWIZZLE_ROW_BYTES;
  static constexpr int KV_BYTES = PANELS * KV_PANEL_BYTES;
  static constexpr int Q_PANEL_BYTES = TILE_Q * SWIZZLE_ROW_BYTES;
  static constexpr int Q_BYTES = PANELS * Q_PANEL_BYTES;
  static constexpr int STEP_STAGES = 2;  // stages of Q, dO, lse and delta
  static constexpr int DS_STAGES = 2;
  static constexpr int DS_BYTES = TILE_K * SWIZZLE_ROW_BYTES;  // dS^T: TILE_Q queries a row
  static constexpr int DQ_COLUMNS = HEAD_DIM / CONSUMERS;      // a consumer's share of dQ
  static constexpr int DQ_BYTES = TILE_Q * HEAD_DIM * int(sizeof(float));
  static constexpr int STATS_BYTES = TILE_Q * int(sizeof(float));  // lse or delta of a step
  static constexpr int STEP_BYTES = 2 * Q_BYTES + 2 * STATS_BYTES;  // one stage's copies
  // kv_full, the step ring, dq_full and dq_empty: 8 bytes each.
  static constexpr int BARRIER_BYTES =
      int(sizeof(StageRing<STEP_STAGES>)) + 3 * int(sizeof(u64));
  static constexpr int SMEM_BYTES = 2 * KV_BYTES + 2 * STEP_STAGES * Q_BYTES +
                                    DS_STAGES * DS_BYTES + DQ_BYTES +
                                    2 * STEP_STAGES * STATS_BYTES + BARRIER_BYTES +
                                    SWIZZLE_REPEAT_BYTES;
  static constexpr int S_STEPS = HEAD_DIM / WGMMA_K;    // wgmma of S^T and of dP^T
  static constexpr int DKV_STEPS = TILE_Q / WGMMA_K;    // wgmma of dV and of dK
  static constexpr int DQ_STEPS = TILE_K / WGMMA_K;     // wgmma of dQ_part
  static constexpr int HALF_DQ_STEPS = WGMMA_M / WGMMA_K;  // over one consumer's keys
  static constexpr int STEPS_PER_PANEL = PANEL_COLUMNS / WGMMA_K;
  static constexpr int S_STEP_BYTES = WGMMA_K * int(sizeof(T));       // along a K-major row
  static constexpr int ROWS_STEP_BYTES = WGMMA_K * SWIZZLE_ROW_BYTES;  // 16 rows on
  // Named barriers of the 256 consumer threads: both halves of dS^T stored; and (persistent)
  // of each consumer's 128: every thread has read its count of items taken.
  static constexpr int DS_READY_BARRIER = 1;
  static constexpr int ITEMS_READ_BARRIER = 2;  // + consumer
  static_assert(is_half_type<T>::value, "wgmma takes fp16 or bf16");
  static_assert(KEY_BLOCKS * BLOCK == TILE_K && (KEY_BLOCKS == 1 || KEY_BLOCKS == 2),
                "a CTA's keys are one 128-block or two 64-blocks, one per consumer");
  static_assert(TILE_Q * int(sizeof(T)) == SWIZZLE_ROW_BYTES,
                "a dS^T row (a step's queries) is one panel row");
  static_assert(BLOCK % TILE_Q == 0 && TILE_Q == WGMMA_M, "steps of whole wgmma rows");
  static_assert(HEAD_DIM % PANEL_COLUMNS == 0 && (HEAD_DIM == 64 || HEAD_DIM == 128),
                "whole panels; dK and dV (HEAD_DIM / 2 registers each) fit beside a step");
  static_assert(DQ_COLUMNS <= PANEL_COLUMNS, "a consumer's dQ columns lie in one panel");
  static_assert((PRODUCER_REGISTERS + CONSUMERS * CONSUMER_REGISTERS) * WARPGROUP_SIZE <=
                    65536 / NUM_THREADS / 8 * 8 * NUM_THREADS,
                "setmaxnreg requests the launch's registers cannot cover hang the GPU");
};

__device__ __forceinline__ unsigned char* bwd_align_to_swizzle_repeat(unsigned char* p) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(p));
  return p + (SWIZZLE_REPEAT_BYTES - address % SWIZZLE_REPEAT_BYTES) % SWIZZLE_REPEAT_BYTES;
}

__device__ __forceinline__ u64 bwd_swizzled_descriptor(const unsigned char* at,
                                                       unsigned panel_bytes) {
  return wgmma_descriptor(at, panel_bytes, SWIZZLE_REPEAT_BYTES, WGMMA_SWIZZLE_128B);
}

// The byte of element pair (row, col) in a swizzled tile of one 128-byte panel per row.
template <typename T>
__device__ __forceinline__ int swizzled_byte(int row, int col) {
  const int byte = col * int(sizeof(T));
  const int chunk = (byte / SWIZZLE_CHUNK_BYTES) ^ (row % SWIZZLE_GROUP_ROWS);
  return row * SWIZZLE_ROW_BYTES + chunk * SWIZZLE_CHUNK_BYTES + byte % SWIZZLE_CHUNK_BYTES;
}

// The order of the dQ adds into one tile: the layout's, by the semaphores (bit-identical run to
// run), or whatever order the CTAs reach the tile in (no waits; CUATTN_BWD_DQ=unordered).
enum DqOrder : int { DQ_ORDERED = 0, DQ_UNORDERED = 1 };

// The persistent backward's hand-over of claimed places: the producer's thread publishes its
// n-th place (BWD_NO_ITEM once the counter has passed the last item) in slot n % SLOTS; each
// consumer thread and the reduce thread reads it, and releases the slot once done with the
// item. A reader may fall behind by a whole item (an empty column's consumers run ahead of the
// reduces still waiting on their ranks) and still read its own. The counts the roles carry
// from item to item (places published, steps copied, items each consumer took) and each
// consumer's dK/dV row base live here too, not in registers across the items: the producer
// runs on 24 of them at d = 128 and the consumers have none to spare.
constexpr int BWD_NO_ITEM = -1;
struct BwdItemSlots {
  static constexpr int SLOTS = 2;
  u64 full[SLOTS];
  u64 empty[SLOTS];
  int place[SLOTS];
  int published;
  int copied_steps;
  static constexpr int CONSUMERS = 2;  // the kernel's consumer warpgroups
  int taken[CONSUMERS];  // items each consumer warpgroup has taken (read by all its threads)
  long long kv_rows[CONSUMERS];  // each consumer's current item: its dK/dV rows' first

  __device__ __forceinline__ void init(int readers) {
    for (int s = 0; s < SLOTS; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], readers);
    }
    published = 0;
    copied_steps = 0;
    for (int c = 0; c < CONSUMERS; ++c) taken[c] = 0;
  }
  // The producer: publishes its next place; returns how many it published before.
  __device__ __forceinline__ int publish(int claimed_place) {
    volatile int* count = &published;
    const int n = *count;
    const int s = n % SLOTS;
    if (n >= SLOTS) mbarrier_wait_parity(&empty[s], unsigned(n / SLOTS - 1) & 1u);
    *reinterpret_cast<volatile int*>(&place[s]) = claimed_place;
    mbarrier_arrive(&full[s]);  // release: the place, before a reader's wait returns
    *count = n + 1;
    return n;
  }
  // A reader: waits for the n-th place, then reads it (again) with placed(n) until release(n).
  __device__ __forceinline__ int wait(int n) {
    mbarrier_wait_parity(&full[n % SLOTS], unsigned(n / SLOTS) & 1u);
    return placed(n);
  }
  __device__ __forceinline__ int placed(int n) {
    return *reinterpret_cast<volatile int*>(&place[n % SLOTS]);
  }
  __device__ __forceinline__ void release(int n) { mbarrier_arrive(&empty[n % SLOTS]); }
};

// What a CTA of either kernel runs: attn_bwd_sm90 (PERSISTENT false) the work it claims once,
// attn_bwd_sm90_persistent (true) every item it claims until the counter passes the last one.
// kv_heads and batch_size: the grid's y and z in the first, arguments in the second.
template <int BLOCK, int TILE_Q, int HEAD_DIM, typename T, int RULE, int DQ_ORDER, bool PERSISTENT>
__device__ __forceinline__ void attn_bwd_sm90_cta(
    const TensorMap& q_map, const TensorMap& k_map, const TensorMap& v_map,
    const TensorMap& dout_map, const TensorMap& stats_map, int q_col, int k_col, int v_col,
    int dout_col, T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dq_accum,
    int* __restrict__ semaphores, int* __restrict__ work_counter,
    const int* __restrict__ col_ptr, const int* __restrict__ row_idx,
    const int* __restrict__ col_mask, const int* __restrict__ dq_ranks,
    const int* __restrict__ tile_order, const u32* __restrict__ mask_table, int n_q, int n_k,
    int q_offset, int kv_group, int num_k_blocks, float scale, int window_left,
    int window_right, int cta_groups, int kv_heads, int batch_size) {
  using Traits = attn_bwd_sm90_traits<BLOCK, TILE_Q, HEAD_DIM, T>;
  using Ring = StageRing<Traits::STEP_STAGES>;
  constexpr int TILE_K = Traits::TILE_K;
  constexpr int KEY_BLOCKS = Traits::KEY_BLOCKS;

  unsigned char* k_tile = bwd_align_to_swizzle_repeat(dynamic_smem<unsigned char>());
  unsigned char* v_tile = k_tile + Traits::KV_BYTES;
  unsigned char* q_stages = v_tile + Traits::KV_BYTES;
  unsigned char* do_stages = q_stages + Traits::STEP_STAGES * Traits::Q_BYTES;
  unsigned char* ds_stages = do_stages + Traits::STEP_STAGES * Traits::Q_BYTES;
  float* dq_tile = reinterpret_cast<float*>(ds_stages + Traits::DS_STAGES * Traits::DS_BYTES);
  float* stats = dq_tile + TILE_Q * HEAD_DIM;  // stage s: lse_log2, then delta
  u64* kv_full = reinterpret_cast<u64*>(stats + 2 * Traits::STEP_STAGES * TILE_Q);
  u64* dq_full = kv_full + 1;
  u64* dq_empty = dq_full + 1;
  Ring* ring = reinterpret_cast<Ring*>(dq_empty + 1);
  __shared__ int claimed;
  __shared__ int computed[Traits::DS_STAGES][Traits::CONSUMERS];  // a consumer's dS^T stage
  // Persistent: kv_empty (the consumers are done with K and V) and the places claimed, handed
  // from the producer to the consumers and the reduce thread.
  __shared__ u64 kv_empty;
  __shared__ BwdItemSlots item_slots;
  static_assert(BwdItemSlots::CONSUMERS == Traits::CONSUMERS, "a count per consumer");
  if (threadIdx.x == 0) {
    mbarrier_init(kv_full, 1);
    mbarrier_init(dq_full, Traits::CONSUMER_THREADS);
    mbarrier_init(dq_empty, 1);
    ring->init(Traits::CONSUMER_THREADS);
    if constexpr (PERSISTENT) {
      mbarrier_init(&kv_empty, Traits::CONSUMER_THREADS);
      item_slots.init(Traits::CONSUMER_THREADS + 1);  // and the reduce thread
    } else {
      claimed = claim_work(work_counter);
    }
  }
  __syncthreads();  // the barriers and the claimed work, before anyone uses them

  // A claimed place: a (kv head, batch) pair of its group and a place in the kv head's
  // tile_order (header). attn_bwd_sm90 decodes its one place here; the persistent kernel each
  // role's at each item (set_item), its sizes (and the divisions' reciprocals) recomputed
  // there rather than held across the items.
  const int num_k_tiles = (num_k_blocks + KEY_BLOCKS - 1) / KEY_BLOCKS;
  int kv_head, batch, k_tile_index, k_block, k_start, k_last;
  auto set_item = [&](int place) {
    int tiles = num_k_tiles;
    int pairs = kv_heads * batch_size;
    int groups = cta_groups;
    if constexpr (PERSISTENT) {
      opaque_to_compiler(tiles);
      opaque_to_compiler(pairs);
      opaque_to_compiler(groups);
    }
    const GroupedItem item = grouped_item(unsigned(place), unsigned(tiles), unsigned(pairs),
                                          unsigned(groups));
    kv_head = item.pair % kv_heads;
    batch = item.pair / kv_heads;
    k_tile_index = tile_order[kv_head * tiles + item.position];
    k_block = k_tile_index * KEY_BLOCKS;  // the item's (first) key block
    k_start = k_tile_index * TILE_K;
    k_last = k_start + TILE_K - 1;
  };
  if constexpr (!PERSISTENT) set_item(claimed);
  const int heads = kv_heads * kv_group;
  const int q_padded = (n_q + TILE_Q - 1) / TILE_Q * TILE_Q;  // rows of stats and dq_accum
  // Shuffled from lane 0 so that ptxas knows it is warp-uniform: what derives from it (the
  // consumer's descriptors) can then live in uniform registers.
  const int warpgroup = __shfl_sync(FULL_WARP, int(threadIdx.x) / Traits::WARPGROUP_SIZE, 0);
  const RuleParams rule{n_q, n_k, q_offset, window_left, window_right, mask_table};
  // The CTA's steps for one query head: every query step of the union of its key blocks' CSC
  // columns (one column with 128-blocks), each with the caller's block's entry mask and the
  // coverage of the rows it passes to next() (row_block: the caller's block, 0 or 1). `column`
  // indexes the first block's col_ptr entry, head * (num_k_blocks + 1) + first block: the walk
  // of the next query head is num_k_blocks + 1 on. Unsigned: no sign extension held in a
  // register by the producer, which runs on 24 of them at d = 128.
  const unsigned head_columns = unsigned(num_k_blocks + 1);
  // whether the second block exists
  auto is_paired = [&] { return KEY_BLOCKS == 2 && k_block + 1 < num_k_blocks; };
  auto column_walk = [&](unsigned column, bool paired, int row_block) {
    return PairedRowTiles<RULE, BLOCK, TILE_Q, false>(col_ptr + column, paired, row_idx,
                                                      col_mask, row_block);
  };
  if (warpgroup == 0) {
    warpgroup_registers_decrease<Traits::PRODUCER_REGISTERS>();
    if (threadIdx.x == 0) {
      // The copies of each item: K and V once, then every step of every query head of the kv
      // head. Persistent: claims until the counter passes the last item, each place handed to
      // the other roles before its copies; the next item's K and V once the consumers are done
      // with the current one's (its Q and dO steps land in the ring meanwhile, as it frees).
      int col_q = q_col, col_k = k_col, col_v = v_col, col_dout = dout_col;
      auto load_panels = [&](unsigned char* tile_smem, int panel_bytes, const TensorMap& map,
                             int col, int row, int map_head, u64* full) {
#pragma unroll
        for (int panel = 0; panel < Traits::PANELS; ++panel) {
          tma_load_4d(tile_smem + panel * panel_bytes, map, col + panel * Traits::PANEL_COLUMNS,
                      row, map_head, batch, full);
        }
      };
      int t = 0;
      for (;;) {
        if constexpr (PERSISTENT) {
          int pairs = kv_heads * batch_size;
          opaque_to_compiler(pairs);  // recomputed here, not held across the item
          const int place = claim_work(work_counter);
          const bool past = place >= num_k_tiles * pairs;
          const int n = item_slots.publish(past ? BWD_NO_ITEM : place);
          if (past) break;
          if (n > 0) mbarrier_wait_parity(&kv_empty, unsigned(n - 1) & 1u);
          set_item(place);
          t = item_slots.copied_steps;
          // the second panels' coordinates computed here, not held across the items
          opaque_to_compiler(col_q);
          opaque_to_compiler(col_k);
          opaque_to_compiler(col_v);
          opaque_to_compiler(col_dout);
        }
        const bool paired = is_paired();
        mbarrier_arrive_expect_tx(kv_full, unsigned(2 * Traits::KV_BYTES));
        load_panels(k_tile, Traits::KV_PANEL_BYTES, k_map, col_k, k_start, kv_head, kv_full);
        load_panels(v_tile, Traits::KV_PANEL_BYTES, v_map, col_v, k_start, kv_head, kv_full);
        for (int group_head = 0; group_head < kv_group; ++group_head) {
          const int head = kv_head * kv_group + group_head;
          auto walk = column_walk(unsigned(head) * head_columns + unsigned(k_block), paired, 0);
          PairedTile tile;
          for (; walk.next(tile, rule, k_start, k_last); ++t) {
            const int stage = Ring::stage(t);
            u64* full = ring->acquire(t, unsigned(Traits::STEP_BYTES));
            load_panels(q_stages + stage * Traits::Q_BYTES, Traits::Q_PANEL_BYTES, q_map, col_q,
                        tile.start, head, full);
            load_panels(do_stages + stage * Traits::Q_BYTES, Traits::Q_PANEL_BYTES, dout_map,
                        col_dout, tile.start, head, full);
            tma_load_4d(stats + stage * 2 * TILE_Q, stats_map, tile.start, 0, head, batch, full);
          }
        }
        if constexpr (PERSISTENT) {
          item_slots.copied_steps = t;
        } else {
          break;
        }
      }
    } else if (threadIdx.x == 32) {
      // The dQ reduces, a step at a time in the walk's order, each at its entry's rank.
      int reduced = 0;
      for (int n = 0;;) {
        if constexpr (PERSISTENT) {
          const int place = item_slots.wait(n);
          if (place == BWD_NO_ITEM) break;
          set_item(place);
        }
        const bool paired = is_paired();
        for (int group_head = 0; group_head < kv_group; ++group_head) {
          const int head = kv_head * kv_group + group_head;
          // the head's first dQ tile (their count fits an int: one per TILE_Q query rows)
          const int head_tile = (batch * heads + head) * (q_padded / TILE_Q);
          auto walk = column_walk(unsigned(head) * head_columns + unsigned(k_block), paired, 0);
          PairedTile tile;
          for (; walk.next(tile, rule, k_start, k_last); ++reduced) {
            const int dq_tile_index = head_tile + tile.start / TILE_Q;
            int* semaphore = semaphores + dq_tile_index;
            mbarrier_wait_parity(dq_full, unsigned(reduced & 1));
            if constexpr (DQ_ORDER == DQ_ORDERED) semaphore_wait(semaphore, dq_ranks[tile.entry]);
            bulk_reduce_add_f32(dq_accum + size_t(dq_tile_index) * TILE_Q * HEAD_DIM, dq_tile,
                                unsigned(Traits::DQ_BYTES));
            tma_store_commit();
            tma_store_wait_read<0>();
            mbarrier_arrive(dq_empty);
            if constexpr (DQ_ORDER == DQ_ORDERED) {
              bulk_wait_group_complete<0>();
              semaphore_release(semaphore);
            }
          }
        }
        if constexpr (PERSISTENT) {
          item_slots.release(n++);
        } else {
          break;
        }
      }
      // Unordered, the reduces' writes to dq_accum are retired once, before the CTA ends.
      if constexpr (DQ_ORDER == DQ_UNORDERED) bulk_wait_group_complete<0>();
    }
    return;
  }

  // A consumer: keys 64 (warpgroup - 1) on of the item's tile, in key block key_first / BLOCK.
  // What derives from the item's tile derives from key_first: one register, where the
  // consumers use all setmaxnreg gives them at d = 128.
  warpgroup_registers_increase<Traits::CONSUMER_REGISTERS>();
  const int consumer = warpgroup - 1;
  const int row_block = KEY_BLOCKS == 2 ? consumer : 0;
  const int warp_in_group = int(threadIdx.x) / 32 % WARPGROUP_WARPS;
  int key_first = k_start + consumer * WGMMA_M;  // the consumer's first key
  int warp_key = key_first + warp_in_group * 16;
  const AccLayout frag;
  const float score_log2 = scale * LOG2E;

  float dk_frags[HEAD_DIM / 8][4] = {};
  float(&dk_acc)[HEAD_DIM / 2] = reinterpret_cast<float(&)[HEAD_DIM / 2]>(dk_frags);
  float dv_frags[HEAD_DIM / 8][4] = {};
  float(&dv_acc)[HEAD_DIM / 2] = reinterpret_cast<float(&)[HEAD_DIM / 2]>(dv_frags);
  float s[TILE_Q / 8][4];
  float(&s_acc)[TILE_Q / 2] = reinterpret_cast<float(&)[TILE_Q / 2]>(s);
  float dp[TILE_Q / 8][4];
  float(&dp_acc)[TILE_Q / 2] = reinterpret_cast<float(&)[TILE_Q / 2]>(dp);
  float dq[Traits::DQ_COLUMNS / 8][4];
  float(&dq_acc)[Traits::DQ_COLUMNS / 2] = reinterpret_cast<float(&)[Traits::DQ_COLUMNS / 2]>(dq);
  // P^T and dS^T as T: A fragments of the dV and dK GEMMs, one per 16 queries.
  u32 p[Traits::DKV_STEPS][WGMMA_A_REGISTERS];
  u32(&p_regs)[Traits::DKV_STEPS * WGMMA_A_REGISTERS] =
      reinterpret_cast<u32(&)[Traits::DKV_STEPS * WGMMA_A_REGISTERS]>(p);
  u32 ds[Traits::DKV_STEPS][WGMMA_A_REGISTERS];
  u32(&ds_regs)[Traits::DKV_STEPS * WGMMA_A_REGISTERS] =
      reinterpret_cast<u32(&)[Traits::DKV_STEPS * WGMMA_A_REGISTERS]>(ds);

  const u64 k_desc = bwd_swizzled_descriptor(k_tile + consumer * WGMMA_M * SWIZZLE_ROW_BYTES,
                                             SWIZZLED_K_MAJOR_LEADING);
  const u64 v_desc = bwd_swizzled_descriptor(v_tile + consumer * WGMMA_M * SWIZZLE_ROW_BYTES,
                                             SWIZZLED_K_MAJOR_LEADING);
  const u64 q_desc = bwd_swizzled_descriptor(q_stages, SWIZZLED_K_MAJOR_LEADING);
  const u64 do_desc = bwd_swizzled_descriptor(do_stages, SWIZZLED_K_MAJOR_LEADING);
  const u64 q_mn_desc = bwd_swizzled_descriptor(q_stages, unsigned(Traits::Q_PANEL_BYTES));
  const u64 do_mn_desc = bwd_swizzled_descriptor(do_stages, unsigned(Traits::Q_PANEL_BYTES));
  const u64 ds_desc = bwd_swizzled_descriptor(ds_stages, unsigned(Traits::DS_BYTES));
  // B of dQ_part: K MN-major, the consumer's DQ_COLUMNS columns (inside one panel).
  constexpr int DQ_B_BYTES_PER_CONSUMER = Traits::DQ_COLUMNS * int(sizeof(T));
  const int dq_b_offset = consumer * DQ_B_BYTES_PER_CONSUMER / SWIZZLE_ROW_BYTES *
                              Traits::KV_PANEL_BYTES +
                          consumer * DQ_B_BYTES_PER_CONSUMER % SWIZZLE_ROW_BYTES;
  const u64 k_mn_desc =
      bwd_swizzled_descriptor(k_tile + dq_b_offset, unsigned(Traits::KV_PANEL_BYTES));

  // S^T = K Q^T and dP^T = V dO^T of stage `stage`, one commit group each.
  auto issue_scores = [&](int stage) {
    const unsigned stage_bytes = unsigned(stage * Traits::Q_BYTES);
    // acc = A B^T over the head dim: A (K or V) from its panels, B (Q or dO) from the stage's.
    auto panels_gemm = [&](float(&acc)[TILE_Q / 2], u64 a_desc, u64 b_desc) {
#pragma unroll
      for (int step = 0; step < Traits::S_STEPS; ++step) {
        const int panel = step / Traits::STEPS_PER_PANEL;
        const int within = (step % Traits::STEPS_PER_PANEL) * Traits::S_STEP_BYTES;
        const unsigned kv_offset = unsigned(panel * Traits::KV_PANEL_BYTES + within);
        const unsigned stage_offset = stage_bytes + unsigned(panel * Traits::Q_PANEL_BYTES + within);
        wgmma_m64k16<T, TILE_Q>(acc, descriptor_advance(a_desc, kv_offset),
                                descriptor_advance(b_desc, stage_offset), step > 0);
      }
      wgmma_commit_group();
    };
    panels_gemm(s_acc, k_desc, q_desc);
    panels_gemm(dp_acc, v_desc, do_desc);
  };
  // dV += P^T dO and dK += dS^T Q of stage `stage`, one commit group.
  auto issue_dkdv = [&](int stage) {
    const unsigned stage_bytes = unsigned(stage * Traits::Q_BYTES);
#pragma unroll
    for (int step = 0; step < Traits::DKV_STEPS; ++step) {
      const unsigned rows = stage_bytes + unsigned(step * Traits::ROWS_STEP_BYTES);
      wgmma_m64k16_rs<T, HEAD_DIM, WGMMA_MN_MAJOR>(dv_acc, p[step],
                                                   descriptor_advance(do_mn_desc, rows), true);
    }
#pragma unroll
    for (int step = 0; step < Traits::DKV_STEPS; ++step) {
      const unsigned rows = stage_bytes + unsigned(step * Traits::ROWS_STEP_BYTES);
      wgmma_m64k16_rs<T, HEAD_DIM, WGMMA_MN_MAJOR>(dk_acc, ds[step],
                                                   descriptor_advance(q_mn_desc, rows), true);
    }
    wgmma_commit_group();
  };
  // dQ_part = dS K over `steps` wgmma from K-step `first` (16 keys each) of dS stage
  // `ds_stage`, retired with whatever else is in flight (no wgmma is left in flight where the
  // paths meet: ptxas would serialise every wgmma, C7520).
  auto dq_gemm = [&](int ds_stage, int first, int steps) {
    const unsigned rows = unsigned(ds_stage * Traits::DS_BYTES + first * Traits::ROWS_STEP_BYTES);
    const unsigned k_rows = unsigned(first * Traits::ROWS_STEP_BYTES);
    wgmma_fence();
#pragma unroll
    for (int step = 0; step < steps; ++step) {
      const unsigned step_rows = unsigned(step * Traits::ROWS_STEP_BYTES);
      wgmma_m64k16<T, Traits::DQ_COLUMNS, WGMMA_MN_MAJOR, WGMMA_MN_MAJOR>(
          dq_acc, descriptor_advance(ds_desc, rows + step_rows),
          descriptor_advance(k_mn_desc, k_rows + step_rows), step > 0);
    }
    wgmma_commit_group();
    wgmma_wait_group<0>();
    wgmma_fence_operands(dk_acc);
    wgmma_fence_operands(dv_acc);
    wgmma_fence_operands(dq_acc);
    wgmma_fence_operands(p_regs);
    wgmma_fence_operands(ds_regs);
  };
  auto fence = [&] {
    wgmma_fence_operands(s_acc);
    wgmma_fence_operands(dp_acc);
    wgmma_fence_operands(dk_acc);
    wgmma_fence_operands(dv_acc);
    wgmma_fence_operands(dq_acc);
    wgmma_fence_operands(p_regs);
    wgmma_fence_operands(ds_regs);
    wgmma_fence();
  };
  // This consumer's rows of dS^T stage `ds_stage`: register `reg` of K-step `step` holds row
  // g + 8 (reg % 2), queries 16 step + 8 (reg / 2) + 2t and the next. Rows g and g + 8 share
  // their swizzle (row % 8), so the pair's stores are one offset apart by a constant: 8 swizzled
  // offsets held across the step loop, not 16.
  auto store_ds = [&](int ds_stage) {
    unsigned char* ds_rows = ds_stages + ds_stage * Traits::DS_BYTES +
                             (consumer * WGMMA_M + warp_in_group * 16) * SWIZZLE_ROW_BYTES;
#pragma unroll
    for (int step = 0; step < Traits::DKV_STEPS; ++step) {
#pragma unroll
      for (int reg = 0; reg < WGMMA_A_REGISTERS; reg += 2) {
        unsigned char* at = ds_rows + swizzled_byte<T>(frag.g, frag.pair_col(2 * step + reg / 2));
        *reinterpret_cast<u32*>(at) = ds[step][reg];
        *reinterpret_cast<u32*>(at + SWIZZLE_REPEAT_BYTES) = ds[step][reg + 1];
      }
    }
    fence_proxy_async();  // the dS^T stores, before wgmma reads them
  };
  // Says whether this consumer computed dS stage `ds_stage` and, once both have said so (and
  // stored their dS^T), whether the other did. The flags alternate with the dS stages, so the
  // next step's cannot overwrite one the other consumer has yet to read.
  auto other_computed = [&](int ds_stage, bool mine) {
    computed[ds_stage][consumer] = mine;
    named_barrier_sync(Traits::DS_READY_BARRIER, Traits::CONSUMER_THREADS);
    return computed[ds_stage][1 - consumer] != 0;
  };

  // The consumer's items: persistent, the count it has taken lives in shared memory (its
  // threads read it at an item's start and end; its first thread advances it between two
  // barriers), so no register holds it across the steps.
  volatile int* items_taken = &item_slots.taken[consumer];
  int t = 0;  // steps walked (the ring's items, and the dQ tiles handed to the reduce)
  for (;;) {
    unsigned kv_phase = 0;
    if constexpr (PERSISTENT) {
      const int n = *items_taken;
      const int place = item_slots.wait(n);
      if (place == BWD_NO_ITEM) return;
      set_item(place);
      key_first = k_start + consumer * WGMMA_M;
      warp_key = key_first + warp_in_group * 16;
      kv_phase = unsigned(n) & 1u;
      // where the item's dK and dV rows start, for the epilogue: kept in shared memory across
      // the steps (the consumer's first thread writes it, the barrier publishes it)
      if (threadIdx.x % Traits::WARPGROUP_SIZE == 0) {
        item_slots.kv_rows[consumer] =
            (long long)((size_t(batch) * kv_heads + kv_head) * size_t(n_k));
      }
      named_barrier_sync(Traits::ITEMS_READ_BARRIER + consumer, Traits::WARPGROUP_SIZE);
    }
    mbarrier_wait_parity(kv_full, kv_phase);  // always: no copy may be in flight when the CTA ends
    unsigned column = unsigned(kv_head * kv_group) * head_columns +
                      unsigned(key_first / TILE_K * KEY_BLOCKS);
    for (int group_head = 0; group_head < kv_group; ++group_head, column += head_columns) {
      // Whether the second block exists, from the column (column % head_columns is the first
      // block) rather than held across the heads: the consumers have no register to spare at d128.
      const bool has_second = KEY_BLOCKS == 2 && column % head_columns + 1 < head_columns - 1;
      auto walk = column_walk(column, has_second, row_block);
      PairedTile tile;
      for (; walk.next(tile, rule, key_first, key_first + WGMMA_M - 1); ++t) {
        const int stage = Ring::stage(t);
        const int ds_stage = t % Traits::DS_STAGES;
        const int q_start = tile.start;
        ring->wait(t);  // also when skipped: see StageRing
        // A consumer whose keys the step does not reach (its block's column lacks the query
        // block, or the rule empties it) skips its GEMMs; the coverage is the warpgroup's,
        // uniform across it. dQ_part = dS K runs over the halves of dS^T that were computed: both
        // (every key), one (its 64 keys), or none (dQ_part = 0, still reduced in its turn).
        bool dq_zero = false;
        if (tile.coverage != TILE_EMPTY) {
          const float* lse_smem = stats + stage * 2 * TILE_Q;
          const float* delta_smem = lse_smem + TILE_Q;
          fence();
          issue_scores(stage);
          wgmma_wait_group<1>();  // S^T; dP^T runs on
          wgmma_fence_operands(s_acc);
          if (tile.coverage != TILE_FULL) {
            mask_score_tile<RULE, BLOCK, TILE_Q, false>(s, rule, warp_key, q_start, tile.block,
                                                        key_first / BLOCK, tile.mask_id);
          }
          const bool ragged = q_start + TILE_Q > n_q;
#pragma unroll
          for (int j = 0; j < TILE_Q / 8; ++j) {
            const float2 lse = *reinterpret_cast<const float2*>(lse_smem + frag.pair_col(j));
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              s[j][e] = exp2f(s[j][e] * score_log2 - (e % 2 ? lse.y : lse.x));
            }
          }
          // Rows past n_q (zero-filled Q and dO, lse +inf) are no rows of the problem: their P
          // is 0 unless an infinite key makes it NaN, so they are zeroed (a uniform branch).
          if (ragged) zero_columns_past<TILE_Q>(s, frag, n_q - q_start);
          wgmma_wait_group<0>();
          wgmma_fence_operands(dp_acc);
#pragma unroll
          for (int j = 0; j < TILE_Q / 8; ++j) {
            const float2 delta = *reinterpret_cast<const float2*>(delta_smem + frag.pair_col(j));
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              dp[j][e] = s[j][e] * (dp[j][e] - (e % 2 ? delta.y : delta.x));
            }
          }
          if (ragged) zero_columns_past<TILE_Q>(dp, frag, n_q - q_start);
          // P^T and dS^T packed as A fragments; dS^T also to shared memory for dQ.
#pragma unroll
          for (int step = 0; step < Traits::DKV_STEPS; ++step) {
#pragma unroll
            for (int reg = 0; reg < WGMMA_A_REGISTERS; ++reg) {
              const int element = step * 2 * WGMMA_A_REGISTERS + 2 * reg;
              p[step][reg] = pack_pair<T>(s_acc[element], s_acc[element + 1]);
              ds[step][reg] = pack_pair<T>(dp_acc[element], dp_acc[element + 1]);
            }
          }
          store_ds(ds_stage);
          fence();
          issue_dkdv(stage);
          const bool both_computed = other_computed(ds_stage, true);
          if (both_computed) {
            dq_gemm(ds_stage, 0, Traits::DQ_STEPS);
          } else {
            dq_gemm(ds_stage, consumer * Traits::HALF_DQ_STEPS, Traits::HALF_DQ_STEPS);
          }
        } else {
          dq_zero = !other_computed(ds_stage, false);
          if (!dq_zero) {
            fence();
            dq_gemm(ds_stage, (1 - consumer) * Traits::HALF_DQ_STEPS, Traits::HALF_DQ_STEPS);
          }
        }
        ring->release(t);
        // dQ_part to the fp32 tile once the reduce has read the previous one.
        mbarrier_wait_parity(dq_empty, unsigned(t & 1) ^ 1u);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = warp_in_group * 16 + frag.row(2 * r);
#pragma unroll
          for (int j = 0; j < Traits::DQ_COLUMNS / 8; ++j) {
            const int col = consumer * Traits::DQ_COLUMNS + frag.pair_col(j);
            *reinterpret_cast<float2*>(dq_tile + row * HEAD_DIM + col) =
                dq_zero ? make_float2(0.0f, 0.0f) : make_float2(dq[j][2 * r], dq[j][2 * r + 1]);
          }
        }
        fence_proxy_async();  // the dQ stores, before the bulk reduce reads them
        mbarrier_arrive(dq_full);
      }
    }

    // Persistent: the last GEMM that reads K or V has retired (dq_gemm waits for it), so the
    // producer may copy the next item's over them while the epilogue runs.
    if constexpr (PERSISTENT) mbarrier_arrive(&kv_empty);
    // dK (times the scale) and dV of the consumer's keys; 0 for keys no query saw.
    size_t kv_rows = (size_t(batch) * kv_heads + kv_head) * size_t(n_k);
    if constexpr (PERSISTENT) {
      kv_rows = size_t(*reinterpret_cast<volatile long long*>(&item_slots.kv_rows[consumer]));
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = warp_key + frag.row(2 * r);
      if (key >= n_k) continue;
      T* dk_row = dk + (kv_rows + key) * HEAD_DIM;
      T* dv_row = dv + (kv_rows + key) * HEAD_DIM;
#pragma unroll
      for (int j = 0; j < HEAD_DIM / 8; ++j) {
        const int col = frag.pair_col(j);
        *reinterpret_cast<u32*>(dk_row + col) =
            pack_pair<T>(dk_frags[j][2 * r] * scale, dk_frags[j][2 * r + 1] * scale);
        *reinterpret_cast<u32*>(dv_row + col) =
            pack_pair<T>(dv_frags[j][2 * r], dv_frags[j][2 * r + 1]);
      }
    }
    if constexpr (PERSISTENT) {
#pragma unroll
      for (int j = 0; j < HEAD_DIM / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_frags[j][e] = dv_frags[j][e] = 0.0f;
      }
      const int n = *items_taken;
      item_slots.release(n);
      named_barrier_sync(Traits::ITEMS_READ_BARRIER + consumer, Traits::WARPGROUP_SIZE);
      if (threadIdx.x % Traits::WARPGROUP_SIZE == 0) *items_taken = n + 1;
      named_barrier_sync(Traits::ITEMS_READ_BARRIER + consumer, Traits::WARPGROUP_SIZE);
    } else {
      break;
    }
  }
}


template <int BLOCK, int TILE_Q, int HEAD_DIM, typename T, int RULE, int DQ_ORDER = DQ_ORDERED>
__global__ void __launch_bounds__(attn_bwd_sm90_traits<BLOCK, TILE_Q, HEAD_DIM, T>::NUM_THREADS, 1)
    attn_bwd_sm90(const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
                  const __grid_constant__ TensorMap v_map,
                  const __grid_constant__ TensorMap dout_map,
                  const __grid_constant__ TensorMap stats_map, int q_col, int k_col, int v_col,
                  int dout_col, T* __restrict__ dk, T* __restrict__ dv,
                  float* __restrict__ dq_accum, int* __restrict__ semaphores,
                  int* __restrict__ work_counter, const int* __restrict__ col_ptr,
                  const int* __restrict__ row_idx, const int* __restrict__ col_mask,
                  const int* __restrict__ dq_ranks, const int* __restrict__ tile_order,
                  const u32* __restrict__ mask_table, int n_q, int n_k, int q_offset,
                  int kv_group, int num_k_blocks, float scale, int window_left,
                  int window_right, int cta_groups) {
  attn_bwd_sm90_cta<BLOCK, TILE_Q, HEAD_DIM, T, RULE, DQ_ORDER, false>(
      q_map, k_map, v_map, dout_map, stats_map, q_col, k_col, v_col, dout_col, dk, dv, dq_accum,
      semaphores, work_counter, col_ptr, row_idx, col_mask, dq_ranks, tile_order, mask_table, n_q,
      n_k, q_offset, kv_group, num_k_blocks, scale, window_left, window_right, cta_groups,
      int(gridDim.y), int(gridDim.z));
}

// The persistent backward's launch: attn_bwd_sm90's threads and dynamic shared memory (what it
// adds, the place hand-over and kv_empty, is static).
template <int BLOCK, int TILE_Q, int HEAD_DIM, typename T>
using attn_bwd_sm90_persistent_traits = attn_bwd_sm90_traits<BLOCK, TILE_Q, HEAD_DIM, T>;

// The persistent backward (CUATTN_BWD_SM90=persistent): a grid of one CTA an SM (any count),
// each claiming attn_bwd_sm90's items (key tile, kv head, batch) from the same counter in the
// same order until it passes the last of num_k_tiles x kv_heads x batch_size: the same dQ ranks,
// and a CTA still waits only on items claimed before its own, all held by running CTAs. An
// item's K and V are copied once the consumers are done with the previous item's (its Q and dO
// steps land in the ring as it frees), under the previous item's dK/dV epilogue and last dQ
// reduces. Every gradient is computed by the same code in the same order: bit-equal to
// attn_bwd_sm90's.
template <int BLOCK, int TILE_Q, int HEAD_DIM, typename T, int RULE, int DQ_ORDER = DQ_ORDERED>
__global__ void __launch_bounds__(attn_bwd_sm90_traits<BLOCK, TILE_Q, HEAD_DIM, T>::NUM_THREADS, 1)
    attn_bwd_sm90_persistent(
        const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
        const __grid_constant__ TensorMap v_map, const __grid_constant__ TensorMap dout_map,
        const __grid_constant__ TensorMap stats_map, int q_col, int k_col, int v_col,
        int dout_col, T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dq_accum,
        int* __restrict__ semaphores, int* __restrict__ work_counter,
        const int* __restrict__ col_ptr, const int* __restrict__ row_idx,
        const int* __restrict__ col_mask, const int* __restrict__ dq_ranks,
        const int* __restrict__ tile_order, const u32* __restrict__ mask_table, int n_q, int n_k,
        int q_offset, int kv_group, int num_k_blocks, float scale, int window_left,
        int window_right, int cta_groups, int kv_heads, int batch_size) {
  attn_bwd_sm90_cta<BLOCK, TILE_Q, HEAD_DIM, T, RULE, DQ_ORDER, true>(
      q_map, k_map, v_map, dout_map, stats_map, q_col, k_col, v_col, dout_col, dk, dv, dq_accum,
      semaphores, work_counter, col_ptr, row_idx, col_mask, dq_ranks, tile_order, mask_table, n_q,
      n_k, q_offset, kv_group, num_k_blocks, scale, window_left, window_right, cta_groups,
      kv_heads, batch_size);
}

// dq = dq_accum * scale as T: one warp per row (row_kernel.cuh), dq [batch, heads, n_q,
// HEAD_DIM] contiguous, dq_accum [batch, heads, n_q_padded, HEAD_DIM].
template <int HEAD_DIM, typename T>
__global__ void __launch_bounds__(row_kernel_traits<HEAD_DIM, T>::NUM_THREADS)
    attn_bwd_sm90_dq(const float* __restrict__ dq_accum, T* __restrict__ dq, int n_q,
                     int n_q_padded, float scale) {
  using Traits = row_kernel_traits<HEAD_DIM, T>;
  const size_t batch_head = size_t(blockIdx.z) * gridDim.y + blockIdx.y;
  const int warp = int(threadIdx.x) / 32;
  const int lane = int(threadIdx.x) % 32;
  for (int r = warp; r < Traits::ROWS_PER_CTA; r += Traits::NUM_WARPS) {
    const int row = int(blockIdx.x) * Traits::ROWS_PER_CTA + r;
    if (row >= n_q) break;
    const float* src = dq_accum + (batch_head * size_t(n_q_padded) + row) * HEAD_DIM;
    T* dst = dq + (batch_head * size_t(n_q) + row) * HEAD_DIM;
    for (int c = lane; c < HEAD_DIM; c += 32) dst[c] = from_float<T>(src[c] * scale);
  }
}
