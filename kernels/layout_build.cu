// Block layouts chosen on the device, and their CSR/CSC index arrays, with no host round trip.
//
// A dynamic layout (cuattn.dynamic) is chosen per (head h, query block i) from block scores
// scores [heads, nbq, nb] of S (float or double) in three steps, every one on the device:
//   select_topk<S, SORT_SIZE>, select_mass<S, SORT_SIZE>: grid (nbq, heads), one thread per
//     pair of sort entries, 32 to MAX_SELECT_THREADS (select_traits).
//     One CTA sorts the key blocks j of row (h, i) in shared memory by (class ascending, key
//     descending, j ascending), class 0 the forced blocks, 1 the other allowed ones, 2 those the
//     causal rule forbids (j > i) and 3 the padding up to SORT_SIZE (a power of two >= nb), and
//     marks the first `count` of that order: chosen uint8 [heads, nbq, nb] (every element is
//     written, 1 chosen, 0 not).
//       topk: key = score; forced = the diagonal (keep_diagonal) and j < keep_first, where
//             allowed; count = min(budget[h], allowed blocks): the forced blocks count toward
//             the budget, which the caller has checked leaves room for them.
//       mass: key = p, the softmax over the allowed blocks of score * scale; forced = the
//             diagonal (keep_diagonal); count = the fewest blocks of the order whose p sums to
//             >= tau - MASS_SLACK, at most the allowed blocks and max_blocks (<= 0: no cap).
//   layout_count: grid (ceil(units / INDEX_WARPS), heads); a warp per unit, units = nbq rows
//     then ceil(nb / 32) strips of 32 key-block columns (a lane per column, reading 32
//     adjacent bytes per row): row_count int32 [heads, nbq], col_count int32 [heads, nb].
//   layout_scan: grid (2), SCAN_THREADS; CTA 0 turns row_count into row_ptr [heads, nbq + 1],
//     CTA 1 col_count into col_ptr [heads, nb + 1]: absolute offsets, head after head, the
//     last entry of head h equal to the first of head h + 1 (as cuattn.Layout stores them).
//   layout_fill: the warps of layout_count write col_idx and row_mask from row_ptr (j
//     ascending in each row) and row_idx and col_mask from col_ptr (i ascending in each
//     column), never past `capacity` entries; a mask is -1 for a block every element of which
//     the rule allows and 0 for one the attention kernels must mask (a causal diagonal block,
//     or the ragged last key block). With `tables` (the vertical-slash rule's bit tables) the
//     rows are filled first (part FILL_ROWS, recording each block's CSR entry in entry_of),
//     mask_vertical_slash writes the tables and row_mask, then the columns (FILL_COLUMNS) copy
//     row_mask through entry_of; otherwise one launch fills both (FILL_BOTH).
//   mask_vertical_slash: see its comment.
// The index buffers are sized by the caller from the budget (heads * nbq * the most blocks a
// row may take), so nothing about the choice has to come back to the host to size them.
// Run: through cuattn.dynamic.topk_blocks / mass_threshold_blocks on CuPy (or torch CUDA)
// arrays, or backend="interp" on NumPy arrays; geometry in cuattn/backends/geometry.py.
#include "common/smem.cuh"
#include "common/types.cuh"

constexpr int MAX_SELECT_THREADS = 256;
constexpr int INDEX_WARPS = 4;
constexpr int SCAN_THREADS = 256;
// A sort entry's code: its class in the top bits, its key block j below (nb < 2^CLASS_SHIFT).
constexpr int CLASS_SHIFT = 28;
constexpr int J_MASK = (1 << CLASS_SHIFT) - 1;
constexpr int FORCED = 0, ALLOWED = 1, FORBIDDEN = 2, PADDING = 3;
// Mass counts as reached within this of tau (sums of rounded probabilities; cuattn.dynamic).
constexpr double MASS_SLACK = 1e-9;
constexpr int FULL_BLOCK = -1;  // mask id of a block needing no element mask (cuattn.Layout)
constexpr int RULE_MASKED = 0;
constexpr int FILL_BOTH = 0, FILL_ROWS = 1, FILL_COLUMNS = 2;  // layout_fill's `part`

template <typename S, int SORT_SIZE>
struct select_traits {
  static_assert(SORT_SIZE >= 32 && (SORT_SIZE & (SORT_SIZE - 1)) == 0, "a power of two");
  // a thread per compare-exchange pair of a sort stage, within [32, MAX_SELECT_THREADS]
  static constexpr int PAIRS = SORT_SIZE / 2;
  static constexpr int NUM_THREADS = PAIRS < MAX_SELECT_THREADS ? (PAIRS < 32 ? 32 : PAIRS)
                                                                : MAX_SELECT_THREADS;
  static constexpr int NUM_WARPS = NUM_THREADS / 32;
  // keys (S) then codes (int); SORT_SIZE * sizeof(S) keeps the codes 4-byte aligned
  static constexpr int SMEM_BYTES = SORT_SIZE * (int(sizeof(S)) + int(sizeof(int)));
};

struct layout_index_traits {
  static constexpr int NUM_THREADS = INDEX_WARPS * 32;
  static constexpr int SMEM_BYTES = 0;
};

struct layout_scan_traits {
  static constexpr int NUM_THREADS = SCAN_THREADS;
  static constexpr int SMEM_BYTES = 0;
};

// The order of the sort: class ascending, then key descending, then j ascending. A strict
// total order (codes are unique), so the sorted row, and the choice, are deterministic.
template <typename S>
__device__ __forceinline__ bool sorts_before(S key_a, int code_a, S key_b, int code_b) {
  const int class_a = code_a >> CLASS_SHIFT, class_b = code_b >> CLASS_SHIFT;
  if (class_a != class_b) return class_a < class_b;
  if (key_a != key_b) return key_a > key_b;
  return code_a < code_b;
}

