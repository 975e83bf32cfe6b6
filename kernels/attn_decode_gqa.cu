// Decode attention over a paged KV cache on tensor cores: a kv group's query rows as the M = 16
// rows of mma.sync m16n8k16, K and V streamed through a ring of shared-memory stages that a
// producer warp fills while four consumer warps compute.
//
// attn_decode_gqa<TILE, HEAD_DIM, T, MODS>: grid (splits, kv_heads * row_chunks, batch), 5
//   warps; T __half or __nv_bfloat16, HEAD_DIM 16 to 256 (kernels/attn_decode.cu's
//   attn_decode_split serves fp32). MODS (kernels/common/types.cuh ScoreModsFlag): MODS_NONE
//   the plain kernel, MODS_SCORE the variant with attn_decode_split's score modifiers and
//   HeavyHitters' per-token scores (below), which also takes fp16 at any scale.
//   What it computes is attn_decode_split's (see its header): a CTA owns one split of one
//   (sequence, kv head)'s page table, pages [split * pages_per_split, ...) of its page_count,
//   walked as table slots (slot f is offset f % page_size of entry f / page_size), and up to
//   ROWS = 16 of the kv group's kv_group * t_q query rows (row r: query head kv_head * kv_group
//   + r / t_q, query r % t_q at position lengths[b] - t_q + r % t_q). A token counts for a row
//   when its position >= 0 (kept), it is <= the row's position and, with use_chosen, the row's
//   Quest (or caller's) choice reads its page; scores are scale * q.k. The two page layouts are
//   attn_decode_split's (a KVCache's with use_slot_pos, a caller's block table without: see its
//   PageWalk). With one split it writes out [B, H, t_q, HEAD_DIM] (T) and lse [B, H, t_q]
//   (float, natural log; -inf: nothing counted) itself; with more, the split's partial part_out
//   [B, H, t_q, splits, HEAD_DIM] and part_lse [B, H, t_q, splits] (float), and the CTA that
//   writes the last split of its rows (counted in tickets [B, kv_heads * row_chunks], zeros at
//   launch) merges them into out and lse as attn_decode_merge does
//   (kernels/common/merge_row.cuh: no merge launch).
//   How: the split's slots are cut in tiles of TILE tokens; tile t goes to stage t % STAGES and
//   consumer warp t % CONSUMER_WARPS (STAGES a multiple of it, so a stage always has the same
//   consumer). The producer warp (the last) walks rounds of max(TILE, 32) tokens (a round
//   fills 32 / TILE stages where TILE is 16, a stage where TILE >= 32) and gives each token of
//   a round a lane: its table entry, slot, K/V row and position, and a 32-bit row mask (bit i:
//   the token counts for row i) into its stage's mask words; its lanes then copy each tile's K
//   and V rows by 16-byte cp.async, consecutive lanes along a row, zero-filled where no token is
//   kept (evicted, room in a page, past the run), so that whatever an unused slot holds (a NaN)
//   meets no probability. Each producer lane arrives on a stage's `full` barrier twice: once
//   when its copies land (cp.async.mbarrier.arrive.noinc) and once at once, publishing the mask
//   words. Round u + 1's positions and round u + 2's table entries are loaded while round u is
//   issued. (fp8 at d >= 128: two producer warps, the last two, take alternate rounds, each
//   reading its own rounds ahead.)
//   A consumer holds Q in A fragments (registers), pre-scaled by scale * log2(e) (at d256 Q's
//   scaled tile stays in shared memory instead and is read by ldmatrix at each tile's S, as in
//   the modifier variant below: Q's fragments beside O's 128 registers a lane spilled; there a
//   CTA runs alone on its SM, its ring two 16-token stages a consumer), computes
//   S = Q K^T (ldmatrix), sets uncounted scores to -inf, runs an exp2 online softmax on the
//   fp32 accumulators, O += P V (ldmatrix.trans, P from registers) and arrives on the stage's
//   `empty` barrier. At the end the four consumers' (O, m, l) merge in shared memory (the
//   stages, reused) and every warp writes rows of the split's answer or partial.
// attn_decode_gqa_fp8<TILE, HEAD_DIM, T, KV, MODS>: the same over fp8 pages (KV fp8_e4m3 or
//   fp8_e5m2, uint8 codes; T __nv_bfloat16), with k_scale and v_scale float32 [num_pages]: the
//   producer also writes each token's page scales beside its row mask, the V scales relative to
//   v_ref, the largest of the tile's counted tokens' (and the stage's v_ref and step: the
//   v_ref of its consumer's tile before, 1 for the first, over v_ref); a consumer widens its
//   stage's codes into fp16 tiles of its own (exact), before the ldmatrix reads, computes
//   S = Q K^T on fp16 tensor cores (Q in fp16, times a power of two that keeps it in fp16's
//   range), multiplies S's columns by the K scales and P's by the relative V scales (so P <= 1
//   stays in fp16's range at any scale), runs O += P V on fp16 tensor cores with O in units of
//   its last tile's v_ref (O's correction times the step), and multiplies O by that v_ref
//   before the merge.
// The modifier variant (MODS_SCORE) computes attn_decode_split's modified scores (its header:
//   softcap, ALiBi, key bias, relative-position bias, dropout, and with keep_scores the
//   per-token scores token_scores [B, H, t_q, max_pages * page_size], -inf where a token did
//   not count). The producer also writes each token's position beside its row mask; the
//   consumers read Q's scaled tile from shared memory at each tile's S = Q K^T (ldmatrix)
//   instead of holding its fragments (the modifiers' registers beside Q, S and O spilled at
//   the 168 registers of 2 CTAs an SM). Q holds q scale log2(e), so S is s2 = log2(e) s, s the
//   natural score the modifiers are defined on; each one is applied in log2 units, in
//   attn_decode_split's order, before the mask:
//     S unscaled     s2 = acc u: u = 2^-k, the power of two that brought an fp16 Q into range
//                    (1 for bf16; over fp8 pages, times the token's K scale)
//     softcap c      c tanh(s / c)  -> s2 = (c log2(e)) tanh(s2 (ln(2) / c))
//     ALiBi          - slope (query position - position) -> s2 += (slope log2(e)) (position -
//                    query position), the difference an exact integer in float as the split
//                    kernel's
//     key bias       + key_bias[b, (head,) position] -> s2 += log2(e) key_bias[...]
//     rel bias       + rel_bias[b, head, clamp(position - query position, -M, M) + M], likewise
//   so exp2(s2 - m2) is the split kernel's exp(s - m); HeavyHitters' score is s2 ln(2). The
//   operands are read where the token is kept (position >= 0: a zero-filled slot's -1 reads
//   none; the mask gives it -inf), and a row past the CTA's rows reads row 0's (it counts
//   nothing). Dropout: each element's keep decision is made at the top of the tile (before S
//   is live, one generator call at a time) by the split kernel's generator at (b, query head,
//   query position, position), and applied to P after l_i's sum (l_i and the lse are of every
//   probability, as the split kernel's).
// Special values (docs/design.md §7): as attn_decode_split, modifiers included (a -inf bias is
//   a -inf score; a NaN in an evicted slot meets no probability). An uncounted token's score is
//   replaced by -inf (probability 0), which still multiplies its v (0 * NaN = NaN, as dense);
//   a slot holding no kept token is read as zeros; a NaN or +inf counted score makes its row
//   NaN; a row that counts nothing in a split writes lse -inf and an out the merge multiplies
//   by 0 (with one split: 0).
// Shapes: as attn_decode_split's (kernels/attn_decode.cu): q [B, H, t_q, HEAD_DIM] contiguous;
//   k_pages, v_pages rows page_rows page + token_rows offset + head_rows kv_head, fewer than
//   2^31; page_table rows at table_batch_stride, table_head_stride; with use_slot_pos slot_pos
//   int64 [num_pages, page_size] and page_count int32 [B, kv_heads]; lengths int64 [B], and
//   positions, below 2^31; chosen uint8 [B, H, t_q, max_pages]; the modifiers' operands as
//   attn_decode_split's.
// Run: cuattn.decode_attention on a KVCache or cuattn.paged_decode, with CUATTN_DECODE=gqa
//   (backend "cuda" or "interp"); TILE, the split count and the variant come from
//   cuattn/backends/geometry.py (decode_gqa_tile, decode_gqa_splits, decode_gqa_mods).
#include "common/decode_cta.cuh"
#include "common/mbarrier.cuh"
#include "common/merge_row.cuh"
#include "common/philox.cuh"
#include "common/smem.cuh"
#include "common/warp_gemm.cuh"
#include "common/warpgroup.cuh"

