// Split-KV decode attention over a paged KV cache (flash-decoding): the splits' partial results.
//
// attn_decode_split<TILE, ROWS, HEAD_DIM, T, MODS>: grid (splits, kv_heads * row_chunks, batch), 4
//   warps; MODS (kernels/common/types.cuh ScoreModsFlag): MODS_NONE the plain kernel, MODS_SCORE
//   the variant that reads softcap.
//   A CTA owns one split of one (sequence, kv head)'s page table, pages
//   [split * pages_per_split, (split + 1) * pages_per_split) of its page_count, read as one run
//   of table slots (slot f is offset f % page_size of table entry f / page_size, so any page
//   size walks the same way), and up to ROWS of the kv group's kv_group * t_q query rows (query
//   head kv_head * kv_group + r / t_q, query r % t_q at position lengths[b] - t_q + r % t_q).
//   A token counts for a row when its position >= 0 (kept), <= the row's position (causal) and,
//   with use_chosen, the row's Quest (or caller's) choice reads its page. Two page layouts, one
//   walk (PageWalk): a KVCache's (use_slot_pos: a table row and page count per (sequence, kv
//   head), positions in slot_pos, pages [num_pages, page_size, HEAD_DIM]) and a caller's
//   (cuattn.paged_decode: one table row per sequence for every kv head, the table slot is the
//   position, kept below lengths[b], which also give the page count; pages [num_blocks,
//   block_size, kv_heads, HEAD_DIM] at any strides that are whole HEAD_DIM rows). A score is
//   scale * q.k, in the MODS_SCORE variant capped as softcap * tanh(s / softcap) if softcap > 0
//   and, with use_alibi, given ALiBi's -slope[b, head] * (query position - token position), and
//   with use_key_bias the key bias of the token's position, key_bias[b, (head,) position], and
//   with use_rel_bias the relative-position table's rel_bias[b, head, clamp(position - query
//   position, -M, M) + M]. With dropout_threshold > 0 each probability a row gives a token is
//   dropped or scaled by dropout_scale before P.V (l_i, the lse and HeavyHitters' scores are of
//   every probability), by the generator at (query position, token position, query head, b)
//   (kernels/common/philox.cuh dropout_keeps).
//   The run is cut in sub-tiles of TOKENS_PER_WARP = TILE / 4 tokens; warp w takes sub-tiles
//   w, w + 4, ... and copies each one's K and V rows into its own two shared stages (cp.async:
//   the next sub-tile is in flight while this one is computed) and computes it alone: no CTA
//   barrier until the end. In a sub-tile, a token belongs to LANES_PER_TOKEN lanes that split its
//   head dim, so one 16-byte K read feeds the FMAs of every row and a score costs
//   log2(LANES_PER_TOKEN) shuffles; the online softmax (m_i, l_i) updates once per sub-tile and
//   row; for P.V each lane owns head-dim elements lane + 32 e, reads its V elements of a token
//   once for all rows and takes each row's probability of that token by a shuffle. At the end
//   the warps' (m_i, l_i, acc) merge in shared memory and the CTA writes the split's partial
//   out [B, H, t_q, splits, HEAD_DIM] (float) and lse [B, H, t_q, splits] (-inf: no token), and
//   with keep_scores the scaled score of every (row, table slot) it walked, -inf where the token
//   did not count: token_scores [B, H, t_q, max_pages * page_size] (HeavyHitters turns them into
//   probabilities with the merged lse, with no second pass over K).
// attn_decode_split_fp8<TILE, ROWS, HEAD_DIM, T, KV, MODS>: the same over fp8 pages (KV fp8_e4m3
//   or fp8_e5m2, uint8 codes; q and out T), with k_scale and v_scale float32 [num_pages], each
//   page's scales: a kept element is code * scale (cuattn/serving/fp8.py). The codes are copied
//   as they are and widened in registers; the K scale multiplies a token's score before any
//   modifier, the V scale its probability in P.V.
// The merge of a row's splits into out and lse is attn_decode_merge, in kernels/merge_states.cu
//   beside the two-way merge it shares its row function with; it multiplies every split, an
//   empty one by weight 0 (what special values need, below).
// attn_decode_mass: grid (ceil(max_pages * page_size / NUM_THREADS), batch * kv_heads): HeavyHitters'
//   score update, a thread per table slot f < page_count * page_size of a (sequence, kv head):
//   the probability each of the kv group's kv_group * t_q query rows gave the slot's token,
//   exp(token_scores[row, f] - lse[row]) (0 where the score is -inf; nothing where it is NaN),
//   summed over the rows in order and added to slot_score (float64) of page_table[f / page_size],
//   offset f % page_size. Every slot is one thread's: no atomics, the same sum on every run.
// Special values (docs/design.md §7, cuattn/serving/decode.py): NaN and inf go as in a dense
//   masked softmax of every query row of a kv group against every kept token, whatever the split
//   count: a token a row does not attend has score -inf (probability 0) and still multiplies its
//   v (0 * NaN = NaN); a slot with no kept token is read as zeros, so what it still holds reaches
//   nothing; a NaN or +inf score makes its row NaN; a row with nothing but -inf gives 0 and -inf.
// Shapes: q [B, H, t_q, HEAD_DIM] contiguous; k_pages, v_pages: the row of table slot f is
// page_rows page + token_rows offset + head_rows kv_head (HEAD_DIM contiguous elements each,
// 16-byte aligned), fewer than 2^31 rows; page_table int32, the row of (b, kv head) at
// b table_batch_stride + kv_head table_head_stride, max_pages entries (attn_decode_mass: [B,
// kv_heads, max_pages]); with use_slot_pos slot_pos int64 [num_pages, page_size] and page_count
// int32 [B, kv_heads] (otherwise not read); lengths int64 [B]; chosen uint8 [B, H, t_q,
// max_pages]; lse float32 [B, H, t_q] (the merged one); slot_score float64 [num_pages,
// page_size].
// Run: through cuattn.decode_attention on a KVCache or cuattn.paged_decode on a caller's page
// table (backend "cuda" or "interp"); TILE, ROWS and the split count come from
// cuattn/backends/geometry.py (decode_tile, decode_rows_per_cta, decode_splits).
#include "common/decode_cta.cuh"
#include "common/merge_row.cuh"
#include "common/philox.cuh"
#include "common/smem.cuh"
#include "common/types.cuh"

