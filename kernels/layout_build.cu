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