template <int TILE, int HEAD_DIM, typename T, typename KV = T, int MODS = MODS_NONE>
struct attn_decode_gqa_traits {
  static constexpr int ROWS = 16;  // query rows per CTA: the M of one mma fragment
  static constexpr int CONSUMER_WARPS = 4;
  // One producer warp (the last), or over fp8 pages at d >= 128 two (the last two) taking
  // alternate rounds: a warp issues on scheduler (warp % 4), and the one producer shares consumer
  // 0's with its whole round (the busiest scheduler: 0.98 of its issue at d256); two fit there
  // without costing residency (d128: 2 CTAs of 6 warps, d256: one), where d <= 96 would lose
  // its third CTA
  static constexpr int FP8_TWO_PRODUCERS_HEAD_DIM = 128;
  static constexpr int PRODUCER_WARPS =
      is_fp8_type<KV>::value && HEAD_DIM >= FP8_TWO_PRODUCERS_HEAD_DIM ? 2 : 1;
  static constexpr int PRODUCER_WARP = CONSUMER_WARPS;  // the first producer
  static constexpr int NUM_WARPS = CONSUMER_WARPS + PRODUCER_WARPS;
  static constexpr int NUM_THREADS = NUM_WARPS * 32;
  // Two resident CTAs per SM at least at d <= 128 (shared memory allows 3 on sm_90): a
  // thread's registers stay under 204, the O, S and Q fragments unspilled. Past it (d256) one:
  // O alone is HEAD_DIM / 2 = 128 registers a lane, and the ring of 16-token stages is 135 KB.
  static constexpr int WIDE_HEAD_DIM = 128;  // the widest head dim with Q's fragments held
  static constexpr bool WIDE = HEAD_DIM > WIDE_HEAD_DIM;
  // fp8 pages at d <= 64 (the plain kernel): three, as shared memory allows on sm_90 (<= 136
  // registers; held to two, ptxas took 137 at d64)
  static constexpr int FP8_THREE_CTAS_HEAD_DIM = 64;
  static constexpr bool THREE_CTAS =
      is_fp8_type<KV>::value && MODS == MODS_NONE && HEAD_DIM <= FP8_THREE_CTAS_HEAD_DIM;
  static constexpr int MIN_CTAS_PER_SM = WIDE ? 1 : THREE_CTAS ? 3 : 2;
  // The producer reads a round of ROUND_TOKENS tokens at once, a token a lane (TILE at least),
  // so that a tile under a warp's 32 tokens (fp8 at d96 and d128) pays the table, position,
  // scale and row-mask work once per 32 tokens; a round fills ROUND_TILES stages, and the ring
  // holds CONSUMER_WARPS rounds (a stage per consumer and round tile).
  static constexpr int ROUND_TOKENS = TILE > 32 ? TILE : 32;
  static constexpr int ROUND_TILES = ROUND_TOKENS / TILE;
  static constexpr int STAGES = CONSUMER_WARPS * ROUND_TILES;
  static constexpr int CHUNK = 16 / int(sizeof(KV));  // elements of one 16-byte copy
  static constexpr int CHUNKS_PER_ROW = HEAD_DIM / CHUNK;
  static constexpr int TOKEN_ROUNDS = ROUND_TOKENS / 32;  // producer: tokens a lane per round
  static constexpr int COPIES_PER_LANE = TILE * CHUNKS_PER_ROW / 32;  // of K (as many of V)
  static constexpr int LD = SmemStride<KV, HEAD_DIM>::value;
  static constexpr int TILE_ELEMS = TILE * LD;  // one K or V tile
  static constexpr int STAGE_ELEMS = 2 * TILE_ELEMS;
  // The full barriers count both arrivals of each producer lane; the empty ones a consumer's.
  static constexpr int FULL_ARRIVALS = 2 * 32;
  static constexpr int EMPTY_ARRIVALS = 32;
  // [full, empty barriers][row masks: STAGES x TILE words][stages], the stages reused by the
  // consumers' final merge: [warp][row][O..., m, l] floats.
  static constexpr int BARRIER_BYTES = 2 * STAGES * 8;
  static constexpr int MASK_BYTES = STAGES * TILE * 4;
  static constexpr int RING_BYTES = STAGES * STAGE_ELEMS * int(sizeof(KV));
  static constexpr int MERGE_LD = HEAD_DIM + 2;
  static constexpr int MERGE_BYTES = CONSUMER_WARPS * ROWS * MERGE_LD * 4;
  // fp8 pages (KV fp8_e4m3 / fp8_e5m2): each stage's K and V page scale a token (after the row
  // masks; the V scales relative to the stage's v_ref) and the stage's (v_ref, step), and
  // after the ring each consumer's K and V tiles widened (to QK and PV), which ldmatrix reads
  static constexpr bool FP8 = is_fp8_type<KV>::value;
  // Q K^T's and P V's operand types: T, or over fp8 pages fp16 (a cvt widens two codes to an
  // fp16 pair in one instruction, exactly; every code is under fp16's largest). P takes its V
  // scale relative to the tile's v_ref, at most 1: a probability times a page's V scale itself
  // could leave fp16's range
  using QK = typename type_if<FP8, __half, T>::type;
  using PV = QK;
  static constexpr int SCALE_BYTES = FP8 ? 2 * STAGES * TILE * 4 + STAGES * 8 : 0;
  static constexpr int WIDE_LD = SmemStride<T, HEAD_DIM>::value;
  static constexpr int WIDE_WARP_BYTES = 2 * TILE * WIDE_LD * int(sizeof(T));  // K, then V
  static constexpr int WIDE_BYTES = FP8 ? CONSUMER_WARPS * WIDE_WARP_BYTES : 0;
  // fp16 Q: the largest finite |q scale log2(e)| is brought under 2^QK_MAX_EXPONENT
  static constexpr int QK_MAX_EXPONENT = 15;
  // The modifier variant (MODS_SCORE): each stage's token positions (after the scales), which
  // the consumers' modifiers read; its fp16 Q is scaled into range as over fp8 pages, since
  // any scale may come with a modifier
  static constexpr bool MODDED = MODS == MODS_SCORE;
  static constexpr bool Q_RESCALED = FP8 || (MODDED && is_same_type<QK, __half>::value);
  static constexpr int POS_BYTES = MODDED ? STAGES * TILE * 4 : 0;
  // ... and Q, scaled, as a [ROWS][Q_LD] tile that the S GEMM reads by ldmatrix each tile: the
  // modifiers' registers (positions, operands, tanh, the dropout generator) beside Q's
  // fragments, S and O spilled at 168 (2 CTAs of 5 warps an SM); at d256 (WIDE) in every
  // variant, Q's 64 fragment registers beside O's 128 and S past what fits unspilled
  static constexpr bool Q_SHARED = MODDED || WIDE;
  static constexpr int Q_LD = SmemStride<QK, HEAD_DIM>::value;
  static constexpr int Q_BYTES = Q_SHARED ? ROWS * Q_LD * int(sizeof(QK)) : 0;
  static constexpr int Q_BARRIER = 1;  // the consumers' named barrier: Q's tile is written
  static constexpr int SMEM_BYTES = BARRIER_BYTES + MASK_BYTES + SCALE_BYTES + POS_BYTES +
                                    Q_BYTES +
                                    (RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES) +
                                    WIDE_BYTES;
  static_assert(is_half_type<T>::value, "tensor-core decode: fp16 or bf16");
  static_assert(is_same_type<KV, T>::value || FP8, "pages of T or of fp8 codes");
  static_assert(sizeof(QK) == sizeof(T) && sizeof(PV) == sizeof(T),
                "the widened K and V tiles are alike in size");
  static_assert((RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES) % 16 == 0,
                "the widened tiles stay 16-byte aligned");
  static_assert(TILE % 16 == 0 && HEAD_DIM % 16 == 0, "whole m16n8k16 steps");
  static_assert(TILE * CHUNKS_PER_ROW % 32 == 0, "a tile's copies divide among the lanes");
  static_assert(ROUND_TOKENS % TILE == 0 && ROUND_TOKENS % 32 == 0,
                "a round is whole tiles, a producer lane's tokens are lane + 32 r");
  static_assert(ROWS <= 32, "a token's row mask is one word");
  static_assert(TILE / 2 <= 32, "a lane's dropout decisions of a tile are one word");
  static_assert(STAGES % CONSUMER_WARPS == 0, "a stage always has the same consumer");
  static_assert(CONSUMER_WARPS / ROUND_TILES % PRODUCER_WARPS == 0,
                "a stage is always filled by the same producer, its tile before's round too");
  static_assert((BARRIER_BYTES + MASK_BYTES) % 16 == 0, "the stages stay 16-byte aligned");
};