template <int TILE, int ROWS, int HEAD_DIM, typename T>
struct attn_decode_split_traits {
  static constexpr int NUM_WARPS = 4;
  static constexpr int NUM_THREADS = NUM_WARPS * 32;
  // Two resident CTAs per SM, what the d = 128 stages' shared memory allows anyway: up to 255
  // registers a thread, so the rows' accumulators never spill.
  static constexpr int MIN_CTAS_PER_SM = 2;
  static constexpr int STAGES = 2;  // per warp: the sub-tile computed and the one in flight
  static constexpr int TOKENS_PER_WARP = TILE / NUM_WARPS;
  static constexpr int LANES_PER_TOKEN = 32 / TOKENS_PER_WARP;
  static constexpr int CHUNK = 16 / int(sizeof(T));  // elements of one 16-byte copy or read
  static constexpr int CHUNKS_PER_ROW = HEAD_DIM / CHUNK;
  static constexpr int CHUNKS_PER_LANE = (CHUNKS_PER_ROW + LANES_PER_TOKEN - 1) / LANES_PER_TOKEN;
  static constexpr int COPIES_PER_LANE = (TOKENS_PER_WARP * CHUNKS_PER_ROW + 31) / 32;
  static constexpr int LANE_ELEMS = (HEAD_DIM + 31) / 32;  // P.V: elements lane + 32 e
  static constexpr int LD = SmemStride<T, HEAD_DIM>::value;
  static constexpr int STAGE_ELEMS = TOKENS_PER_WARP * LD;      // one K or V sub-tile
  static constexpr int WARP_ELEMS = STAGES * 2 * STAGE_ELEMS;   // [stage][K, V][token][LD]
  // q (scaled, float) and each row's query index, then the warps' stages, which the final
  // merge ([warp][row][acc..., m_i, l_i], float) reuses.
  static constexpr int Q_BYTES = ROWS * (HEAD_DIM + 1) * 4;
  static constexpr int TILE_BYTES = NUM_WARPS * WARP_ELEMS * int(sizeof(T));
  static constexpr int MERGE_BYTES = NUM_WARPS * ROWS * (HEAD_DIM + 2) * 4;
  static constexpr int SMEM_BYTES = Q_BYTES + (TILE_BYTES > MERGE_BYTES ? TILE_BYTES : MERGE_BYTES);
  static_assert(TILE % NUM_WARPS == 0 && 32 % TOKENS_PER_WARP == 0, "a warp's tokens split its lanes");
  static_assert(HEAD_DIM % CHUNK == 0, "K rows are whole 16-byte chunks");
  static_assert(ROWS % 4 == 0, "the stages after q must stay 16-byte aligned");
};

