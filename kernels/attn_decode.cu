// Split-KV decode attention over a paged KV cache (flash-decoding), and the merge of its splits.
//
// attn_decode_split<HEAD_DIM, T>: grid (splits, kv_heads * row_chunks, batch), 4 warps.
//   A CTA owns one split of one (sequence, kv head)'s page table: pages
//   [split * pages_per_split, (split + 1) * pages_per_split) of its page_count. Its query rows
//   are up to ROWS_PER_CTA of the kv group's kv_group * t_q rows (query head kv_head * kv_group
//   + r / t_q, query r % t_q at position lengths[b] - t_q + r % t_q); every row of the group
//   shares each K/V tile the CTA loads. A token (page, slot) counts for a row when its position
//   slot_pos >= 0 (not evicted), <= the row's position (causal) and, with use_chosen, the
//   row's Quest choice reads that page. Online softmax per row; writes the split's partial
//   out [B, H, t_q, splits, HEAD_DIM] (float) and lse [B, H, t_q, splits] (-inf: no token),
//   and with keep_scores the scaled score of every (row, table slot), -inf where not counted:
//   token_scores [B, H, t_q, max_pages * page_size] (HeavyHitters turns them into probabilities
//   with the merged lse, with no second pass over K).
// attn_decode_merge<HEAD_DIM, T>: one warp per row of out [rows, HEAD_DIM]: the exact merge of
//   its `splits` partial results (splits with lse -inf contribute nothing; none: 0 and -inf).
// Shapes: q [B, H, t_q, HEAD_DIM] contiguous; k_pages, v_pages [num_pages, page_size, HEAD_DIM]
// contiguous; slot_pos int64 [num_pages, page_size]; page_table int32 [B, kv_heads, max_pages];
// page_count int32 [B, kv_heads]; lengths int64 [B]; chosen uint8 [B, H, t_q, max_pages].
// Run: through cuattn.decode_attention on a KVCache (backend "cuda" or "interp"); geometry and
// the split count come from cuattn/backends/geometry.py.
#include "common/row_kernel.cuh"
#include "common/smem.cuh"
#include "common/types.cuh"

// Tokens per shared-memory tile: a page is walked in tiles of this many tokens, so any page
// size works with a fixed shared-memory size.
constexpr int DECODE_TILE = 16;

template <int HEAD_DIM, typename T>
struct attn_decode_split_traits {
  static constexpr int NUM_WARPS = 4;
  static constexpr int NUM_THREADS = NUM_WARPS * 32;
  static constexpr int ROWS_PER_WARP = 4;
  static constexpr int ROWS_PER_CTA = NUM_WARPS * ROWS_PER_WARP;
  // Elements of a HEAD_DIM row each lane owns (lane, lane + 32, ...).
  static constexpr int LANE_ELEMS = (HEAD_DIM + 31) / 32;
  static constexpr int LD = SmemStride<T, HEAD_DIM>::value;
  static constexpr int TILE_BYTES = DECODE_TILE * LD * int(sizeof(T));
  // K tile, V tile, and the tile's token positions.
  static constexpr int SMEM_BYTES = 2 * TILE_BYTES + DECODE_TILE * int(sizeof(long long));
};

// CUDA's integer min is a device builtin the interpreter's host compiler lacks; one spelling.
__device__ __forceinline__ int min_int(int a, int b) { return a < b ? a : b; }

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

