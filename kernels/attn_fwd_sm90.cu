// Block-sparse attention forward for sm_90a (Hopper): warpgroup MMA (wgmma) fed by TMA from a
// producer warpgroup, issue 27 stage (b).
//
// Computes what kernels/attn_fwd.cu computes without score modifiers, for every (batch, head,
// query) row over the keys its layout allows:
//   S = Q K^T * scale,  P = softmax(S),  out = P V,  lse = log(sum(exp(S)))
// Shapes: q, out [batch, heads, n_q, HEAD_DIM] and k, v [batch, heads / kv_group, n_k, HEAD_DIM]
// of T (__half or __nv_bfloat16); q, k and v are read through rank-4 TMA tensor maps (innermost
// first: columns, rows, heads, batch; any strides the maps can describe), each map's columns
// starting at q_col / k_col / v_col (the host may move a map's base down to the 128 bytes a
// swizzled map needs and start the columns further in); out written through a fourth such map
// (out_col) by TMA stores; query head h reads kv head h / kv_group (GQA/MQA); lse float32
// [batch, heads, n_q]. The layout's CSR arrays (docs/design.md §2) name the active key blocks of
// each query block, and the element rule RULE (none, causal, window, bitmask) applies inside
// the blocks whose entry mask is >= 0, exactly as in attn_fwd (kernels/common/walk.cuh and
// mask_score_frags). Queries are the last n_q of n_k
// positions (q_offset = n_k - n_q). A row with no allowed key gets out = 0 and lse = -inf.
//
// Work decomposition: one CTA per (128 query rows, head, batch), started in cta_groups groups
// of (head, batch) pairs, and within a group the last rows' CTAs of every pair first
// (cta_tile_longest_first in common/types.cuh: the longest rows start first, and a group's K
// and V fit the L2 its resident CTAs share), in three warpgroups of 128 threads (warp
// specialisation, common/warpgroup.cuh):
//   warpgroup 0, the producer, gives its registers up (setmaxnreg.dec); one thread walks the
//     layout and issues every TMA copy: Q once, then K and V of each active key tile into
//     rings of KV_STAGES stages;
//   warpgroups 1 and 2, the consumers, take those registers (setmaxnreg.inc); consumer c owns
//     rows 64c .. 64c + 63 of the CTA, the M = 64 of one wgmma, and computes every tile, the
//     two taking turns at the tensor pipe.
// With CONSUMERS = 3 (d = 64, 64-blocks, 64-key tiles; opt-in, geometry.sm90_consumers) a CTA
// is 192 query rows, three adjacent layout blocks, one a consumer (warpgroups 1 to 3, 160
// registers each), walking the union of the three rows (RowUnionTiles), the consumers taking
// turns in a ring: at d = 64 a consumer's softmax is as long as at d = 128 over half the wgmma
// work, and a third warpgroup keeps more warps issuing beside the tensor pipe.
// attn_fwd_sm90_persistent (issue 53) computes the same items, each exactly as a CTA here does,
// on a grid of about one CTA per SM that claims them from a work list the host builds from the
// layout, longest rows first, rows far longer than the rest split into chunks that
// attn_fwd_sm90_merge merges after it (its own note, at the end of the file).
// With 128-blocks the CTA owns one layout block and walks its CSR row; with 64-blocks it owns
// two adjacent blocks, one per consumer, and walks the union of their rows (PairedRowTiles),
// each consumer skipping the key tiles its own block's row lacks (wgmma is issued by a whole
// warpgroup, so that is the grain of every skip). Every thread that walks walks the same tiles.
// With 64-blocks and TILE_N = 128 (key pairs, opt-in: geometry.sm90_key_pairs) a key tile is
// two adjacent key blocks 2j, 2j + 1 (KeyPairTiles): the producer copies each half a row of the
// CTA holds (a box of BLOCK rows into its half of the stage; a half no row holds is not read),
// each half is masked under its own block's entry mask, and a consumer whose row holds one half
// computes it alone, QK^T and PV as the N = BLOCK wgmma over that half's rows of the stages.
//
// Per active key tile of TILE_N keys, for each consumer:
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
// Shared memory: Q (128 rows; each consumer's O rows on the way out; attn_fwd_sm90_persistent
// has two such tiles at d <= 128, one item's Q landing while the other computes, and one at
// d = 256), KV_STAGES stages of K,
// then of V (TILE_N rows each), then the mbarriers. Every tile is in 64-column panels of
// 128-byte rows with the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)), each
// panel on a 1024-byte boundary: what a TMA box of 64 columns with the 128-byte swizzle writes,
// and the canonical layout wgmma's descriptors read, K-major for Q and K, MN-major for V (the
// same bytes; only the descriptor's strides differ).
//
// Pipeline (two mbarrier rings, StageRing in common/mbarrier.cuh): K of tile t goes to stage
// t % KV_STAGES of the K ring, V to the same stage of the V ring; the producer copies K(t), then
// V(t), each once its stage is free. A consumer's iteration t issues QK^T(t) and then PV of the
// previous tile it computed back to back, waits for QK^T(t) alone (wgmma.wait_group 1) and hands
// K(t)'s stage back, masks and exponentiates S(t) while that PV runs, waits for it and hands its
// V stage back, then rescales O to S(t)'s running max (with RESCALE_SKIP only where it moved
// past the bound) and packs P(t). The
// two consumers take turns to issue (two named barriers): one's softmax runs
// while the other's GEMMs do; a turn is taken every tile, issuing or not, and once more for the
// last PV, so the turns pair up. Holding K(t) and V(t - 1) at once is why K and V have rings of
// their own: one shared ring would keep both stages busy and leave the next copy no time to
// land. A consumer waits for every item of both rings, computed on or not, before it hands the
// item back (StageRing). Both TMA and wgmma are the asynchronous proxy: no proxy fence between
// them. q_full completes with Q's bytes; every copy issued is waited for by the consumers (they
// walk the same tiles and always wait for Q), so no copy is in flight when the CTA ends.
//
// Template parameters: BLOCK (layout block, 64 or 128), TILE_N (keys per tile: 64, or 128 with
// 128-blocks or key pairs, at d <= 128), HEAD_DIM (64, 128, 256), T, RULE (MaskRule), RESCALE
// (Sm90Rescale: RESCALE_ALWAYS unless named; RESCALE_SKIP leaves O and l_i unscaled on a tile
// whose max grows by at most 2^RESCALE_SKIP_LOG2 in every row of the warp), EXP2 (Sm90Exp2:
// EXP2_MUFU unless named; EXP2_POLY computes a quarter of the softmax's exp2 on the FMA pipe,
// common/exp2_poly.cuh), CONSUMERS (2, or 3: above). Run:
// compiled by NVRTC for sm_90a only (CuPy's RawModule compiles for the device's own arch, which
// rejects wgmma), or on the CPU interpreter (cuattn/backends/interp.py;
// tests/backends/test_attn_fwd_sm90.py), e.g.
// `attn_fwd_sm90<128, 128, 128, __nv_bfloat16, MASK_CAUSAL>` on grid (ceil(n_q / 128), heads,
// batch), 384 threads, attn_fwd_sm90_traits::SMEM_BYTES of dynamic shared memory, the tensor
// maps' boxes PANEL_COLUMNS x TILE_M (q), PANEL_COLUMNS x KV_BOX_ROWS (k, v: TILE_N, or BLOCK
// with key pairs) and PANEL_COLUMNS x 64 (out) x 1 x 1; attn_fwd_sm90_persistent the same way
// on (CTAs, 1, 1) with attn_fwd_sm90_persistent_traits::SMEM_BYTES
// (tests/backends/test_attn_fwd_sm90_persistent.py), then, where it split rows,
// `attn_fwd_sm90_merge<128, __nv_bfloat16>` on (ceil(split rows x 128 / 16), 1, 1),
// row_kernel_traits' 128 threads and no shared memory.
#include "common/exp2_poly.cuh"
#include "common/merge_row.cuh"
#include "common/row_kernel.cuh"
#include "common/score_tile.cuh"
#include "common/semaphore.cuh"
#include "common/smem.cuh"
#include "common/walk.cuh"
#include "common/warp_gemm.cuh"
#include "common/warpgroup.cuh"
#include "common/wgmma.cuh"