// max(a, b) that is NaN when either is (fmaxf drops a NaN): a row's running max carries a NaN
// score, so that the row comes out NaN rather than missing that score.
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

// One (sequence, kv head)'s page table and where its tokens live. Table entry e names a page;
// the token at offset o of page p starts page_rows p + token_rows o + head_row HEAD_DIM-element
// rows into k_pages and v_pages (a KVCache's per-(sequence, kv head) pages: page_size, 1, 0; a
// caller's [num_blocks, block_size, kv_heads, HEAD_DIM] pages: block_size kv_heads, kv_heads,
// kv_head). Its position: slot_pos[p page_size + o] with use_slot_pos (a KVCache's), otherwise
// the table slot itself, kept while below the sequence's length.
struct PageWalk {
  const int* __restrict__ table;
  const long long* __restrict__ slot_pos;
  int page_size, page_rows, token_rows, head_row;
  long long length;
  int use_slot_pos;

  // The k_pages / v_pages row of table slot f (in entry `entry`, page `page`) and its position.
  __device__ __forceinline__ int row_of(int f, int entry, int page) const {
    return page * page_rows + (f - entry * page_size) * token_rows + head_row;
  }
  __device__ __forceinline__ long long position(int f, int entry, int page) const {
    if (!use_slot_pos) return f < length ? f : -1;
    return slot_pos[page * page_size + (f - entry * page_size)];
  }
};

// Starts the copy of one sub-tile (table slots first_slot + t, t < TOKENS_PER_WARP; none past
// last_slot) of K and V into `stage` ([K, V][token][LD]) and commits it. A slot past the run or
// keeping no token (position -1: evicted, room in a page, past a caller's sequence) is
// zero-filled: its memory may hold an earlier token's NaN or inf, which 0 * x would carry into
// every row. Returns this lane's token's position (-1 for those) and, in `entry`, the token's
// page-table entry; for fp8 pages (T fp8_e4m3 or fp8_e5m2) also its page's scales, read here so
// that their loads are in flight with the copies (page 0's, finite, past the run; unused
// otherwise).
template <typename Traits, int HEAD_DIM, typename T>
__device__ __forceinline__ long long copy_sub_tile(T* stage, const T* __restrict__ k_pages,
                                                   const T* __restrict__ v_pages,
                                                   const PageWalk& walk, int first_slot,
                                                   int last_slot, int& entry,
                                                   const float* __restrict__ k_scale,
                                                   const float* __restrict__ v_scale,
                                                   float& token_k_scale, float& token_v_scale) {
  constexpr int TPW = Traits::TOKENS_PER_WARP;
  constexpr int CPR = Traits::CHUNKS_PER_ROW;
  const int lane = int(threadIdx.x) % 32;
  const int f = first_slot + lane % TPW;
  const bool valid = f < last_slot;
  entry = valid ? f / walk.page_size : 0;
  const int page = valid ? walk.table[entry] : 0;
  const int slot_row = valid ? walk.row_of(f, entry, page) : 0;
  if constexpr (is_fp8_type<T>::value) {
    token_k_scale = k_scale[page];
    token_v_scale = v_scale[page];
  }
  const long long pos = valid ? walk.position(f, entry, page) : -1;
#pragma unroll
  for (int c = 0; c < Traits::COPIES_PER_LANE; ++c) {
    const int chunk = lane + 32 * c;
    const int row = min_int(chunk / CPR, TPW - 1);
    // every lane shuffles (a shuffle needs the whole warp); lane `row` holds token `row`
    const int src_row = __shfl_sync(FULL_WARP, slot_row, row);
    const int row_valid = __shfl_sync(FULL_WARP, int(pos >= 0), row);
    if (chunk < TPW * CPR) {
      const int col = (chunk % CPR) * Traits::CHUNK;
      const size_t src = size_t(src_row) * HEAD_DIM + col;
      cp_async_16(stage + row * Traits::LD + col, k_pages + src, row_valid != 0);
      cp_async_16(stage + Traits::STAGE_ELEMS + row * Traits::LD + col, v_pages + src,
                  row_valid != 0);
    }
  }
  cp_async_commit();
  return pos;
}