// A token's row mask: bit i when the token at position `pos` (-1: none kept) counts for row i
// (all_rows: the CTA's rows). query_of[i]: row i's query index (0 .. t_q - 1); first_query_pos:
// query 0's position. Causal: a token at or before query 0 counts for every row, one past the
// last query for none. With use_chosen, Quest's choice of the token's page for row i is
// chosen_of_entry[i * max_pages] (the CTA's rows are consecutive rows of [B, H, t_q]).
template <int ROWS>
__device__ __forceinline__ u32 row_mask(long long pos, long long first_query_pos, int t_q,
                                        const int (&query_of)[ROWS], u32 all_rows,
                                        const unsigned char* __restrict__ chosen_of_entry,
                                        int max_pages, int use_chosen) {
  if (pos < 0) return 0u;
  const long long ahead = pos - first_query_pos;  // counts for rows whose query is >= this
  u32 mask = all_rows;
  if (ahead >= t_q) {
    mask = 0u;
  } else if (ahead > 0) {
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      if (query_of[i] < ahead) mask &= ~(1u << i);
    }
  }
  if (use_chosen) {
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      if ((mask >> i & 1u) && chosen_of_entry[size_t(i) * max_pages] == 0) mask &= ~(1u << i);
    }
  }
  return mask;
}

// fp8 pages: a consumer widens one stage's K or V tile of codes ([TILE][LD]) to fp16 (the cvt's
// pairs as they come, exact) in its own tile ([TILE][WIDE_LD]), 16 codes a lane at a time.
template <typename Traits, typename KV>
__device__ __forceinline__ void widen_tile(__half* wide, const KV* codes, int lane) {
  constexpr int CHUNKS = Traits::TILE_ELEMS / Traits::LD * Traits::CHUNKS_PER_ROW;
  static_assert(CHUNKS % 32 == 0, "a tile's chunks divide among the lanes");
  // a chunk at a time: unrolled, every chunk's load goes ahead of the stores (registers)
#pragma unroll 1
  for (int i = 0; i < CHUNKS / 32; ++i) {
    const int c = lane + 32 * i;
    const int row = c / Traits::CHUNKS_PER_ROW;
    const int col = c % Traits::CHUNKS_PER_ROW * Traits::CHUNK;
    u32 words[4];
    load_16_words(codes + row * Traits::LD + col, words);
    u32* dst = reinterpret_cast<u32*>(wide + row * Traits::WIDE_LD + col);
#pragma unroll
    for (int e = 0; e < Traits::CHUNK / 2; ++e) {
      dst[e] = fp8x2_to_half2<KV>((unsigned short)(words[e / 2] >> (16 * (e % 2))));
    }
  }
}

// The modifier variant's operands, attn_decode_split's (kernels/attn_decode.cu: softcap > 0 caps,
// ALiBi's slopes [B, H] at alibi_batch_stride, key_bias at its batch and query-head strides
// indexed by position, rel_bias [B, H, 2M + 1] at rel_bias_batch_stride, M =
// rel_max_distance, dropout), and HeavyHitters' token_scores [B, H, t_q, max_pages page_size]
// with keep_scores. The plain kernel (MODS_NONE) reads none of them.
struct GqaScoreMods {
  float* __restrict__ token_scores;
  float softcap;
  const float* __restrict__ alibi_slopes;
  int use_alibi, alibi_batch_stride;
  const float* __restrict__ key_bias;
  int use_key_bias;
  long long key_bias_batch_stride, key_bias_head_stride;
  const float* __restrict__ rel_bias;
  int use_rel_bias, rel_bias_batch_stride, rel_max_distance;
  long long dropout_threshold, dropout_seed;
  float dropout_scale;
  const u32* __restrict__ dropout_seed_words;
  int use_seed_words, keep_scores;
};