// The 128-byte swizzle of every tile: a shared-memory row is one 128-byte panel row, the
// pattern (and each panel) repeats every 8 rows.
constexpr int SWIZZLE_ROW_BYTES = 128;
constexpr int SWIZZLE_GROUP_ROWS = 8;
constexpr int SWIZZLE_REPEAT_BYTES = SWIZZLE_ROW_BYTES * SWIZZLE_GROUP_ROWS;
constexpr int SWIZZLE_CHUNK_BYTES = 16;  // the unit the pattern moves
// The leading byte offset of a swizzled K-major operand is unused (the PTX ISA: "assumed 1",
// one 16-byte unit).
constexpr unsigned SWIZZLED_K_MAJOR_LEADING = 16;
// Columns of a score tile one mask pass covers: a bitmask row is read 64 bits at a time.
constexpr int MASK_PASS_COLUMNS = 64;
// attn_fwd_sm90_persistent's work list: an entry a claim (geometry.Sm90WorkList.items, the
// fields in the order of geometry's SM90_WORK_FIELDS): the item, the key blocks [first, end) it
// walks (for the host), its slot (NO_SLOT: an unsplit row), and where those key blocks lie in
// its CSR rows, entries [first, end) of row a, then of row b (the second block of a paired
// item), counted from each row's first (the walk's restrict_to).
constexpr int ROW_ENTRY_INTS = 2 * 2;  // [first, end) of each of an item's (up to) two rows
enum WorkField {
  WORK_ITEM,
  WORK_FIRST_BLOCK,
  WORK_END_BLOCK,
  WORK_SLOT,
  WORK_ROW_ENTRIES,
  WORK_FIELDS = WORK_ROW_ENTRIES + ROW_ENTRY_INTS
};
constexpr int NO_SLOT = -1;
// attn_fwd_sm90_merge's list: an entry a split row (geometry.Sm90WorkList.merges).
enum MergeField { MERGE_ITEM, MERGE_FIRST_SLOT, MERGE_CHUNKS, MERGE_FIELDS };

// Every size of the kernel, chosen here and checked.
// CONSUMERS: consumer warpgroups (2; 3 at d = 64 on 64-blocks and 64-key tiles, opt-in:
// geometry.sm90_consumers).
template <int BLOCK, int TILE_N, int HEAD_DIM, typename T, int CONSUMERS_ = 2>
struct attn_fwd_sm90_traits {
  static constexpr int WARPGROUP_SIZE = WARPGROUP_WARPS * 32;
  static constexpr int CONSUMERS = CONSUMERS_;  // warpgroups computing, after the producer
  static constexpr int NUM_THREADS = (1 + CONSUMERS) * WARPGROUP_SIZE;
  static constexpr int CONSUMER_THREADS = CONSUMERS * WARPGROUP_SIZE;
  // Registers per thread after setmaxnreg: the producer keeps what issuing copies needs, the
  // consumers take the rest. With one CTA of 384 threads per SM the launch gives each thread
  // 168 (65536 / 384, in steps of 8); 128 x (24 + 2 x 240) = 64512 is what the launch holds.
  // With three consumers (512 threads, 128 each at launch) 128 x (24 + 3 x 160) = 64512.
  static constexpr int PRODUCER_REGISTERS = 24;
  static constexpr int CONSUMER_REGISTERS = CONSUMERS == 2 ? 240 : 160;
  static constexpr int TILE_M = CONSUMERS * WGMMA_M;  // query rows per CTA
  // Layout blocks per CTA: 1 (128-blocks: the consumers split it), or one a consumer (64-blocks).
  static constexpr int ROW_BLOCKS = TILE_M / BLOCK;
  static constexpr int PANEL_COLUMNS = SWIZZLE_ROW_BYTES / int(sizeof(T));
  static constexpr int PANELS = HEAD_DIM / PANEL_COLUMNS;
  static constexpr int Q_PANEL_BYTES = TILE_M * SWIZZLE_ROW_BYTES;
  static constexpr int KV_PANEL_BYTES = TILE_N * SWIZZLE_ROW_BYTES;
  static constexpr int Q_BYTES = PANELS * Q_PANEL_BYTES;
  static constexpr int KV_BYTES = PANELS * KV_PANEL_BYTES;
  // Key tiles of two adjacent key blocks (64-blocks, TILE_N = 128: KeyPairTiles): each half is
  // copied as a box of BLOCK rows where a row of the CTA holds it, and computed by a consumer
  // whose row holds it; a consumer with one half issues the N = BLOCK wgmma over that half alone.
  static constexpr bool PAIRED_KEYS = TILE_N > BLOCK;
  static constexpr int KV_BOX_ROWS = PAIRED_KEYS ? BLOCK : TILE_N;  // rows of a K/V copy
  static constexpr int KV_BOXES = TILE_N / KV_BOX_ROWS;             // copies a panel, at most
  static constexpr int KV_BOX_BYTES = PANELS * KV_BOX_ROWS * SWIZZLE_ROW_BYTES;  // all panels'
  static constexpr int KV_BOX_OFFSET = KV_BOX_ROWS * SWIZZLE_ROW_BYTES;  // of box h in a panel
  // Stages of each of the K and the V ring; tile t's K and V are in stage t % KV_STAGES of theirs.
  static constexpr int KV_STAGES = 2;
  // q_full, then the K and the V ring (a full and an empty barrier a stage): 8 bytes each.
  static constexpr int BARRIER_BYTES = int(sizeof(u64) + 2 * sizeof(StageRing<KV_STAGES>));
  // Q, the K and the V stages, the barriers, and room to start the tiles on the swizzle's
  // repeat wherever the block's dynamic shared memory begins.
  static constexpr int SMEM_BYTES =
      Q_BYTES + 2 * KV_STAGES * KV_BYTES + BARRIER_BYTES + SWIZZLE_REPEAT_BYTES;
  // Whether the softmax of S(t) runs while PV(t - 1) does: P(t - 1) then stays live
  // through it. At d = 256 O alone holds 128 of a consumer's 240 registers and that does not
  // fit (the paired bitmask instantiations spill), so PV(t - 1) is waited for first there; it
  // still follows QK^T(t) on the tensor pipe without a gap.
  static constexpr bool SOFTMAX_UNDER_PV = HEAD_DIM <= 128;
  // The consumers' turns at the tensor pipe, in a ring: consumer c waits on named barrier
  // TURN_BARRIER + c before it issues, and arrives on the next one's after (its 128 threads
  // and the previous consumer's 128 meet on each).
  static constexpr int TURN_BARRIER = 1;
  static constexpr int TURN_THREADS = 2 * WARPGROUP_SIZE;
  // Consumer c's own 128 threads meet on named barrier STORE_BARRIER + c before its TMA stores.
  static constexpr int STORE_BARRIER = TURN_BARRIER + CONSUMERS;
  static constexpr int QK_STEPS = HEAD_DIM / WGMMA_K;  // wgmma of S = Q K^T
  static constexpr int PV_STEPS = TILE_N / WGMMA_K;    // wgmma of O += P V
  static constexpr int STEPS_PER_PANEL = PANEL_COLUMNS / WGMMA_K;
  // Bytes from one K-step of QK^T to the next inside a panel row, and of PV (16 V rows).
  static constexpr int QK_STEP_BYTES = WGMMA_K * int(sizeof(T));
  static constexpr int PV_STEP_BYTES = WGMMA_K * SWIZZLE_ROW_BYTES;
  static constexpr int MASK_PASSES = TILE_N > MASK_PASS_COLUMNS ? TILE_N / MASK_PASS_COLUMNS : 1;
  static constexpr int MASK_COLUMNS = TILE_N / MASK_PASSES;
  static_assert(is_half_type<T>::value, "wgmma takes fp16 or bf16 (fp32 keeps attn_fwd)");
  static_assert(KV_STAGES >= 2, "a ring: the producer copies ahead while a stage computes");
  static_assert((PRODUCER_REGISTERS + CONSUMERS * CONSUMER_REGISTERS) * WARPGROUP_SIZE <=
                    65536 / NUM_THREADS / 8 * 8 * NUM_THREADS,
                "setmaxnreg requests the launch's registers cannot cover hang the GPU");
  static_assert(BLOCK == 64 || BLOCK == 128, "a warpgroup's 64 rows lie in one layout block");
  static_assert(CONSUMERS == 2 || (CONSUMERS == 3 && BLOCK == 64 && TILE_N == 64 &&
                                   HEAD_DIM == 64),
                "three consumers: 192 rows are three 64-blocks, and d = 64 fits 160 registers");
  static_assert((BLOCK % TILE_N == 0 || (TILE_N == 2 * BLOCK && ROW_BLOCKS == 2)) &&
                    (TILE_N == 64 || TILE_N == 128),
                "key tiles of 64 or 128 inside one block, or of two 64-blocks");
  static_assert(TILE_N <= 64 || HEAD_DIM <= 128, "S and O of 128 keys fit at d <= 128 alone");
  static_assert(HEAD_DIM % PANEL_COLUMNS == 0 && HEAD_DIM <= 256,
                "whole 128-byte panels, and N <= 256 for O += P V");
};

// The first byte at or after `p` on the swizzle's repeat in the shared-memory window (where
// the pattern anchors, so the descriptors' base offset is 0).
__device__ __forceinline__ unsigned char* align_to_swizzle_repeat(unsigned char* p) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(p));
  return p + (SWIZZLE_REPEAT_BYTES - address % SWIZZLE_REPEAT_BYTES) % SWIZZLE_REPEAT_BYTES;
}

// The consumer's width-dependent steps over KEYS keys of a TILE_N-key tile (all of them, or with
// key pairs one half's): templates here rather than generic lambdas in the kernel, which NVRTC
// compiles as host code. A half's S has accumulators of its own (s_half): where it shared S's,
// ptxas serialised every wgmma for want of registers (C7511).