// The split kernel's body, for pages of KV: T (attn_decode_split) or fp8 codes whose page
// scales are k_scale and v_scale (attn_decode_split_fp8; nullptr otherwise).
template <int TILE, int ROWS, int HEAD_DIM, typename T, typename KV, int MODS>
__device__ __forceinline__ void attn_decode_split_body(
                      const T* __restrict__ q, const KV* __restrict__ k_pages,
                      const KV* __restrict__ v_pages, const long long* __restrict__ slot_pos,
                      const int* __restrict__ page_table, const int* __restrict__ page_count,
                      const long long* __restrict__ lengths, const unsigned char* __restrict__ chosen,
                      float* __restrict__ part_out, float* __restrict__ part_lse,
                      float* __restrict__ token_scores, int heads, int kv_heads, int t_q,
                      int page_size, int max_pages, int table_batch_stride,
                      int table_head_stride, int page_rows, int token_rows, int head_rows,
                      int use_slot_pos, int splits, int pages_per_split, float scale,
                      float softcap, const float* __restrict__ alibi_slopes, int use_alibi,
                      int alibi_batch_stride, const float* __restrict__ key_bias,
                      int use_key_bias, long long key_bias_batch_stride,
                      long long key_bias_head_stride, const float* __restrict__ rel_bias,
                      int use_rel_bias, int rel_bias_batch_stride, int rel_max_distance,
                      long long dropout_threshold, long long dropout_seed, float dropout_scale,
                      const u32* __restrict__ dropout_seed_words, int use_seed_words,
                      int use_chosen, int keep_scores, const float* __restrict__ k_scale,
                      const float* __restrict__ v_scale) {
  using Traits = attn_decode_split_traits<TILE, ROWS, HEAD_DIM, KV>;
  constexpr bool FP8 = is_fp8_type<KV>::value;
  constexpr int TPW = Traits::TOKENS_PER_WARP;
  constexpr int LPT = Traits::LANES_PER_TOKEN;
  constexpr int CHUNK = Traits::CHUNK;
  const int warp = int(threadIdx.x) / 32;
  const int lane = int(threadIdx.x) % 32;
  const int kv_group = heads / kv_heads;
  const DecodeCta<ROWS> cta(heads, kv_heads, t_q, lengths, page_count, page_size,
                            pages_per_split, use_slot_pos);
  const int split = cta.split, kv_head = cta.kv_head, first_row = cta.first_row, b = cta.b;
  const int rows = cta.rows, slot_lo = cta.slot_lo, slot_hi = cta.slot_hi;
  const long long length = cta.length;
  const long long first_query_pos = length - t_q;  // query r % t_q sits at this + r % t_q
  const int* table =
      page_table + size_t(b) * table_batch_stride + size_t(kv_head) * table_head_stride;
  const PageWalk walk{table, slot_pos, page_size, page_rows, token_rows, kv_head * head_rows,
                      length, use_slot_pos};
  const size_t tokens_per_row = size_t(max_pages) * page_size;
  // row i of the CTA: row index into [B, H, t_q] (query head, then query)
  auto q_row_of = [&](int i) {
    const int r = first_row + i;
    return (size_t(b) * heads + kv_head * kv_group + r / t_q) * t_q + r % t_q;
  };

  float* q_smem = dynamic_smem<float>();
  int* query_smem = reinterpret_cast<int*>(q_smem + ROWS * HEAD_DIM);
  KV* warp_stages = reinterpret_cast<KV*>(query_smem + ROWS) + warp * Traits::WARP_ELEMS;
  for (int x = int(threadIdx.x); x < ROWS * HEAD_DIM; x += Traits::NUM_THREADS) {
    const int i = x / HEAD_DIM;
    q_smem[x] = i < rows ? to_float(q[q_row_of(i) * HEAD_DIM + x % HEAD_DIM]) * scale : 0.f;
  }
  if (int(threadIdx.x) < ROWS) query_smem[threadIdx.x] = (first_row + int(threadIdx.x)) % t_q;
  __syncthreads();

  // Per row, replicated in every lane: running max m_i and sum l_i; acc: this lane's elements.
  float m_i[ROWS], l_i[ROWS], acc[ROWS][Traits::LANE_ELEMS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    m_i[i] = -INFINITY;
    l_i[i] = 0.f;
#pragma unroll
    for (int e = 0; e < Traits::LANE_ELEMS; ++e) acc[i][e] = 0.f;
  }

  const int token = lane % TPW;  // this lane's token in a sub-tile
  const int part = lane / TPW;   // and which of its head dim's chunks it reads: part + LPT c
  const int sub_tiles = (slot_hi - slot_lo + TPW - 1) / TPW;
  const int mine = sub_tiles > warp ? (sub_tiles - warp + Traits::NUM_WARPS - 1) / Traits::NUM_WARPS : 0;
  int entry_next = 0;
  long long pos_next = -1;
  float k_scale_next = 1.f, v_scale_next = 1.f;  // fp8: the lane's token's page scales
  if (mine > 0) {
    pos_next = copy_sub_tile<Traits, HEAD_DIM>(warp_stages, k_pages, v_pages, walk,
                                               slot_lo + warp * TPW, slot_hi, entry_next, k_scale,
                                               v_scale, k_scale_next, v_scale_next);
  }

  // The sub-tile loop: warp `warp`'s k-th sub-tile starts at table slot first_slot.
  for (int k = 0; k < mine; ++k) {
    const long long pos = pos_next;
    const int entry = entry_next;
    const float token_k_scale = k_scale_next, token_v_scale = v_scale_next;
    const int first_slot = slot_lo + (warp + Traits::NUM_WARPS * k) * TPW;
    const KV* k_tile = warp_stages + (k % Traits::STAGES) * 2 * Traits::STAGE_ELEMS;
    const KV* v_tile = k_tile + Traits::STAGE_ELEMS;
    if (k + 1 < mine) {
      KV* next = warp_stages + ((k + 1) % Traits::STAGES) * 2 * Traits::STAGE_ELEMS;
      pos_next = copy_sub_tile<Traits, HEAD_DIM>(next, k_pages, v_pages, walk,
                                                 first_slot + Traits::NUM_WARPS * TPW, slot_hi,
                                                 entry_next, k_scale, v_scale, k_scale_next,
                                                 v_scale_next);
    } else {
      cp_async_commit();  // an empty group, so that waiting for all but one means this sub-tile
    }
    cp_async_wait_group<1>();
    __syncwarp();  // every lane's copies of this sub-tile are visible to the whole warp

    // s_i: this lane's token's scaled score for every row, its chunks first, then the parts'
    float s[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) s[i] = 0.f;
#pragma unroll
    for (int c = 0; c < Traits::CHUNKS_PER_LANE; ++c) {
      const int chunk = part + LPT * c;
      if (chunk < Traits::CHUNKS_PER_ROW) {
        float k_chunk[CHUNK];
        load_16_as_float(k_tile + token * Traits::LD + chunk * CHUNK, k_chunk);
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
          if (i >= rows) break;  // uniform across the CTA
#pragma unroll
          for (int h = 0; h < CHUNK; h += 4) {
            float q_part[4];
            load_16_as_float(q_smem + i * HEAD_DIM + chunk * CHUNK + h, q_part);
#pragma unroll
            for (int x = 0; x < 4; ++x) s[i] += q_part[x] * k_chunk[h + x];
          }
        }
      }
    }
    const bool in_run = first_slot + token < slot_hi;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      if (i >= rows) break;
#pragma unroll
      for (int offset = TPW; offset < 32; offset *= 2) s[i] += __shfl_xor_sync(FULL_WARP, s[i], offset);
      if constexpr (FP8) s[i] *= token_k_scale;  // q.(code scale), before every modifier
      const long long query_pos = first_query_pos + query_smem[i];
      if constexpr (MODS == MODS_SCORE) {
        if (softcap > 0.f) s[i] = softcap * tanhf(s[i] / softcap);  // Gemma 2's capped score
        const int head = kv_head * kv_group + (first_row + i) / t_q;  // the row's query head
        if (use_alibi) s[i] -= alibi_slopes[b * alibi_batch_stride + head] * float(query_pos - pos);
        if (use_key_bias && pos >= 0) {  // an evicted slot (pos -1) counts for nothing anyway
          s[i] += key_bias[b * key_bias_batch_stride + head * key_bias_head_stride + pos];
        }
        if (use_rel_bias && pos >= 0) {
          const long long reach = rel_max_distance;
          const long long rel = pos - query_pos;
          const long long column = rel < -reach ? 0 : rel > reach ? 2 * reach : rel + reach;
          s[i] += rel_bias[b * rel_bias_batch_stride + head * (2 * reach + 1) + column];
        }
      }
      bool counts = pos >= 0 && pos <= query_pos;
      if (use_chosen && counts) counts = chosen[q_row_of(i) * max_pages + entry] != 0;
      s[i] = counts ? s[i] : -INFINITY;
      if (keep_scores && in_run && part == 0) {
        token_scores[q_row_of(i) * tokens_per_row + first_slot + token] = s[i];
      }
      // online softmax over the sub-tile's tokens (lanes of one part hold every token once)
      float m_tile = s[i];
#pragma unroll
      for (int offset = 1; offset < TPW; offset *= 2) {
        m_tile = nan_max(m_tile, __shfl_xor_sync(FULL_WARP, m_tile, offset));
      }
      const float m_new = nan_max(m_i[i], m_tile);
      if (m_new == -INFINITY) {  // nothing but -inf so far (uniform across the warp)
        s[i] = 0.f;  // p = 0, which P.V still multiplies: 0 * NaN in v is NaN, as dense
        continue;
      }
      // a NaN or +inf max (a NaN or +inf score) makes p and the correction NaN: l_i and acc too
      const float correction = expf(m_i[i] - m_new);  // m_i = -inf: exp(-inf) = 0
      const float p = expf(s[i] - m_new);             // s = -inf: 0
      float p_sum = p;
#pragma unroll
      for (int offset = 1; offset < TPW; offset *= 2) p_sum += __shfl_xor_sync(FULL_WARP, p_sum, offset);
      l_i[i] = l_i[i] * correction + p_sum;
      m_i[i] = m_new;
#pragma unroll
      for (int e = 0; e < Traits::LANE_ELEMS; ++e) acc[i][e] *= correction;
      s[i] = p;
      if constexpr (MODS == MODS_SCORE) {  // l_i above is of every probability, dropped or not
        const Dropout dropout = Dropout::make(dropout_threshold, dropout_seed, dropout_seed_words,
                                              use_seed_words, dropout_scale);
        if (dropout.on()) {
          const int head = kv_head * kv_group + (first_row + i) / t_q;
          s[i] = dropout_keeps(dropout, b, head, query_pos, pos) ? p * dropout.scale : 0.f;
        }
      }
      // fp8: P.V multiplies the V codes, so each token's probability takes its page's V scale
      if constexpr (FP8) s[i] *= token_v_scale;
    }

    // acc += P V: each token's V elements read once, its probability per row from its lane