// The modifier variant's scores (header: the arithmetic in log2 units), in place in a
// consumer's S accumulators before the mask: the score unscaled (Q's power of two and fp8's K
// scales), then softcap, ALiBi, the key bias and the relative-position bias, in
// attn_decode_split's order, each flag tested once a tile. pos_of: the tile's token positions
// (-1: none kept, whose bias is not read: the mask gives it -inf); k_scale_of: its K scales
// (fp8); row_head, row_pos: the lane's rows' (g, g + 8) query heads and positions.
template <int TILE, typename Traits>
__device__ __forceinline__ void score_mods(float (&s_acc)[TILE / 8][4], const AccLayout& frag,
                                           const GqaScoreMods& mods, const int* pos_of,
                                           const float* k_scale_of, float q_unscale, int b,
                                           const int (&row_head)[2], const int (&row_pos)[2]) {
  constexpr float LOG2E = 1.4426950408889634f;
  constexpr float LN2 = 0.6931471805599453f;
  if constexpr (Traits::Q_RESCALED) {
#pragma unroll
    for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float unscale = q_unscale;
        if constexpr (Traits::FP8) unscale = k_scale_of[frag.col(j, e)] * q_unscale;
        s_acc[j][e] *= unscale;
      }
    }
  }
  if (mods.softcap > 0.f) {  // Gemma 2's capped score: c tanh(s / c)
    const float cap_in = LN2 / mods.softcap, cap_out = mods.softcap * LOG2E;
#pragma unroll
    for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s_acc[j][e] = cap_out * tanhf(s_acc[j][e] * cap_in);
    }
  }
  if (mods.use_alibi) {  // -slope (query position - token position)
    float row_slope[2];  // in log2 units; read each tile (held across the loop, they spilled)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_slope[r] = mods.alibi_slopes[size_t(b) * mods.alibi_batch_stride + row_head[r]] * LOG2E;
    }
#pragma unroll
    for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = pos_of[frag.col(j, e)];
        s_acc[j][e] += row_slope[e / 2] * float(pos - row_pos[e / 2]);
      }
    }
  }
  if (mods.use_key_bias) {  // key_bias[b, (head,) position]
    const float* bias_of[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      bias_of[r] = mods.key_bias + b * mods.key_bias_batch_stride +
                   row_head[r] * mods.key_bias_head_stride;
    }
#pragma unroll
    for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = pos_of[frag.col(j, e)];
        if (pos >= 0) s_acc[j][e] = fmaf(bias_of[e / 2][pos], LOG2E, s_acc[j][e]);
      }
    }
  }
  if (mods.use_rel_bias) {  // rel_bias[b, head, clamp(position - query position, -M, M) + M]
    const int reach = mods.rel_max_distance;
    const float* table_of[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      table_of[r] = mods.rel_bias + size_t(b) * mods.rel_bias_batch_stride +
                    size_t(row_head[r]) * (2 * reach + 1);
    }
#pragma unroll
    for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = pos_of[frag.col(j, e)];
        if (pos >= 0) {
          const int rel = pos - row_pos[e / 2];
          const int column = rel < -reach ? 0 : rel > reach ? 2 * reach : rel + reach;
          s_acc[j][e] = fmaf(table_of[e / 2][column], LOG2E, s_acc[j][e]);
        }
      }
    }
  }
}

// The kernel's body, for pages of KV: T (attn_decode_gqa) or fp8 codes whose page scales are
// k_scale and v_scale (attn_decode_gqa_fp8; nullptr otherwise); MODS_SCORE applies `mods`.
template <int TILE, int HEAD_DIM, typename T, typename KV, int MODS>
__device__ __forceinline__ void attn_decode_gqa_body(
    const T* __restrict__ q, const KV* __restrict__ k_pages, const KV* __restrict__ v_pages,
    const long long* __restrict__ slot_pos, const int* __restrict__ page_table,
    const int* __restrict__ page_count, const long long* __restrict__ lengths,
    const unsigned char* __restrict__ chosen, float* __restrict__ part_out,
    float* __restrict__ part_lse, T* __restrict__ out, float* __restrict__ lse,
    int* __restrict__ tickets, int heads, int kv_heads, int t_q, int page_size, int max_pages,
    int table_batch_stride, int table_head_stride, int page_rows, int token_rows, int head_rows,
    int use_slot_pos, int splits, int pages_per_split, float scale, int use_chosen,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale,
    const GqaScoreMods& mods) {
  using Traits = attn_decode_gqa_traits<TILE, HEAD_DIM, T, KV, MODS>;
  constexpr bool FP8 = Traits::FP8;
  constexpr int ROWS = Traits::ROWS;
  constexpr int STAGES = Traits::STAGES;
  constexpr int LD = Traits::LD;
  constexpr float LOG2E = 1.4426950408889634f;
  constexpr float LN2 = 0.6931471805599453f;
  const int warp = int(threadIdx.x / 32);
  const int lane = int(threadIdx.x % 32);
  const int kv_group = heads / kv_heads;
  const DecodeCta<ROWS> cta(heads, kv_heads, t_q, lengths, page_count, page_size,
                            pages_per_split, use_slot_pos);
  const int split = cta.split, kv_head = cta.kv_head, first_row = cta.first_row, b = cta.b;
  const int rows = cta.rows, slot_lo = cta.slot_lo, slot_hi = cta.slot_hi;
  const long long length = cta.length;
  const int tiles = (slot_hi - slot_lo + TILE - 1) / TILE;
  // Row i of the CTA is row first_q_row + i of [B, H, t_q] (query head, then query): the kv
  // group's rows are consecutive there.
  const size_t first_q_row = (size_t(b) * heads + size_t(kv_head) * kv_group) * t_q + first_row;

  u64* full = dynamic_smem<u64>();
  u64* empty = full + STAGES;
  u32* mask_smem = reinterpret_cast<u32*>(empty + STAGES);
  float* k_scale_smem = reinterpret_cast<float*>(mask_smem + STAGES * TILE);  // fp8 only
  float* v_scale_smem = k_scale_smem + STAGES * TILE;  // relative to the stage's v_ref
  // (v_ref, step): step is the v_ref of the consumer's tile before (1 for its first) over v_ref
  float2* v_ref_smem = reinterpret_cast<float2*>(v_scale_smem + STAGES * TILE);
  int* pos_smem = reinterpret_cast<int*>(  // the modifier variant only
      reinterpret_cast<unsigned char*>(mask_smem + STAGES * TILE) + Traits::SCALE_BYTES);
  using QK = typename Traits::QK;
  QK* q_smem = reinterpret_cast<QK*>(  // Q_SHARED only
      reinterpret_cast<unsigned char*>(pos_smem) + Traits::POS_BYTES);
  KV* ring = reinterpret_cast<KV*>(reinterpret_cast<unsigned char*>(mask_smem + STAGES * TILE) +
                                   Traits::SCALE_BYTES + Traits::POS_BYTES + Traits::Q_BYTES);
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbarrier_init(&full[s], Traits::FULL_ARRIVALS);
      mbarrier_init(&empty[s], Traits::EMPTY_ARRIVALS);
    }
  }
  __syncthreads();  // the barriers, initialised, before any thread uses them

  // Consumers: per lane, rows g and g + 8 of the accumulator layout.
  const AccLayout frag;
  float m_i[2] = {-INFINITY, -INFINITY};  // running max (log2 units), the same in a quad
  float l_i[2] = {0.f, 0.f};              // this lane's part of the running sum
  float acc[HEAD_DIM / 8][4];