// S of KEYS keys = Q K^T, K `stage_bytes` into the K stages: HEAD_DIM / 16 wgmma.
template <int KEYS, typename T, typename Traits>
__device__ __forceinline__ void issue_qk_steps(float (&s_keys)[KEYS / 2], u64 q_desc, u64 k_desc,
                                               unsigned stage_bytes) {
#pragma unroll
  for (int step = 0; step < Traits::QK_STEPS; ++step) {
    const int panel = step / Traits::STEPS_PER_PANEL;
    const int within = (step % Traits::STEPS_PER_PANEL) * Traits::QK_STEP_BYTES;
    const u64 desc_q = descriptor_advance(q_desc, panel * Traits::Q_PANEL_BYTES + within);
    const u64 desc_k =
        descriptor_advance(k_desc, stage_bytes + panel * Traits::KV_PANEL_BYTES + within);
    wgmma_m64k16<T, KEYS>(s_keys, desc_q, desc_k, step > 0);
  }
}
// O += P V over KEYS keys, V `stage_bytes` into the V stages: P's first KEYS / 16 K-steps.
template <int KEYS, int HEAD_DIM, typename T, int PV_STEPS, typename Traits>
__device__ __forceinline__ void issue_pv_steps(float (&o_acc)[HEAD_DIM / 2],
                                               const u32 (&p)[PV_STEPS][WGMMA_A_REGISTERS],
                                               u64 v_desc, unsigned stage_bytes) {
#pragma unroll
  for (int step = 0; step < KEYS / WGMMA_K; ++step) {
    const u64 desc_v = descriptor_advance(v_desc, stage_bytes + step * Traits::PV_STEP_BYTES);
    wgmma_m64k16_rs<T, HEAD_DIM, WGMMA_MN_MAJOR>(o_acc, p[step], desc_v, true);
  }
}
// How the consumers keep O and l_i on the running max (the kernels' RESCALE argument):
// RESCALE_ALWAYS rescales them every tile the max grows; RESCALE_SKIP (opt-in,
// CUATTN_SM90_RESCALE=skip) keeps the max the exponentials use while no row of the warp's 16
// has a tile max more than RESCALE_SKIP_LOG2 above it, so those tiles skip O's HEAD_DIM / 2
// multiplies and the two exp2 of the rescale. P is then at most 2^RESCALE_SKIP_LOG2 instead of
// 1, and the epilogue divides by l_i summed against the same max: exact in real arithmetic.
enum Sm90Rescale : int { RESCALE_ALWAYS = 0, RESCALE_SKIP = 1 };
// exp2 units: P <= 256. P is rounded to T for PV: fp16's largest finite value is 65504, just
// under 2^16, so any bound up to 2^15 keeps P finite there (bf16 has float's range); O and l_i
// are float, whose range the extra 2^8 cannot reach.
constexpr float RESCALE_SKIP_LOG2 = 8.f;
constexpr float FP16_P_MAX_LOG2 = 15.f;  // fp16 holds 2^15, not 2^16 (65504 is its largest)
static_assert(RESCALE_SKIP_LOG2 <= FP16_P_MAX_LOG2, "P rounded to fp16 must stay finite");

// How the consumers compute the softmax's exp2 (the kernels' EXP2 argument): EXP2_MUFU all on
// MUFU (exp2f); EXP2_POLY (opt-in, CUATTN_SM90_EXP2=poly) the two elements of every
// EXP2_POLY_EVERY-th n-tile of a row on the FMA pipe (exp2_poly of T's degree), the others on
// MUFU, so that the two pipes share them: at d = 64 MUFU's 16 an SM a cycle keep it as busy as
// the tensor pipe. The rescale's alphas and the unfolded exponent (huge_score_probs) stay on
// MUFU.
enum Sm90Exp2 : int { EXP2_MUFU = 0, EXP2_POLY = 1 };
constexpr int EXP2_POLY_EVERY = 4;  // a quarter: MUFU's time under the tensor pipe's at d = 64
constexpr int NO_POLY = 0;          // the polynomial degree that means every exp2 on MUFU

// Row r's probabilities exp2(score - base) of S of KEYS keys in place, as row_probs computes
// them, the columns of every EXP2_POLY_EVERY-th n-tile by exp2_poly<POLY_DEGREE>; their sum.
template <int KEYS, int POLY_DEGREE>
__device__ __forceinline__ float row_probs_poly(float (&s_keys)[KEYS / 8][4], int r,
                                                const ScoreScale& score_scale, float base) {
  const float factor = score_factor<MODS_NONE>(score_scale);
  if (!(fabsf(base) < SCALE_FOLD_MAX)) return huge_score_probs<KEYS>(s_keys, r, factor, base);
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < KEYS / 8; ++j) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const float x = fmaf(s_keys[j][2 * r + c], factor, -base);
      const bool on_fma = j % EXP2_POLY_EVERY == EXP2_POLY_EVERY - 1;
      s_keys[j][2 * r + c] = on_fma ? exp2_poly<POLY_DEGREE>(x) : exp2f(x);
      sum += s_keys[j][2 * r + c];
    }
  }
  return sum;
}

// Row r's new running max: the larger of m_i and the row's max over S of KEYS keys.
template <int KEYS>
__device__ __forceinline__ float running_max(const float (&s_keys)[KEYS / 8][4], int r,
                                             float m_i, const ScoreScale& score_scale) {
  float tile_max = -INFINITY;
#pragma unroll
  for (int j = 0; j < KEYS / 8; ++j) {
    tile_max = fmaxf(tile_max, fmaxf(s_keys[j][2 * r], s_keys[j][2 * r + 1]));
  }
  return fmaxf(m_i, scaled_max<MODS_NONE>(quad_max(tile_max), score_scale));
}
// Row r of S exponentiated in place against max `m_used` (m_i[r], or the new running max where
// `rescale`: then alpha[r] is the factor O and l_i[r] take to it), l_i[r] and m_i[r] updated;
// POLY_DEGREE (NO_POLY: every exp2 on MUFU) as in row_probs_poly.
template <int KEYS, int POLY_DEGREE>
__device__ __forceinline__ void exponentiate_row(float (&s_keys)[KEYS / 8][4], int r,
                                                 float m_used, bool rescale, float (&m_i)[2],
                                                 float (&l_i)[2], float (&alpha)[2],
                                                 const ScoreScale& score_scale) {
  // A row that has seen no allowed key yet keeps max -inf; subtracting 0 instead keeps
  // exp2 away from (-inf) - (-inf) = NaN and still yields p = 0.
  const float m_base = m_used == -INFINITY ? 0.f : m_used;
  if (rescale) alpha[r] = exp2f(m_i[r] - m_base);
  float row_sum;
  if constexpr (POLY_DEGREE == NO_POLY) {
    row_sum = row_probs<MODS_NONE, KEYS>(s_keys, r, score_scale, m_base);
  } else {
    row_sum = row_probs_poly<KEYS, POLY_DEGREE>(s_keys, r, score_scale, m_base);
  }
  l_i[r] = rescale ? l_i[r] * alpha[r] + row_sum : l_i[r] + row_sum;
  m_i[r] = m_used;
}
// The online softmax of S of KEYS keys (masked already), exponentiated in place; returns
// whether O must be rescaled by alpha[r]: always with RESCALE_ALWAYS; with RESCALE_SKIP only
// where some row of the warp's 16 grew past the bound (a vote: the branch on it is uniform
// across the warp), alpha unset otherwise. POLY_DEGREE as in exponentiate_row.
template <int KEYS, int RESCALE, int POLY_DEGREE>
__device__ __forceinline__ bool softmax_rows(float (&s_keys)[KEYS / 8][4], float (&m_i)[2],
                                             float (&l_i)[2], float (&alpha)[2],
                                             const ScoreScale& score_scale) {
  if constexpr (RESCALE == RESCALE_ALWAYS) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = running_max<KEYS>(s_keys, r, m_i[r], score_scale);
      exponentiate_row<KEYS, POLY_DEGREE>(s_keys, r, m_new, true, m_i, l_i, alpha, score_scale);
    }
    return true;
  } else {
    float m_new[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) m_new[r] = running_max<KEYS>(s_keys, r, m_i[r], score_scale);
    // A row's first allowed key grows its max from -inf by +inf: a rescale (alpha 0). A row
    // still at -inf gives NaN here, which grows nothing.
    const bool grows =
        m_new[0] - m_i[0] > RESCALE_SKIP_LOG2 || m_new[1] - m_i[1] > RESCALE_SKIP_LOG2;
    const bool rescale = __ballot_sync(FULL_WARP, grows) != 0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      exponentiate_row<KEYS, POLY_DEGREE>(s_keys, r, rescale ? m_new[r] : m_i[r], rescale, m_i,
                                          l_i, alpha, score_scale);
    }
    return rescale;
  }
}
// P of S of KEYS keys, as T, in P's first KEYS / 16 K-steps: the accumulators of keys 16 step ..
// 16 step + 15 are the A fragment of K-step `step` (kernels/common/wgmma.cuh).
template <int KEYS, typename T, int PV_STEPS>
__device__ __forceinline__ void pack_p(const float (&s_keys)[KEYS / 2],
                                       u32 (&p)[PV_STEPS][WGMMA_A_REGISTERS]) {
#pragma unroll
  for (int step = 0; step < KEYS / WGMMA_K; ++step) {
#pragma unroll
    for (int reg = 0; reg < WGMMA_A_REGISTERS; ++reg) {
      const int element = step * 2 * WGMMA_A_REGISTERS + 2 * reg;
      p[step][reg] = pack_pair<T>(s_keys[element], s_keys[element + 1]);
    }
  }
}