#pragma unroll
    for (int t = 0; t < TPW; ++t) {
      float v_elem[Traits::LANE_ELEMS];
#pragma unroll
      for (int e = 0; e < Traits::LANE_ELEMS; ++e) {
        const int d = lane + 32 * e;
        v_elem[e] = d < HEAD_DIM ? to_float(v_tile[t * Traits::LD + d]) : 0.f;
      }
#pragma unroll
      for (int i = 0; i < ROWS; ++i) {
        if (i >= rows) break;
        const float p = __shfl_sync(FULL_WARP, s[i], t);
#pragma unroll
        for (int e = 0; e < Traits::LANE_ELEMS; ++e) acc[i][e] += p * v_elem[e];
      }
    }
    __syncwarp();  // the stage is free for the copy the next iteration starts
  }

  // The warps' partial results merge through shared memory (reusing the stages).
  cp_async_wait_all();
  __syncthreads();
  float* merge_smem = reinterpret_cast<float*>(query_smem + ROWS);
  constexpr int MERGE_LD = HEAD_DIM + 2;  // acc..., m_i, l_i
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    if (i >= rows) break;
    float* mine_row = merge_smem + (warp * ROWS + i) * MERGE_LD;
#pragma unroll
    for (int e = 0; e < Traits::LANE_ELEMS; ++e) {
      const int d = lane + 32 * e;
      if (d < HEAD_DIM) mine_row[d] = acc[i][e];
    }
    if (lane == 0) {
      mine_row[HEAD_DIM] = m_i[i];
      mine_row[HEAD_DIM + 1] = l_i[i];
    }
  }
  __syncthreads();
  for (int i = warp; i < rows; i += Traits::NUM_WARPS) {
    WarpPartials<Traits::NUM_WARPS, HEAD_DIM, false> parts{merge_smem + i * MERGE_LD,
                                                           ROWS * MERGE_LD};
    parts.weigh();
    // l_all == 0: no token the row attends in this split, or only -inf scores: lse -inf, and
    // out the bare sum, 0 or the NaN of a 0 * NaN, which the merge multiplies by its weight 0
    // (so that the split count never decides whether it reaches the row). A NaN l_all (a NaN or
    // +inf score) gives NaN for both.
    const bool empty = parts.l_all == 0.f;
    const float inv_l = empty ? 1.f : 1.f / parts.l_all;
    const size_t out_row = q_row_of(i) * splits + split;
    for (int d = lane; d < HEAD_DIM; d += 32) {
      part_out[out_row * HEAD_DIM + d] = parts.column(d) * inv_l;
    }
    if (lane == 0) part_lse[out_row] = empty ? -INFINITY : parts.m_all + logf(parts.l_all);
  }
}