// Bitonic sort of SORT_SIZE (key, code) pairs in shared memory by the CTA; the caller syncs
// after filling them, and the sort ends synced.
template <typename S, int SORT_SIZE>
__device__ void bitonic_sort(S* keys, int* codes) {
  constexpr int THREADS = select_traits<S, SORT_SIZE>::NUM_THREADS;
  for (int size = 2; size <= SORT_SIZE; size *= 2) {
    for (int stride = size / 2; stride > 0; stride /= 2) {
      for (int t = int(threadIdx.x); t < SORT_SIZE / 2; t += THREADS) {
        const int lo = 2 * t - (t & (stride - 1));  // the t-th index whose `stride` bit is 0
        const int hi = lo + stride;
        const bool ascending = (lo & size) == 0;
        if (sorts_before(keys[hi], codes[hi], keys[lo], codes[lo]) == ascending) {
          const S key = keys[lo];
          keys[lo] = keys[hi];
          keys[hi] = key;
          const int code = codes[lo];
          codes[lo] = codes[hi];
          codes[hi] = code;
        }
      }
      __syncthreads();
    }
  }
}

template <typename S>
__device__ __forceinline__ S reduce_pair(S a, S b, bool take_max) {
  return take_max ? (a > b ? a : b) : a + b;
}

// Max or sum over a CTA of NUM_WARPS warps; every thread gets the result. `scratch` holds
// NUM_WARPS values.
template <int NUM_WARPS, typename S>
__device__ S block_reduce(S value, bool take_max, S* scratch) {
  for (int offset = 16; offset > 0; offset /= 2)
    value = reduce_pair(value, __shfl_xor_sync(FULL_WARP, value, offset), take_max);
  const int warp = int(threadIdx.x) / 32;
  if (int(threadIdx.x) % 32 == 0) scratch[warp] = value;
  __syncthreads();
  S total = scratch[0];
  for (int w = 1; w < NUM_WARPS; ++w) total = reduce_pair(total, scratch[w], take_max);
  __syncthreads();  // scratch may be reused by the next reduction
  return total;
}

// Marks chosen[j] = 1 for the first `count` entries of the sorted row, 0 for the others.
template <int SORT_SIZE, int THREADS>
__device__ void write_choice(const int* codes, int count, int nb, unsigned char* chosen_row) {
  for (int t = int(threadIdx.x); t < SORT_SIZE; t += THREADS) {
    const int j = codes[t] & J_MASK;
    if (j < nb) chosen_row[j] = t < count ? 1 : 0;
  }
}

// Allowed key blocks of query block i: j <= i under the causal rule (square layouts), else all.
__device__ __forceinline__ int allowed_blocks(int i, int nb, int causal) {
  return causal ? (i + 1 < nb ? i + 1 : nb) : nb;
}

template <typename S, int SORT_SIZE>
__global__ void __launch_bounds__(select_traits<S, SORT_SIZE>::NUM_THREADS, 1)
    select_topk(const S* __restrict__ scores, const int* __restrict__ budget,
                unsigned char* __restrict__ chosen, int nbq, int nb, int causal,
                int keep_diagonal, int keep_first) {
  using Traits = select_traits<S, SORT_SIZE>;
  const int i = int(blockIdx.x), h = int(blockIdx.y);
  const size_t row = size_t(h) * nbq + i;
  const S* row_scores = scores + row * nb;
  S* keys = dynamic_smem<S>();
  int* codes = reinterpret_cast<int*>(keys + SORT_SIZE);
  for (int j = int(threadIdx.x); j < SORT_SIZE; j += Traits::NUM_THREADS) {
    int cls = PADDING;
    if (j < nb && causal && j > i) {
      cls = FORBIDDEN;
    } else if (j < nb) {
      cls = ((keep_diagonal && j == i) || j < keep_first) ? FORCED : ALLOWED;
    }
    keys[j] = cls <= ALLOWED ? row_scores[j] : S(0);
    codes[j] = (cls << CLASS_SHIFT) | j;
  }
  __syncthreads();
  bitonic_sort<S, SORT_SIZE>(keys, codes);
  const int allowed = allowed_blocks(i, nb, causal);
  const int count = budget[h] < allowed ? budget[h] : allowed;
  write_choice<SORT_SIZE, Traits::NUM_THREADS>(codes, count, nb, chosen + row * nb);
}

template <typename S, int SORT_SIZE>
__global__ void __launch_bounds__(select_traits<S, SORT_SIZE>::NUM_THREADS, 1)
    select_mass(const S* __restrict__ scores, unsigned char* __restrict__ chosen, int nbq, int nb,
                int causal, int keep_diagonal, double scale, double tau, int max_blocks) {
  using Traits = select_traits<S, SORT_SIZE>;
  __shared__ S scratch[Traits::NUM_WARPS];
  __shared__ int count_smem;
  const int i = int(blockIdx.x), h = int(blockIdx.y);
  const size_t row = size_t(h) * nbq + i;
  const S* row_scores = scores + row * nb;
  S* keys = dynamic_smem<S>();
  int* codes = reinterpret_cast<int*>(keys + SORT_SIZE);
  const int allowed = allowed_blocks(i, nb, causal);
  // softmax over the allowed blocks: max, then the sum of exp, then p (in the key slots)
  S m_i = -INFINITY;
  for (int j = int(threadIdx.x); j < allowed; j += Traits::NUM_THREADS) {
    const S s = row_scores[j] * S(scale);
    m_i = s > m_i ? s : m_i;
  }
  m_i = block_reduce<Traits::NUM_WARPS>(m_i, true, scratch);
  S l_i = 0;
  for (int j = int(threadIdx.x); j < SORT_SIZE; j += Traits::NUM_THREADS) {
    const S p = j < allowed ? S(exp(row_scores[j] * S(scale) - m_i)) : S(0);
    keys[j] = p;
    l_i += p;
  }
  l_i = block_reduce<Traits::NUM_WARPS>(l_i, false, scratch);
  for (int j = int(threadIdx.x); j < SORT_SIZE; j += Traits::NUM_THREADS) {
    const int cls = j >= nb ? PADDING
                    : j >= allowed ? FORBIDDEN
                    : (keep_diagonal && j == i) ? FORCED
                                                : ALLOWED;
    keys[j] = keys[j] / l_i;
    codes[j] = (cls << CLASS_SHIFT) | j;
  }
  __syncthreads();
  bitonic_sort<S, SORT_SIZE>(keys, codes);
  if (threadIdx.x == 0) {
    // summed in sorted order, one after another, as the reference's cumulative sum
    int count = allowed;
    S mass = 0;
    for (int t = 0; t < allowed; ++t) {
      mass += keys[t];
      if (double(mass) >= tau - MASS_SLACK) {
        count = t + 1;
        break;
      }
    }
    count_smem = (max_blocks > 0 && max_blocks < count) ? max_blocks : count;
  }
  __syncthreads();
  write_choice<SORT_SIZE, Traits::NUM_THREADS>(codes, count_smem, nb, chosen + row * nb);
}