// The descriptor of a swizzled operand at `at` (K-major: 8-row groups one repeat apart; MN-major:
// the same, and the next 64 columns `panel_bytes` on).
__device__ __forceinline__ u64 swizzled_descriptor(const unsigned char* at, unsigned panel_bytes) {
  return wgmma_descriptor(at, panel_bytes, SWIZZLE_REPEAT_BYTES, WGMMA_SWIZZLE_128B);
}

// The shared memory every item of a CTA reuses: Q_BUFFERS Q tiles (each consumer's O rows on
// the way out), the K and the V stages, a q_full a Q tile, and the two rings.
template <int BLOCK, int TILE_N, int HEAD_DIM, typename T, int Q_BUFFERS, int CONSUMERS = 2>
struct Sm90FwdSmem {
  using Traits = attn_fwd_sm90_traits<BLOCK, TILE_N, HEAD_DIM, T, CONSUMERS>;
  using Ring = StageRing<Traits::KV_STAGES>;
  unsigned char* q_tiles;
  unsigned char* k_stages;
  unsigned char* v_stages;
  u64* q_full;  // one a Q tile
  Ring* k_ring;
  Ring* v_ring;

  // Carved from the dynamic shared memory; `extra` is what follows v_ring (the persistent
  // kernel's q_empty barriers, item slots and producer state).
  static __device__ __forceinline__ Sm90FwdSmem carve(unsigned char** extra) {
    Sm90FwdSmem smem;
    smem.q_tiles = align_to_swizzle_repeat(dynamic_smem<unsigned char>());
    smem.k_stages = smem.q_tiles + Q_BUFFERS * Traits::Q_BYTES;
    smem.v_stages = smem.k_stages + Traits::KV_STAGES * Traits::KV_BYTES;
    smem.q_full = reinterpret_cast<u64*>(smem.v_stages + Traits::KV_STAGES * Traits::KV_BYTES);
    smem.k_ring = reinterpret_cast<Ring*>(smem.q_full + Q_BUFFERS);
    smem.v_ring = smem.k_ring + 1;
    *extra = reinterpret_cast<unsigned char*>(smem.v_ring + 1);
    return smem;
  }
  // By thread 0, before a __syncthreads.
  __device__ __forceinline__ void init() const {
#pragma unroll
    for (int buffer = 0; buffer < Q_BUFFERS; ++buffer) mbarrier_init(q_full + buffer, 1);
    k_ring->init(Traits::CONSUMER_THREADS);
    v_ring->init(Traits::CONSUMER_THREADS);
  }
  __device__ __forceinline__ unsigned char* q_tile(int buffer) const {
    return q_tiles + buffer * Traits::Q_BYTES;
  }
};

// The consumers' turns at the tensor pipe (consume_item) run on across a CTA's items, and the
// first consumer issues first: the last opens with a pass to it, once a CTA.
template <typename Traits>
__device__ __forceinline__ void open_turns(int consumer) {
  if (consumer == Traits::CONSUMERS - 1) {
    named_barrier_arrive(Traits::TURN_BARRIER, Traits::TURN_THREADS);
  }
}
// The consumer after `consumer` in the ring of turns.
template <typename Traits>
__device__ __forceinline__ int next_consumer(int consumer) {
  if constexpr (Traits::CONSUMERS == 2) {
    return 1 - consumer;
  } else {
    return consumer + 1 == Traits::CONSUMERS ? 0 : consumer + 1;
  }
}
// Once a CTA, after its last item: the first consumer takes the turn the last passed last, so
// that no named barrier phase is left half-arrived when the CTA ends. Not once an item: a
// persistent CTA's second consumer may start the next item (its Q is in) while the first still
// finishes this one, and its opening pass would then be a second arrival on a phase the first
// has not yet taken.
template <typename Traits>
__device__ __forceinline__ void close_turns(int consumer) {
  if (consumer == 0) named_barrier_sync(Traits::TURN_BARRIER, Traits::TURN_THREADS);
}

// One tile's worth of copies: PANELS boxes of PANEL_COLUMNS columns side by side. Past two
// panels (d = 256) each panel's first column is computed where it is copied: hoisted out of
// the producer's tile loop, the K and V maps' six would not fit its 24 registers beside the
// walk (attn_fwd_sm90_persistent spilled).
template <int BLOCK, int TILE_N, int HEAD_DIM, typename T>
__device__ __forceinline__ void load_panels(unsigned char* tile_smem, int panel_bytes,
                                            const TensorMap& map, int col, int row, int map_head,
                                            int batch, u64* full) {
  using Traits = attn_fwd_sm90_traits<BLOCK, TILE_N, HEAD_DIM, T>;
#pragma unroll
  for (int panel = 0; panel < Traits::PANELS; ++panel) {
    int column = col;
    if constexpr (Traits::PANELS > 2) opaque_to_compiler(column);
    tma_load_4d(tile_smem + panel * panel_bytes, map, column + panel * Traits::PANEL_COLUMNS, row,
                map_head, batch, full);
  }
}

// One key tile's K or V copies into stage t of its ring (`stages`: that ring's buffers), once
// the stage is free: the whole tile, or with key pairs the halves a row of the CTA holds, each a
// box of BLOCK rows into its half of the stage (the 128-byte swizzle repeats every 8 rows, so a
// half lands as one 128-row box would write it); a half no row holds is not read (it may lie
// past the keys).
template <int BLOCK, int TILE_N, int HEAD_DIM, typename T, typename Ring, typename Tile>
__device__ __forceinline__ void load_kv_tile(Ring* ring, unsigned char* stages,
                                             const TensorMap& map, int col, const Tile& tile,
                                             int t, int kv_head, int batch) {
  using Traits = attn_fwd_sm90_traits<BLOCK, TILE_N, HEAD_DIM, T>;
  if constexpr (Traits::PAIRED_KEYS) {
    u64* full = ring->acquire(t, unsigned(__popc(tile.held) * Traits::KV_BOX_BYTES));
#pragma unroll
    for (int half = 0; half < Traits::KV_BOXES; ++half) {
      if (tile.held >> half & 1) {
        load_panels<BLOCK, TILE_N, HEAD_DIM, T>(
            stages + Ring::stage(t) * Traits::KV_BYTES + half * Traits::KV_BOX_OFFSET,
            Traits::KV_PANEL_BYTES, map, col, tile.start + half * BLOCK, kv_head, batch, full);
      }
    }
  } else {
    load_panels<BLOCK, TILE_N, HEAD_DIM, T>(stages + Ring::stage(t) * Traits::KV_BYTES,
                                            Traits::KV_PANEL_BYTES, map, col, tile.start,
                                            kv_head, batch,
                                            ring->acquire(t, unsigned(Traits::KV_BYTES)));
  }
}

// The producer's K and V copies of one item (128 query rows of one head and batch), after its
// Q's (the caller's): every active key tile's into the rings, the item's tiles numbered on from
// `t` (the CTA's running count: stage and phase continue across items). CHUNKED: the item is
// the part of its rows that `chunk()` names (its WORK_ROW_ENTRIES: a chunk of a split row).
template <int BLOCK, int TILE_N, int HEAD_DIM, typename T, int RULE, bool CHUNKED, typename Smem,
          typename Chunk>
__device__ __forceinline__ void produce_item(const Smem& smem, const TensorMap& k_map,
                                             const TensorMap& v_map, int k_col, int v_col,
                                             const int* row_ptr, const int* col_idx,
                                             const int* row_mask, const RuleParams& rule,
                                             int num_blocks, int head, int kv_head, int batch,
                                             int q_start, int& t, Chunk chunk) {
  using Traits = typename Smem::Traits;
  // The CTA's tiles (with 64-blocks every caller gets the same ones: the first block's view).
  auto walk = forward_walk<Traits::ROW_BLOCKS, RULE, BLOCK, TILE_N>(
      row_ptr, col_idx, row_mask, head, num_blocks, q_start / BLOCK, 0);
  if constexpr (CHUNKED) walk.restrict_to(chunk());
  const int walk_last = q_start + (Traits::ROW_BLOCKS > 1 ? WGMMA_M : Traits::TILE_M) - 1;
  typename decltype(walk)::Tile tile;
  while (walk.next(tile, rule, q_start, walk_last)) {
    // K first: the consumers read K(t) an iteration before V(t) (header)
    load_kv_tile<BLOCK, TILE_N, HEAD_DIM, T>(smem.k_ring, smem.k_stages, k_map, k_col, tile, t,
                                             kv_head, batch);
    load_kv_tile<BLOCK, TILE_N, HEAD_DIM, T>(smem.v_ring, smem.v_stages, v_map, v_col, tile, t,
                                             kv_head, batch);
    ++t;
  }
}