template <int TILE, int ROWS, int HEAD_DIM, typename T, int MODS>
__global__ void __launch_bounds__(attn_decode_split_traits<TILE, ROWS, HEAD_DIM, T>::NUM_THREADS,
                                  attn_decode_split_traits<TILE, ROWS, HEAD_DIM, T>::MIN_CTAS_PER_SM)
    attn_decode_split(const T* __restrict__ q, const T* __restrict__ k_pages,
                      const T* __restrict__ v_pages, const long long* __restrict__ slot_pos,
                      const int* __restrict__ page_table, const int* __restrict__ page_count,
                      const long long* __restrict__ lengths, const unsigned char* __restrict__ chosen,
                      float* __restrict__ part_out, float* __restrict__ part_lse,
                      float* __restrict__ token_scores, int heads, int kv_heads, int t_q,
                      int page_size, int max_pages, int table_batch_stride,
                      int table_head_stride, int page_rows, int token_rows, int head_rows,
                      int use_slot_pos, int splits, int pages_per_split, float scale,
                      float softcap, const float* __restrict__ alibi_slopes, int use_alibi,
                      int alibi_batch_stride, const float* __restrict__ key_bias,
                      int use_key_bias, long long key_bias_batch_stride,
                      long long key_bias_head_stride, const float* __restrict__ rel_bias,
                      int use_rel_bias, int rel_bias_batch_stride, int rel_max_distance,
                      long long dropout_threshold, long long dropout_seed, float dropout_scale,
                      const u32* __restrict__ dropout_seed_words, int use_seed_words,
                      int use_chosen, int keep_scores) {
  attn_decode_split_body<TILE, ROWS, HEAD_DIM, T, T, MODS>(
      q, k_pages, v_pages, slot_pos, page_table, page_count, lengths, chosen, part_out, part_lse,
      token_scores, heads, kv_heads, t_q, page_size, max_pages, table_batch_stride,
      table_head_stride, page_rows, token_rows, head_rows, use_slot_pos, splits, pages_per_split,
      scale, softcap, alibi_slopes, use_alibi, alibi_batch_stride, key_bias, use_key_bias,
      key_bias_batch_stride, key_bias_head_stride, rel_bias, use_rel_bias, rel_bias_batch_stride,
      rel_max_distance, dropout_threshold, dropout_seed, dropout_scale, dropout_seed_words,
      use_seed_words, use_chosen, keep_scores, nullptr, nullptr);
}