#pragma unroll
  for (int j = 0; j < HEAD_DIM / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  }

  constexpr int PRODUCERS = Traits::PRODUCER_WARPS;
  if (PRODUCERS == 1 ? warp == Traits::PRODUCER_WARP : warp >= Traits::PRODUCER_WARP) {
    const int* table =
        page_table + size_t(b) * table_batch_stride + size_t(kv_head) * table_head_stride;
    const int head_row = kv_head * head_rows;
    const long long first_query_pos = length - t_q;  // query r % t_q sits at this + r % t_q
    int query_of[ROWS];
    u32 all_rows = 0u;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      query_of[i] = (first_row + i) % t_q;
      if (i < rows) all_rows |= 1u << i;
    }
    // Quest's choices of the CTA's rows: [ROWS][max_pages] from here (a stand-in without Quest)
    const unsigned char* chosen_rows = chosen + (use_chosen ? first_q_row * max_pages : 0);
    // A round's tokens, one a lane per token round r (token lane + 32 r): the page slot (-1:
    // past the run), its k_pages / v_pages row and the position there (-1: none kept; a
    // caller's table's is the table slot, kept below the length). Read ahead: while round u is
    // issued, the positions of this warp's next round and the table entries of the one after
    // are loaded, so that the producer never waits for its own dependent pair of loads (table,
    // then slot_pos).
    constexpr int ROUND_TOKENS = Traits::ROUND_TOKENS;
    constexpr int ROUND_TILES = Traits::ROUND_TILES;
    const int rounds = (tiles + ROUND_TILES - 1) / ROUND_TILES;
    // this warp's rounds: first_round, first_round + PRODUCERS, ...
    const int first_round = PRODUCERS == 1 ? 0 : warp - Traits::PRODUCER_WARP;
    struct Tokens {
      int slot[Traits::TOKEN_ROUNDS];
      int row[Traits::TOKEN_ROUNDS];
      int page[Traits::TOKEN_ROUNDS];  // fp8: its scales' index (0 past the run)
      long long pos[Traits::TOKEN_ROUNDS];
      float k_scale[Traits::TOKEN_ROUNDS];  // fp8: the page's scales, read with the position
      float v_scale[Traits::TOKEN_ROUNDS];
    };
    auto read_slots = [&](int u, Tokens& tokens) {
#pragma unroll
      for (int r = 0; r < Traits::TOKEN_ROUNDS; ++r) {
        const int f = slot_lo + u * ROUND_TOKENS + lane + 32 * r;
        const bool in_run = u < rounds && f < slot_hi;
        const int entry = in_run ? f / page_size : 0;
        const int page = in_run ? table[entry] : 0;
        const int offset = f - entry * page_size;
        tokens.slot[r] = in_run ? page * page_size + offset : -1;
        if constexpr (FP8) tokens.page[r] = page;
        tokens.row[r] = page * page_rows + offset * token_rows + head_row;
        if (!use_slot_pos) tokens.pos[r] = in_run && f < length ? f : -1;
      }
    };
    auto read_positions = [&](Tokens& tokens) {
#pragma unroll
      for (int r = 0; r < Traits::TOKEN_ROUNDS; ++r) {
        if (use_slot_pos) tokens.pos[r] = tokens.slot[r] >= 0 ? slot_pos[tokens.slot[r]] : -1;
        if constexpr (FP8) {
          tokens.k_scale[r] = k_scale[tokens.page[r]];
          tokens.v_scale[r] = v_scale[tokens.page[r]];
        }
      }
    };
    // fp8: the v_ref of the tiles of this warp's last V_REF_ROUNDS rounds, oldest first (1
    // before the first), each lane its tile's: round u - CONSUMER_WARPS / ROUND_TILES's tile g
    // is tile t - CONSUMER_WARPS, the one before of tile t's consumer
    constexpr int V_REF_ROUNDS = Traits::CONSUMER_WARPS / ROUND_TILES / PRODUCERS;
    float v_ref_before[V_REF_ROUNDS];