template <int HEAD_DIM, typename T>
__global__ void __launch_bounds__(attn_decode_split_traits<HEAD_DIM, T>::NUM_THREADS, 1)
    attn_decode_split(const T* __restrict__ q, const T* __restrict__ k_pages,
                      const T* __restrict__ v_pages, const long long* __restrict__ slot_pos,
                      const int* __restrict__ page_table, const int* __restrict__ page_count,
                      const long long* __restrict__ lengths, const unsigned char* __restrict__ chosen,
                      float* __restrict__ part_out, float* __restrict__ part_lse,
                      float* __restrict__ token_scores, int heads, int kv_heads, int t_q,
                      int page_size, int max_pages, int splits, int pages_per_split, float scale,
                      int use_chosen, int keep_scores) {
  using Traits = attn_decode_split_traits<HEAD_DIM, T>;
  const int warp = int(threadIdx.x) / 32;
  const int lane = int(threadIdx.x) % 32;
  const int kv_group = heads / kv_heads;
  const int group_rows = kv_group * t_q;
  const int row_chunks = (group_rows + Traits::ROWS_PER_CTA - 1) / Traits::ROWS_PER_CTA;
  const int split = int(blockIdx.x);
  const int kv_head = int(blockIdx.y) / row_chunks;
  const int first_row = (int(blockIdx.y) % row_chunks) * Traits::ROWS_PER_CTA;
  const int b = int(blockIdx.z);
  const long long length = lengths[b];
  const size_t table_row = size_t(b) * kv_heads + kv_head;
  const int pages = page_count[table_row];
  const int page_lo = min_int(split * pages_per_split, pages);
  const int page_hi = min_int(page_lo + pages_per_split, pages);
  const size_t tokens_per_row = size_t(max_pages) * page_size;

  T* k_smem = dynamic_smem<T>();
  T* v_smem = k_smem + DECODE_TILE * Traits::LD;
  long long* pos_smem = reinterpret_cast<long long*>(v_smem + DECODE_TILE * Traits::LD);

  // Per row this warp owns: query (scaled, in float), running max m_i, sum l_i, output acc.
  float q_reg[Traits::ROWS_PER_WARP][Traits::LANE_ELEMS];
  float m_i[Traits::ROWS_PER_WARP], l_i[Traits::ROWS_PER_WARP];
  float acc[Traits::ROWS_PER_WARP][Traits::LANE_ELEMS];
  size_t q_row[Traits::ROWS_PER_WARP];  // row index into [B, H, t_q]
  long long q_pos[Traits::ROWS_PER_WARP];
  bool live[Traits::ROWS_PER_WARP];
#pragma unroll
  for (int i = 0; i < Traits::ROWS_PER_WARP; ++i) {
    const int r = first_row + warp + i * Traits::NUM_WARPS;
    live[i] = r < group_rows;
    const int head = kv_head * kv_group + (live[i] ? r / t_q : 0);
    const int query = live[i] ? r % t_q : 0;
    q_row[i] = (size_t(b) * heads + head) * t_q + query;
    q_pos[i] = length - t_q + query;
    m_i[i] = -INFINITY;
    l_i[i] = 0.f;
#pragma unroll
    for (int e = 0; e < Traits::LANE_ELEMS; ++e) {
      const int d = lane + 32 * e;
      q_reg[i][e] = (live[i] && d < HEAD_DIM) ? to_float(q[q_row[i] * HEAD_DIM + d]) * scale : 0.f;
      acc[i][e] = 0.f;
    }
  }

  // The tile loop: a page's tokens in tiles of DECODE_TILE.
  for (int j = page_lo; j < page_hi; ++j) {
    const size_t page = size_t(page_table[table_row * max_pages + j]);
    for (int first = 0; first < page_size; first += DECODE_TILE) {
      const int count = min_int(DECODE_TILE, page_size - first);
      const size_t base = (page * page_size + first) * HEAD_DIM;
      load_tile_async<DECODE_TILE, HEAD_DIM, Traits::NUM_THREADS>(k_smem, Traits::LD,
                                                                 k_pages + base, HEAD_DIM, count);
      load_tile_async<DECODE_TILE, HEAD_DIM, Traits::NUM_THREADS>(v_smem, Traits::LD,
                                                                 v_pages + base, HEAD_DIM, count);
      cp_async_commit();
      if (int(threadIdx.x) < DECODE_TILE) {
        const int t = int(threadIdx.x);
        pos_smem[t] = t < count ? slot_pos[page * page_size + first + t] : -1;
      }
      cp_async_wait_all();
      __syncthreads();
#pragma unroll
      for (int i = 0; i < Traits::ROWS_PER_WARP; ++i) {
        if (!live[i]) continue;  // uniform across the warp
        const bool page_read =
            !use_chosen || chosen[q_row[i] * max_pages + j] != 0;
        for (int t = 0; t < count; ++t) {
          const long long pos = pos_smem[t];
          const bool counts = page_read && pos >= 0 && pos <= q_pos[i];
          float s = -INFINITY;
          if (counts) {
            float partial = 0.f;
#pragma unroll
            for (int e = 0; e < Traits::LANE_ELEMS; ++e) {
              const int d = lane + 32 * e;
              if (d < HEAD_DIM) partial += q_reg[i][e] * to_float(k_smem[t * Traits::LD + d]);
            }
            s = warp_sum(partial);
            const float m_new = fmaxf(m_i[i], s);
            const float correction = expf(m_i[i] - m_new);  // m_i = -inf: exp(-inf) = 0
            const float p = expf(s - m_new);
            l_i[i] = l_i[i] * correction + p;
#pragma unroll
            for (int e = 0; e < Traits::LANE_ELEMS; ++e) {
              const int d = lane + 32 * e;
              const float v = d < HEAD_DIM ? to_float(v_smem[t * Traits::LD + d]) : 0.f;
              acc[i][e] = acc[i][e] * correction + p * v;
            }
            m_i[i] = m_new;
          }
          if (keep_scores && lane == 0) {
            token_scores[q_row[i] * tokens_per_row + size_t(j) * page_size + first + t] = s;
          }
        }
      }
      __syncthreads();  // the next tile overwrites the shared tiles
    }
  }

#pragma unroll
  for (int i = 0; i < Traits::ROWS_PER_WARP; ++i) {
    if (!live[i]) continue;
    const size_t out_row = q_row[i] * splits + split;
    const float inv_l = l_i[i] > 0.f ? 1.f / l_i[i] : 0.f;
#pragma unroll
    for (int e = 0; e < Traits::LANE_ELEMS; ++e) {
      const int d = lane + 32 * e;
      if (d < HEAD_DIM) part_out[out_row * HEAD_DIM + d] = acc[i][e] * inv_l;
    }
    if (lane == 0) part_lse[out_row] = l_i[i] > 0.f ? m_i[i] + logf(l_i[i]) : -INFINITY;
  }
}