// attn_decode_split over fp8 pages (KV fp8_e4m3 or fp8_e5m2; q and out stay T): the value of
// a kept element is its code times its page's scale, k_scale / v_scale float32 [num_pages]
// (cuattn/serving/fp8.py). The codes are copied as they are (half the bytes of 16-bit pages)
// and widened in registers; the K scale multiplies a token's q.code before any modifier, the V
// scale its probability in P.V (l_i, the lse and the per-token scores are of the probabilities
// alone).
template <int TILE, int ROWS, int HEAD_DIM, typename T, typename KV, int MODS>
__global__ void __launch_bounds__(attn_decode_split_traits<TILE, ROWS, HEAD_DIM, KV>::NUM_THREADS,
                                  attn_decode_split_traits<TILE, ROWS, HEAD_DIM, KV>::MIN_CTAS_PER_SM)
    attn_decode_split_fp8(const T* __restrict__ q, const KV* __restrict__ k_pages,
                          const KV* __restrict__ v_pages, const long long* __restrict__ slot_pos,
                          const int* __restrict__ page_table, const int* __restrict__ page_count,
                          const long long* __restrict__ lengths,
                          const unsigned char* __restrict__ chosen, float* __restrict__ part_out,
                          float* __restrict__ part_lse, float* __restrict__ token_scores, int heads,
                          int kv_heads, int t_q, int page_size, int max_pages,
                          int table_batch_stride, int table_head_stride, int page_rows,
                          int token_rows, int head_rows, int use_slot_pos, int splits,
                          int pages_per_split, float scale, float softcap,
                          const float* __restrict__ alibi_slopes, int use_alibi,
                          int alibi_batch_stride, const float* __restrict__ key_bias,
                          int use_key_bias, long long key_bias_batch_stride,
                          long long key_bias_head_stride, const float* __restrict__ rel_bias,
                          int use_rel_bias, int rel_bias_batch_stride, int rel_max_distance,
                          long long dropout_threshold, long long dropout_seed, float dropout_scale,
                          const u32* __restrict__ dropout_seed_words, int use_seed_words,
                          int use_chosen, int keep_scores, const float* __restrict__ k_scale,
                          const float* __restrict__ v_scale) {
  static_assert(is_fp8_type<KV>::value, "the fp8 split kernel reads fp8 pages");
  attn_decode_split_body<TILE, ROWS, HEAD_DIM, T, KV, MODS>(
      q, k_pages, v_pages, slot_pos, page_table, page_count, lengths, chosen, part_out, part_lse,
      token_scores, heads, kv_heads, t_q, page_size, max_pages, table_batch_stride,
      table_head_stride, page_rows, token_rows, head_rows, use_slot_pos, splits, pages_per_split,
      scale, softcap, alibi_slopes, use_alibi, alibi_batch_stride, key_bias, use_key_bias,
      key_bias_batch_stride, key_bias_head_stride, rel_bias, use_rel_bias, rel_bias_batch_stride,
      rel_max_distance, dropout_threshold, dropout_seed, dropout_scale, dropout_seed_words,
      use_seed_words, use_chosen, keep_scores, k_scale, v_scale);
}