#pragma unroll
    for (int i = 0; i < V_REF_ROUNDS; ++i) v_ref_before[i] = 1.f;
    Tokens now, next, after;
    read_slots(first_round, now);
    read_slots(first_round + PRODUCERS, next);
    read_positions(now);
    for (int u = first_round; u < rounds; u += PRODUCERS) {
      read_positions(next);
      read_slots(u + 2 * PRODUCERS, after);
      u32 mask[Traits::TOKEN_ROUNDS];
      int kept_row[Traits::TOKEN_ROUNDS];  // -1: zero-filled
#pragma unroll
      for (int r = 0; r < Traits::TOKEN_ROUNDS; ++r) {
        const int entry =
            use_chosen ? (slot_lo + u * ROUND_TOKENS + lane + 32 * r) / page_size : 0;
        mask[r] = row_mask<ROWS>(now.pos[r], first_query_pos, t_q, query_of, all_rows,
                                 chosen_rows + entry, max_pages, use_chosen);
        kept_row[r] = now.pos[r] >= 0 ? now.row[r] : -1;
      }
      // fp8: v_ref, the largest V scale of the tile's counted tokens (a lane holds its tile's:
      // the shuffles stay within TILE lanes, or the warp), 1 where none counts; each token's V
      // scale over it (0 where the token counts for no row: its probability is 0 everywhere,
      // and a scale far over v_ref must not make 0 x inf)
      float v_ref = 1.f, v_ref_inv = 1.f, v_step = 1.f;
      if constexpr (FP8) {
        float v_max = 0.f;  // fmaxf drops a NaN scale: its ratio below stays NaN
#pragma unroll
        for (int r = 0; r < Traits::TOKEN_ROUNDS; ++r) {
          v_max = fmaxf(v_max, mask[r] != 0u ? now.v_scale[r] : 0.f);
        }
#pragma unroll
        for (int offset = (TILE < 32 ? TILE : 32) / 2; offset > 0; offset /= 2) {
          v_max = fmaxf(v_max, __shfl_xor_sync(FULL_WARP, v_max, offset));
        }
        v_ref = v_max > 0.f ? v_max : 1.f;
        v_ref_inv = __fdividef(1.f, v_ref);  // exact for the powers of two a KVCache keeps
        v_step = v_ref_before[0] * v_ref_inv;  // the consumer's O from its tile before's units
#pragma unroll
        for (int i = 0; i + 1 < V_REF_ROUNDS; ++i) v_ref_before[i] = v_ref_before[i + 1];
        v_ref_before[V_REF_ROUNDS - 1] = v_ref;
      }
#pragma unroll
      for (int g = 0; g < ROUND_TILES; ++g) {
        const int t = u * ROUND_TILES + g;
        if (t >= tiles) break;
        const int s = t % STAGES;
        mbarrier_wait_parity(&empty[s], unsigned(t / STAGES & 1) ^ 1u);  // the stage is free
#pragma unroll
        for (int r = 0; r < Traits::TOKEN_ROUNDS; ++r) {
          const int token = lane + 32 * r - g * TILE;  // of tile g, if in [0, TILE)
          if (token >= 0 && token < TILE) {
            mask_smem[s * TILE + token] = mask[r];
            if constexpr (FP8) {  // a zero-filled slot is 0 at any scale
              k_scale_smem[s * TILE + token] = now.k_scale[r];
              v_scale_smem[s * TILE + token] = mask[r] != 0u ? now.v_scale[r] * v_ref_inv : 0.f;
            }
            if constexpr (Traits::MODDED) pos_smem[s * TILE + token] = int(now.pos[r]);
          }
        }
        if constexpr (FP8) {  // the tile's first lane
          if (lane == g * TILE % 32) v_ref_smem[s] = make_float2(v_ref, v_step);
        }
        KV* k_tile = ring + s * Traits::STAGE_ELEMS;
        KV* v_tile = k_tile + Traits::TILE_ELEMS;
#pragma unroll
        for (int c = 0; c < Traits::COPIES_PER_LANE; ++c) {
          const int chunk = lane + 32 * c;
          const int row = chunk / Traits::CHUNKS_PER_ROW;  // the tile's token
          const int col = chunk % Traits::CHUNKS_PER_ROW * Traits::CHUNK;
          // the round's token g TILE + row is lane (g TILE + row) % 32's, in token round
          // c / CHUNKS_PER_ROW where a round is one tile (g = 0), else in the only one
          const int round = Traits::TOKEN_ROUNDS == 1 ? 0 : c / Traits::CHUNKS_PER_ROW;
          const int row_of_token =
              __shfl_sync(FULL_WARP, kept_row[round], (g * TILE + row) % 32);
          const bool kept = row_of_token >= 0;
          const size_t src = size_t(kept ? row_of_token : 0) * HEAD_DIM + col;
          cp_async_16(k_tile + row * LD + col, k_pages + src, kept);
          cp_async_16(v_tile + row * LD + col, v_pages + src, kept);
        }
        cp_async_mbarrier_arrive_noinc(&full[s]);  // when this lane's copies have landed
        mbarrier_arrive(&full[s]);                 // and the mask words, now
      }
      now = next;
      next = after;
    }
  } else {
    // Q's A fragments: reg r of k-step ks holds row g + 8 (r % 2), columns 16 ks + 2 t + 8 (r / 2)
    // and the next (ptx.cuh), rows past `rows` zero.
    float q_scale = scale * LOG2E;
    // fp16 Q over fp8 pages or with modifiers (Q_RESCALED): q_scale also takes a power of two
    // that keeps the CTA's largest finite |q q_scale| under 2^15, so none overflows fp16 (1
    // where none would: the plain fp16 kernel runs only where |scale log2(e)| <= 1 keeps q in
    // range, geometry.decode_gqa_applies); S takes its inverse, q_unscale (fp8: with the K
    // scales). An inf or NaN element stays what it is.
    float q_unscale = 1.f;
    auto q_at = [&](int ks, int r, int half) {
      const int row = frag.g + 8 * (r % 2);
      const int col = 16 * ks + 2 * frag.t + 8 * (r / 2) + half;
      return row < rows ? to_float(q[(first_q_row + row) * HEAD_DIM + col]) * q_scale : 0.f;
    };
    if constexpr (Traits::Q_RESCALED) {
      float q_max = 0.f;
#pragma unroll
      for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          const float x = fabsf(q_at(ks, r / 2, r % 2));
          if (x < INFINITY) q_max = fmaxf(q_max, x);  // a NaN compares false too
        }
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        q_max = fmaxf(q_max, __shfl_xor_sync(FULL_WARP, q_max, offset));
      }
      const int exponent = (__float_as_int(q_max) >> 23) - 127;  // of a finite, non-negative max
      if (exponent >= Traits::QK_MAX_EXPONENT) {
        q_scale *= __int_as_float((127 + Traits::QK_MAX_EXPONENT - 1 - exponent) << 23);
        q_unscale = __int_as_float((127 - Traits::QK_MAX_EXPONENT + 1 + exponent) << 23);
      }
    }
    // Q's A fragments (d <= 128; the modifier variant writes consumer 0's as Q's tile, all
    // alike), or at d256 (WIDE) Q's tile written by the consumers together, a pair of columns
    // a thread at a time (every consumer's q_scale is alike; written from one warp's fragments,
    // their 128 loads a lane beside O's zeros spilled), whose S reads no fragment: one unused
    // row keeps the array's type
    u32 q_frag[Traits::WIDE ? 1 : HEAD_DIM / 16][4];
    if constexpr (Traits::WIDE) {
      constexpr int PAIRS_PER_ROW = HEAD_DIM / 2;
      constexpr int CONSUMER_THREADS = Traits::CONSUMER_WARPS * 32;
#pragma unroll 4
      for (int i = int(threadIdx.x); i < ROWS * PAIRS_PER_ROW; i += CONSUMER_THREADS) {
        const int row = i / PAIRS_PER_ROW, col = 2 * (i % PAIRS_PER_ROW);
        const bool mine = row < rows;  // rows past the CTA's are zero (and read nothing)
        const T* q_pair = q + (first_q_row + (mine ? row : 0)) * HEAD_DIM + col;
        *reinterpret_cast<u32*>(q_smem + row * Traits::Q_LD + col) =
            pack_pair<QK>(mine ? to_float(q_pair[0]) * q_scale : 0.f,
                          mine ? to_float(q_pair[1]) * q_scale : 0.f);
      }
      named_barrier_sync(Traits::Q_BARRIER, CONSUMER_THREADS);
    } else {
#pragma unroll
      for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
#pragma unroll
        for (int r = 0; r < 4; ++r) q_frag[ks][r] = pack_pair<QK>(q_at(ks, r, 0), q_at(ks, r, 1));
      }
      if constexpr (Traits::MODDED) {
        if (warp == 0) {
#pragma unroll
          for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int row = frag.g + 8 * (r % 2), col = 16 * ks + 2 * frag.t + 8 * (r / 2);
              *reinterpret_cast<u32*>(q_smem + row * Traits::Q_LD + col) = q_frag[ks][r];
            }
          }
        }
        named_barrier_sync(Traits::Q_BARRIER, Traits::CONSUMER_WARPS * 32);
      }
    }
    // The modifier variant: the query head and position of the lane's rows g and g + 8 (a row
    // past `rows` takes row 0's, so that its operand reads stay in bounds: it counts nothing)
    int row_head[2] = {0, 0}, row_pos[2] = {0, 0};
    if constexpr (Traits::MODDED) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = frag.g + 8 * r;
        const int group_row = first_row + (row < rows ? row : 0);
        row_head[r] = kv_head * kv_group + group_row / t_q;
        row_pos[r] = int(length - t_q) + group_row % t_q;
      }
    }
    for (int t = warp; t < tiles; t += Traits::CONSUMER_WARPS) {
      const int s = t % STAGES;
      mbarrier_wait_parity(&full[s], unsigned(t / STAGES & 1));
      const int* pos_of = pos_smem + s * TILE;  // the modifier variant's token positions
      // Dropout's decisions for the lane's TILE / 2 elements, bit 4 j + e: made before S is
      // live and a generator call at a time (its state beside S, Q and O, or unrolled, spilled)
      u32 kept = 0u;
      if constexpr (Traits::MODDED) {
        const Dropout dropout = Dropout::make(mods.dropout_threshold, mods.dropout_seed,
                                              mods.dropout_seed_words, mods.use_seed_words,
                                              mods.dropout_scale);
        if (dropout.on()) {
#pragma unroll 1
          for (int i = 0; i < TILE / 2; ++i) {
            const int r = i % 4 / 2;  // element e = i % 4 of n-tile j = i / 4
            const int head = r ? row_head[1] : row_head[0], pos = r ? row_pos[1] : row_pos[0];
            kept |= u32(dropout_keeps(dropout, b, head, pos, pos_of[frag.col(i / 4, i % 4)])) << i;
          }
        }
      }
      using PV = typename Traits::PV;
      const QK* k_tile;
      const PV* v_tile;
      int tile_ld;
      if constexpr (FP8) {
        // the codes widened (exact: every e4m3 and e5m2 code is an fp16) into this warp's own
        // fp16 tiles; the scales stay outside, on the scores and the probabilities
        unsigned char* wide = reinterpret_cast<unsigned char*>(ring) +
                              (Traits::RING_BYTES > Traits::MERGE_BYTES ? Traits::RING_BYTES
                                                                        : Traits::MERGE_BYTES) +
                              warp * Traits::WIDE_WARP_BYTES;
        QK* k_wide = reinterpret_cast<QK*>(wide);
        PV* v_wide = reinterpret_cast<PV*>(wide + Traits::WIDE_WARP_BYTES / 2);
        widen_tile<Traits>(k_wide, ring + s * Traits::STAGE_ELEMS, lane);
        widen_tile<Traits>(v_wide, ring + s * Traits::STAGE_ELEMS + Traits::TILE_ELEMS, lane);
        __syncwarp();
        k_tile = k_wide;
        v_tile = v_wide;
        tile_ld = Traits::WIDE_LD;
      } else {
        k_tile = ring + s * Traits::STAGE_ELEMS;
        v_tile = k_tile + Traits::TILE_ELEMS;
        tile_ld = LD;
      }
      float s_acc[TILE / 8][4];
#pragma unroll
      for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s_acc[j][e] = 0.f;
      }
      if constexpr (Traits::Q_SHARED) {
        warp_gemm_rs_nk<TILE, HEAD_DIM>(s_acc, q_smem, Traits::Q_LD, k_tile, tile_ld);
      } else {
        warp_gemm_fs_nk<TILE, HEAD_DIM>(s_acc, q_frag, k_tile, tile_ld);
      }
      if constexpr (Traits::MODDED) {
        score_mods<TILE, Traits>(s_acc, frag, mods, pos_of, k_scale_smem + s * TILE, q_unscale, b,
                           row_head, row_pos);
      }
      // an uncounted token's score is replaced by -inf, never multiplied
      const u32* masks = mask_smem + s * TILE;
      float m_tile[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < TILE / 8; ++j) {
        const u32 words[2] = {masks[frag.pair_col(j)], masks[frag.pair_col(j) + 1]};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          // fp8: q.code times the token's K scale (and q_unscale) is the score (the modifier
          // variant's score_mods did that)
          if constexpr (FP8 && !Traits::MODDED) {
            s_acc[j][e] *= k_scale_smem[s * TILE + frag.pair_col(j) + e % 2] * q_unscale;
          }
          const u32 word = words[e % 2] >> frag.g;
          const bool counts = (word >> (8 * (e / 2))) & 1u;
          s_acc[j][e] = counts ? s_acc[j][e] : -INFINITY;
          // fmaxf drops a NaN score from the max; its probability below is NaN all the same
          m_tile[e / 2] = fmaxf(m_tile[e / 2], s_acc[j][e]);
        }
      }
      if constexpr (Traits::MODDED) {
        if (mods.keep_scores) {  // HeavyHitters': the natural score, -inf where it did not count
          const size_t tokens_per_row = size_t(max_pages) * page_size;
#pragma unroll
          for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int slot = slot_lo + t * TILE + frag.col(j, e);
              if (frag.row(e) < rows && slot < slot_hi) {
                mods.token_scores[(first_q_row + frag.row(e)) * tokens_per_row + slot] =
                    s_acc[j][e] * LN2;
              }
            }
          }
        }
      }
      float base[2], correction[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m_new = fmaxf(m_i[r], quad_max(m_tile[r]));
        // nothing but -inf so far: shift by 0, so that a -inf gives p = 0 (not NaN) and a NaN
        // score still gives NaN; a +inf max makes p and the correction NaN (the row NaN)
        base[r] = m_new == -INFINITY ? 0.f : m_new;
        correction[r] = exp2f(m_i[r] - base[r]);
        m_i[r] = m_new;
      }
      float p_sum[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s_acc[j][e] = exp2f(s_acc[j][e] - base[e / 2]);
          p_sum[e / 2] += s_acc[j][e];
          // fp8: P.V multiplies the V codes, so a probability takes its token's V scale over
          // the tile's v_ref (at most 1: the fp16 P stays in range at any scale)
          if constexpr (FP8) s_acc[j][e] *= v_scale_smem[s * TILE + frag.pair_col(j) + e % 2];
        }
      }
      if constexpr (Traits::MODDED) {  // l_i is of every probability, dropped or not
        if (u32(mods.dropout_threshold) != 0u) {
#pragma unroll
          for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              s_acc[j][e] = (kept >> (4 * j + e) & 1u) ? s_acc[j][e] * mods.dropout_scale : 0.f;
            }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) l_i[r] = l_i[r] * correction[r] + p_sum[r];
      // fp8: O's correction also takes it from the v_ref of this warp's tile before to this
      // tile's (l_i's stays of the probabilities alone); a 0 correction (nothing counted yet)
      // stays 0
      if constexpr (FP8) {
        const float step = v_ref_smem[s].y;
#pragma unroll
        for (int r = 0; r < 2; ++r) correction[r] *= step;
      }