template <int HEAD_DIM, typename T>
__global__ void __launch_bounds__(row_kernel_traits<HEAD_DIM, T>::NUM_THREADS, 1)
    attn_decode_merge(const float* __restrict__ part_out, const float* __restrict__ part_lse,
                      T* __restrict__ out, float* __restrict__ lse, int rows, int splits) {
  using Traits = row_kernel_traits<HEAD_DIM, T>;
  const int warp = int(threadIdx.x) / 32;
  const int lane = int(threadIdx.x) % 32;
  for (int r = warp; r < Traits::ROWS_PER_CTA; r += Traits::NUM_WARPS) {
    const int row = int(blockIdx.x) * Traits::ROWS_PER_CTA + r;
    if (row >= rows) break;  // uniform across the warp
    const float* row_lse = part_lse + size_t(row) * splits;
    float base = -INFINITY;
    for (int s = 0; s < splits; ++s) base = fmaxf(base, row_lse[s]);
    float total = 0.f;
    for (int s = 0; s < splits; ++s) total += base == -INFINITY ? 0.f : expf(row_lse[s] - base);
    const float inv_total = total > 0.f ? 1.f / total : 0.f;
    for (int d = lane; d < HEAD_DIM; d += 32) {
      float sum = 0.f;
      for (int s = 0; s < splits; ++s) {
        // a split with no token has weight 0 and must not multiply its out
        const float w = base == -INFINITY ? 0.f : expf(row_lse[s] - base);
        if (w > 0.f) sum += w * part_out[(size_t(row) * splits + s) * HEAD_DIM + d];
      }
      out[size_t(row) * HEAD_DIM + d] = from_float<T>(sum * inv_total);
    }
    if (lane == 0) lse[row] = total > 0.f ? base + logf(total) : -INFINITY;
  }
}
