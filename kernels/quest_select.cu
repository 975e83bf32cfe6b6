// Quest's page choice on the device: every real page's bound for every query row, then the top
// pages of each row by a radix select (cuattn/serving/decode.py quest_chosen). One launch where
// the (sequence, kv head) pairs fill the GPU; where they do not (one long sequence) the pages of
// a pair are split over CTAs and a second kernel selects, a CTA a row.
//
// quest_select<HEAD_DIM, T, B>: grid (batch * kv_heads, splits), NUM_WARPS warps; CTA (pair,
//   split), pair = b * kv_heads + kv head, owns the kv group's rows = kv_group * t_q query rows
//   (query head kv head * kv_group + r / t_q, query r % t_q: consecutive rows of [B, H, t_q])
//   and the pair's table entries [split * pages_per_split, min(count, (split + 1) *
//   pages_per_split)), count = page_count[pair], read in place (page_table[pair, entry] names
//   the row of key_min / key_max).
//   Phase 1, the bounds: warp w takes the split's entries w, w + NUM_WARPS, ...,
//   PAGES_IN_FLIGHT at a time; lane l holds elements l + 32 e of the page's key_min and key_max
//   rows (B: float, or bfloat16 widened exactly) and, per row, of max(q, 0) and min(q, 0) (a
//   NaN q element stays NaN in both, as NumPy's maximum and minimum give it), in register tiles
//   of ROW_TILE rows (more rows walk the pages again). A row's bound is the sum over the page's
//   elements of max(q, 0) * max_i + min(q, 0) * min_i: each lane adds fmaf(max(q,0), max_i)
//   then fmaf(min(q,0), min_i) over its elements in order, then the tile's rows are summed
//   over the 32 lanes by one reduce-scatter (reduce_scatter: of half the tile where the rows
//   fill at most half), a fixed order, so a page's bound is the same bits whichever CTA and
//   warp compute it. A NaN bound becomes +inf (read ahead of every other page), -0 becomes +0
//   (a tie with +0, as the reference's comparisons have it). The sums are
//   float32 in this fixed order, not in the reference's matrix-product order (_page_bounds):
//   the same value where every partial sum is exact, within float32 rounding of it otherwise;
//   the special values (NaN from 0 * inf or a NaN element, +inf, -inf, inf - inf) are those of
//   the same terms in any order (a GPU build flushes denormals, -ftz as every kernel's: a
//   denormal key or query element counts as 0 there, on the interpreter as itself). Each bound
//   goes to bounds[row, entry] (float32 [B, H, t_q, max_pages], a workspace: entries >= count
//   are never written nor read).
//   Phase 2, the choice, only with one split (gridDim.y == 1; otherwise quest_select_rows
//   makes it): a warp per row. The candidates are entries [0, count - 1), every real page but
//   the newest; take = min(budget_pages, count - 1) of them, the largest bounds, ties to the
//   lower entry. Where 0 < take < count - 1 a radix select over the bounds' order-preserving
//   codes (order_code: unsigned order is float order) finds the take-th largest code,
//   RADIX_BITS a pass from the top, with a BINS-bin histogram a warp in shared memory (atomics
//   on the warp's own bins), and how many codes equal to it are taken; then one pass in entry
//   order writes chosen[row, entry] = 1 for a code above the threshold, for the first of those
//   equal to it (a ballot's prefix count) and for the newest entry (count - 1), 0 for every
//   other entry up to max_pages. No sort: O(count) work a row.
// quest_select_rows: grid (B * H * t_q), a CTA of NUM_WARPS warps per query row over the
//   bounds every split wrote: the same selection with the CTA's threads sharing one histogram
//   (a bin a thread for the scan) and CODES_IN_FLIGHT bounds loaded a thread before their
//   atomics; a row of at most NUM_THREADS * CODES_IN_FLIGHT candidates (8192) is loaded once
//   and its codes held in registers through every pass. The last pass's bin counts the codes
//   equal to the threshold: where all of them are taken (the usual case) the write pass takes
//   every code at or above it, with no barrier; otherwise it ranks the ties in entry order by a
//   prefix sum over the CTA, NUM_THREADS entries a round.
// Shapes: q [B, H, t_q, HEAD_DIM] contiguous, T float, __half or __nv_bfloat16 (widened to
// float exactly); key_min, key_max B [pool rows, HEAD_DIM] (B float or __nv_bfloat16: a 16-bit
// or fp8 cache keeps them as bf16 bits rounded outward); page_table int32 [B, kv_heads,
// max_pages]; page_count int32 [B, kv_heads]; chosen uint8 [B, H, t_q, max_pages] (what the
// decode kernels read as `chosen`). budget_pages >= 0.
// Run: cuattn.decode_attention on a Quest cache (backend "interp"; on a GPU with
// CUATTN_QUEST=kernel), or KernelBackend.quest_select; geometry in
// cuattn/backends/geometry.py (QuestSelectConfig, QuestRowsConfig, quest_splits).
#include "common/smem.cuh"
#include "common/types.cuh"