#pragma unroll
      for (int j = 0; j < HEAD_DIM / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] *= correction[e / 2];
      }
      // O += P V: P's zeros still multiply v, 0 * NaN = NaN, as the dense computation
      warp_gemm_regs_kn<HEAD_DIM, TILE>(acc, s_acc, v_tile, tile_ld, nullptr);
      mbarrier_arrive(&empty[s]);  // this lane's reads of the stage are done
    }
  }

  // The consumers' (O, m, l) merge through shared memory (the ring, whose copies have all
  // landed: every tile was waited for).
  __syncthreads();
  float* merge_smem = reinterpret_cast<float*>(ring);
  constexpr int MERGE_LD = Traits::MERGE_LD;
  if (warp < Traits::CONSUMER_WARPS) {
    if constexpr (FP8) {
      // O in the V scales' units: times the v_ref of this warp's last tile, whose stage no tile
      // refills (1 without a tile)
      const int last = warp + (tiles - 1 - warp) / Traits::CONSUMER_WARPS * Traits::CONSUMER_WARPS;
      const float v_units = warp < tiles ? v_ref_smem[last % STAGES].x : 1.f;
#pragma unroll
      for (int j = 0; j < HEAD_DIM / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] *= v_units;
      }
    }
    float* mine = merge_smem + warp * ROWS * MERGE_LD;
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) mine[frag.row(e) * MERGE_LD + frag.col(j, e)] = acc[j][e];
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l_row = quad_sum(l_i[r]);
      if (frag.t == 0) {
        mine[frag.row(2 * r) * MERGE_LD + HEAD_DIM] = m_i[r];
        mine[frag.row(2 * r) * MERGE_LD + HEAD_DIM + 1] = l_row;
      }
    }
  }
  __syncthreads();
  for (int i = warp; i < rows; i += Traits::NUM_WARPS) {
    WarpPartials<Traits::CONSUMER_WARPS, HEAD_DIM, true> parts{merge_smem + i * MERGE_LD,
                                                               ROWS * MERGE_LD};
    parts.weigh();
    // l_all == 0: the row counts nothing in this split: lse -inf and out the bare sum, which
    // the merge multiplies by its weight 0; a NaN l_all gives NaN for both
    const float m_all = parts.m_all, l_all = parts.l_all;
    const bool none = l_all == 0.f;
    const float inv_l = none ? 1.f : 1.f / l_all;
    // With one split the row's answer itself (what attn_decode_merge makes of one part),
    // otherwise the split's partial
    const size_t q_row = first_q_row + i;
    for (int d = lane; d < HEAD_DIM; d += 32) {
      const float sum = parts.column(d);
      if (splits == 1) {
        out[q_row * HEAD_DIM + d] = from_float<T>(none ? 0.f : sum * inv_l);
      } else {
        part_out[(q_row * splits + split) * HEAD_DIM + d] = sum * inv_l;
      }
    }
    if (lane == 0) {
      const float row_lse = none ? -INFINITY : (m_all + log2f(l_all)) * LN2;
      if (splits == 1) {
        lse[q_row] = row_lse;
      } else {
        part_lse[q_row * splits + split] = row_lse;
      }
    }
  }
  if (splits == 1) return;

  // The CTA that writes the last split of its rows merges them all (no merge kernel): every
  // thread's partials are fenced device-wide before the ticket counts them.
  __shared__ int merges;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int ticket = atomicAdd(&tickets[size_t(blockIdx.z) * gridDim.y + blockIdx.y], 1);
    merges = ticket == splits - 1;
  }
  __syncthreads();
  if (!merges) return;
  __threadfence();  // the other splits' partials, read after their tickets
  for (int i = warp; i < rows; i += Traits::NUM_WARPS) {
    const size_t q_row = first_q_row + i;
    const SplitMajor<HEAD_DIM> parts{part_out + q_row * splits * HEAD_DIM,
                                     part_lse + q_row * splits, splits};
    merge_row<HEAD_DIM, MERGE_WEIGH_EMPTY>(parts, out + q_row * HEAD_DIM, lse + q_row, lane);
  }
}