// A consumer's part of one item: rows 64 `consumer` on of the item's 128, over the tiles the
// producer numbered from `t` (advanced past them), once Q has landed in Q tile `q_buffer` (the
// caller waits for its q_full); ends once this consumer's O rows are stored and the TMA unit
// has read them out of that Q tile (only the thread that stored them knows when: a persistent
// CTA lets it hand the tile back). CHUNKED: the item is the part of its rows `row_entries`
// names (WORK_ROW_ENTRIES), and a chunk of a split row (slot != NO_SLOT) writes its partial out,
// normalised by its own sum, and lse as float32 to rows slot x TILE_M on of part_out and
// part_lse instead of out and lse.
template <int BLOCK, int TILE_N, int HEAD_DIM, typename T, int RULE, bool CHUNKED, int RESCALE,
          int EXP2, typename Smem>
__device__ __forceinline__ void consume_item(const Smem& smem, int q_buffer,
                                             const TensorMap& out_map, int out_col,
                                             float* __restrict__ lse, const int* row_ptr,
                                             const int* col_idx, const int* row_mask,
                                             const RuleParams& rule, int n_q, int num_blocks,
                                             float scale, int consumer, int head, int heads,
                                             int batch, int q_start, const int* row_entries,
                                             int slot, float* __restrict__ part_out,
                                             float* __restrict__ part_lse, int& t) {
  using Traits = typename Smem::Traits;
  using Ring = StageRing<Traits::KV_STAGES>;
  constexpr int POLY_DEGREE = EXP2 == EXP2_POLY ? exp2_poly_degree<T>::value : NO_POLY;
  Ring* k_ring = smem.k_ring;
  Ring* v_ring = smem.v_ring;
  const int q_block = q_start / BLOCK;
  const int warp_in_group = int(threadIdx.x) / 32 % WARPGROUP_WARPS;
  const int row_block = Traits::ROW_BLOCKS > 1 ? consumer : 0;  // the consumer's own block
  const int group_first = q_start + consumer * WGMMA_M;
  const int warp_first = group_first + warp_in_group * 16;
  auto walk = forward_walk<Traits::ROW_BLOCKS, RULE, BLOCK, TILE_N>(
      row_ptr, col_idx, row_mask, head, num_blocks, q_block, row_block);
  if constexpr (CHUNKED) walk.restrict_to(row_entries);
  // The rows the walk tests: the CTA's, or where each consumer owns a block its own.
  const int walk_first = Traits::ROW_BLOCKS > 1 ? group_first : q_start;
  const int walk_last = walk_first + (Traits::ROW_BLOCKS > 1 ? WGMMA_M : Traits::TILE_M) - 1;

  // The consumer's accumulators in the wgmma D layout, seen as mma.sync fragments (header).
  float o[HEAD_DIM / 8][4] = {};
  float(&o_acc)[HEAD_DIM / 2] = reinterpret_cast<float(&)[HEAD_DIM / 2]>(o);
  float s[TILE_N / 8][4];
  float(&s_acc)[TILE_N / 2] = reinterpret_cast<float(&)[TILE_N / 2]>(s);
  // With key pairs, S of a tile one half of which this consumer computes.
  constexpr int HALF_KEYS = Traits::KV_BOX_ROWS;
  float s_half[HALF_KEYS / 8][4];
  float(&s_half_acc)[HALF_KEYS / 2] = reinterpret_cast<float(&)[HALF_KEYS / 2]>(s_half);
  // P of the pending tile as T: the accumulators of keys 16 step .. 16 step + 15 are the A
  // fragment of K-step `step` (kernels/common/wgmma.cuh); PV's operand until its wait.
  u32 p[Traits::PV_STEPS][WGMMA_A_REGISTERS];
  u32(&p_regs)[Traits::PV_STEPS * WGMMA_A_REGISTERS] =
      reinterpret_cast<u32(&)[Traits::PV_STEPS * WGMMA_A_REGISTERS]>(p);
  float m_i[2] = {-INFINITY, -INFINITY};  // rows g and g + 8, log2 domain
  float l_i[2] = {};                      // this thread's columns only
  const ScoreScale score_scale = ScoreScale::make<MODS_NONE>(scale, 0.f, nullptr, 0, 0, 0);
  unsigned char* q_group = smem.q_tile(q_buffer) + consumer * WGMMA_M * SWIZZLE_ROW_BYTES;

  // The operands' descriptors, each advanced by offsets from these (descriptor_advance).
  const u64 q_desc = swizzled_descriptor(q_group, SWIZZLED_K_MAJOR_LEADING);
  const u64 k_desc = swizzled_descriptor(smem.k_stages, SWIZZLED_K_MAJOR_LEADING);
  const u64 v_desc = swizzled_descriptor(smem.v_stages, unsigned(Traits::KV_PANEL_BYTES));
  // Keys a wgmma of this consumer spans: the tile's, or (`half_keys`, with key pairs) one
  // half's, `offset` bytes into the stage. Every call passes a constant `half_keys`: the
  // branches on it fold away.
  // S = Q K^T of tile t, one commit group.
  auto issue_qk = [&](bool half_keys, int t, unsigned offset) {
    const unsigned stage_bytes = unsigned(Ring::stage(t) * Traits::KV_BYTES) + offset;
    if (Traits::PAIRED_KEYS && half_keys) {
      issue_qk_steps<HALF_KEYS, T, Traits>(s_half_acc, q_desc, k_desc, stage_bytes);
    } else {
      issue_qk_steps<TILE_N, T, Traits>(s_acc, q_desc, k_desc, stage_bytes);
    }
    wgmma_commit_group();
  };
  // O += P V with the V of tile t, one commit group.
  auto issue_pv = [&](bool half_keys, int t, unsigned offset) {
    const unsigned stage_bytes = unsigned(Ring::stage(t) * Traits::KV_BYTES) + offset;
    if (Traits::PAIRED_KEYS && half_keys) {
      issue_pv_steps<HALF_KEYS, HEAD_DIM, T, Traits::PV_STEPS, Traits>(o_acc, p, v_desc,
                                                                      stage_bytes);
    } else {
      issue_pv_steps<TILE_N, HEAD_DIM, T, Traits::PV_STEPS, Traits>(o_acc, p, v_desc,
                                                                   stage_bytes);
    }
    wgmma_commit_group();
  };
  // S's and P's registers a wgmma over `half_keys` keys writes or reads: a half's alone (what
  // else is fenced stays live across the wgmma).
  auto fence_s = [&](bool half_keys) {
    if (Traits::PAIRED_KEYS && half_keys) {
      wgmma_fence_operands(s_half_acc);
    } else {
      wgmma_fence_operands(s_acc);
    }
  };
  auto fence_p = [&](bool half_keys) {
    if (Traits::PAIRED_KEYS && half_keys) {
      constexpr int HALF_P = HALF_KEYS / WGMMA_K * WGMMA_A_REGISTERS;
      wgmma_fence_operands(reinterpret_cast<u32(&)[HALF_P]>(p_regs));
    } else {
      wgmma_fence_operands(p_regs);
    }
  };
  // The registers the next wgmmas read or write (QK^T's S over `half_s`, PV's P over
  // `half_p`), settled before their wgmma.fence.
  auto fence = [&](bool half_s, bool half_p) {
    fence_s(half_s);
    wgmma_fence_operands(o_acc);
    fence_p(half_p);
    wgmma_fence();
  };
  // After the last wait: O, and P's registers, which PV read until then (kept live to here so
  // that none is reused while it runs).
  auto settle_pv = [&](bool half_p) {
    wgmma_fence_operands(o_acc);
    fence_p(half_p);
  };
  // This consumer's turn to issue (named barriers: the consumers take turns in a ring,
  // open_turns), and the next one's after it. Taken every tile, issuing or not, so that the
  // turns pair up.
  const int my_turn = Traits::TURN_BARRIER + consumer;
  const int their_turn = Traits::TURN_BARRIER + next_consumer<Traits>(consumer);
  auto take_turn = [&] { named_barrier_sync(my_turn, Traits::TURN_THREADS); };
  auto pass_turn = [&] { named_barrier_arrive(their_turn, Traits::TURN_THREADS); };
  // What is pending of tile t - 1: the keys of its PV still to issue (0: none; HALF_KEYS: one
  // half of a key pair) and where they lie in its V stage.
  int pending = 0;
  unsigned pending_offset = 0;
  // A turn with no QK^T to issue: PV(previous) alone when it is pending, issued and retired in
  // its own branch (see the loop's note on C7520), else an empty turn.
  auto pv_alone = [&](bool half_keys, int previous) {
    v_ring->wait(previous);
    take_turn();
    fence(half_keys, half_keys);
    issue_pv(half_keys, previous, pending_offset);
    pass_turn();
    wgmma_wait_group<0>();
    settle_pv(half_keys);
    v_ring->release(previous);
  };
  auto pv_turn = [&](int previous) {
    if (pending == TILE_N) {
      pv_alone(false, previous);
    } else if (Traits::PAIRED_KEYS && pending == HALF_KEYS) {
      pv_alone(true, previous);
    } else {
      take_turn();
      pass_turn();
    }
  };
  // The element rule on S(t) (`half_keys`: on s_half, key block tile.block + `half`'s; with
  // key pairs otherwise each half of S under its own block), with the tile's view `mine`
  // (WarpTile; unused with key pairs, whose tile holds each half's mask and coverage).
  typename decltype(walk)::Tile tile{};
  WarpTile mine{};
  auto mask_scores = [&](bool half_keys, int half) {
    if constexpr (Traits::PAIRED_KEYS) {
      auto mask_half = [&](float(&columns)[HALF_KEYS / 8][4], int half) {
        const int coverage = half ? tile.coverage[1] : tile.coverage[0];
        if (coverage != TILE_FULL) {
          mask_score_frags<RULE, BLOCK, 1, HALF_KEYS, true>(
              *reinterpret_cast<float(*)[1][HALF_KEYS / 8][4]>(&columns), rule, warp_first,
              tile.start + half * BLOCK, q_block + row_block, tile.block + half,
              half ? tile.mask_id[1] : tile.mask_id[0]);
        }
      };
      auto& halves = reinterpret_cast<float(&)[KEY_HALVES][HALF_KEYS / 8][4]>(s);
      if (half_keys) {
        mask_half(s_half, half);
      } else {
        mask_half(halves[0], 0);
        mask_half(halves[1], 1);
      }
    } else if (mine.coverage != TILE_FULL) {
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
  };
  // The mask and the online softmax of S(t); whether O needs a rescale, and alpha[r], the
  // rescale, returned for when PV is in.
  auto softmax = [&](bool half_keys, int half, float (&alpha)[2]) {
    mask_scores(half_keys, half);
    if (Traits::PAIRED_KEYS && half_keys) {
      return softmax_rows<HALF_KEYS, RESCALE, POLY_DEGREE>(s_half, m_i, l_i, alpha, score_scale);
    }
    return softmax_rows<TILE_N, RESCALE, POLY_DEGREE>(s, m_i, l_i, alpha, score_scale);
  };
  // O rescaled to the running max where the softmax moved it, P(t) packed for its PV.
  auto rescale_and_pack = [&](bool half_keys, bool rescale, const float (&alpha)[2]) {
    if (rescale) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 8; ++j) {
          o[j][2 * r] *= alpha[r];
          o[j][2 * r + 1] *= alpha[r];
        }
      }
    }
    if (Traits::PAIRED_KEYS && half_keys) {
      pack_p<HALF_KEYS, T>(s_half_acc, p);
    } else {
      pack_p<TILE_N, T>(s_acc, p);
    }
  };
  // Tile t computed (`half_keys`: its half `half` alone): QK^T(t) and PV(t - 1), when this
  // consumer computed tile t - 1, issued back to back; the mask and softmax of S(t) while PV
  // runs; then O rescaled and P(t) packed for the next iteration's PV. Each branch issues and
  // waits for its own wgmma: none is in flight where the paths meet (ptxas would otherwise
  // serialise every wgmma, C7520).
  auto compute = [&](bool half_keys, int half) {
    const unsigned offset = unsigned(half * Traits::KV_BOX_OFFSET);
    float alpha[2];
    bool rescale;
    auto with_pv = [&](bool half_pv) {
      v_ring->wait(t - 1);
      take_turn();
      fence(half_keys, half_pv);
      issue_qk(half_keys, t, offset);
      issue_pv(half_pv, t - 1, pending_offset);
      pass_turn();
      if constexpr (Traits::SOFTMAX_UNDER_PV) {
        wgmma_wait_group<1>();  // QK^T(t), the older group; PV(t - 1) runs on
        fence_s(half_keys);
        k_ring->release(t);
        rescale = softmax(half_keys, half, alpha);
        wgmma_wait_group<0>();
        settle_pv(half_pv);
        v_ring->release(t - 1);
      } else {
        wgmma_wait_group<0>();
        fence_s(half_keys);
        settle_pv(half_pv);
        k_ring->release(t);
        v_ring->release(t - 1);
        rescale = softmax(half_keys, half, alpha);
      }
    };
    if (pending == TILE_N) {
      with_pv(false);
    } else if (Traits::PAIRED_KEYS && pending == HALF_KEYS) {
      with_pv(true);
    } else {
      take_turn();
      fence(half_keys, half_keys);
      issue_qk(half_keys, t, offset);
      pass_turn();
      wgmma_wait_group<0>();
      fence_s(half_keys);
      k_ring->release(t);
      rescale = softmax(half_keys, half, alpha);
    }
    rescale_and_pack(half_keys, rescale, alpha);
    pending = Traits::PAIRED_KEYS && half_keys ? HALF_KEYS : TILE_N;
    pending_offset = offset;
  };
  // A tile this consumer's rows do not reach (the other block's tile in a paired CTA, or above
  // the diagonal): K(t) and V(t) are never read, but waited for all the same (StageRing).
  auto skip = [&] {
    k_ring->release(t);
    pv_turn(t - 1);
    v_ring->wait(t);
    v_ring->release(t);
    pending = 0;
  };

  // The inner loop, one active key tile t per iteration; the coverage is the warpgroup's,
  // uniform across it.
  for (; walk.next(tile, rule, walk_first, walk_last); ++t) {
    k_ring->wait(t);  // also when skipped: see StageRing
    if constexpr (Traits::PAIRED_KEYS) {
      // A consumer whose row holds one half computes that half alone (the N = HALF_KEYS
      // wgmma over its rows of the stages)
      const bool first = tile.coverage[0] != TILE_EMPTY;
      const bool second = tile.coverage[1] != TILE_EMPTY;
      if (first && second) {
        compute(false, 0);
      } else if (first || second) {
        compute(true, int(second));  // one copy of the half path for either half
      } else {
        skip();
      }
    } else {
      mine = warp_view<RULE, TILE_N>(tile, row_block, rule, group_first,
                                     group_first + WGMMA_M - 1);
      if (mine.coverage != TILE_EMPTY) {
        compute(false, 0);
      } else {
        skip();
      }
    }
  }
  pv_turn(t - 1);  // the last tile's PV

  // The epilogue through shared memory: O normalised, as T, into this consumer's
  // 64 rows of the Q tile, which no wgmma reads any more, in the swizzled panel layout a TMA box
  // of 64 columns writes back (the 8 rows of a warp's store land in 8 different 16-byte chunks:
  // no bank conflict); then one thread stores a panel at a time, rows past n_q clipped by the
  // unit.
  AccLayout frag;
  // The lane's place made opaque here: the store addresses below depend on it alone, and in
  // attn_fwd_sm90_persistent's item loop the compiler would hoist their 2 x HEAD_DIM / 8
  // values out of it and hold them through the main loop, which spills.
  opaque_to_compiler(frag.g);
  opaque_to_compiler(frag.t);
  if (CHUNKED && slot != NO_SLOT) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(l_i[r]);
      const int row = consumer * WGMMA_M + warp_in_group * 16 + frag.row(2 * r);  // in the 128
      const bool empty = l == 0.f;  // as below: 0 and -inf, which the merge weighs by 0
      const float inv_l = 1.f / l;
      const size_t part_row = size_t(slot) * Traits::TILE_M + size_t(row);
      float* out_row = part_out + part_row * HEAD_DIM;