template <int HEAD_DIM, typename T, typename B>
struct quest_select_traits {
  static constexpr int NUM_WARPS = 8;
  static constexpr int NUM_THREADS = NUM_WARPS * 32;
  static constexpr int LANE_ELEMS = (HEAD_DIM + 31) / 32;  // elements lane + 32 e of a row
  // rows whose max(q, 0) and min(q, 0) a lane holds at once: 2 x 8 x 4 registers at d128
  static constexpr int ROW_TILE = HEAD_DIM <= 128 ? 8 : 4;
  static constexpr int PAGES_IN_FLIGHT = 2;  // a warp's pages loaded before their sums
  // Two CTAs an SM up to d128 (32 KB of bounds in flight); d256's row tile needs one CTA's
  // registers (ptxas left to choose spilled d256 on sm_80)
  static constexpr int MIN_CTAS_PER_SM = HEAD_DIM <= 128 ? 2 : 1;
  static constexpr int RADIX_BITS = 8;
  static constexpr int BINS = 1 << RADIX_BITS;
  static constexpr int PASSES = 32 / RADIX_BITS;
  static constexpr int BINS_PER_LANE = BINS / 32;
  static constexpr int SMEM_BYTES = NUM_WARPS * BINS * int(sizeof(int));  // the histograms
};

// No bound's code exceeds it (+inf's is 0xff800000): the threshold of a choice of no page.
constexpr u32 NO_THRESHOLD = 0xffffffffu;