// The score modifiers and HeavyHitters' scores (GqaScoreMods), after every argument the plain
// kernel (MODS_NONE) reads, which ignores them.
#define CUATTN_GQA_SCORE_MOD_PARAMS                                                        \
  float* __restrict__ token_scores, float softcap, const float* __restrict__ alibi_slopes,    \
      int use_alibi, int alibi_batch_stride, const float* __restrict__ key_bias,              \
      int use_key_bias, long long key_bias_batch_stride, long long key_bias_head_stride,      \
      const float* __restrict__ rel_bias, int use_rel_bias, int rel_bias_batch_stride,        \
      int rel_max_distance, long long dropout_threshold, long long dropout_seed,              \
      float dropout_scale, const u32* __restrict__ dropout_seed_words, int use_seed_words,    \
      int keep_scores
#define CUATTN_GQA_SCORE_MODS                                                                 \
  GqaScoreMods {                                                                              \
    token_scores, softcap, alibi_slopes, use_alibi, alibi_batch_stride, key_bias,             \
        use_key_bias, key_bias_batch_stride, key_bias_head_stride, rel_bias, use_rel_bias,    \
        rel_bias_batch_stride, rel_max_distance, dropout_threshold, dropout_seed,             \
        dropout_scale, dropout_seed_words, use_seed_words, keep_scores                        \
  }

template <int TILE, int HEAD_DIM, typename T, int MODS>
__global__ void __launch_bounds__(
    attn_decode_gqa_traits<TILE, HEAD_DIM, T, T, MODS>::NUM_THREADS,
    attn_decode_gqa_traits<TILE, HEAD_DIM, T, T, MODS>::MIN_CTAS_PER_SM)
    attn_decode_gqa(const T* __restrict__ q, const T* __restrict__ k_pages,
                    const T* __restrict__ v_pages, const long long* __restrict__ slot_pos,
                    const int* __restrict__ page_table, const int* __restrict__ page_count,
                    const long long* __restrict__ lengths, const unsigned char* __restrict__ chosen,
                    float* __restrict__ part_out, float* __restrict__ part_lse,
                    T* __restrict__ out, float* __restrict__ lse, int* __restrict__ tickets,
                    int heads, int kv_heads, int t_q, int page_size, int max_pages,
                    int table_batch_stride, int table_head_stride, int page_rows, int token_rows,
                    int head_rows, int use_slot_pos, int splits, int pages_per_split, float scale,
                    int use_chosen, CUATTN_GQA_SCORE_MOD_PARAMS) {
  attn_decode_gqa_body<TILE, HEAD_DIM, T, T, MODS>(
      q, k_pages, v_pages, slot_pos, page_table, page_count, lengths, chosen, part_out, part_lse,
      out, lse, tickets, heads, kv_heads, t_q, page_size, max_pages, table_batch_stride,
      table_head_stride, page_rows, token_rows, head_rows, use_slot_pos, splits, pages_per_split,
      scale, use_chosen, nullptr, nullptr, CUATTN_GQA_SCORE_MODS);
}

// attn_decode_gqa over fp8 pages (KV fp8_e4m3 or fp8_e5m2; q and out bf16): the producer copies
// the codes (half the bytes) and each token's page scales (k_scale / v_scale float32
// [num_pages], cuattn/serving/fp8.py) into the stage; a consumer widens the K and V codes to
// fp16 in tiles of its own (exact), multiplies each score by its token's K scale before the
// mask (and every modifier) and each probability by its V scale over the tile's v_ref after
// l_i's sum, and computes on tensor cores as attn_decode_gqa (Q K^T and P V in fp16, O in
// units of its last tile's v_ref).
template <int TILE, int HEAD_DIM, typename T, typename KV, int MODS>
__global__ void __launch_bounds__(
    attn_decode_gqa_traits<TILE, HEAD_DIM, T, KV, MODS>::NUM_THREADS,
    attn_decode_gqa_traits<TILE, HEAD_DIM, T, KV, MODS>::MIN_CTAS_PER_SM)
    attn_decode_gqa_fp8(const T* __restrict__ q, const KV* __restrict__ k_pages,
                        const KV* __restrict__ v_pages, const long long* __restrict__ slot_pos,
                        const int* __restrict__ page_table, const int* __restrict__ page_count,
                        const long long* __restrict__ lengths,
                        const unsigned char* __restrict__ chosen, float* __restrict__ part_out,
                        float* __restrict__ part_lse, T* __restrict__ out, float* __restrict__ lse,
                        int* __restrict__ tickets, int heads, int kv_heads, int t_q, int page_size,
                        int max_pages, int table_batch_stride, int table_head_stride,
                        int page_rows, int token_rows, int head_rows, int use_slot_pos,
                        int splits, int pages_per_split, float scale,
                        int use_chosen, const float* __restrict__ k_scale,
                        const float* __restrict__ v_scale, CUATTN_GQA_SCORE_MOD_PARAMS) {
  static_assert(is_fp8_type<KV>::value, "the fp8 tensor-core decode reads fp8 pages");
  attn_decode_gqa_body<TILE, HEAD_DIM, T, KV, MODS>(
      q, k_pages, v_pages, slot_pos, page_table, page_count, lengths, chosen, part_out, part_lse,
      out, lse, tickets, heads, kv_heads, t_q, page_size, max_pages, table_batch_stride,
      table_head_stride, page_rows, token_rows, head_rows, use_slot_pos, splits, pages_per_split,
      scale, use_chosen, k_scale, v_scale, CUATTN_GQA_SCORE_MODS);
}

#undef CUATTN_GQA_SCORE_MOD_PARAMS
#undef CUATTN_GQA_SCORE_MODS