// -1 when every element of block (i, j) is allowed, else 0 (see the header).
__device__ __forceinline__ int block_mask_id(int i, int j, int blocksize, int n_k, int q_offset,
                                             int causal) {
  const bool ragged = (j + 1) * blocksize > n_k;
  const bool inside = !causal || j * blocksize + blocksize - 1 <= i * blocksize + q_offset;
  return inside && !ragged ? FULL_BLOCK : RULE_MASKED;
}

// This warp's unit of layout_count / layout_fill (see the header): query-block row `row` when
// row >= 0, else key-block columns [first_column, first_column + 32) (none past nb).
struct IndexUnit {
  int lane, h, row, first_column;
  const unsigned char* head;  // chosen[h]
};

__device__ __forceinline__ IndexUnit index_unit(const unsigned char* chosen, int nbq, int nb) {
  const int unit = int(blockIdx.x) * INDEX_WARPS + int(threadIdx.x) / 32;
  const int h = int(blockIdx.y);
  const bool is_row = unit < nbq;
  return {int(threadIdx.x) % 32, h, is_row ? unit : -1, is_row ? 0 : (unit - nbq) * 32,
          chosen + size_t(h) * nbq * nb};
}

__global__ void __launch_bounds__(INDEX_WARPS * 32, 1)
    layout_count(const unsigned char* __restrict__ chosen, int* __restrict__ row_count,
                 int* __restrict__ col_count, int nbq, int nb) {
  const IndexUnit u = index_unit(chosen, nbq, nb);
  if (u.row >= 0) {
    const unsigned char* row = u.head + size_t(u.row) * nb;
    int count = 0;
    for (int j0 = 0; j0 < nb; j0 += 32) {  // uniform over the warp: every lane votes
      const int j = j0 + u.lane;
      count += __popc(__ballot_sync(FULL_WARP, j < nb && row[j] != 0));
    }
    if (u.lane == 0) row_count[size_t(u.h) * nbq + u.row] = count;
  } else if (u.first_column + u.lane < nb) {
    const int j = u.first_column + u.lane;
    int count = 0;
    for (int i = 0; i < nbq; ++i) count += u.head[size_t(i) * nb + j] != 0;
    col_count[size_t(u.h) * nb + j] = count;
  }
}