#pragma unroll
      for (int j = 0; j < HEAD_DIM / 8; ++j) {
        *reinterpret_cast<float2*>(out_row + frag.pair_col(j)) =
            make_float2(empty ? 0.f : o[j][2 * r] * inv_l, empty ? 0.f : o[j][2 * r + 1] * inv_l);
      }
      if (frag.t == 0) part_lse[part_row] = empty ? -INFINITY : (m_i[r] + log2f(l)) * LN2;
    }
    // Every thread of this consumer past its last wgmma before its storing thread hands the Q
    // tile back.
    named_barrier_sync(Traits::STORE_BARRIER + consumer, Traits::WARPGROUP_SIZE);
    return;
  }
  unsigned char* o_tile = q_group;  // this consumer's rows of the Q tile
  const size_t head_offset = (size_t(batch) * heads + head) * size_t(n_q);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(l_i[r]);
    const int row = warp_in_group * 16 + frag.row(2 * r);  // in the consumer's 64
    // l == 0: no allowed key (or only -inf scores): out 0 and lse -inf, written, since o may
    // hold 0 * NaN from a masked key's v.
    const bool empty = l == 0.f;
    const float inv_l = 1.f / l;
    unsigned char* o_row = o_tile + row * SWIZZLE_ROW_BYTES;
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 8; ++j) {
      const int col = frag.pair_col(j);
      const int panel = col / Traits::PANEL_COLUMNS;
      const int byte = (col % Traits::PANEL_COLUMNS) * int(sizeof(T));
      const int chunk = (byte / SWIZZLE_CHUNK_BYTES) ^ (row % SWIZZLE_GROUP_ROWS);
      *reinterpret_cast<u32*>(o_row + panel * Traits::Q_PANEL_BYTES + chunk * SWIZZLE_CHUNK_BYTES +
                              byte % SWIZZLE_CHUNK_BYTES) =
          pack_pair<T>(empty ? 0.f : o[j][2 * r] * inv_l, empty ? 0.f : o[j][2 * r + 1] * inv_l);
    }
    const int q_row = group_first + row;
    if (frag.t == 0 && q_row < n_q) {
      lse[head_offset + q_row] = empty ? -INFINITY : (m_i[r] + log2f(l)) * LN2;
    }
  }
  fence_proxy_async();  // the plain stores, before the TMA unit reads them
  named_barrier_sync(Traits::STORE_BARRIER + consumer, Traits::WARPGROUP_SIZE);
  if (threadIdx.x % Traits::WARPGROUP_SIZE == 0) {
#pragma unroll
    for (int panel = 0; panel < Traits::PANELS; ++panel) {
      tma_store_4d(out_map, out_col + panel * Traits::PANEL_COLUMNS, group_first, head, batch,
                   o_tile + panel * Traits::Q_PANEL_BYTES);
    }
    tma_store_commit();
    tma_store_wait_read<0>();  // the tile stays the CTA's until the unit has read it
  }
}