struct attn_decode_mass_traits {
  static constexpr int NUM_THREADS = 128;
  static constexpr int SMEM_BYTES = 0;
};

__global__ void __launch_bounds__(attn_decode_mass_traits::NUM_THREADS)
    attn_decode_mass(const float* __restrict__ token_scores, const float* __restrict__ lse,
                     const int* __restrict__ page_table, const int* __restrict__ page_count,
                     double* __restrict__ slot_score, int heads, int kv_heads, int t_q,
                     int page_size, int max_pages) {
  const int pair = int(blockIdx.y);  // b * kv_heads + kv head
  const int f = int(blockIdx.x) * attn_decode_mass_traits::NUM_THREADS + int(threadIdx.x);
  if (f >= page_count[pair] * page_size) return;
  const int kv_group = heads / kv_heads;
  // the group's rows of [B, H, t_q] are contiguous: query heads kv_head * kv_group + g, then t_q
  const size_t first_row = (size_t(pair / kv_heads) * heads + size_t(pair % kv_heads) * kv_group) * t_q;
  const size_t tokens_per_row = size_t(max_pages) * page_size;
  float mass = 0.f;
  for (int r = 0; r < kv_group * t_q; ++r) {
    const size_t row = first_row + r;
    const float s = token_scores[row * tokens_per_row + f];
    const float row_lse = lse[row];
    // A NaN probability (a NaN row: a NaN or +inf score makes its lse NaN) adds nothing, so the
    // scores stay finite: a NaN one has no rank among the others. An empty row (lse -inf) has
    // s = -inf throughout: -inf - -inf is NaN too, and adds nothing.
    const float p = expf(s - row_lse);
    if (p >= 0.f) mass += p;  // false for NaN
  }
  const int entry = f / page_size;
  const size_t slot = size_t(page_table[size_t(pair) * max_pages + entry]) * page_size + (f - entry * page_size);
  slot_score[slot] += double(mass);
}