// The unsigned code of a bound (no NaN, no -0) whose unsigned order is the float order.
__device__ __forceinline__ u32 order_code(float bound) {
  const u32 bits = u32(__float_as_int(bound));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The warp's sums of ROWS values a lane (ROWS a power of two <= 32), reduce-scattered: each
// step halves the rows a lane keeps (the lanes with the step's offset bit set keep the upper
// half) and adds its partner's; then the lanes of a row add the rest. Lane l returns row
// l / (32 / ROWS)'s sum over all 32 lanes, the same bits on each of its 32 / ROWS lanes (every
// addition pairs the same two partial sums on both lanes: a + b == b + a). ROWS - 1 +
// log2(32 / ROWS) shuffles and additions (and two selects a pair halved), where a butterfly a
// row is 5 and 5 a row: 6 and 6 for 4 rows (against 20 and 20), 9 and 9 for 8 (40 and 40).
template <int ROWS>
__device__ __forceinline__ float reduce_scatter(float* values, int lane) {
#pragma unroll
  for (int half = ROWS / 2, offset = 16; half >= 1; half /= 2, offset /= 2) {
    const bool upper = (lane & offset) != 0;
#pragma unroll
    for (int k = 0; k < half; ++k) {
      const float send = upper ? values[k] : values[k + half];
      const float keep = upper ? values[k + half] : values[k];
      values[k] = keep + __shfl_xor_sync(FULL_WARP, send, offset);
    }
  }
#pragma unroll
  for (int offset = 16 / ROWS; offset > 0; offset /= 2)
    values[0] += __shfl_xor_sync(FULL_WARP, values[0], offset);
  return values[0];
}

// The bounds of a tile's first `rows` (<= ROWS) rows from their lanes' partial sums: one lane
// a row stores row r's bound to out[r * stride]. NaN (unequal to itself) becomes +inf, -0
// (equal to 0) +0.
template <int ROWS>
__device__ __forceinline__ void store_bounds(float* partial, int lane, int rows, float* out,
                                             int stride) {
  constexpr int LANES_PER_ROW = 32 / ROWS;
  const float sum = reduce_scatter<ROWS>(partial, lane);
  const int row = lane / LANES_PER_ROW;
  if (lane % LANES_PER_ROW == 0 && row < rows)
    out[size_t(row) * stride] = sum != sum ? INFINITY : (sum == 0.f ? 0.f : sum);
}

// Inclusive prefix sum over the warp's lanes.
__device__ __forceinline__ int warp_inclusive_sum(int value, int lane) {
  for (int offset = 1; offset < 32; offset *= 2) {
    const int other = __shfl_sync(FULL_WARP, value, lane >= offset ? lane - offset : 0);
    if (lane >= offset) value += other;
  }
  return value;
}

template <int HEAD_DIM, typename T, typename B>
__global__ void __launch_bounds__(quest_select_traits<HEAD_DIM, T, B>::NUM_THREADS,
                                  quest_select_traits<HEAD_DIM, T, B>::MIN_CTAS_PER_SM)
    quest_select(const T* __restrict__ q, const B* __restrict__ key_min,
                 const B* __restrict__ key_max, const int* __restrict__ page_table,
                 const int* __restrict__ page_count, float* __restrict__ bounds,
                 unsigned char* __restrict__ chosen, int heads, int kv_heads, int t_q,
                 int max_pages, int pages_per_split, int budget_pages) {
  using Traits = quest_select_traits<HEAD_DIM, T, B>;
  constexpr int NUM_WARPS = Traits::NUM_WARPS, ROW_TILE = Traits::ROW_TILE;
  constexpr int LANE_ELEMS = Traits::LANE_ELEMS, FLIGHT = Traits::PAGES_IN_FLIGHT;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int pair = int(blockIdx.x);
  const int kv_group = heads / kv_heads;
  const int rows = kv_group * t_q;
  const size_t first_row =
      (size_t(pair / kv_heads) * heads + size_t(pair % kv_heads) * kv_group) * t_q;
  const int count = page_count[pair];
  const int* table = page_table + size_t(pair) * max_pages;
  const int split_first = int(blockIdx.y) * pages_per_split;
  const int split_end =
      count - split_first < pages_per_split ? count : split_first + pages_per_split;

  // ---- phase 1: the bounds ----
  for (int tile = 0; tile < rows; tile += ROW_TILE) {
    const int tile_rows = rows - tile < ROW_TILE ? rows - tile : ROW_TILE;
    float q_pos[ROW_TILE][LANE_ELEMS], q_neg[ROW_TILE][LANE_ELEMS];
#pragma unroll
    for (int r = 0; r < ROW_TILE; ++r) {
#pragma unroll
      for (int e = 0; e < LANE_ELEMS; ++e) {
        const int i = lane + 32 * e;
        const float x = (r < tile_rows && i < HEAD_DIM)
                            ? to_float(q[(first_row + tile + r) * HEAD_DIM + i])
                            : 0.f;
        q_pos[r][e] = x < 0.f ? 0.f : x;  // NaN fails both tests: it stays NaN
        q_neg[r][e] = x > 0.f ? 0.f : x;
      }
    }
    for (int first = split_first + warp; first < split_end; first += NUM_WARPS * FLIGHT) {
      float lo[FLIGHT][LANE_ELEMS], hi[FLIGHT][LANE_ELEMS];
#pragma unroll
      for (int p = 0; p < FLIGHT; ++p) {
        const int entry = first + p * NUM_WARPS;
        const bool real = entry < split_end;
        // one address a page; the elements at constant offsets from it
        const size_t row = (real ? size_t(table[entry]) : 0) * HEAD_DIM + lane;
        const B* lo_row = key_min + row;
        const B* hi_row = key_max + row;
#pragma unroll
        for (int e = 0; e < LANE_ELEMS; ++e) {
          const bool here = real && lane + 32 * e < HEAD_DIM;
          lo[p][e] = here ? to_float(lo_row[32 * e]) : 0.f;
          hi[p][e] = here ? to_float(hi_row[32 * e]) : 0.f;
        }
      }
#pragma unroll
      for (int p = 0; p < FLIGHT; ++p) {
        const int entry = first + p * NUM_WARPS;
        if (entry >= split_end) break;
        float acc[ROW_TILE];
#pragma unroll
        for (int r = 0; r < ROW_TILE; ++r) {
          acc[r] = 0.f;
          if (r >= tile_rows) continue;
#pragma unroll
          for (int e = 0; e < LANE_ELEMS; ++e) {
            acc[r] = fmaf(q_pos[r][e], hi[p][e], acc[r]);
            acc[r] = fmaf(q_neg[r][e], lo[p][e], acc[r]);
          }
        }
        // a tile of at most half its rows reduces half of them (fewer steps); warp-uniform
        float* page_bounds = bounds + (first_row + tile) * max_pages + entry;
        if (tile_rows <= ROW_TILE / 2)
          store_bounds<ROW_TILE / 2>(acc, lane, tile_rows, page_bounds, max_pages);
        else
          store_bounds<ROW_TILE>(acc, lane, tile_rows, page_bounds, max_pages);
      }
    }
  }
  if (gridDim.y > 1) return;  // quest_select_rows selects over every split's bounds
  __syncthreads();  // every warp's bounds are written (and visible to the CTA)

  // ---- phase 2: the choice, a warp per row ----
  constexpr int BINS = Traits::BINS, BINS_PER_LANE = Traits::BINS_PER_LANE;
  int* histogram = dynamic_smem<int>() + warp * BINS;
  const int candidates = count > 0 ? count - 1 : 0;  // every real page but the newest
  const int take = budget_pages < candidates ? budget_pages : candidates;
  for (int r = warp; r < rows; r += NUM_WARPS) {
    const float* row_bounds = bounds + (first_row + r) * max_pages;
    u32 threshold = NO_THRESHOLD;
    int ties_wanted = 0;  // codes equal to the threshold taken, the lowest entries first
    if (take > 0 && take < candidates) {
      u32 prefix = 0, prefix_mask = 0;
      int remaining = take;  // still to take among the codes matching prefix
      for (int pass = 0; pass < Traits::PASSES; ++pass) {
        const int shift = 32 - Traits::RADIX_BITS * (pass + 1);
        __syncwarp();  // the last pass's reads of the bins are done
        for (int bin = lane; bin < BINS; bin += 32) histogram[bin] = 0;
        __syncwarp();
        // the bounds come back from L2 (other warps wrote them): 8 loads in flight a lane
#pragma unroll 8
        for (int j = lane; j < candidates; j += 32) {
          const u32 code = order_code(row_bounds[j]);
          if ((code & prefix_mask) == prefix) atomicAdd(&histogram[(code >> shift) & (BINS - 1)], 1);
        }
        __syncwarp();
        // lane l owns digits BINS - 1 - BINS_PER_LANE l - c, c ascending: the largest first
        int bin_counts[BINS_PER_LANE];
        int lane_total = 0;
#pragma unroll
        for (int c = 0; c < BINS_PER_LANE; ++c) {
          bin_counts[c] = histogram[BINS - 1 - BINS_PER_LANE * lane - c];
          lane_total += bin_counts[c];
        }
        const int inclusive = warp_inclusive_sum(lane_total, lane);
        const int exclusive = inclusive - lane_total;
        // the one lane whose digits hold the remaining-th largest code
        const unsigned crossing =
            __ballot_sync(FULL_WARP, exclusive < remaining && remaining <= inclusive);
        const int owner = __popc((crossing & (0u - crossing)) - 1u);
        int digit = 0, above = 0, before = exclusive;
        bool found = false;
#pragma unroll
        for (int c = 0; c < BINS_PER_LANE; ++c) {
          if (!found && before + bin_counts[c] >= remaining) {
            digit = BINS - 1 - BINS_PER_LANE * lane - c;
            above = before;
            found = true;
          }
          before += bin_counts[c];
        }
        digit = __shfl_sync(FULL_WARP, digit, owner);
        above = __shfl_sync(FULL_WARP, above, owner);
        prefix |= u32(digit) << shift;
        prefix_mask |= u32(BINS - 1) << shift;
        remaining -= above;
      }
      threshold = prefix;
      ties_wanted = remaining;
    }
    unsigned char* row_chosen = chosen + (first_row + r) * max_pages;
    int ties_before = 0;
    for (int base = 0; base < max_pages; base += 32) {
      const int j = base + lane;
      bool taken = j < candidates && take == candidates;
      bool tie = false;
      if (j < candidates && take < candidates) {
        const u32 code = order_code(row_bounds[j]);
        taken = code > threshold;
        tie = code == threshold;
      }
      const unsigned ties = __ballot_sync(FULL_WARP, tie);
      const int rank = ties_before + __popc(ties & ((1u << lane) - 1u));
      taken = taken || (tie && rank < ties_wanted);
      ties_before += __popc(ties);
      if (j < max_pages) row_chosen[j] = (taken || j == count - 1) ? 1 : 0;
    }
  }
}

struct quest_select_rows_traits {
  static constexpr int NUM_WARPS = 8;
  static constexpr int NUM_THREADS = NUM_WARPS * 32;
  static constexpr int RADIX_BITS = 8;
  static constexpr int BINS = 1 << RADIX_BITS;
  static constexpr int PASSES = 32 / RADIX_BITS;
  // a thread's bounds loaded before their atomics: 8192 candidates a CTA in one round from L2
  static constexpr int CODES_IN_FLIGHT = 32;
  // the CTA's histogram and a spare bin for the codes a pass does not count
  static constexpr int SMEM_BYTES = (BINS + 1) * int(sizeof(int));
  static_assert(BINS == NUM_THREADS, "the scan gives each thread one bin");
};

// The codes of a tile: entries first + c * STRIDE, c < FLIGHT; past the candidates code 0,
// below every bound's (-inf's is 0x007fffff), so never the threshold nor above it: the select
// counts it in the lowest bin and never takes it.
template <int FLIGHT, int STRIDE>
__device__ __forceinline__ void load_codes(const float* row_bounds, int first, int candidates,
                                           u32 (&codes)[FLIGHT]) {
#pragma unroll
  for (int c = 0; c < FLIGHT; ++c) {
    const int j = first + c * STRIDE;
    codes[c] = j < candidates ? order_code(row_bounds[j]) : 0u;
  }
}

// A tile's codes matching prefix into the histogram, by digit (shift), the others into the
// spare bin BINS (every lane adds: no divergent branch a code); warp_first is the warp's first
// entry of the tile: a warp past the candidates skips the slot (a uniform branch).
template <int FLIGHT, int STRIDE, int BINS>
__device__ __forceinline__ void count_codes(const u32 (&codes)[FLIGHT], int warp_first,
                                            int candidates, u32 prefix, u32 prefix_mask,
                                            int shift, int* histogram) {
#pragma unroll
  for (int c = 0; c < FLIGHT; ++c) {
    if (warp_first + c * STRIDE >= candidates) break;
    const bool match = (codes[c] & prefix_mask) == prefix;
    atomicAdd(&histogram[match ? (codes[c] >> shift) & (BINS - 1) : BINS], 1);
  }
}

// Inclusive prefix sum over the CTA's threads; totals holds NUM_WARPS ints (free on entry,
// read by every thread before the caller's next __syncthreads).
template <int NUM_WARPS>
__device__ __forceinline__ int cta_inclusive_sum(int value, int* totals, int warp, int lane) {
  const int inclusive = warp_inclusive_sum(value, lane);
  if (lane == 31) totals[warp] = inclusive;
  __syncthreads();
  int before = 0;
#pragma unroll
  for (int w = 0; w < NUM_WARPS; ++w) before += w < warp ? totals[w] : 0;
  return before + inclusive;
}

__global__ void __launch_bounds__(quest_select_rows_traits::NUM_THREADS)
    quest_select_rows(const float* __restrict__ bounds, const int* __restrict__ page_count,
                      unsigned char* __restrict__ chosen, int heads, int kv_heads, int t_q,
                      int max_pages, int budget_pages) {
  using Traits = quest_select_rows_traits;
  constexpr int NUM_THREADS = Traits::NUM_THREADS, NUM_WARPS = Traits::NUM_WARPS;
  constexpr int BINS = Traits::BINS, FLIGHT = Traits::CODES_IN_FLIGHT;
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const size_t row = blockIdx.x;  // (b, head, t) of [B, H, t_q]
  const size_t b = row / (size_t(heads) * t_q);
  const int head = int(row / t_q % heads);
  const int count = page_count[b * kv_heads + head / (heads / kv_heads)];
  const int candidates = count > 0 ? count - 1 : 0;  // every real page but the newest
  const int take = budget_pages < candidates ? budget_pages : candidates;
  const float* row_bounds = bounds + row * max_pages;
  int* histogram = dynamic_smem<int>();
  __shared__ int warp_totals[NUM_WARPS];
  __shared__ int found_digit, found_above, found_count;

  u32 threshold = NO_THRESHOLD;
  int ties_wanted = 0;  // codes equal to the threshold taken, the lowest entries first
  int ties = 0;         // codes equal to the threshold (the last pass's bin is one code)
  // a row of at most a tile: its codes stay in registers through every pass
  const bool held = candidates <= NUM_THREADS * FLIGHT;
  const int warp_first = tid - lane;
  u32 codes[FLIGHT];
  if (held) load_codes<FLIGHT, NUM_THREADS>(row_bounds, tid, candidates, codes);
  if (take > 0 && take < candidates) {
    u32 prefix = 0, prefix_mask = 0;
    int remaining = take;  // still to take among the codes matching prefix
    for (int pass = 0; pass < Traits::PASSES; ++pass) {
      const int shift = 32 - Traits::RADIX_BITS * (pass + 1);
      histogram[tid] = 0;  // the last pass's reads of it ended at its closing __syncthreads
      __syncthreads();  // (the spare bin is written, never read)
      if (held) {
        count_codes<FLIGHT, NUM_THREADS, BINS>(codes, warp_first, candidates, prefix,
                                                prefix_mask, shift, histogram);
      } else {
        for (int first = tid; first - lane < candidates; first += NUM_THREADS * FLIGHT) {
          load_codes<FLIGHT, NUM_THREADS>(row_bounds, first, candidates, codes);
          count_codes<FLIGHT, NUM_THREADS, BINS>(codes, first - lane, candidates, prefix,
                                                  prefix_mask, shift, histogram);
        }
      }
      __syncthreads();
      // thread t owns digit BINS - 1 - t: the largest digits first
      const int digit = BINS - 1 - tid;
      const int in_bin = histogram[digit];
      const int inclusive = cta_inclusive_sum<NUM_WARPS>(in_bin, warp_totals, warp, lane);
      const int exclusive = inclusive - in_bin;
      if (exclusive < remaining && remaining <= inclusive) {  // the one bin holding it
        found_digit = digit;
        found_above = exclusive;
        found_count = in_bin;
      }
      __syncthreads();
      prefix |= u32(found_digit) << shift;
      prefix_mask |= u32(BINS - 1) << shift;
      remaining -= found_above;
    }
    threshold = prefix;
    ties_wanted = remaining;
    ties = found_count;
  }
  unsigned char* row_chosen = chosen + row * max_pages;
  if (ties_wanted == ties) {
    // every code at or above the threshold is taken: no ranks, no barrier. The least code
    // taken: the threshold; 1 where every candidate is (code 0, past them, is not); with
    // take == 0 NO_THRESHOLD, above every bound's code
    const u32 least = take == candidates ? 1u : threshold;
    for (int first = tid; first - lane < max_pages; first += NUM_THREADS * FLIGHT) {
      // the held tile is the first; past it a held row has no candidates (no loads)
      if (!held || first != tid)
        load_codes<FLIGHT, NUM_THREADS>(row_bounds, first, candidates, codes);
#pragma unroll
      for (int c = 0; c < FLIGHT; ++c) {
        const int j = first + c * NUM_THREADS;
        if (j - lane >= max_pages) break;
        if (j < max_pages) row_chosen[j] = (codes[c] >= least || j == count - 1) ? 1 : 0;
      }
    }
    return;
  }
  // some of the threshold's ties are left out: rank them in entry order, NUM_THREADS entries a
  // round (warp_totals was last read before the passes' closing barrier)
  int ties_before = 0;
  for (int base = 0; base < max_pages; base += NUM_THREADS) {
    const int j = base + tid;
    bool taken = false, tie = false;
    if (j < candidates) {
      const u32 code = order_code(row_bounds[j]);
      taken = code > threshold;
      tie = code == threshold;
    }
    const int tie_rank = cta_inclusive_sum<NUM_WARPS>(tie ? 1 : 0, warp_totals, warp, lane);
    int chunk_ties = 0;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) chunk_ties += warp_totals[w];
    taken = taken || (tie && ties_before + tie_rank <= ties_wanted);
    ties_before += chunk_ties;
    if (j < max_pages) row_chosen[j] = (taken || j == count - 1) ? 1 : 0;
    __syncthreads();  // warp_totals read before the next chunk's sum writes them
  }
}