template <int BLOCK, int TILE_N, int HEAD_DIM, typename T, int RULE,
          int RESCALE = RESCALE_ALWAYS, int EXP2 = EXP2_MUFU, int CONSUMERS = 2>
__global__ void __launch_bounds__(
    attn_fwd_sm90_traits<BLOCK, TILE_N, HEAD_DIM, T, CONSUMERS>::NUM_THREADS, 1)
    attn_fwd_sm90(const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
                  const __grid_constant__ TensorMap v_map,
                  const __grid_constant__ TensorMap out_map, int q_col, int k_col, int v_col,
                  int out_col, float* __restrict__ lse, const int* __restrict__ row_ptr,
                  const int* __restrict__ col_idx, const int* __restrict__ row_mask,
                  const u32* __restrict__ mask_table, int n_q, int n_k, int q_offset,
                  int kv_group, int num_blocks, float scale, int window_left, int window_right,
                  int cta_groups) {
  using Traits = attn_fwd_sm90_traits<BLOCK, TILE_N, HEAD_DIM, T, CONSUMERS>;
  using Smem = Sm90FwdSmem<BLOCK, TILE_N, HEAD_DIM, T, 1, CONSUMERS>;

  const CtaTile cta = cta_tile_longest_first(unsigned(cta_groups));
  const int q_start = cta.tile * Traits::TILE_M;
  if (q_start >= n_q) return;  // (a grid rounded up past the queries)
  const int warpgroup = int(threadIdx.x) / Traits::WARPGROUP_SIZE;
  const RuleParams rule{n_q, n_k, q_offset, window_left, window_right, mask_table};
  unsigned char* unused;
  const Smem smem = Smem::carve(&unused);
  if (threadIdx.x == 0) smem.init();
  __syncthreads();  // the barriers, initialised, before any thread uses them (the last barrier)

  if (warpgroup == 0) {
    // The producer: one thread issues every copy; the warpgroup's registers go to the others.
    warpgroup_registers_decrease<Traits::PRODUCER_REGISTERS>();
    if (threadIdx.x != 0) return;
    mbarrier_arrive_expect_tx(smem.q_full, unsigned(Traits::Q_BYTES));
    load_panels<BLOCK, TILE_N, HEAD_DIM, T>(smem.q_tile(0), Traits::Q_PANEL_BYTES, q_map, q_col,
                                            q_start, cta.head, cta.batch, smem.q_full);
    int t = 0;
    produce_item<BLOCK, TILE_N, HEAD_DIM, T, RULE, false>(
        smem, k_map, v_map, k_col, v_col, row_ptr, col_idx, row_mask, rule, num_blocks, cta.head,
        cta.head / kv_group, cta.batch, q_start, t, [] { return nullptr; });
    return;
  }

  // A consumer: rows 64 (warpgroup - 1) on of the CTA.
  warpgroup_registers_increase<Traits::CONSUMER_REGISTERS>();
  mbarrier_wait_parity(smem.q_full, 0);  // always: no copy may be in flight when the CTA ends
  const int consumer = warpgroup - 1;
  open_turns<Traits>(consumer);
  int t = 0;
  consume_item<BLOCK, TILE_N, HEAD_DIM, T, RULE, false, RESCALE, EXP2>(
      smem, 0, out_map, out_col, lse, row_ptr, col_idx, row_mask, rule, n_q, num_blocks, scale,
      consumer, cta.head, int(gridDim.y), cta.batch, q_start, nullptr, NO_SLOT, nullptr, nullptr,
      t);
  close_turns<Traits>(consumer);
}

// The persistent forward (issue 53): the same items, (128 query rows, head, batch), taken by a
// grid of about one CTA per SM from a work list the host builds from the layout
// (geometry.sm90_work_list: longest rows first within the L2-sized groups of pairs that
// attn_fwd_sm90 starts together). An entry of the list (WorkField) is an item, pair *
// ceil(n_q / 128) + tile with pair = batch * heads + head, the key blocks [first, end) it
// walks, and a slot: a row far longer than the rest is split into chunks of its key blocks,
// each an entry whose consumers write a float32 partial (out, lse) to its slot of part_out and
// part_lse; attn_fwd_sm90_merge merges them after the launch. A CTA claims list places from a
// counter (claim_work, zeroed before the launch) until the list is out: the place claimed next
// is always the next in the list, so the order is the list's whatever the CTAs' speeds (a fixed
// stride would hand one CTA every longest row of each round).
//
// What persists across a CTA's items: the barriers, the rings' running tile count (stage and
// phase continue), the consumers' turns. The CTA's n-th item uses Q tile n % Q_BUFFERS, each
// tile with its own q_full, q_empty and item slot, whose phases count that tile's uses
// (n / Q_BUFFERS). Per item, the producer thread claims a place once it has issued the
// previous item's last K/V copy, waits for the tile's q_empty (both consumers' O rows of the
// item Q_BUFFERS back read out of it by the TMA unit), writes the claimed place into the tile's
// item slot, copies Q with q_full announcing both, then the item's K and V: so the next item's
// Q lands while the consumers still compute the current one and store it from the other tile.
// The consumers wait for q_full, read the entry, compute it exactly as attn_fwd_sm90's CTA
// does, and each consumer's storing thread arrives on the tile's q_empty once its store has
// been read. The list out, the producer publishes NO_ITEM with a plain arrive and the consumers
// leave: no copy is then in flight (every one issued was waited for).
constexpr int NO_ITEM = -1;
// The producer's state in shared memory: the place claimed, the count of items published, and
// the claimed entry's WORK_ROW_ENTRIES, copied there when claimed (read from the list where
// used, their 64-bit addresses spill the producer's 24 registers).
enum ProducerState {
  CLAIMED,
  PUBLISHED,
  ROW_ENTRIES,
  PRODUCER_STATE_INTS = ROW_ENTRIES + ROW_ENTRY_INTS
};

template <int BLOCK, int TILE_N, int HEAD_DIM, typename T>
struct attn_fwd_sm90_persistent_traits : attn_fwd_sm90_traits<BLOCK, TILE_N, HEAD_DIM, T> {
  using Base = attn_fwd_sm90_traits<BLOCK, TILE_N, HEAD_DIM, T>;
  // Q tiles: the next item's Q lands in one while the current item computes from the other
  // (at d <= 128 a second tile of 16 or 32 KB fits beside the rings at every key tile). At
  // d = 256 one: a second 64 KB tile does not fit beside the rings' 128 KB, so the next Q is
  // copied once both consumers' O rows of the current item are read out of the tile.
  static constexpr int Q_BUFFERS = HEAD_DIM <= 128 ? 2 : 1;
  // The other Q tiles and their q_full, then a q_empty and an item slot a Q tile and the
  // producer's state, after attn_fwd_sm90's.
  static constexpr int SMEM_BYTES = Base::SMEM_BYTES +
                                    (Q_BUFFERS - 1) * (Base::Q_BYTES + int(sizeof(u64))) +
                                    Q_BUFFERS * int(sizeof(u64)) +
                                    (Q_BUFFERS + PRODUCER_STATE_INTS) * int(sizeof(int));
  static_assert(SMEM_BYTES <= 227 * 1024, "sm_90's shared memory a CTA");
};

template <int BLOCK, int TILE_N, int HEAD_DIM, typename T, int RULE,
          int RESCALE = RESCALE_ALWAYS, int EXP2 = EXP2_MUFU>