__global__ void __launch_bounds__(SCAN_THREADS, 1)
    layout_scan(const int* __restrict__ row_count, int* __restrict__ row_ptr,
                const int* __restrict__ col_count, int* __restrict__ col_ptr, int heads, int nbq,
                int nb) {
  __shared__ int chunk_sums[SCAN_THREADS];
  const bool columns = blockIdx.x == 1;
  const int* count = columns ? col_count : row_count;
  int* ptr = columns ? col_ptr : row_ptr;
  const int per_head = columns ? nb : nbq;
  const int total = heads * per_head;
  const int chunk = (total + SCAN_THREADS - 1) / SCAN_THREADS;
  const int lo = int(threadIdx.x) * chunk < total ? int(threadIdx.x) * chunk : total;
  const int hi = lo + chunk < total ? lo + chunk : total;
  int sum = 0;
  for (int e = lo; e < hi; ++e) sum += count[e];
  chunk_sums[threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {  // SCAN_THREADS sums, one after another: exclusive prefix in place
    int running = 0;
    for (int t = 0; t < SCAN_THREADS; ++t) {
      const int mine = chunk_sums[t];
      chunk_sums[t] = running;
      running += mine;
    }
  }
  __syncthreads();
  int offset = chunk_sums[threadIdx.x];
  for (int e = lo; e < hi; ++e) {
    const int h = e / per_head, i = e % per_head;
    const size_t at = size_t(h) * (per_head + 1) + i;
    ptr[at] = offset;
    offset += count[e];
    if (i == per_head - 1) ptr[at + 1] = offset;
  }
}

__global__ void __launch_bounds__(INDEX_WARPS * 32, 1)
    layout_fill(const unsigned char* __restrict__ chosen, const int* __restrict__ row_ptr,
                int* __restrict__ col_idx, int* __restrict__ row_mask,
                const int* __restrict__ col_ptr, int* __restrict__ row_idx,
                int* __restrict__ col_mask, int* __restrict__ entry_of, int nbq, int nb,
                int blocksize, int n_k, int q_offset, int causal, int capacity, int tables,
                int part) {
  const IndexUnit u = index_unit(chosen, nbq, nb);
  if (u.row >= 0 && part != FILL_COLUMNS) {
    const int i = u.row;
    const unsigned char* row = u.head + size_t(i) * nb;
    int next = row_ptr[size_t(u.h) * (nbq + 1) + i];
    for (int j0 = 0; j0 < nb; j0 += 32) {
      const int j = j0 + u.lane;
      const bool on = j < nb && row[j] != 0;
      const unsigned votes = __ballot_sync(FULL_WARP, on);
      const int at = next + __popc(votes & ((1u << u.lane) - 1u));  // lanes below come first
      if (on && at < capacity) {
        col_idx[at] = j;
        if (tables) {
          entry_of[(size_t(u.h) * nbq + i) * nb + j] = at;  // row_mask: mask_vertical_slash
        } else {
          row_mask[at] = block_mask_id(i, j, blocksize, n_k, q_offset, causal);
        }
      }
      next += __popc(votes);
    }
  } else if (u.row < 0 && part != FILL_ROWS && u.first_column + u.lane < nb) {
    const int j = u.first_column + u.lane;
    int next = col_ptr[size_t(u.h) * (nb + 1) + j];
    for (int i = 0; i < nbq; ++i) {
      if (u.head[size_t(i) * nb + j] == 0) continue;
      if (next < capacity) {
        row_idx[next] = i;
        // with tables, a block's CSC entry names the mask its CSR entry got
        col_mask[next] = tables ? row_mask[entry_of[(size_t(u.h) * nbq + i) * nb + j]]
                                : block_mask_id(i, j, blocksize, n_k, q_offset, causal);
      }
      ++next;
    }
  }
}

// Per-block bit tables of the vertical-slash rule: for every CSR entry e of query-block row i
// (one warp per entry), bit c of word w of row r of mask_table[e] says whether query q = i*b + r
// sees key k = j*b + 32w + c: q < n, k < n, k <= q when causal, and (is_vertical[h, k] or
// is_slash[h, q - k + n]). row_mask[e] = -1 when every element of a block that is not ragged
// is allowed (no table needed), else e. Grid (nbq, heads), INDEX_WARPS warps.
__global__ void __launch_bounds__(INDEX_WARPS * 32, 1)
    mask_vertical_slash(const int* __restrict__ row_ptr, const int* __restrict__ col_idx,
                        const unsigned char* __restrict__ is_vertical,
                        const unsigned char* __restrict__ is_slash,
                        unsigned* __restrict__ mask_table, int* __restrict__ row_mask, int nbq,
                        int n, int blocksize, int causal) {
  const int lane = int(threadIdx.x) % 32;
  const int i = int(blockIdx.x), h = int(blockIdx.y);
  const int words = (blocksize + 31) / 32;
  const unsigned char* vertical = is_vertical + size_t(h) * n;
  const unsigned char* slash = is_slash + size_t(h) * 2 * n;
  const int lo = row_ptr[size_t(h) * (nbq + 1) + i], hi = row_ptr[size_t(h) * (nbq + 1) + i + 1];
  for (int e = lo + int(threadIdx.x) / 32; e < hi; e += INDEX_WARPS) {  // uniform per warp
    const int j = col_idx[e];
    bool lacks = (j + 1) * blocksize > n;  // a ragged key block always keeps its table
    for (int pair = lane; pair < blocksize * words; pair += 32) {
      const int r = pair / words, w = pair % words;
      const int q = i * blocksize + r;
      unsigned bits = 0;
      for (int c = 0; c < 32 && 32 * w + c < blocksize; ++c) {
        const int k = j * blocksize + 32 * w + c;
        const bool on = q < n && k < n && (!causal || k <= q) && (vertical[k] || slash[q - k + n]);
        bits |= unsigned(on) << c;
        lacks = lacks || (q < n && !on);
      }
      mask_table[(size_t(e) * blocksize + r) * words + w] = bits;
    }
    const bool needs_table = __ballot_sync(FULL_WARP, lacks) != 0;
    if (lane == 0) row_mask[e] = needs_table ? e : FULL_BLOCK;
  }
}

// ---- The sm_90a kernels' schedules of a device layout ------------------------------------------
//
// The same lists the host builds from a host layout's blocks (geometry.sm90_work_list for
// attn_fwd_sm90_persistent; backward_tile_order and dq_ranks of cuattn/backends/kernels.py for
// attn_bwd_sm90), built where the layout lives from its chosen blocks and CSR/CSC arrays, equal
// to the host's entry for entry. Nothing comes back to the host: every buffer is sized from
// shapes (the bounds below), and where the host needs a count for a launch it takes the bound.
//
// The forward's work list, four launches (units: the (head, query tile) pairs, tiles of 128
// query rows of ITEM_ROWS layout rows each; a walk unit: `span` adjacent key blocks, 2 where the
// kernel walks 128-key tiles of two 64-blocks, else 1):
//   sm90_work_count: a warp per unit: the walk units the union of its rows holds, union_count.
//   sm90_work_scan: one CTA: the split threshold (split_factor x the mean unit's key tiles, at
//     least split_min_tiles; where batch x units < sms and the longest unit walks more than
//     spread_percent / 100 x the launch's key tiles over sms (at least split_min_tiles: the
//     fill), at most the fill; raised, where the launch's chunks would write more than
//     max_slots partial slots, to the lowest threshold whose chunks fit: as
//     geometry.sm90_split_tiles), each unit's chunks (1: not split) and the exclusive prefix
//     sums of its entries (entry_ptr), of the chunks of split units (slot_ptr: partial slots)
//     and of the split units (merge_ptr), each [units + 1].
//   sm90_work_fill: a warp per unit: its entries of one batch (EntryField), a split unit's
//     chunk boundaries at the first key block of the union's (L c / chunks)-th walk unit (L the
//     union's walk units: a cut never falls inside a key pair) with the rows' entries before
//     each, and each entry's sort weight (walk, computed, tile).
//   sm90_work_order: a thread per (entry, batch): its place, the number of entries of its L2
//     group (the pairs attn_fwd_sm90 starts together: the first groups % pairs one pair more)
//     that sort before it: heavier weight first (more key tiles walked, then more blocks
//     computed, then the later tile), then pair and chunk ascending; writes the entry
//     (attn_fwd_sm90.cu's WorkField) and, for a split row's first chunk, its merge entry.
// The list holds at most list_bound = batch x (units + extra) entries, the merges batch x extra
// and the slots twice that: a unit split above 4 x the mean leaves the chunks beyond one a unit
// under units / 4 (extra = units / 4); where batch x units < sms the threshold may be the
// launch's key tiles over sms, and they sum to under sms / batch a batch (extra = the larger).
// The cap bounds the slots by max_slots, the merges by half of it (a split unit has two chunks
// or more) and the entries beyond one a unit by it.
// The list is written to the END of its list_bound entries and work_counter starts at its
// first: the persistent kernel, launched with num_items = list_bound, claims exactly the list.
// Merge entries past the split rows are left with no chunks (attn_fwd_sm90_merge passes them by).
//
// The backward's, two launches:
//   sm90_claim_order: a CTA per kv head: each key tile's walked query blocks (the union of its
//     columns' CSC rows, summed over the kv head's query heads), then its place in the claim
//     order (fewest first, ties the higher tile first): tile_order [kv heads, tiles] and its
//     inverse tile_place.
//   sm90_dq_ranks: a warp per query-block row (h, i): the tiles holding a block of the row
//     flagged at their claim places in shared memory, their bits and popcount prefix, then for
//     each CSR entry (i, j) the held tiles claimed before j's, written to the CSC entry of
//     (i, j) (found by binary search of column j's ascending rows).
constexpr int NO_CHUNK = -1;  // an entry of a whole row (attn_fwd_sm90.cu's NO_SLOT)
enum EntryField {
  ENTRY_HEAD,
  ENTRY_TILE,
  ENTRY_CHUNK,
  ENTRY_FIRST,  // key blocks [first, end)
  ENTRY_END,
  ENTRY_A_FIRST,  // entries of the item's first row before `first`, before `end`
  ENTRY_A_END,
  ENTRY_B_FIRST,  // of its second row (64-blocks)
  ENTRY_B_END,
  ENTRY_U_FIRST,  // walk units of the rows' union before `first`, before `end`
  ENTRY_U_END,
  ENTRY_FIELDS
};
// The persistent forward's list entry (attn_fwd_sm90.cu WorkField) and merge entry (MergeField)
enum ListField {
  LIST_ITEM,
  LIST_FIRST,
  LIST_END,
  LIST_SLOT,
  LIST_A_FIRST,
  LIST_A_END,
  LIST_B_FIRST,
  LIST_B_END,
  LIST_FIELDS
};
enum MergeListField { MERGE_LIST_ITEM, MERGE_LIST_FIRST_SLOT, MERGE_LIST_CHUNKS, MERGE_LIST_FIELDS };
// A sort weight: key tiles walked, blocks computed and tile, WEIGHT_BITS each, high to low.
constexpr int WEIGHT_BITS = 21;
// Key tiles an sm90_dq_ranks row flags in shared memory (a selection row's most key blocks), and
// the key blocks an sm_90a backward tile holds at most (two 64-blocks).
constexpr int MAX_CLAIM_TILES = 8192;
constexpr int MAX_TILE_BLOCKS = 2;
constexpr int WORD_BITS = 32;
constexpr unsigned EVEN_LANES = 0x55555555u;

// The walk units of a ballot over 32 adjacent key blocks (the first at a multiple of 32), each
// at its first block's lane: the votes themselves (span 1), or a key pair's at its even lane.
__device__ __forceinline__ unsigned unit_votes(unsigned votes, int span) {
  return span == 1 ? votes : (votes | (votes >> 1)) & EVEN_LANES;
}

// A unit's layout rows (the item's first and, with 64-blocks, second; nullptr past nbq).
struct WorkUnit {
  int lane, h, t, unit;
  const unsigned char* row_a;
  const unsigned char* row_b;
};

__device__ __forceinline__ WorkUnit work_unit(const unsigned char* chosen, int nbq, int nb,
                                              int item_rows, int tiles) {
  const int t = int(blockIdx.x) * INDEX_WARPS + int(threadIdx.x) / 32;
  const int h = int(blockIdx.y);
  const int row = t * item_rows;
  const unsigned char* head = chosen + size_t(h) * nbq * nb;
  const bool has_a = t < tiles, has_b = has_a && item_rows > 1 && row + 1 < nbq;
  return {int(threadIdx.x) % 32, h, t, h * tiles + t,
          has_a ? head + size_t(row) * nb : nullptr,
          has_b ? head + size_t(row + 1) * nb : nullptr};
}

__global__ void __launch_bounds__(INDEX_WARPS * 32, 1)
    sm90_work_count(const unsigned char* __restrict__ chosen, int* __restrict__ union_count,
                    int nbq, int nb, int item_rows, int tiles, int span) {
  const WorkUnit u = work_unit(chosen, nbq, nb, item_rows, tiles);
  if (u.row_a == nullptr) return;  // uniform over the warp
  int count = 0;
  for (int j0 = 0; j0 < nb; j0 += 32) {
    const int j = j0 + u.lane;
    const bool on = j < nb && (u.row_a[j] != 0 || (u.row_b != nullptr && u.row_b[j] != 0));
    count += __popc(unit_votes(__ballot_sync(FULL_WARP, on), span));
  }
  if (u.lane == 0) union_count[u.unit] = count;
}

// A unit's chunks: split above split_tiles key tiles into ceil(walked / split_tiles).
__device__ __forceinline__ int unit_chunks(int union_units, int key_tiles, int split_tiles) {
  const int walked = union_units * key_tiles;
  return walked > split_tiles ? (walked + split_tiles - 1) / split_tiles : 1;
}

// Partial slots of units [lo, hi) split above split_tiles: the chunks of every split unit.
__device__ __forceinline__ long long units_slots(const int* union_count, int lo, int hi,
                                                 int key_tiles, int split_tiles) {
  long long slots = 0;
  for (int u = lo; u < hi; ++u) {
    const int chunks = unit_chunks(union_count[u], key_tiles, split_tiles);
    slots += chunks > 1 ? chunks : 0;
  }
  return slots;
}

__global__ void __launch_bounds__(SCAN_THREADS, 1)
    sm90_work_scan(const int* __restrict__ union_count, int* __restrict__ entry_ptr,
                   int* __restrict__ slot_ptr, int* __restrict__ merge_ptr,
                   int* __restrict__ split_tiles, int units, int key_tiles, int split_factor,
                   int split_min_tiles, int spread_percent, int batch, int sms,
                   int max_slots) {
  __shared__ long long walked_sums[SCAN_THREADS];
  __shared__ int chunk_sums[3][SCAN_THREADS];
  // the cap's bisection: over the cap at `low` (or untried), within it at `high`; `candidate`
  // the threshold tried next, or NO_CANDIDATE once the threshold is `high`
  __shared__ int low_smem, high_smem, candidate_smem;
  constexpr int NO_CANDIDATE = -1;
  const int chunk = (units + SCAN_THREADS - 1) / SCAN_THREADS;
  const int lo = int(threadIdx.x) * chunk < units ? int(threadIdx.x) * chunk : units;
  const int hi = lo + chunk < units ? lo + chunk : units;
  long long walked = 0;
  int longest = 0;
  for (int u = lo; u < hi; ++u) {
    const int tiles = union_count[u] * key_tiles;
    walked += tiles;
    longest = tiles > longest ? tiles : longest;
  }
  walked_sums[threadIdx.x] = walked;
  chunk_sums[0][threadIdx.x] = longest;
  __syncthreads();
  if (threadIdx.x == 0) {  // the host's mean in float64, ceil of split_factor times it
    long long total = 0;
    int most = 0;
    for (int t = 0; t < SCAN_THREADS; ++t) {
      total += walked_sums[t];
      most = chunk_sums[0][t] > most ? chunk_sums[0][t] : most;
    }
    const double mean = units > 0 ? double(total) / double(units) : 0.0;
    const int above = int(ceil(double(split_factor) * mean));
    int threshold = above > split_min_tiles ? above : split_min_tiles;
    if ((long long)batch * units < sms) {  // few items: chunks to fill about one wave
      const long long fill = ((long long)batch * total + sms - 1) / sms;
      const int fill_tiles = fill > split_min_tiles ? int(fill) : split_min_tiles;
      // only where the rows are uneven enough that the split can pay its tail and the merge
      const bool uneven = 100LL * most > (long long)spread_percent * fill_tiles;
      threshold = uneven && fill_tiles < threshold ? fill_tiles : threshold;
    }
    // the threshold itself first; the longest unit's tiles split nothing, so are within it
    low_smem = threshold - 1;
    high_smem = most > threshold ? most : threshold;
    candidate_smem = threshold;
  }
  __syncthreads();
  // The cap on the launch's partial slots: the lowest threshold from the mean's (or the SMs')
  // on whose chunks fit max_slots, found by bisection (the slots never grow with the
  // threshold), as geometry.sm90_split_tiles finds it.
  for (int candidate = candidate_smem; candidate != NO_CANDIDATE; candidate = candidate_smem) {
    walked_sums[threadIdx.x] = units_slots(union_count, lo, hi, key_tiles, candidate);
    __syncthreads();
    if (threadIdx.x == 0) {
      long long slots = 0;
      for (int t = 0; t < SCAN_THREADS; ++t) slots += walked_sums[t];
      if ((long long)batch * slots <= max_slots) {
        high_smem = candidate;
      } else {
        low_smem = candidate;
      }
      const int gap = high_smem - low_smem;
      candidate_smem = gap > 1 ? low_smem + gap / 2 : NO_CANDIDATE;
      if (gap <= 1) *split_tiles = high_smem;
    }
    __syncthreads();
  }
  const int threshold = high_smem;
  int sums[3] = {0, 0, 0};  // entries, split chunks, split units
  for (int u = lo; u < hi; ++u) {
    const int chunks = unit_chunks(union_count[u], key_tiles, threshold);
    sums[0] += chunks;
    sums[1] += chunks > 1 ? chunks : 0;
    sums[2] += chunks > 1;
  }
  for (int s = 0; s < 3; ++s) chunk_sums[s][threadIdx.x] = sums[s];
  __syncthreads();
  if (threadIdx.x < 3) {  // three exclusive prefixes, one thread each
    int running = 0;
    for (int t = 0; t < SCAN_THREADS; ++t) {
      const int mine = chunk_sums[threadIdx.x][t];
      chunk_sums[threadIdx.x][t] = running;
      running += mine;
    }
  }
  __syncthreads();
  int offsets[3] = {chunk_sums[0][threadIdx.x], chunk_sums[1][threadIdx.x],
                    chunk_sums[2][threadIdx.x]};
  for (int u = lo; u < hi; ++u) {
    entry_ptr[u] = offsets[0];
    slot_ptr[u] = offsets[1];
    merge_ptr[u] = offsets[2];
    const int chunks = unit_chunks(union_count[u], key_tiles, threshold);
    offsets[0] += chunks;
    offsets[1] += chunks > 1 ? chunks : 0;
    offsets[2] += chunks > 1;
  }
  if (hi == units && lo < hi) {
    entry_ptr[units] = offsets[0];
    slot_ptr[units] = offsets[1];
    merge_ptr[units] = offsets[2];
  }
  if (units == 0 && threadIdx.x == 0) entry_ptr[0] = slot_ptr[0] = merge_ptr[0] = 0;
}

__global__ void __launch_bounds__(INDEX_WARPS * 32, 1)
    sm90_work_fill(const unsigned char* __restrict__ chosen, const int* __restrict__ union_count,
                   const int* __restrict__ entry_ptr, int* __restrict__ entries,
                   u64* __restrict__ weights, int nbq, int nb, int item_rows, int tiles,
                   int span, int key_tiles) {
  const WorkUnit u = work_unit(chosen, nbq, nb, item_rows, tiles);
  if (u.row_a == nullptr) return;  // uniform over the warp
  const int first_entry = entry_ptr[u.unit];
  const int chunks = entry_ptr[u.unit + 1] - first_entry;
  const long long union_units = union_count[u.unit];
  int* rows = entries + size_t(first_entry) * ENTRY_FIELDS;
  const unsigned below = (1u << u.lane) - 1u;
  int before_a = 0, before_b = 0, before_union = 0;
  for (int j0 = 0; j0 < nb; j0 += 32) {
    const int j = j0 + u.lane;
    const bool a = j < nb && u.row_a[j] != 0;
    const bool b = j < nb && u.row_b != nullptr && u.row_b[j] != 0;
    const unsigned votes_a = __ballot_sync(FULL_WARP, a), votes_b = __ballot_sync(FULL_WARP, b);
    const unsigned votes_union = unit_votes(votes_a | votes_b, span);
    if (((votes_union >> u.lane) & 1u) && chunks > 1) {
      // key j starts the union's r-th walk unit: a cut when r = floor(L c / chunks) for some
      // 0 < c < chunks, that is for c = ceil(r chunks / L) (the targets are distinct: chunks <= L)
      const long long r = before_union + __popc(votes_union & below);
      const long long c = (r * chunks + union_units - 1) / union_units;
      if (c >= 1 && c < chunks && union_units * c / chunks == r) {
        const int at_a = before_a + __popc(votes_a & below);
        const int at_b = before_b + __popc(votes_b & below);
        int* starts = rows + c * ENTRY_FIELDS;
        int* ends = starts - ENTRY_FIELDS;
        starts[ENTRY_FIRST] = ends[ENTRY_END] = j;
        starts[ENTRY_A_FIRST] = ends[ENTRY_A_END] = at_a;
        starts[ENTRY_B_FIRST] = ends[ENTRY_B_END] = at_b;
        starts[ENTRY_U_FIRST] = ends[ENTRY_U_END] = int(r);
      }
    }
    before_a += __popc(votes_a);
    before_b += __popc(votes_b);
    before_union += __popc(votes_union);
  }
  if (u.lane == 0) {
    for (int c = 0; c < chunks; ++c) {
      rows[c * ENTRY_FIELDS + ENTRY_HEAD] = u.h;
      rows[c * ENTRY_FIELDS + ENTRY_TILE] = u.t;
      rows[c * ENTRY_FIELDS + ENTRY_CHUNK] = chunks > 1 ? c : NO_CHUNK;
    }
    rows[ENTRY_FIRST] = rows[ENTRY_A_FIRST] = rows[ENTRY_B_FIRST] = rows[ENTRY_U_FIRST] = 0;
    int* last = rows + (chunks - 1) * ENTRY_FIELDS;
    last[ENTRY_END] = nb;
    last[ENTRY_A_END] = before_a;
    last[ENTRY_B_END] = before_b;
    last[ENTRY_U_END] = before_union;
  }
  __syncwarp();
  for (int c = u.lane; c < chunks; c += 32) {
    const int* row = rows + c * ENTRY_FIELDS;
    const u64 walk = u64(row[ENTRY_U_END] - row[ENTRY_U_FIRST]) * u64(key_tiles);
    const u64 computed =
        u64(row[ENTRY_A_END] - row[ENTRY_A_FIRST] + row[ENTRY_B_END] - row[ENTRY_B_FIRST]);
    weights[first_entry + c] =
        (walk << (2 * WEIGHT_BITS)) | (computed << WEIGHT_BITS) | u64(u.t);
  }
}

// The first pair of L2 group g: the first `wide` groups hold narrow + 1 pairs, the rest narrow.
__device__ __forceinline__ int group_first_pair(int g, int narrow, int wide) {
  return g < wide ? g * (narrow + 1) : wide * (narrow + 1) + (g - wide) * narrow;
}

__global__ void __launch_bounds__(INDEX_WARPS * 32, 1)
    sm90_work_order(const int* __restrict__ entries, const u64* __restrict__ weights,
                    const int* __restrict__ entry_ptr, const int* __restrict__ slot_ptr,
                    const int* __restrict__ merge_ptr, int* __restrict__ work_list,
                    int* __restrict__ merge_list, int* __restrict__ work_counter, int heads,
                    int tiles, int batch, int groups, int list_bound) {
  const int p = int(blockIdx.x) * INDEX_WARPS * 32 + int(threadIdx.x);
  const int b = int(blockIdx.y);
  const int units = heads * tiles;
  const int per_batch = entry_ptr[units];
  const int list_first = list_bound - batch * per_batch;  // the list ends at list_bound
  if (p == 0 && b == 0) *work_counter = list_first;
  if (p >= per_batch) return;
  const int* entry = entries + size_t(p) * ENTRY_FIELDS;
  const int h = entry[ENTRY_HEAD], t = entry[ENTRY_TILE], chunk = entry[ENTRY_CHUNK];
  const int unit = h * tiles + t;
  const int pairs = batch * heads, pair = b * heads + h;
  const int narrow = pairs / groups, wide = pairs % groups;
  const int g = pair < wide * (narrow + 1) ? pair / (narrow + 1)
                                           : wide + (pair - wide * (narrow + 1)) / narrow;
  const int first_pair = group_first_pair(g, narrow, wide);
  const int end_pair = group_first_pair(g + 1, narrow, wide);
  const u64 weight = weights[p];
  int rank = 0;
  for (int q = first_pair; q < end_pair; ++q) {
    const int bq = q / heads, hq = q % heads;
    const int lo = entry_ptr[hq * tiles], hi = entry_ptr[(hq + 1) * tiles];
    for (int other = lo; other < hi; ++other) {
      const u64 w = weights[other];
      rank += w > weight || (w == weight && (bq < b || (bq == b && other < p)));
    }
  }
  const int group_start = first_pair / heads * per_batch + entry_ptr[first_pair % heads * tiles];
  int* out = work_list + size_t(list_first + group_start + rank) * LIST_FIELDS;
  const int item = pair * tiles + t;
  const int slot = chunk == NO_CHUNK ? NO_CHUNK : b * slot_ptr[units] + slot_ptr[unit] + chunk;
  out[LIST_ITEM] = item;
  out[LIST_FIRST] = entry[ENTRY_FIRST];
  out[LIST_END] = entry[ENTRY_END];
  out[LIST_SLOT] = slot;
  out[LIST_A_FIRST] = entry[ENTRY_A_FIRST];
  out[LIST_A_END] = entry[ENTRY_A_END];
  out[LIST_B_FIRST] = entry[ENTRY_B_FIRST];
  out[LIST_B_END] = entry[ENTRY_B_END];
  if (chunk == 0) {
    int* merge = merge_list + size_t(b * merge_ptr[units] + merge_ptr[unit]) * MERGE_LIST_FIELDS;
    merge[MERGE_LIST_ITEM] = item;
    merge[MERGE_LIST_FIRST_SLOT] = slot;
    merge[MERGE_LIST_CHUNKS] = entry_ptr[unit + 1] - entry_ptr[unit];
  }
}

// Query blocks of head h that key tile `tile` (key blocks [tile kb, tile kb + kb), kb <=
// MAX_TILE_BLOCKS) walks: the union of its columns' ascending CSC rows, merged.
__device__ int tile_walked(const int* col_ptr, const int* row_idx, int h, int tile, int nb,
                           int key_blocks) {
  int next[MAX_TILE_BLOCKS], end[MAX_TILE_BLOCKS];
  for (int c = 0; c < MAX_TILE_BLOCKS; ++c) {
    const int j = tile * key_blocks + c;
    const bool has = c < key_blocks && j < nb;
    next[c] = has ? col_ptr[size_t(h) * (nb + 1) + j] : 0;
    end[c] = has ? col_ptr[size_t(h) * (nb + 1) + j + 1] : 0;
  }
  int walked = 0;
  for (;;) {
    int lowest = -1;
    for (int c = 0; c < MAX_TILE_BLOCKS; ++c) {
      if (next[c] < end[c] && (lowest < 0 || row_idx[next[c]] < lowest)) lowest = row_idx[next[c]];
    }
    if (lowest < 0) return walked;
    ++walked;
    for (int c = 0; c < MAX_TILE_BLOCKS; ++c) {
      if (next[c] < end[c] && row_idx[next[c]] == lowest) ++next[c];
    }
  }
}

__global__ void __launch_bounds__(SCAN_THREADS, 1)
    sm90_claim_order(const int* __restrict__ col_ptr, const int* __restrict__ row_idx,
                     int* __restrict__ walked, int* __restrict__ tile_order,
                     int* __restrict__ tile_place, int nb, int tiles, int key_blocks,
                     int kv_group) {
  const int kv_head = int(blockIdx.x);
  int* kv_walked = walked + size_t(kv_head) * tiles;
  for (int tile = int(threadIdx.x); tile < tiles; tile += SCAN_THREADS) {
    int total = 0;
    for (int g = 0; g < kv_group; ++g) {
      total += tile_walked(col_ptr, row_idx, kv_head * kv_group + g, tile, nb, key_blocks);
    }
    kv_walked[tile] = total;
  }
  __syncthreads();  // every tile's count, before any is ranked against it
  for (int tile = int(threadIdx.x); tile < tiles; tile += SCAN_THREADS) {
    const int mine = kv_walked[tile];
    int place = 0;
    for (int other = 0; other < tiles; ++other) {
      const int theirs = kv_walked[other];
      place += theirs < mine || (theirs == mine && other > tile);
    }
    tile_order[size_t(kv_head) * tiles + place] = tile;
    tile_place[size_t(kv_head) * tiles + tile] = place;
  }
}

__global__ void __launch_bounds__(INDEX_WARPS * 32, 1)
    sm90_dq_ranks(const int* __restrict__ row_ptr, const int* __restrict__ col_idx,
                  const int* __restrict__ col_ptr, const int* __restrict__ row_idx,
                  const int* __restrict__ tile_place, int* __restrict__ dq_ranks, int nbq,
                  int nb, int tiles, int key_blocks, int kv_group) {
  constexpr int WORDS = MAX_CLAIM_TILES / WORD_BITS;
  __shared__ unsigned char held_smem[INDEX_WARPS][MAX_CLAIM_TILES];  // by claim place
  __shared__ unsigned bits_smem[INDEX_WARPS][WORDS];
  __shared__ int before_smem[INDEX_WARPS][WORDS];  // held places in the words before
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int i = int(blockIdx.x) * INDEX_WARPS + warp, h = int(blockIdx.y);
  if (i >= nbq) return;  // uniform over the warp
  unsigned char* held = held_smem[warp];
  unsigned* bits = bits_smem[warp];
  int* before = before_smem[warp];
  const int* place_of = tile_place + size_t(h / kv_group) * tiles;
  const int words = (tiles + WORD_BITS - 1) / WORD_BITS;
  const int lo = row_ptr[size_t(h) * (nbq + 1) + i], hi = row_ptr[size_t(h) * (nbq + 1) + i + 1];
  for (int place = lane; place < words * WORD_BITS; place += 32) held[place] = 0;
  __syncwarp();
  for (int e = lo + lane; e < hi; e += 32) held[place_of[col_idx[e] / key_blocks]] = 1;
  __syncwarp();
  for (int w = lane; w < words; w += 32) {
    unsigned word = 0;
    for (int c = 0; c < WORD_BITS; ++c) word |= unsigned(held[w * WORD_BITS + c]) << c;
    bits[w] = word;
  }
  __syncwarp();
  if (lane == 0) {
    int running = 0;
    for (int w = 0; w < words; ++w) {
      before[w] = running;
      running += __popc(bits[w]);
    }
  }
  __syncwarp();
  for (int e = lo + lane; e < hi; e += 32) {
    const int j = col_idx[e];
    const int place = place_of[j / key_blocks];
    const int w = place / WORD_BITS;
    const int rank = before[w] + __popc(bits[w] & ((1u << (place % WORD_BITS)) - 1u));
    int first = col_ptr[size_t(h) * (nb + 1) + j], last = col_ptr[size_t(h) * (nb + 1) + j + 1];
    while (first < last) {  // column j's rows ascend: the entry of row i
      const int mid = (first + last) / 2;
      if (row_idx[mid] < i) {
        first = mid + 1;
      } else {
        last = mid;
      }
    }
    dq_ranks[first] = rank;
  }
}