__global__ void __launch_bounds__(attn_fwd_sm90_traits<BLOCK, TILE_N, HEAD_DIM, T>::NUM_THREADS, 1)
    attn_fwd_sm90_persistent(
        const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
        const __grid_constant__ TensorMap v_map, const __grid_constant__ TensorMap out_map,
        int q_col, int k_col, int v_col, int out_col, float* __restrict__ lse,
        const int* __restrict__ row_ptr, const int* __restrict__ col_idx,
        const int* __restrict__ row_mask, const u32* __restrict__ mask_table, int n_q, int n_k,
        int q_offset, int kv_group, int num_blocks, float scale, int window_left,
        int window_right, const int* __restrict__ work_list, int num_items, int heads,
        int* __restrict__ work_counter, float* __restrict__ part_out,
        float* __restrict__ part_lse) {
  using Traits = attn_fwd_sm90_persistent_traits<BLOCK, TILE_N, HEAD_DIM, T>;
  constexpr int Q_BUFFERS = Traits::Q_BUFFERS;
  using Smem = Sm90FwdSmem<BLOCK, TILE_N, HEAD_DIM, T, Q_BUFFERS>;

  const int warpgroup = int(threadIdx.x) / Traits::WARPGROUP_SIZE;
  const int q_tiles = (n_q + Traits::TILE_M - 1) / Traits::TILE_M;
  const RuleParams rule{n_q, n_k, q_offset, window_left, window_right, mask_table};
  unsigned char* extra;
  const Smem smem = Smem::carve(&extra);
  u64* q_empty = reinterpret_cast<u64*>(extra);  // one a Q tile
  // The place of the item each Q tile holds, for the consumers
  volatile int* item_slot = reinterpret_cast<int*>(q_empty + Q_BUFFERS);
  volatile int* producer_state = item_slot + Q_BUFFERS;
  if (threadIdx.x == 0) {
    smem.init();
#pragma unroll
    for (int buffer = 0; buffer < Q_BUFFERS; ++buffer) {
      mbarrier_init(q_empty + buffer, Traits::CONSUMERS);  // each consumer's storing thread
    }
    producer_state[PUBLISHED] = 0;
  }
  __syncthreads();  // the barriers, initialised, before any thread uses them (the last barrier)

  if (warpgroup == 0) {
    warpgroup_registers_decrease<Traits::PRODUCER_REGISTERS>();
    if (threadIdx.x != 0) return;
    // Its state lives in shared memory (ProducerState), read where used. The claimed place
    // into the next Q tile's item slot once the item that tile held is stored and read out:
    // that tile, returned.
    auto publish = [&] {
      const int published = producer_state[PUBLISHED];
      const int buffer = published % Q_BUFFERS;
      if (published >= Q_BUFFERS) {
        mbarrier_wait_parity(q_empty + buffer, unsigned(published / Q_BUFFERS - 1) & 1u);
      }
      item_slot[buffer] = producer_state[CLAIMED];
      producer_state[PUBLISHED] = published + 1;
      return buffer;
    };
    int t = 0;
    for (;;) {
      const int place = claim_work(work_counter);
      producer_state[CLAIMED] = place < num_items ? place : NO_ITEM;
      if (place >= num_items) {
        mbarrier_arrive(smem.q_full + publish());
        return;
      }
      const int* entry = work_list + place * WORK_FIELDS;
#pragma unroll
      for (int i = 0; i < ROW_ENTRY_INTS; ++i) {
        producer_state[ROW_ENTRIES + i] = entry[WORK_ROW_ENTRIES + i];
      }
      const int item = entry[WORK_ITEM];
      const int pair = item / q_tiles;
      const int head = pair % heads;
      const int q_start = item % q_tiles * Traits::TILE_M;
      // Q first, into the other tile: it lands while the consumers finish the previous item.
      const int buffer = publish();
      u64* q_full = smem.q_full + buffer;
      mbarrier_arrive_expect_tx(q_full, unsigned(Traits::Q_BYTES));
      load_panels<BLOCK, TILE_N, HEAD_DIM, T>(smem.q_tile(buffer), Traits::Q_PANEL_BYTES, q_map,
                                              q_col, q_start, head, pair / heads, q_full);
      auto chunk = [&] { return producer_state + ROW_ENTRIES; };
      produce_item<BLOCK, TILE_N, HEAD_DIM, T, RULE, true>(
          smem, k_map, v_map, k_col, v_col, row_ptr, col_idx, row_mask, rule, num_blocks, head,
          head / kv_group, pair / heads, q_start, t, chunk);
    }
  }

  warpgroup_registers_increase<Traits::CONSUMER_REGISTERS>();
  const int consumer = warpgroup - 1;
  open_turns<Traits>(consumer);
  int t = 0;
  for (int n = 0;; ++n) {
    const int buffer = n % Q_BUFFERS;
    mbarrier_wait_parity(smem.q_full + buffer, unsigned(n / Q_BUFFERS) & 1u);
    const int place = item_slot[buffer];
    if (place == NO_ITEM) {
      close_turns<Traits>(consumer);
      return;
    }
    const int* entry = work_list + place * WORK_FIELDS;
    const int item = entry[WORK_ITEM];
    const int pair = item / q_tiles;
    consume_item<BLOCK, TILE_N, HEAD_DIM, T, RULE, true, RESCALE, EXP2>(
        smem, buffer, out_map, out_col, lse, row_ptr, col_idx, row_mask, rule, n_q, num_blocks,
        scale, consumer, pair % heads, heads, pair / heads, item % q_tiles * Traits::TILE_M,
        entry + WORK_ROW_ENTRIES, entry[WORK_SLOT], part_out, part_lse, t);
    if (threadIdx.x % Traits::WARPGROUP_SIZE == 0) mbarrier_arrive(q_empty + buffer);
  }
}

// The merge of split rows (issue 53): after attn_fwd_sm90_persistent, each split row's chunks
// (merge_list: MergeField, its chunks' slots consecutive) merged through the LSE in chunk order,
// one warp a query row (row_kernel_traits; merge_row, kernels/common/merge_row.cuh), into out
// [batch, heads, n_q, HEAD_DIM] (contiguous) and lse. rows = merge entries x 128; a row past n_q
// (the last query tile's) and an entry of no chunks (the padding of a list built on the device,
// cuattn/backends/layout_build.py) are left alone. A chunk with no key for a row (lse -inf,
// out 0) weighs 0; a row no chunk reaches gets out 0 and lse -inf.
template <int HEAD_DIM>
struct ChunkSlots {
  static constexpr int SPLITS = 0;
  static constexpr int SLOT_ROWS = 2 * WGMMA_M;  // a slot holds an item's 128 rows
  const float* row_out;  // the row in the first chunk's slot; the next chunk's SLOT_ROWS on
  const float* row_lse;
  int chunks;
  __device__ __forceinline__ int count() const { return chunks; }
  __device__ __forceinline__ float lse(int s) const { return row_lse[size_t(s) * SLOT_ROWS]; }
  __device__ __forceinline__ float out(int s, int d) const {
    return row_out[size_t(s) * SLOT_ROWS * HEAD_DIM + d];
  }
};

template <int HEAD_DIM, typename T>
__global__ void __launch_bounds__(row_kernel_traits<HEAD_DIM, T>::NUM_THREADS)
    attn_fwd_sm90_merge(const float* __restrict__ part_out, const float* __restrict__ part_lse,
                        const int* __restrict__ merge_list, T* __restrict__ out,
                        float* __restrict__ lse, int n_q, int rows) {
  using Traits = row_kernel_traits<HEAD_DIM, T>;
  constexpr int SLOT_ROWS = ChunkSlots<HEAD_DIM>::SLOT_ROWS;
  const int q_tiles = (n_q + SLOT_ROWS - 1) / SLOT_ROWS;
  const int warp = int(threadIdx.x / 32);
  const int lane = int(threadIdx.x % 32);
  for (int r = warp; r < Traits::ROWS_PER_CTA; r += Traits::NUM_WARPS) {
    const int row = int(blockIdx.x) * Traits::ROWS_PER_CTA + r;
    if (row >= rows) break;  // uniform across the warp
    const int* entry = merge_list + row / SLOT_ROWS * MERGE_FIELDS;
    if (entry[MERGE_CHUNKS] == 0) continue;  // a device-built list's padding past its split rows
    const int within = row % SLOT_ROWS;
    const int item = entry[MERGE_ITEM];
    const int q_row = item % q_tiles * SLOT_ROWS + within;
    if (q_row >= n_q) continue;
    const size_t at = size_t(item / q_tiles) * n_q + q_row;
    const size_t first = size_t(entry[MERGE_FIRST_SLOT]) * SLOT_ROWS + within;
    const ChunkSlots<HEAD_DIM> parts{part_out + first * HEAD_DIM, part_lse + first,
                                     entry[MERGE_CHUNKS]};
    merge_row<HEAD_DIM, MERGE_WEIGH_EMPTY>(parts, out + at * HEAD_DIM, lse + at, lane);
  }
}
